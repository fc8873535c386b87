"""Ahead-of-time compilation, part 2: one recorded launch compiled for ``sm_<capability>``
without a GPU, and what the compiled code says.

:func:`compile_launch` runs Triton's whole pipeline (TTIR -> TTGIR -> LLVM IR -> PTX -> ptxas
-> cubin) for a ``GPUTarget`` after Triton's own launch-time specialisation (:func:`_specialize`,
through the Triton-internal helpers of :func:`_triton_internals`), then reads shared memory,
registers, spills (:func:`cubin_resources`, ptxas' log) and PTX facts (:func:`ptx_facts`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import io
import os
import re
import subprocess
import tempfile
import time
from typing import Any

from workbench.transforms.kernel_launches import TARGETS, Launch


def toolchain() -> dict[str, str | None]:
    """Paths of the ptxas binaries and cuobjdump bundled with Triton (None where missing)."""
    out: dict[str, str | None] = {}
    from triton import knobs  # lazy: triton (~0.7 s; the CLI's parser imports this module via kernel_aot)

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
        raise ImportError(f"triton {triton.__version__} lacks an API workbench.transforms.kernel_compile uses ({e}); "
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

