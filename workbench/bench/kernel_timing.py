"""The kernel benchmark's rows, its environment, its timing and the device's ceilings.

Every measurement is one row with the columns :data:`ROW_FIELDS` (:func:`new_row` fills the
environment: device, versions, interpreter).  :func:`time_calls` times a call (CUDA events after
an L2 flush on a GPU, ``perf_counter`` on a CPU), :func:`compare_timing` states one row against
another with the noise; :func:`measure_ceilings` measures the copy bandwidth and matmul rate every
other row is a fraction of.
"""

from __future__ import annotations

import os
import statistics
import sys
from collections.abc import Callable
from datetime import UTC, datetime

import torch

from workbench.errors import WorkbenchError
from workbench.measure.timing import time_call

ROW_FIELDS = [
    "time", "section", "op", "provider", "status", "error", "note", "timing",
    "device", "device_name", "dtype", "sizes", "backends", "model",
    "repeats", "ms_median", "ms_min", "ms_max", "vs_eager",
    "metric", "formula", "bytes", "flops", "achieved", "ceiling_name", "ceiling", "frac_of_ceiling",
    "max_err", "err_vs", "launches_per_step", "launch_counter", "torch", "triton", "interpreter",
]
INTERPRETER_NOTE = "triton-interpreter"


# ---- environment ------------------------------------------------------------------------------
def prepare_device(device: str | torch.device | None) -> torch.device:
    """Resolve the device; on a CPU switch the Triton interpreter on (before any kernel module is
    imported: ``@triton.jit`` chooses compiler or interpreter at import time)."""
    from workbench.model.loader import resolve_device

    dev = resolve_device(device)
    if dev.type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") != "1":
        loaded = [m for m in sys.modules if m.startswith("workbench_kernels.") and not m.endswith("_testing")]
        if loaded:
            raise WorkbenchError(f"kernel bench on a CPU needs TRITON_INTERPRET=1, but {', '.join(loaded)} were "
                                 "already imported without it; set the variable before starting Python")
        os.environ["TRITON_INTERPRET"] = "1"
    return dev


def environment(dev: torch.device) -> dict:
    from workbench.bench.vs_transformers import cpu_name

    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {"device": str(dev), "torch": torch.__version__, "triton": triton_version,
            "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else cpu_name(),
            "interpreter": os.environ.get("TRITON_INTERPRET", "0") == "1"}


def new_row(env: dict, section: str, op: str, provider: str, **values) -> dict:
    row = dict.fromkeys(ROW_FIELDS)
    row.update(env, time=datetime.now(UTC).isoformat(timespec="seconds"), section=section, op=op,
               provider=provider, status="ok")
    row.update(values)
    return row



def error_text(e: BaseException) -> str:
    """An exception as one line of at most 400 characters (a row's ``error`` column)."""
    msg = f"{type(e).__name__}: {e}".replace("\n", " ")
    return msg if len(msg) <= 400 else msg[:397] + "..."


# ---- timing -----------------------------------------------------------------------------------
_FLUSH: dict[torch.device, torch.Tensor] = {}


# GPU cycles a spin kernel keeps the stream busy between the L2 flush and a timed call, so that the
# start event fires only once the host has enqueued the call (~0.25 ms at H100/H200 clocks: longer
# than a Triton wrapper's or a compiled guard's host time)
SPIN_CYCLES = 500_000


def time_calls(fn: Callable, dev: torch.device, warmup: int, repeats: int, flush_l2: bool = False) -> list[float]:
    """Seconds per call of ``fn`` (``repeats`` of them, after ``warmup`` untimed calls).

    Off CUDA: :func:`workbench.measure.timing.time_call` (``perf_counter``).  On CUDA: one pair
    of timing events per call.  With ``flush_l2`` a 256 MiB zero evicts the L2 cache before each
    call, outside the timed window, and a spin kernel (``torch.cuda._sleep``) then keeps the GPU
    busy while the host runs the call's Python (wrapper checks, autotune lookup, compile guards):
    without it the GPU finished the flush, passed the start event and idled until the call's
    kernels arrived, and a microsecond kernel was charged the host's launch time."""
    if dev.type != "cuda":
        return [ms / 1e3 for ms in time_call(fn, dev, warmup=warmup, repeats=repeats)]
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize(dev)
    if flush_l2 and dev not in _FLUSH:
        _FLUSH[dev] = torch.empty(256 << 20, dtype=torch.int8, device=dev)      # > any L2 cache today
    flush = _FLUSH.get(dev) if flush_l2 else None
    spin = getattr(torch.cuda, "_sleep", None) if flush is not None else None
    out = []
    for _ in range(repeats):
        if flush is not None:
            flush.zero_()                            # evict the L2 cache (outside the timed window)
        if spin is not None:
            spin(SPIN_CYCLES)                        # the GPU is busy while the host enqueues fn
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize(dev)
        out.append(start.elapsed_time(end) / 1e3)
    return out


def timing_fields(times: list[float]) -> dict:
    return {"repeats": len(times), "ms_median": statistics.median(times) * 1e3, "ms_min": min(times) * 1e3,
            "ms_max": max(times) * 1e3}


def compare_timing(row, ref) -> str:
    """A timing against the reference, with the noise stated: ``within noise`` when the two
    ``ms_min..ms_max`` ranges overlap, else the ratio of the medians (``25.3x slower``)."""
    if row["ms_min"] <= ref["ms_max"] and ref["ms_min"] <= row["ms_max"]:
        return "within noise (min..max ranges overlap)"
    ratio = row["ms_median"] / ref["ms_median"]
    return f"{ratio:.3g}x slower" if ratio > 1 else f"{1 / ratio:.3g}x faster"


# ---- 1. ceilings ------------------------------------------------------------------------------
def measure_ceilings(dev: torch.device, dtype: torch.dtype, sz: dict, env: dict, warmup: int,
                     repeats: int) -> tuple[list[dict], dict]:
    """Rows for copy bandwidth and matmul rate, and ``{"GB/s": ..., "TFLOP/s": ...}`` (None if failed)."""
    rows, ceilings = [], {"GB/s": None, "TFLOP/s": None}
    mm_dtype = dtype if dev.type == "cuda" else torch.float32
    try:
        n = (sz["copy_mib"] << 20) // torch.finfo(dtype).bits * 8
        src = torch.randn(n, device=dev).to(dtype)
        dst = torch.empty_like(src)
        t = timing_fields(time_calls(lambda: dst.copy_(src), dev, warmup, repeats))
        nbytes = 2 * n * src.element_size()
        ceilings["GB/s"] = nbytes / (t["ms_median"] / 1e3) / 1e9
        rows.append(new_row(env, "ceilings", "copy", "torch", backends="torch", dtype=dtype_name(dtype),
                            sizes=f"n={n}", metric="GB/s",
                            formula="2 * n * elem_bytes (read + write)", bytes=nbytes, achieved=ceilings["GB/s"],
                            timing="device" if dev.type == "cuda" else "host", **t))
    except Exception as e:  # noqa: BLE001 - recorded, the run goes on
        rows.append(new_row(env, "ceilings", "copy", "torch", status="error", error=error_text(e),
                            dtype=dtype_name(dtype)))
    try:
        m = sz["matmul"]
        a, b = (torch.randn(m, m, device=dev).to(mm_dtype) for _ in range(2))
        t = timing_fields(time_calls(lambda: a @ b, dev, warmup, repeats))
        flops = 2 * m ** 3
        ceilings["TFLOP/s"] = flops / (t["ms_median"] / 1e3) / 1e12
        rows.append(new_row(env, "ceilings", "matmul", "torch", backends="torch", dtype=dtype_name(mm_dtype),
                            sizes=f"m=n=k={m}",
                            metric="TFLOP/s", formula="2 * m * n * k", flops=flops, achieved=ceilings["TFLOP/s"],
                            timing="device" if dev.type == "cuda" else "host", note=f"{torch.get_num_threads()} threads"
                            if dev.type == "cpu" else None, **t))
    except Exception as e:  # noqa: BLE001
        rows.append(new_row(env, "ceilings", "matmul", "torch", status="error", error=error_text(e),
                            dtype=dtype_name(mm_dtype)))
    return rows, ceilings



def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
