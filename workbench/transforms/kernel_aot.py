"""Compile every Triton kernel ahead of time for real GPU targets -- no GPU needed -- and read
what the compiled code says.

On a CPU the kernels run only under the Triton interpreter, which accepts some code the real
compiler rejects.  Triton can, however, compile for a GPU *target* without a GPU: ``triton.compile``
runs the whole pipeline (TTIR -> TTGIR -> LLVM IR -> PTX -> ptxas -> cubin) for, say,
``GPUTarget("cuda", 90, 32)``.  This module does that for every kernel of ``kernels/`` at
representative sizes and reports, per kernel / case / target:

* whether it compiles (the compiler's message when not) and how long it took;
* shared memory (from Triton's metadata) and registers per thread (from the cubin, via the
  ``cuobjdump`` that ships with Triton), with a note where a config needs more shared memory
  than the target has (the autotuner skips such a config on that GPU) or more registers than
  the register file holds;
* PTX facts a kernel tutorial points at: vectorised global loads (``ld.global.v4`` /
  ``.v2``), asynchronous copies (``cp.async``: Ampere's global -> shared pipeline), tensor-core
  instructions (``mma.sync`` on sm_80 and sm_90; ``wgmma.mma_async``, Hopper's warpgroup MMA,
  where Triton emits it), and local memory (``st.local`` in the PTX, spill bytes from ptxas,
  the stack frame from the cubin).

How launches are obtained.  Nothing is duplicated from the host wrappers: each case *calls the
real wrapper* (``rmsnorm``, ``attention_prefill``, ``paged_decode`` ...) with ``meta`` tensors
(shapes, strides, dtypes, no storage) while the module's kernel objects are swapped for
recorders, so every BLOCK size, ``num_warps``, grid and runtime argument is what the wrapper
computes.  For autotuned kernels every config that survives the kernel's own pruning is
compiled (on a GPU the autotuner tries each of them).  The recorded arguments then go through
Triton's own launch-time specialisation (integer == 1 -> constexpr, 16-divisible integers and
16-aligned pointers get ``tt.divisibility``, exactly as ``JITFunction.run`` does), with a meta
tensor's ``data_ptr()`` standing for a 16-byte-aligned allocation plus its storage offset.
(That path uses Triton-internal helpers, ``create_function_from_signature`` and
``JITFunction._pack_args`` among them, feature-detected for Triton 3.6 - 3.9: see
``_triton_internals``; should they change, every row reports the error.)

The one thing no wrapper can compute here is the number of SMs (``paged_decode`` asks the
CUDA device): the decode cases pass ``num_splits`` from the wrapper's own
``choose_num_splits`` with the SM count of a representative GPU of the target (H100/H200:
132, A100: 108).

The process must not run the interpreter (``TRITON_INTERPRET=1`` turns ``@triton.jit`` into an
interpreted function when a kernel module is imported).  :func:`collect` checks that, and
:func:`run_from_args` re-runs itself as ``python -m workbench.transforms.kernel_aot`` without the
variable when it is set.

CLI: ``workbench kernels-aot [--targets 90,80] [--dtypes bfloat16,float16,float32]
[--configs all|first|last|ends] [--kernels rmsnorm,...] [--json]``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import io
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Callable

# ---- targets and shapes ---------------------------------------------------------------------------

# capability -> (name, SMs of a representative GPU, max shared memory per block in bytes
# (opt-in), 32-bit registers per SM).  H100 / H200 SXM: 132 SMs, 227 KB; A100: 108 SMs, 163 KB.
TARGETS: dict[int, tuple[str, int, int, int]] = {
    90: ("Hopper (H100/H200)", 132, 232448, 65536),
    80: ("Ampere (A100)", 108, 166912, 65536),
}

# Llama-3.2-1B: hidden 2048, intermediate 8192, 32 query heads / 8 KV heads, head_dim 64,
# vocabulary 128,256; the paged KV cache's block size is 16.  HD128: the attention shapes of
# Llama-3-8B (32 / 8 heads, head_dim 128).
HIDDEN, INTERMEDIATE, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 2048, 8192, 32, 8, 64, 16
HEAD_DIM_LARGE = 128
VOCAB = 128256
PREFILL_TOKENS = 512          # one 512-token prompt
DECODE_BATCH = 64             # decode attention: 64 sequences, one new token each (pointwise ops: 1)
LONG_CONTEXT = 4096           # decode of one sequence with a long context (split-K)
NUM_BLOCKS = 4096             # pool size of a layer's paged cache (blocks of BLOCK_SIZE tokens)

CONFIG_CHOICES = ("all", "first", "last", "ends")
KERNEL_FILES = ("rmsnorm", "rope", "swiglu", "flash_prefill", "paged_decode", "sampling")
DTYPES = ("bfloat16", "float16", "float32")
_SHORT = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def _dtype(name: str):
    import torch

    aliases = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}
    name = aliases.get(name, name)
    if name not in DTYPES:
        raise ValueError(f"dtype {name!r}: expected one of {', '.join(DTYPES)}")
    return getattr(torch, name)


# ---- the representative cases: real wrapper calls on meta tensors ---------------------------------

def _cases(file: str, dtype, capability: int) -> list[tuple[str, Callable[[Any], None]]]:
    """(case name, call(module)) for one kernel file; each call is a host-wrapper call as the
    model / engine makes it (``workbench.transforms.backends``), on meta tensors."""
    import torch

    meta = dict(device="meta", dtype=dtype)
    i32 = dict(device="meta", dtype=torch.int32)
    i64 = dict(device="meta", dtype=torch.int64)
    T, B, S = PREFILL_TOKENS, DECODE_BATCH, LONG_CONTEXT
    nh, nkv = NUM_HEADS, NUM_KV_HEADS

    def empty(*shape, **kw):
        return torch.empty(*shape, **kw)

    if file == "rmsnorm":
        return [
            (f"rmsnorm prefill {T}x{HIDDEN}",
             lambda m: m.rmsnorm(empty(1, T, HIDDEN, **meta), empty(HIDDEN, **meta), 1e-5)),
            (f"add_rmsnorm prefill {T}x{HIDDEN}",
             lambda m: m.add_rmsnorm(empty(1, T, HIDDEN, **meta), empty(1, T, HIDDEN, **meta),
                                     empty(HIDDEN, **meta), 1e-5)),
            (f"add_rmsnorm decode 1x{HIDDEN}",
             lambda m: m.add_rmsnorm(empty(1, 1, HIDDEN, **meta), empty(1, 1, HIDDEN, **meta),
                                     empty(HIDDEN, **meta), 1e-5)),
        ]
    if file == "rope":
        def qkv(n, hd=HEAD_DIM):     # the projections' outputs viewed as [tokens, heads, hd]
            return empty(n, nh, hd, **meta), empty(n, nkv, hd, **meta), empty(n, nkv, hd, **meta)

        def rope(m, n):
            q, k, _ = qkv(n)
            m.rope(q, k, empty(n, HEAD_DIM, **meta), empty(n, HEAD_DIM, **meta), empty(n, **i64))

        def rope_kv_write(m, n):
            q, k, v = qkv(n)
            kc = empty(NUM_BLOCKS, BLOCK_SIZE, nkv, HEAD_DIM, **meta)
            m.rope_kv_write(q, k, v, empty(n, HEAD_DIM, **meta), empty(n, HEAD_DIM, **meta), empty(n, **i64),
                            kc, torch.empty_like(kc), empty(n, **i64))

        return [(f"rope prefill {T} tok", lambda m: rope(m, T)),
                (f"rope_kv_write prefill {T} tok", lambda m: rope_kv_write(m, T)),
                ("rope_kv_write decode 1 tok", lambda m: rope_kv_write(m, 1))]
    if file == "swiglu":
        return [(f"swiglu prefill {T}x{INTERMEDIATE}",
                 lambda m: m.swiglu(empty(1, T, INTERMEDIATE, **meta), empty(1, T, INTERMEDIATE, **meta))),
                (f"swiglu merged decode 1x2x{INTERMEDIATE}",
                 lambda m: m.swiglu(empty(1, 1, 2 * INTERMEDIATE, **meta)))]
    if file == "flash_prefill":
        def prefill(m, hd):          # the model's layout: [B, T, heads, hd] transposed to [B, heads, T, hd]
            q = empty(1, T, nh, hd, **meta).transpose(1, 2)
            k = empty(1, T, nkv, hd, **meta).transpose(1, 2)
            m.attention_prefill(q, k, torch.empty_like(k), causal=True)

        def paged_chunk(m):          # chunked prefill: 2 sequences, the last 256 of 1024 / 512 keys
            q = empty(2 * 256, nh, HEAD_DIM, **meta)
            kc = empty(NUM_BLOCKS, BLOCK_SIZE, nkv, HEAD_DIM, **meta)
            m.flash_prefill_paged(q, kc, torch.empty_like(kc), empty(2, 1024 // BLOCK_SIZE, **i32),
                                  empty(3, **i32), empty(2, **i32), 256, check=False)

        return [(f"attention_prefill {T} tok hd{HEAD_DIM}", lambda m: prefill(m, HEAD_DIM)),
                (f"attention_prefill {T} tok hd{HEAD_DIM_LARGE}", lambda m: prefill(m, HEAD_DIM_LARGE)),
                (f"flash_prefill_paged chunk 2x256 hd{HEAD_DIM}", paged_chunk)]
    if file == "paged_decode":
        sms = TARGETS[capability][1]

        def decode(m, batch, ctx):
            q = empty(batch, nh, HEAD_DIM, **meta)
            kc = empty(NUM_BLOCKS, BLOCK_SIZE, nkv, HEAD_DIM, **meta)
            # the SM count is the one input the wrapper reads from a live device: use the target's
            splits = m.choose_num_splits(batch, nkv, ctx, sms)
            m.paged_decode(q, kc, torch.empty_like(kc), empty(batch, ctx // BLOCK_SIZE, **i32),
                           empty(batch, **i32), num_splits=splits, check=False)

        return [(f"paged_decode B={B} ctx 1024", lambda m: decode(m, B, 1024)),
                (f"paged_decode B=1 ctx {S} (split-K)", lambda m: decode(m, 1, S))]
    if file == "sampling":       # the lm_head's logits of a decode batch, one token per sequence
        return [(f"greedy_tokens B={B} V={VOCAB}",
                 lambda m: m.greedy_tokens(empty(B, VOCAB, **meta))),
                (f"sample_tokens B={B} V={VOCAB} top-k 50 top-p 0.9",
                 lambda m: m.sample_tokens(empty(B, VOCAB, **meta), temperature=0.8, top_k=50, top_p=0.9))]
    raise ValueError(f"unknown kernel file {file!r}; expected one of {', '.join(KERNEL_FILES)}")


# ---- recording launches ---------------------------------------------------------------------------

@dataclass
class Launch:
    """One kernel launch as a host wrapper made it (arguments are meta tensors / numbers)."""
    file: str
    kernel: str                 # the module attribute, e.g. "_paged_decode_split_kernel"
    case: str
    grid: Any
    args: tuple
    kwargs: dict
    configs: list = field(default_factory=list)   # autotune configs after pruning; [None] if not autotuned


def _is_kernel(obj) -> bool:
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import JITFunction

    return isinstance(obj, (JITFunction, Autotuner))


def kernel_names(module) -> list[str]:
    """The launchable kernels of a kernel module: ``@triton.jit`` objects named ``*_kernel``
    (device helpers such as ``_dot`` are compiled as part of the kernels that call them)."""
    return sorted(n for n, v in vars(module).items() if n.endswith("_kernel") and _is_kernel(v))


class _Recorder:
    def __init__(self, name: str, launches: list, context: dict):
        self.name, self.launches, self.context = name, launches, context

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append(Launch(self.context["file"], self.name, self.context["case"], grid, args, kwargs))
        return launch


@contextlib.contextmanager
def _recording(module, launches: list, context: dict):
    import workbench_kernels as pkg

    names = kernel_names(module)
    real = {n: getattr(module, n) for n in names}
    counts = dict(pkg.LAUNCHES)
    for n in names:
        setattr(module, n, _Recorder(n, launches, context))
    try:
        yield real
    finally:
        for n, v in real.items():
            setattr(module, n, v)
        pkg.LAUNCHES.clear()
        pkg.LAUNCHES.update(counts)


def check_not_interpreted() -> None:
    """Raise WorkbenchError when this process runs Triton kernels through the interpreter."""
    from workbench.errors import WorkbenchError

    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        raise WorkbenchError("ahead-of-time compilation needs a process without TRITON_INTERPRET=1 "
                             "(run `python -m workbench.transforms.kernel_aot`, which starts without it)")
    loaded = [n for n, mod in sys.modules.items() if n.startswith("workbench_kernels.")
              and any(type(v).__name__ == "InterpretedFunction" for v in vars(mod).values())]
    if loaded:
        raise WorkbenchError(f"{', '.join(sorted(loaded))} were imported under the Triton interpreter; "
                             "compile in a fresh process (`python -m workbench.transforms.kernel_aot`)")


def record_launches(file: str, dtype, capability: int) -> tuple[list[Launch], list[str]]:
    """The launches of every case of one kernel file, and the kernels of the file."""
    importlib.import_module("workbench")      # registers the workbench_kernels import name
    module = importlib.import_module(f"workbench_kernels.{file}")
    launches: list[Launch] = []
    context: dict = {"file": file}
    with _recording(module, launches, context) as real:
        for case, call in _cases(file, dtype, capability):
            context["case"] = f"{case} {_SHORT[str(dtype).removeprefix('torch.')]}"
            call(module)
    for ln in launches:
        kern = real[ln.kernel]
        if hasattr(kern, "configs"):            # triton.autotune: the configs it would try here
            kern.nargs = dict(zip(kern.arg_names, ln.args))
            try:
                ln.configs = list(kern.prune_configs(ln.kwargs))
            finally:
                kern.nargs = None
        else:
            ln.configs = [None]
    return launches, kernel_names(module)


# ---- compiling ------------------------------------------------------------------------------------

def toolchain() -> dict[str, str | None]:
    """Paths of the ptxas binaries and cuobjdump bundled with Triton (None where missing)."""
    out: dict[str, str | None] = {}
    from triton import knobs

    for key in ("ptxas", "ptxas_blackwell", "cuobjdump"):
        try:
            out[key] = getattr(knobs.nvidia, key).path
        except Exception:   # the tool is missing from this triton install
            out[key] = None
    return out


def ptxas_missing(capabilities=(90, 80)) -> str | None:
    """Why ahead-of-time compilation cannot run here (ptxas missing), or None."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas
    except Exception as e:          # no NVIDIA backend in this triton
        return f"triton's NVIDIA backend is not importable: {e}"
    for cap in capabilities:
        try:
            path = get_ptxas(cap).path
        except Exception as e:
            return f"ptxas for sm_{cap} not found in the triton install: {e}"
        if not os.path.isfile(path):
            return f"ptxas for sm_{cap} not found at {path}"
    return None


# Triton-internal APIs this module uses, all present (same signatures) in Triton 3.6 - 3.9:
# triton.knobs (compilation / runtime / nvidia), triton.runtime.jit.create_function_from_signature,
# JITFunction._pack_args, triton.compiler.compiler.make_backend, triton.compiler.ASTSource,
# triton.backends.nvidia.compiler.get_ptxas, Autotuner.prune_configs.  ``JITFunction.run`` copies
# some compilation knobs into the launch options, and that set grows between releases
# (``fpsan_homomorphic_casts`` since 3.9): each is passed only where this Triton has it.
SUPPORTED_TRITON = "3.6 - 3.9"
_LAUNCH_KNOBS = ("instrumentation_mode", "fpsan_homomorphic_casts")


def _triton_internals():
    """The Triton-internal functions used below, or an ImportError that names the Triton
    version and the missing API (each compile row then reports it)."""
    import triton

    try:
        from triton import knobs
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        from triton.compiler.compiler import make_backend
        from triton.runtime.jit import JITFunction, create_function_from_signature
    except ImportError as e:
        raise ImportError(f"triton {triton.__version__} lacks an API workbench.transforms.kernel_aot uses ({e}); "
                          f"supported: triton {SUPPORTED_TRITON}") from None
    if not hasattr(JITFunction, "_pack_args"):
        raise ImportError(f"triton {triton.__version__} has no JITFunction._pack_args; "
                          f"supported: triton {SUPPORTED_TRITON}")
    return knobs, GPUTarget, ASTSource, make_backend, create_function_from_signature


def _launch_knobs(knobs, backend) -> dict:
    """The compilation knobs ``JITFunction.run`` adds to a launch's options in this Triton: those
    that exist both as a knob and as a field of the backend's options (``_pack_args`` rejects
    any other keyword)."""
    try:
        fields = {f.name for f in dataclasses.fields(backend.parse_options({}))}
    except Exception:       # options are not a dataclass here: trust the knobs alone
        fields = None
    return {name: getattr(knobs.compilation, name) for name in _LAUNCH_KNOBS
            if hasattr(knobs.compilation, name) and (fields is None or name in fields)}


def _specialize(jit, backend, args: tuple, kwargs: dict):
    """Signature, constexprs, attrs and options exactly as ``JITFunction.run`` derives them."""
    knobs, _, _, _, create_function_from_signature = _triton_internals()

    kwargs = dict(kwargs)
    kwargs["debug"] = kwargs.get("debug", jit.debug) or knobs.runtime.debug
    kwargs.update(_launch_knobs(knobs, backend))
    binder = create_function_from_signature(jit.signature, jit.params, backend)
    bound_args, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = jit._pack_args(backend, kwargs, bound_args, specialization, options)
    return signature, constexprs, attrs, options, bound_args


_LD_GLOBAL = re.compile(r"\bld\.global[\w.:]*")
_PTXAS_REGS = re.compile(r"Used (\d+) registers")
_PTXAS_SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_RES = re.compile(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")


def ptx_facts(ptx: str) -> dict[str, int]:
    """Counts of the PTX instructions a kernel tutorial points at (static counts in the code,
    not executed counts: an unrolled loop body counts once per copy)."""
    loads = _LD_GLOBAL.findall(ptx)
    return {
        "ld_v4": sum(".v4." in ld for ld in loads),
        "ld_v2": sum(".v2." in ld for ld in loads),
        "ld_scalar": sum(".v2." not in ld and ".v4." not in ld for ld in loads),
        "cp_async": len(re.findall(r"\bcp\.async\.(?:ca|cg)\.shared\.global", ptx)),
        "tma": len(re.findall(r"\bcp\.async\.bulk\.tensor", ptx)),
        "mma": len(re.findall(r"\bmma\.sync\.aligned", ptx)),
        "wgmma": len(re.findall(r"\bwgmma\.mma_async", ptx)),
        "ptx_local": len(re.findall(r"\b(?:st|ld)\.local", ptx)),
    }


def cubin_resources(cubin: bytes, cuobjdump: str | None) -> dict[str, int | None]:
    """Registers, stack frame and local memory per thread, from ``cuobjdump --dump-resource-usage``."""
    none = {"regs": None, "stack": None, "local": None}
    if not cuobjdump:
        return none
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        try:
            out = subprocess.run([cuobjdump, "--dump-resource-usage", path], capture_output=True, text=True,
                                 timeout=60).stdout
        except (OSError, subprocess.SubprocessError):
            return none
    m = _RES.search(out)
    if not m:
        return none
    return {"regs": int(m.group(1)), "stack": int(m.group(2)), "local": int(m.group(4))}


def _config_text(cfg, launch: Launch) -> str:
    if cfg is None:
        keys = [k for k in launch.kwargs if k.startswith("BLOCK_")]
        parts = [f"{k}={launch.kwargs[k]}" for k in keys]
        if "num_warps" in launch.kwargs:
            parts.append(f"w{launch.kwargs['num_warps']}")
        return " ".join(parts)
    return " ".join([f"{k}={v}" for k, v in cfg.kwargs.items()] + [f"w{cfg.num_warps}", f"s{cfg.num_stages}"])


def _grid_text(grid, bound_args: dict) -> str:
    try:
        g = grid(bound_args) if callable(grid) else grid
        return "x".join(str(int(x)) for x in g)
    except Exception:
        return "?"


def compile_launch(launch: Launch, cfg, capability: int, tools: dict) -> dict:
    """Compile one launch (with one autotune config) for ``sm_<capability>``; one result row."""
    import triton

    module = importlib.import_module(f"workbench_kernels.{launch.file}")
    kern = getattr(module, launch.kernel)
    jit = kern.fn if hasattr(kern, "configs") else kern
    kwargs = dict(launch.kwargs)
    if cfg is not None:
        kwargs.update(cfg.all_kwargs())
    name, _, smem_max, regfile = TARGETS[capability]
    row: dict[str, Any] = {"file": launch.file, "kernel": launch.kernel, "case": launch.case,
                           "target": f"sm_{capability}", "config": _config_text(cfg, launch), "grid": "",
                           "status": "error", "error": "", "seconds": None, "smem": None, "num_warps": None,
                           "num_stages": None, "regs": None, "stack": None, "spill_bytes": None, "note": ""}
    t0 = time.perf_counter()
    log = io.StringIO()
    knobs = None
    try:
        knobs, GPUTarget, ASTSource, make_backend, _ = _triton_internals()
        old_dump = getattr(knobs.nvidia, "dump_ptxas_log", False)
        target = GPUTarget("cuda", capability, 32)
        backend = make_backend(target)
        signature, constexprs, attrs, options, bound = _specialize(jit, backend, launch.args, kwargs)
        row["grid"] = _grid_text(launch.grid, {**bound, **kwargs})
        knobs.nvidia.dump_ptxas_log = True      # ptxas -v: registers and spill bytes (printed to stdout)
        with contextlib.redirect_stdout(log):
            compiled = triton.compile(ASTSource(jit, signature, constexprs, attrs), target=target,
                                      options=options.__dict__)
    except Exception as e:      # a compile failure is a result row, not a crash
        row["seconds"] = round(time.perf_counter() - t0, 3)
        msg = str(e).strip() or type(e).__name__
        msg = f"{type(e).__name__}: {msg}"
        # Triton's CompilationError quotes the source first and states the problem last: keep both ends
        row["error"] = msg if len(msg) <= 4000 else f"{msg[:1000]}\n...\n{msg[-3000:]}"
        return row
    finally:
        if knobs is not None:
            knobs.nvidia.dump_ptxas_log = old_dump
    row["seconds"] = round(time.perf_counter() - t0, 3)
    md = compiled.metadata
    row.update(status="ok", smem=int(md.shared), num_warps=int(md.num_warps), num_stages=int(md.num_stages))
    row.update(ptx_facts(compiled.asm.get("ptx", "")))
    res = cubin_resources(compiled.asm.get("cubin", b""), tools.get("cuobjdump"))
    row["regs"], row["stack"] = res["regs"], res["stack"]
    ptxas_log = log.getvalue()
    if row["regs"] is None and (m := _PTXAS_REGS.search(ptxas_log)):
        row["regs"] = int(m.group(1))
    if m := _PTXAS_SPILL.search(ptxas_log):        # absent when Triton's cache served the kernel
        row["spill_bytes"] = int(m.group(1)) + int(m.group(2))
    notes = []
    if row["smem"] > smem_max:
        notes.append(f"needs {row['smem']} B shared memory > {smem_max} on {name}: the autotuner skips this config")
    if row["regs"] is not None and row["regs"] * row["num_warps"] * 32 > regfile:
        notes.append(f"{row['regs']} regs x {row['num_warps'] * 32} threads > {regfile}-register file: "
                     "launch would fail")
    if row["spill_bytes"]:
        notes.append(f"spills {row['spill_bytes']} B to local memory")
    row["note"] = "; ".join(notes)
    return row


def collect(targets=(90, 80), dtypes=("bfloat16",), configs: str = "all", kernels=KERNEL_FILES,
            progress: Callable[[str], None] | None = None) -> list[dict]:
    """Compile every kernel of ``kernels`` (file names) at its representative cases for each
    target capability and dtype.  ``configs``: ``all`` autotune configs (after pruning), the
    ``first`` of each, the ``last``, or both (``ends``: the largest and the smallest tile in
    this library's config lists).  Returns one row per (launch, config, target); see
    :func:`compile_launch`.
    A kernel that no case launches gets an error row (a new kernel needs a case here)."""
    check_not_interpreted()
    if configs not in CONFIG_CHOICES:
        raise ValueError(f"configs={configs!r}: expected one of {', '.join(CONFIG_CHOICES)}")
    for cap in targets:
        if cap not in TARGETS:
            raise ValueError(f"target {cap}: expected one of {sorted(TARGETS)}")
    bad = [k for k in kernels if k not in KERNEL_FILES]
    if bad:
        raise ValueError(f"kernels {bad}: expected some of {', '.join(KERNEL_FILES)}")
    tools = toolchain()
    rows: list[dict] = []
    for file in kernels:
        for dt in dtypes:
            dtype = _dtype(dt)
            for cap in targets:
                launches, names = record_launches(file, dtype, cap)
                seen: set = set()
                for ln in launches:
                    cfgs = {"all": ln.configs, "first": ln.configs[:1], "last": ln.configs[-1:],
                            "ends": ln.configs[:1] + ln.configs[1:][-1:]}[configs]
                    for cfg in cfgs:
                        key = (ln.kernel, ln.case, None if cfg is None else str(cfg))
                        if key in seen:     # e.g. a wrapper launching the same kernel twice
                            continue
                        seen.add(key)
                        row = compile_launch(ln, cfg, cap, tools)
                        row["dtype"] = _SHORT.get(dt, dt)
                        rows.append(row)
                        if progress:
                            progress(f"{row['target']} {row['kernel']} [{row['case']}] {row['config']}: "
                                     f"{row['status']} {row['seconds']:.1f}s")
                launched = {ln.kernel for ln in launches}
                for n in names:
                    if n not in launched:
                        rows.append({"file": file, "kernel": n, "case": f"(no case) {_SHORT.get(dt, dt)}",
                                     "target": f"sm_{cap}", "config": "", "grid": "", "status": "error",
                                     "error": "no representative case launches this kernel: add one to "
                                              "workbench.transforms.kernel_aot._cases", "seconds": 0.0, "dtype": _SHORT.get(dt, dt),
                                     "note": ""})
    return rows


# ---- presentation ---------------------------------------------------------------------------------

_COLUMNS = [("kernel", "kernel"), ("case", "case"), ("target", "target"), ("config", "config"),
            ("status", "ok"), ("seconds", "s"), ("smem", "smem B"), ("num_warps", "warps"), ("regs", "regs"),
            ("ld_v4", "ld.v4"), ("ld_v2", "ld.v2"), ("ld_scalar", "ld.1"), ("cp_async", "cp.async"),
            ("mma", "mma.sync"), ("wgmma", "wgmma"), ("spill_bytes", "spill B")]


def format_aot(rows: list[dict]) -> str:
    """A plain-text table (one line per row), then notes and the compiler's errors in full."""
    def cell(row, key):
        v = row.get(key)
        if key == "status":
            return "ok" if v == "ok" else "FAIL"
        if key == "kernel":
            return str(v).strip("_").removesuffix("_kernel")
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:.1f}"
        return str(v)

    table = [[h for _, h in _COLUMNS]] + [[cell(r, k) for k, _ in _COLUMNS] for r in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(_COLUMNS))]
    text = ["  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in table]
    text.insert(1, "  ".join("-" * w for w in widths))
    ok = sum(r["status"] == "ok" for r in rows)
    total_s = sum(r.get("seconds") or 0.0 for r in rows)
    text.append("")
    text.append(f"{ok}/{len(rows)} compiled ({total_s:.1f} s).  ld.v4 / ld.v2 / ld.1: vector / scalar "
                "ld.global in the PTX (static counts); cp.async: global->shared async copies; mma.sync / "
                "wgmma: tensor-core instructions; regs: per thread (cuobjdump); spill B: ptxas spill "
                "stores + loads ('-' when Triton's cache served the kernel).")
    for r in rows:
        if r.get("note"):
            text.append(f"note: {r['target']} {cell(r, 'kernel')} [{r['case']}] {r['config']}: {r['note']}")
    for r in rows:
        if r["status"] != "ok":
            lines = (r.get("error") or "").strip().splitlines() or [""]
            shown = lines if len(lines) <= 10 else lines[:1] + ["..."] + lines[-8:]   # the message is last
            text.append(f"FAILED: {r['target']} {cell(r, 'kernel')} [{r['case']}] {r['config']}:")
            text.extend(f"    {line}" for line in shown)
    return "\n".join(text)


# ---- CLI ------------------------------------------------------------------------------------------

def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--targets", default="90,80",
                   help="comma-separated CUDA compute capabilities: 90 (Hopper), 80 (Ampere); default 90,80")
    p.add_argument("--dtypes", default="bfloat16",
                   help="comma-separated: bfloat16, float16, float32, or 'all' (default bfloat16)")
    p.add_argument("--configs", default="all", choices=CONFIG_CHOICES,
                   help="autotuned kernels: every config the autotuner would try (all), the first (largest "
                        "tile), the last (smallest), or both (ends); default all")
    p.add_argument("--kernels", default=",".join(KERNEL_FILES),
                   help=f"comma-separated kernel files (default all: {','.join(KERNEL_FILES)})")
    p.add_argument("--json", action="store_true", help="print {'rows': [...]} as JSON instead of the table")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    return p


def _split(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _interpreted() -> bool:
    try:
        check_not_interpreted()
    except Exception:
        return True
    return False


def run_from_args(args: argparse.Namespace) -> int:
    """Exit status 0 when every row compiled, 1 when some failed (their errors are printed),
    2 on bad options or a missing toolchain."""
    from workbench.errors import WorkbenchError

    if _interpreted():       # this process runs the interpreter: compile in a clean one
        argv = [sys.executable, "-m", "workbench.transforms.kernel_aot", "--targets", args.targets, "--dtypes", args.dtypes,
                "--configs", args.configs, "--kernels", args.kernels] + ["--json"] * args.json + \
            ["--quiet"] * args.quiet
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        return subprocess.run(argv, env=env).returncode
    try:
        targets = tuple(int(t.removeprefix("sm_").removeprefix("sm")) for t in _split(args.targets))
    except ValueError:
        raise WorkbenchError(f"--targets {args.targets!r}: expected capabilities such as 90,80")
    dtypes = DTYPES if args.dtypes.strip() == "all" else tuple(_split(args.dtypes))
    missing = ptxas_missing(targets)
    if missing:
        raise WorkbenchError(missing)
    say = None if (args.quiet or args.json) else (lambda msg: print(f"[kernels-aot] {msg}", file=sys.stderr,
                                                                    flush=True))
    try:
        rows = collect(targets=targets, dtypes=dtypes, configs=args.configs, kernels=tuple(_split(args.kernels)),
                       progress=say)
    except ValueError as e:
        raise WorkbenchError(str(e)) from None
    if args.json:
        print(json.dumps({"rows": rows}, indent=1))
    else:
        print(format_aot(rows))
    return 0 if all(r["status"] == "ok" for r in rows) else 1


def main(argv: list[str] | None = None) -> int:
    """``python -m workbench.transforms.kernel_aot`` (what ``workbench kernels-aot`` runs)."""
    from workbench.errors import WorkbenchError

    p = add_arguments(argparse.ArgumentParser(prog="workbench kernels-aot",
                                              description=__doc__.split("\n\n")[0]))
    args = p.parse_args(argv)
    try:
        return run_from_args(args)
    except WorkbenchError as e:
        print(f"workbench kernels-aot: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
