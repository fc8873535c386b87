"""Kernel benchmark: the device's ceilings, each fused kernel against torch, the decode step.

One command does it all (a few minutes on a GPU, well under a minute at the small CPU sizes)::

    PYTHONPATH=. python scripts/bench_kernels.py                 # full sizes on CUDA, small on CPU
    PYTHONPATH=. python scripts/bench_kernels.py --device cpu --ops rmsnorm,swiglu --json out.json

Three sections, measured side by side in one run:

1. **ceilings** - device copy bandwidth (``dst.copy_(src)`` of a large tensor, bytes = read +
   write) and the matmul rate (``a @ b``, ``2 n^3`` FLOPs; bf16 on a GPU, fp32 on a CPU);
2. **kernels** - each op with every provider: ``eager`` (the plain-torch path the model runs
   with backend ``eager``), ``compile`` (``torch.compile`` of it) and ``triton`` (the fused
   kernel); achieved GB/s or TFLOP/s from the minimum bytes / FLOPs stated in the row's
   ``formula``, its fraction of the ceiling measured above, and its max abs error against a
   float32 reference computed on the same (upcast) inputs;
3. **decode** - one decode step of a model at batch 1 with ``eager`` / ``fused`` (every op with
   a Triton kernel on its path) / ``fused+graphs`` (the step replayed as a CUDA graph): latency,
   the fraction of the roofline ``(weight bytes + KV bytes read) / copy bandwidth / step time``,
   kernel launches per step, and the max logit error against the eager step.

Every measurement is one row (columns :data:`ROW_FIELDS`) stating device, dtype, sizes, backend
per op and the torch / triton versions.  A row that fails keeps its error (``status="error"``)
and the run goes on; a provider that is not run says why (``status="skipped"``).

Timing: warm-up calls, then ``repeats`` timed calls, median / min / max.  On CUDA each call is
timed with CUDA events after a 256 MB write that evicts the L2 cache (kernel rows); on a CPU with
``perf_counter``.  On a CPU the Triton kernels run under the interpreter (``TRITON_INTERPRET=1``,
set here before any kernel module is imported): those rows are labelled ``timing =
"triton-interpreter"``: they test the code path and its errors, they are not speed claims.

This module is the run (:class:`KernelBenchConfig`, :func:`run_kernel_bench`, and
:func:`run_and_report`, what ``workbench kernels-bench`` does); its parts are
:mod:`~workbench.bench.kernel_timing` (rows, timing, ceilings), :mod:`~workbench.bench.kernel_op_cases`
(the kernels against torch), :mod:`~workbench.bench.kernel_decode` (the decode step) and
:mod:`~workbench.bench.kernel_report` (CSV and table), whose names are importable from here too
(the kernels notebook uses them as ``kb.<name>``).  The command line is in
:mod:`workbench.cli.kernels`.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from workbench.bench.kernel_decode import (
    count_step_launches,
    decode_rows,
    fused_backends,
    step_bytes,
)
from workbench.bench.kernel_op_cases import BACKEND_OP, OPS, Case, make_case, run_case
from workbench.bench.kernel_report import append_csv, check_csv, format_table
from workbench.bench.kernel_timing import (
    INTERPRETER_NOTE,
    ROW_FIELDS,
    compare_timing,
    dtype_name,
    environment,
    error_text,
    measure_ceilings,
    new_row,
    prepare_device,
    time_calls,
    timing_fields,
)
from workbench.errors import ConfigError

__all__ = [
    "SECTIONS", "SIZES", "KernelBenchConfig", "resolve_sizes", "run_kernel_bench", "run_and_report", "measure_op",
    # the parts (see the module docstring)
    "ROW_FIELDS", "INTERPRETER_NOTE", "prepare_device", "environment", "new_row", "time_calls", "timing_fields",
    "compare_timing", "measure_ceilings", "OPS", "BACKEND_OP", "Case", "make_case", "run_case", "fused_backends",
    "count_step_launches", "step_bytes", "decode_rows", "check_csv", "append_csv", "format_table",
]

from workbench.bench.kernel_names import SECTIONS  # noqa: E402,F401 - torch-free: the CLI's parser reads it

# Sizes.  "full": shapes of Llama-3.2-1B (hidden 2048, MLP 8192, 32 q / 8 kv heads of 64) at
# many tokens, so that every tensor is larger than the L2 cache; the attention kernels at the
# Llama-3-8B head shape (head dim 128).  "small": what the Triton interpreter runs in seconds.
SIZES = {
    "full": dict(rows=32768, hidden=2048, inter=8192, rope_tokens=16384, rope_heads=(32, 8, 64),
                 attn_heads=(32, 8, 128), prefill=(4, 4096), decode=(16, 4096), page=16,
                 copy_mib=1024, matmul=8192, model="preset:llama-3.2-1b", context=1024, warmup=5, repeats=20),
    "small": dict(rows=64, hidden=256, inter=704, rope_tokens=48, rope_heads=(8, 4, 32),
                  attn_heads=(4, 2, 32), prefill=(2, 40), decode=(2, 72), page=16,
                  copy_mib=32, matmul=384, model="preset:tiny", context=24, warmup=1, repeats=3),
}


@dataclass
class KernelBenchConfig:
    device: str | None = None          # None: cuda if available, else cpu
    size: str = "auto"                 # "small" | "full" | "auto" (full on CUDA, small on CPU)
    dtype: str | None = None           # None: bfloat16 on CUDA, float32 on CPU
    compile: str = "auto"              # "on" | "off" | "auto" (on for CUDA; CPU compiles take ~10 s per op)
    sections: tuple[str, ...] = SECTIONS
    ops: tuple[str, ...] = OPS
    model: str | None = None           # decode section; None: the size's model (preset:llama-3.2-1b / preset:tiny)
    context: int | None = None         # decode section: tokens already in the KV cache
    warmup: int | None = None
    repeats: int | None = None
    seed: int = 0
    overrides: dict = field(default_factory=dict)   # any SIZES entry, e.g. {"rows": 128}

    def __post_init__(self) -> None:
        if self.size not in ("auto", "small", "full"):
            raise ConfigError(f"kernel bench: size must be auto, small or full, got {self.size!r}")
        if self.compile not in ("auto", "on", "off"):
            raise ConfigError(f"kernel bench: compile must be auto, on or off, got {self.compile!r}")
        for name, allowed in (("sections", SECTIONS), ("ops", OPS)):
            bad = [x for x in getattr(self, name) if x not in allowed]
            if bad:
                raise ConfigError(f"kernel bench: unknown {name} {bad}; choose from {', '.join(allowed)}")
        for name in ("warmup", "repeats", "context"):
            v = getattr(self, name)
            if v is not None and v < (0 if name == "warmup" else 1):
                raise ConfigError(f"kernel bench: {name} must be >= {0 if name == 'warmup' else 1}, got {v}")
        unknown = set(self.overrides) - set(SIZES["small"])
        if unknown:
            raise ConfigError(f"kernel bench: unknown size overrides {sorted(unknown)}; "
                              f"known: {', '.join(SIZES['small'])}")


# ---- the run ----------------------------------------------------------------------------------
def resolve_sizes(cfg: KernelBenchConfig, dev: torch.device) -> dict:
    size = cfg.size if cfg.size != "auto" else ("full" if dev.type == "cuda" else "small")
    sz = {**SIZES[size], **cfg.overrides, "name": size}
    for name in ("warmup", "repeats", "context", "model"):
        if getattr(cfg, name) is not None:
            sz[name] = getattr(cfg, name)
    return sz


def run_kernel_bench(cfg: KernelBenchConfig, progress: Callable[[str], None] | None = None,
                     on_rows: Callable[[list[dict]], None] | None = None) -> list[dict]:
    """Run the configured sections (ceilings first, then the others in the order of
    ``cfg.sections``); returns every row (failed and skipped ones included).  ``on_rows(new)``
    gets each batch of finished rows as soon as it is done (``run_and_report`` appends them to the
    CSV then, so a run stopped by a time cap keeps what it measured).  In the kernels section
    every op's ``eager`` and ``triton`` rows come first, the ``compile`` rows (inductor's compile
    time is the slow part) in a second pass."""
    from workbench.model.loader import load_model, parse_dtype

    dev = prepare_device(cfg.device)
    dtype = parse_dtype(cfg.dtype) or (torch.bfloat16 if dev.type == "cuda" else torch.float32)
    sz = resolve_sizes(cfg, dev)
    env = environment(dev)
    say = progress or (lambda msg: None)
    rows: list[dict] = []

    def emit(new: list[dict]) -> None:
        rows.extend(new)
        if on_rows is not None and new:
            on_rows(new)

    torch.manual_seed(cfg.seed)
    # The ceilings are measured whatever the sections: every fraction below divides by them.
    say("ceilings: copy bandwidth, matmul rate")
    ceiling_rows, ceilings = measure_ceilings(dev, dtype, sz, env, sz["warmup"] + 1, max(sz["repeats"], 5))
    emit(ceiling_rows)
    for section in cfg.sections:
        if section == "kernels":
            _kernel_section(cfg, sz, dev, dtype, env, ceilings, say, emit)
        elif section == "decode":
            say(f"decode step: {sz['model']} at context {sz['context']}")
            try:
                model = load_model(sz["model"], device=dev, dtype=cfg.dtype or (dtype if dev.type == "cuda" else None))
                name = sz["model"] + ("" if dev.type == "cuda" else " (CPU size, not the Llama-3.2-1B shape)")
                emit(decode_rows(model, {"eager": {}, "fused": {k: v for k, v in fused_backends().items()
                                                                if v == "triton"}},
                                 sz["context"], env, ceilings, sz["warmup"], sz["repeats"], model_name=name,
                                 seed=cfg.seed))
                del model
            except Exception as e:  # noqa: BLE001
                emit([new_row(env, "decode", "decode_step", p, status="error", error=error_text(e), model=sz["model"])
                      for p in ("eager", "fused", "fused+graphs")])
    return rows


def _kernel_section(cfg, sz, dev, dtype, env, ceilings, say, emit) -> None:
    """Pass 1: each op's eager and Triton rows; pass 2: its torch.compile row (vs the eager row of pass 1)."""
    compile_skip = None
    if cfg.compile == "off":
        compile_skip = "torch.compile switched off (--compile off)"
    elif cfg.compile == "auto" and dev.type != "cuda":
        compile_skip = ("torch.compile skipped on CPU by default (~10 s of C++ compilation per op); "
                        "--compile on runs it")
    eager_ms: dict[str, float | None] = {}
    for op in cfg.ops:
        say(f"kernels: {op}")
        providers = {"eager": None, "triton": None}
        try:
            case = make_case(op, sz, dev, dtype, cfg.seed)
            got = run_case(case, providers, dev, env, ceilings, sz["warmup"], sz["repeats"], dtype)
        except Exception as e:  # noqa: BLE001 - the inputs or the reference failed
            got = [new_row(env, "kernels", op, p, status="error", error=error_text(e), dtype=dtype_name(dtype))
                   for p in providers]
        eager_ms[op] = next((r["ms_median"] for r in got if r["provider"] == "eager"), None)
        emit(got)
    for op in cfg.ops:
        if compile_skip is None:
            say(f"kernels: {op} (torch.compile)")
        try:
            case = make_case(op, sz, dev, dtype, cfg.seed)
            got = run_case(case, {"compile": compile_skip}, dev, env, ceilings, sz["warmup"], sz["repeats"], dtype)
        except Exception as e:  # noqa: BLE001
            got = [new_row(env, "kernels", op, "compile", status="error", error=error_text(e), dtype=dtype_name(dtype))]
        for r in got:
            if eager_ms.get(op) and r["ms_median"]:
                r["vs_eager"] = eager_ms[op] / r["ms_median"]      # > 1: faster than eager
        emit(got)


def measure_op(op: str, sizes: dict, dev: torch.device, dtype: torch.dtype, providers: dict, env: dict,
               ceilings: dict, warmup: int, repeats: int):
    """Every provider of one op at ``sizes``, as the kernel section measures it (the kernels
    notebook measures its ops one at a time with this), asserting that none failed.  Returns the
    rows as a DataFrame (one per provider); its ``attrs`` say what was measured: ``op``,
    ``sizes``, ``metric`` and the ``formula`` of its FLOPs / bytes."""
    import pandas as pd

    case = make_case(op, sizes, dev, dtype)
    rows = run_case(case, providers, dev, env, ceilings, warmup, repeats, dtype)
    failed = [f"{r['provider']}: {r['error']}" for r in rows if r["status"] == "error"]
    assert not failed, failed
    df = pd.DataFrame(rows)
    df.attrs.update(op=op, sizes=case.sizes, metric=case.metric, formula=case.formula)
    return df


def run_and_report(cfg: KernelBenchConfig, csv: str | None = "runs/kernel_bench.csv", json_path: str | None = None,
                   quiet: bool = False) -> list[dict]:
    """What ``workbench kernels-bench`` does: run, append the rows to ``csv`` as each batch is
    measured (refused before running when its columns differ; None or '' skips it), write
    ``{'rows': [...]}`` to ``json_path``, and print the table last (progress lines on stderr
    unless ``quiet``).
    Returns the rows; failed rows are data, not an exception."""
    if csv:
        check_csv(csv)
    say = None if quiet else (lambda msg: print(f"[kernel bench] {msg}", file=sys.stderr, flush=True))
    t0 = time.perf_counter()
    rows = run_kernel_bench(cfg, progress=say, on_rows=(lambda new: append_csv(new, csv)) if csv else None)
    if csv:
        print(f"appended {len(rows)} rows to {csv} (as they were measured)")
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps({"rows": rows}, indent=1))
        print(f"wrote {json_path}")
    bad = sum(r["status"] == "error" for r in rows)
    print(f"{len(rows)} rows in {time.perf_counter() - t0:.1f} s; {bad} failed (see their error column)")
    print(format_table(rows))
    return rows
