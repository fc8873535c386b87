"""The benchmarks' kernel cases and the device check's warm-up.

The cases live in two modules, their names importable from here (the module callers import):
:mod:`~workbench.bench.kernel_op_cases` (:class:`Case`, :func:`make_case`, :func:`run_case`: each
fused kernel at one size, against torch and an fp32 reference) and
:mod:`~workbench.bench.kernel_launch_cases` (:class:`LaunchCase`, :func:`bench_launch_cases`: every
launch configuration the benchmarks make, which ``workbench kernels-aot`` compiles for sm_90).

This module is the warm-up: :func:`warm_up`, the device check's first step, compiles and autotunes
every launch case on the GPU before the benchmarks run (it reads :func:`bench_launch_cases` from
this module's namespace); :func:`compile_shard` is what each of its compile worker processes runs
(``python -m workbench.cli.gpu_results step warmup-compile``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable

import torch

from workbench.bench.kernel_launch_cases import LaunchCase, bench_launch_cases
from workbench.bench.kernel_op_cases import BACKEND_OP, OPS, Case, make_case, run_case
from workbench.bench.kernel_timing import error_text

__all__ = ["BACKEND_OP", "OPS", "Case", "LaunchCase", "bench_launch_cases", "compile_shard", "make_case",
           "run_case", "warm_up"]


# ---- the device check's warm-up: compile and autotune every case before the benchmarks run -----------

def compile_shard(shard: int, shards: int, device=None, dtype=None) -> list[dict]:
    """Compile, without launching, the launches of cases ``shard::shards`` of
    :func:`bench_launch_cases` on ``device`` (CUDA): each case is recorded with real tensors
    (the wrappers' arithmetic, nothing runs), then every launch goes through Triton's own
    ``warmup`` (an autotuned kernel: every config its pruning keeps) into Triton's cache.  Several
    processes run shards side by side (compiling is CPU work); one row per case."""
    from workbench.transforms.kernel_aot import record_case

    dev = torch.device(device or "cuda")
    dtype = dtype or torch.bfloat16
    rows = []
    for case in bench_launch_cases()[shard::shards]:
        t0 = time.perf_counter()
        row = {"phase": "compile", "source": case.source, "case": case.name, "file": case.file, "launches": 0,
               "status": "ok", "error": None}
        try:
            launches, real = record_case(case, dev, dtype)
            for ln in launches:
                real[ln.kernel].warmup(*ln.args, grid=ln.grid, **ln.kwargs)
            row["launches"] = len(launches)
        except Exception as e:  # noqa: BLE001 - the run phase compiles what this could not
            row.update(status="error", error=error_text(e))
        row["seconds"] = round(time.perf_counter() - t0, 3)
        rows.append(row)
    return rows


def _record_on_meta(cases: list, done: Callable[[dict], None]) -> None:
    """The dry run without CUDA: each case recorded on meta tensors at its GPU sizes (the builders
    and the wrappers' launch arithmetic run, nothing compiles); one row per case to ``done``."""
    from workbench.transforms.kernel_aot import record_case

    for case in cases:
        t0 = time.perf_counter()
        row = {"phase": "record (meta, no GPU)", "source": case.source, "case": case.name, "file": case.file,
               "status": "ok", "error": None}
        try:
            launches, _ = record_case(case, "meta", torch.bfloat16, sms=132)
            row["launches"] = len(launches)
        except Exception as e:  # noqa: BLE001
            row.update(status="error", error=error_text(e))
        row["seconds"] = round(time.perf_counter() - t0, 3)
        done(row)


def _compile_in_workers(cases: list, workers: int, dev, deadline: float | None, say: Callable[[str], None],
                        done: Callable[[dict], None]) -> None:
    """``workers`` processes compile the cases' launches side by side without launching (each runs
    :func:`compile_shard` through ``gpu_results step warmup-compile``); their rows go to ``done``,
    a worker that fails or outlives ``deadline`` is one error row."""
    import os
    import subprocess
    import sys

    say(f"compile: {len(cases)} cases in {workers} processes")
    t0 = time.perf_counter()
    env = {k: v for k, v in os.environ.items() if k not in ("WORKBENCH_PARTIAL_OUT", "WORKBENCH_COMPILE_LOG")}
    env["OMP_NUM_THREADS"] = "1"
    procs = [subprocess.Popen([sys.executable, "-m", "workbench.cli.gpu_results", "step", "warmup-compile",
                               "--shard", str(i), "--shards", str(workers), "--device", str(dev)],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
             for i in range(workers)]
    for p in procs:
        left = None if deadline is None else max(1.0, deadline - time.time())
        try:
            out, _ = p.communicate(timeout=left)
            last = (out or "").strip().splitlines()[-1:] or ["{}"]      # the worker prints its JSON last
            for r in json.loads(last[0]).get("rows", []):
                done(r)
        except (subprocess.TimeoutExpired, ValueError) as e:
            p.kill()
            done({"phase": "compile", "source": "", "case": f"worker {procs.index(p)}", "status": "error",
                  "error": f"{type(e).__name__}", "seconds": round(time.perf_counter() - t0, 3)})
    say(f"compiled in {time.perf_counter() - t0:.1f} s")


def _run_each_case(cases: list, dev, dtype, late: Callable[[], bool], say: Callable[[str], None],
                   done: Callable[[dict], None]) -> None:
    """Every case once for real, in order (an autotuned kernel benchmarks its configs here);
    past the deadline (``late()``) the rest are skipped rows."""
    for case in cases:
        if late():
            done({"phase": "run", "source": case.source, "case": case.name, "file": case.file, "status": "skipped",
                  "error": "past the step's deadline", "seconds": 0.0})
            continue
        t0 = time.perf_counter()
        row = {"phase": "run", "source": case.source, "case": case.name, "file": case.file, "status": "ok",
               "error": None}
        try:
            with torch.inference_mode():
                case.call(dev, dtype)
            torch.cuda.synchronize(dev)
        except Exception as e:  # noqa: BLE001 - the benchmark then compiles it (its compile seconds show it)
            row.update(status="error", error=error_text(e))
        row["seconds"] = round(time.perf_counter() - t0, 3)
        say(f"{case.label()}: {row['status']} {row['seconds']:.2f} s")
        done(row)


def _compile_bench_ops(dev, dtype, late: Callable[[], bool], say: Callable[[str], None],
                       done: Callable[[dict], None]) -> None:
    """``torch.compile`` of the kernel bench's eager ops at its full sizes (inductor's FX-graph
    cache then serves the bench's ``compile`` provider); stops past the deadline (``late()``)."""
    from workbench.bench.kernels import SIZES

    for op in OPS:
        if late():
            break
        t0 = time.perf_counter()
        row = {"phase": "inductor", "source": "kernels-bench", "case": f"torch.compile {op} (size full)",
               "file": "", "status": "ok", "error": None}
        try:
            fn, args, kwargs = make_case(op, SIZES["full"], dev, dtype).eager
            with torch.inference_mode():
                torch.compile(fn)(*args, **kwargs)
            torch.cuda.synchronize(dev)
        except Exception as e:  # noqa: BLE001
            row.update(status="error", error=error_text(e))
        row["seconds"] = round(time.perf_counter() - t0, 3)
        say(f"{row['case']}: {row['status']} {row['seconds']:.2f} s")
        done(row)
        torch.cuda.empty_cache()


def warm_up(device=None, dtype=None, workers: int = 0, inductor: bool = True, deadline: float | None = None,
            progress: Callable[[str], None] | None = None, on_rows: Callable[[list], None] | None = None) -> dict:
    """Compile and autotune the benchmarks' kernels once, before they are timed (the device
    check's first step; Triton's and inductor's caches carry the results to the later steps).

    On CUDA: (1) with ``workers`` > 1, that many processes compile the cases' launches side by
    side without launching (:func:`compile_shard`); (2) every case runs once for real, in order
    (an autotuned kernel benchmarks its configs here, once: Triton writes the choice to its cache
    when ``TRITON_CACHE_AUTOTUNING=1``); (3) ``inductor``: ``torch.compile`` of the kernel bench's
    eager ops at its full sizes (the ``compile`` provider: inductor's FX-graph cache serves the
    bench).  Without CUDA (the dry run) each case is recorded on meta tensors at its GPU sizes:
    the builders and the wrappers' launch arithmetic run, nothing compiles.  ``deadline``
    (``time.time()``): later cases are skipped past it.  Returns ``{"rows": [...], ...}``."""
    from workbench.model.loader import resolve_device

    dev = resolve_device(device)
    say = progress or (lambda msg: None)
    rows: list[dict] = []
    t_start = time.perf_counter()

    def done(row):
        rows.append(row)
        if on_rows is not None:
            on_rows(rows)

    def late() -> bool:
        return deadline is not None and time.time() > deadline

    cases = bench_launch_cases()
    if dev.type != "cuda":
        _record_on_meta(cases, done)
        return {"device": str(dev), "cases": len(cases), "rows": rows,
                "seconds": round(time.perf_counter() - t_start, 2)}
    dtype = dtype or torch.bfloat16
    if workers > 1:
        _compile_in_workers(cases, workers, dev, deadline, say, done)
    _run_each_case(cases, dev, dtype, late, say, done)
    if inductor:
        _compile_bench_ops(dev, dtype, late, say, done)
    return {"device": str(dev), "cases": len(cases), "workers": workers, "rows": rows,
            "seconds": round(time.perf_counter() - t_start, 2)}
