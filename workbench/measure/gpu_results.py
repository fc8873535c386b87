"""GPU results that last: the tables ``scripts/device_check.sh`` writes on a GPU, and the
latest of each for the notebooks.

A GPU is lent now and then for a few minutes; what it measured is committed under
``results/gpu/<device>-<date>/`` (``<device>`` a slug of the GPU's name such as ``nvidia-h200``,
``<date>`` the UTC date ``YYYY-MM-DD``; a second run on the same day gets ``-2``, ``-3`` ...).
One folder holds (see ``results/gpu/README.md``)::

    meta.json          device_name, date, utc_time, torch, triton, cuda, git_commit, python ...; tables:
                       each table "ok", "partial (step timeout)" (what the step saved before its cap) or why not
    summary.csv        one row per step of the device check: step, status, seconds, limit_s (the cap it ran
                       under), gpu_cap_s (its planned cap on a GPU), compile_s (Triton JIT + autotuning +
                       inductor seconds in the step), triton_compiles, triton_jit_s, autotune_s, inductor_s
    warmup.csv         the warm-up step: one row per benchmark launch case compiled / run / torch.compile'd
                       (phase, source, case, file, seconds, status)
    engine_bench.csv   `workbench bench`: one row per side (the reference configuration, the bare loop,
                       CUDA-graphed decode / transformers.generate)
    engine_fast_bench.csv  the same with torch.compile'd decode (compile, compile + CUDA graphs)
    kernel_bench.csv   `workbench kernels-bench`'s own CSV, unchanged: the decode roofline's rows (ceilings,
                       decode step) then the kernel rows, appended as they were measured
    sched_bench.csv    `workbench sched-bench --json`, long format: section, config, metric, value
    prefix_bench.csv   `workbench prefix-bench --json`, long format: section, config, metric, value
    prefetch_bench.csv the prefetch link step and the weight-streaming step, long format: section, config,
                       metric, value (link, ceiling_gbps, pick, streaming, verdict, sweep, engine_options)
    tier_bench.csv     `workbench tier-bench --json` (physical KV tiers), long format
    quant_bench.csv    the quantized-kernel step (`workbench.bench.quant_kernels`): one row per (shape, m):
                       dense bf16 vs the W4A16 / W8A16 / W4A8 Triton kernels
    calibrate.csv      `workbench calibrate-quant --objective latency --json`: one row per measured mix
                       (degradation on the search / confirmation text, decode ms, the recommendation)
    decode_stack.csv   `workbench decode-stack --json`: one row per (configuration, batch): decode tokens/s in the
                       engine (median, min, max), ms per step, at batch 1 the fraction of the copy bandwidth measured
                       in the run, the ratio to the contiguous graph path and greedy agreement with it; a refused or
                       failed configuration is a row with its status and reason
    e2e.csv            notebook 06's ablation at its tiny size (`workbench.bench.end_to_end.run_end_to_end`):
                       one row per configuration (medians of TTFT / TPOT / E2E, throughput, memory, quality,
                       verdicts against the baseline, its step in the stack), then one per layer not measured
                       or not stacked (status and the engine's reason)
    device_check.log   the last lines of every step's output

A notebook shows the latest GPU table next to its CPU figures::

    from workbench.measure.gpu_results import latest, describe
    t = latest("sched_bench")          # None when no GPU run wrote that table yet
    print(describe("sched_bench"))     # "on a GPU: NVIDIA H200, 2026-12-01 (...)" or "on a GPU: not measured yet ..."
    t.frame                            # a pandas DataFrame

The device check calls :func:`start` and :func:`write_tables` through a command line in
:mod:`workbench.cli.gpu_results` (these modules are stdlib only; pandas is imported lazily, by
:attr:`GpuTable.frame` alone)::

    python -m workbench.cli.gpu_results start --probe JSON [--out DIR]   # prints: CUDA<TAB>DIR
    python -m workbench.cli.gpu_results run [--triton] -- -m MODULE ARGS   # one step, its compile seconds
    python -m workbench.cli.gpu_results write-tables OUT_DIR --work WORK_DIR
    python -m workbench.cli.gpu_results latest TABLE                      # print the latest table

A step that its time cap stops keeps what it measured: the kernel bench appends its CSV row by
row; the other benchmarks of this package call :func:`save_partial` as they go (a no-op unless
``$WORKBENCH_PARTIAL_OUT`` is set, as the device check does per step), and :func:`write_tables`
writes a partial table from it.  :class:`CompileLog` counts a step's JIT / autotune / inductor
seconds for the summary.

This module is the one every caller imports; the names live in four modules, one concept each:
:mod:`.gpu_latest` (reading the latest committed table), :mod:`.gpu_tables` (a run's raw outputs ->
its tables; :func:`save_partial`), :mod:`.compile_log` (a step's compile seconds) and
:mod:`.gpu_folder` (the output folder and its ``meta.json``).
"""

from workbench.measure.compile_log import COMPILE_ENV, CompileLog, read_compile_log
from workbench.measure.gpu_folder import (
    DRY_RUN_DIR,
    git_commit,
    output_dir,
    slug,
    start,
)
from workbench.measure.gpu_latest import (
    REPO,
    RESULTS_ROOT,
    GpuTable,
    describe,
    latest,
    read_meta,
    result_folders,
)
from workbench.measure.gpu_tables import (
    CSV_STEPS,
    ENGINE_STEPS,
    LOG_NAME,
    LOG_TAIL_LINES,
    LONG_COLUMNS,
    PARTIAL_ENV,
    ROW_STEPS,
    SUMMARY_COLUMNS,
    TABLES,
    engine_rows,
    long_rows,
    read_json_output,
    read_steps,
    save_partial,
    write_csv,
    write_tables,
)

# every name of the four modules that callers use through this one
__all__ = [
    "COMPILE_ENV",
    "CSV_STEPS",
    "DRY_RUN_DIR",
    "ENGINE_STEPS",
    "LOG_NAME",
    "LOG_TAIL_LINES",
    "LONG_COLUMNS",
    "PARTIAL_ENV",
    "REPO",
    "RESULTS_ROOT",
    "ROW_STEPS",
    "SUMMARY_COLUMNS",
    "TABLES",
    "CompileLog",
    "GpuTable",
    "describe",
    "engine_rows",
    "git_commit",
    "latest",
    "long_rows",
    "output_dir",
    "read_compile_log",
    "read_json_output",
    "read_meta",
    "read_steps",
    "result_folders",
    "save_partial",
    "slug",
    "start",
    "write_csv",
    "write_tables",
]
