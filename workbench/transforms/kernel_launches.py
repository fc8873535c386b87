"""Ahead-of-time compilation, part 1: the kernel launches the host wrappers make, recorded on
meta tensors.

Each representative case (:func:`_cases`) calls a real host wrapper (``rmsnorm``,
``attention_prefill``, ``paged_decode`` ...) on ``meta`` tensors while the module's kernel objects
are swapped for recorders (:func:`record_launches`), so every BLOCK size, ``num_warps``, grid
and runtime argument is what the wrapper computes; for an autotuned kernel, the configs that
survive its own pruning.  :mod:`workbench.transforms.kernel_compile` compiles them.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
from dataclasses import dataclass, field
from typing import Any
from collections.abc import Callable

import workbench_kernels

from workbench.errors import WorkbenchError

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

KERNEL_FILES = ("rmsnorm", "rope", "swiglu", "flash_prefill", "paged_decode", "sampling", "quant_matmul")
DTYPES = ("bfloat16", "float16", "float32")
DTYPE_SHORT = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def torch_dtype(name: str):
    """``"bfloat16"`` (or ``bf16``, ``fp16``, ``half``, ``fp32``, ``float``) -> the torch dtype."""
    import torch  # lazy: torch (~3 s) and triton only once launches are recorded; the CLI's parser reads KERNEL_FILES

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
    if file == "quant_matmul":   # the MLP's up projection (out 8192, in 2048) quantized, group 128
        N, K, g = INTERMEDIATE, HIDDEN, 128
        u8, i8, f32 = (dict(device="meta", dtype=t) for t in (torch.uint8, torch.int8, torch.float32))

        def call(m, op, rows):
            x = empty(rows, K, **meta)
            s = empty(N, K // g, **f32)
            if op == "w4a16":
                m.w4a16_matmul(x, empty(N, K // 2, **u8), s, None, g)
            elif op == "w8a16":
                m.w8a16_matmul(x, empty(N, K, **i8), s, None, g)
            else:
                m.w4a8_matmul(x, empty(N, K // 2, **u8), s, g)

        return [(f"{op} {'decode' if rows == 1 else 'batch'} {rows}x{K} -> {N} g{g}",
                 lambda m, op=op, rows=rows: call(m, op, rows))
                for op in ("w4a16", "w8a16", "w4a8") for rows in (1, 64)]
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
    names = kernel_names(module)
    real = {n: getattr(module, n) for n in names}
    # a kernel file may re-export kernels its sibling modules define and launch (``quant_matmul``):
    # swap each kernel in every loaded workbench_kernels module that binds it, where its wrapper looks it up
    homes = [mod for name, mod in list(sys.modules.items())
             if mod is module or (name.startswith("workbench_kernels.") and mod is not None)]
    bound = [(mod, n) for mod in homes for n in names if vars(mod).get(n) is real[n]]
    counts = dict(workbench_kernels.LAUNCHES)
    for mod, n in bound:
        setattr(mod, n, _Recorder(n, launches, context))
    try:
        yield real
    finally:
        for mod, n in bound:
            setattr(mod, n, real[n])
        workbench_kernels.LAUNCHES.clear()
        workbench_kernels.LAUNCHES.update(counts)


def check_not_interpreted() -> None:
    """Raise WorkbenchError when this process runs Triton kernels through the interpreter."""
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        raise WorkbenchError("ahead-of-time compilation needs a process without TRITON_INTERPRET=1 "
                             "(run `python -m workbench.cli kernels-aot`, which starts without it)")
    loaded = [n for n, mod in sys.modules.items() if n.startswith("workbench_kernels.")
              and any(type(v).__name__ == "InterpretedFunction" for v in vars(mod).values())]
    if loaded:
        raise WorkbenchError(f"{', '.join(sorted(loaded))} were imported under the Triton interpreter; "
                             "compile in a fresh process (`python -m workbench.cli kernels-aot`)")


def record_launches(file: str, dtype, capability: int) -> tuple[list[Launch], list[str]]:
    """The launches of every case of one kernel file, and the kernels of the file."""
    importlib.import_module("workbench")      # registers the workbench_kernels import name
    module = importlib.import_module(f"workbench_kernels.{file}")
    launches: list[Launch] = []
    context: dict = {"file": file}
    with _recording(module, launches, context) as real:
        for case, call in _cases(file, dtype, capability):
            context["case"] = f"{case} {DTYPE_SHORT[str(dtype).removeprefix('torch.')]}"
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

