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
:mod:`workbench.cli.gpu_results` (this module is stdlib only; pandas is imported lazily, by
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
"""

from __future__ import annotations

import csv
import json
import os
import platform
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
RESULTS_ROOT = REPO / "results" / "gpu"          # committed: measured on a GPU, never edited by hand
DRY_RUN_DIR = REPO / "runs" / "device_check"     # git-ignored: a run without CUDA writes here

# step -> the table it produces (the CSV is named after the step, with these exceptions: the kernel
# bench's steps keep the name of the CSV `workbench kernels-bench` has always written, and two steps
# can write one table: the decode roofline and the kernel rows both go to kernel_bench.csv, the
# prefetch link and the weight-streaming runs to prefetch_bench.csv)
TABLES = {"warmup": "warmup", "decode_roofline": "kernel_bench", "kernels_bench": "kernel_bench",
          "decode_stack": "decode_stack", "quant_bench": "quant_bench", "prefetch_link": "prefetch_bench",
          "e2e": "e2e", "engine_bench": "engine_bench", "engine_fast": "engine_fast_bench",
          "sched_bench": "sched_bench", "prefetch_bench": "prefetch_bench", "tier_bench": "tier_bench",
          "prefix_bench": "prefix_bench", "calibrate": "calibrate"}
CSV_STEPS = ("decode_roofline", "kernels_bench")   # they append rows to <work>/kernel_bench.csv as they go
ENGINE_STEPS = ("engine_bench", "engine_fast")      # `workbench bench --json` outputs: one row per side
ROW_STEPS = ("e2e", "decode_stack", "warmup")       # {"rows": [...]}: one row each
SUMMARY_COLUMNS = ["step", "status", "seconds", "limit_s", "gpu_cap_s", "compile_s", "triton_compiles",
                   "triton_jit_s", "autotune_s", "inductor_s"]
LONG_COLUMNS = ["section", "config", "metric", "value"]
LOG_NAME = "device_check.log"
LOG_TAIL_LINES = 40
PARTIAL_ENV = "WORKBENCH_PARTIAL_OUT"      # where a step saves what it has measured so far (JSON)
COMPILE_ENV = "WORKBENCH_COMPILE_LOG"      # where a step's process writes its JIT / compile seconds (JSON)

_DATE = re.compile(r"(\d{4}-\d{2}-\d{2})")


# ---- reading: the latest committed table ---------------------------------------------------------

@dataclass
class GpuTable:
    """One committed GPU table: ``results/gpu/<folder>/<table>.csv`` and its folder's meta."""
    table: str
    folder: Path
    device: str                 # the GPU's name from meta.json ("NVIDIA H200"), else the folder's slug
    date: str                   # YYYY-MM-DD (UTC) from the folder name
    meta: dict = field(default_factory=dict)
    _frame: Any = field(default=None, repr=False)

    @property
    def path(self) -> Path:
        return self.folder / f"{self.table}.csv"

    @property
    def frame(self):
        """The table as a pandas DataFrame (read once)."""
        if self._frame is None:
            import pandas as pd

            self._frame = pd.read_csv(self.path)
        return self._frame

    @property
    def label(self) -> str:
        """``"NVIDIA H200, 2026-12-01"``: where and when the table was measured."""
        return f"{self.device}, {self.date}"

    def __str__(self) -> str:
        return self.label


def _folder_key(folder: Path) -> tuple[str, int, str]:
    """Sort key: the date in the name, then the same-day run number (``-2`` after none), then
    the name."""
    m = _DATE.search(folder.name)
    date = m.group(1) if m else ""
    rest = folder.name[m.end():] if m else ""
    run = int(rest[1:]) if re.fullmatch(r"-\d+", rest) else 1
    return date, run, folder.name


def result_folders(root: str | Path | None = None) -> list[Path]:
    """The dated result folders under ``root`` (default ``results/gpu``), oldest first."""
    root = Path(root) if root is not None else RESULTS_ROOT
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if p.is_dir() and _DATE.search(p.name)), key=_folder_key)


def read_meta(folder: str | Path) -> dict:
    try:
        meta = json.loads((Path(folder) / "meta.json").read_text())
    except (OSError, ValueError):
        return {}
    return meta if isinstance(meta, dict) else {}


def latest(table: str, root: str | Path | None = None) -> GpuTable | None:
    """The newest committed ``<table>.csv`` under ``root`` (default ``results/gpu``): by the date
    in the folder name, then the folder name; None when no folder has that table."""
    table = table.removesuffix(".csv")
    for folder in reversed(result_folders(root)):
        if (folder / f"{table}.csv").is_file():
            meta = read_meta(folder)
            if meta.get("dry_run"):         # a CPU dry run written here by hand (OUT_DIR): not a GPU figure
                continue
            date = _DATE.search(folder.name).group(1)
            slug = folder.name[:_DATE.search(folder.name).start()].rstrip("-") or folder.name
            return GpuTable(table=table, folder=folder, device=str(meta.get("device_name") or slug), date=date,
                            meta=meta)
    return None


def describe(table: str, root: str | Path | None = None) -> str:
    """Where the latest GPU table comes from ("on a GPU: NVIDIA H200, 2026-12-01
    (results/gpu/nvidia-h200-2026-12-01/sched_bench.csv)"), or that there is none."""
    found = latest(table, root)
    if found is None:
        return f"on a GPU: not measured yet (no results/gpu/*/{table.removesuffix('.csv')}.csv)"
    return f"on a GPU: {found.label} ({found.folder.name}/{found.table}.csv)"


# ---- writing: JSON of the benchmarks -> CSV rows --------------------------------------------------

def slug(name: str) -> str:
    """``"NVIDIA H200"`` -> ``"nvidia-h200"`` (letters, digits and single dashes)."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "unknown-device"


def _scalar(v) -> bool:
    return v is None or isinstance(v, (str, int, float, bool))


def engine_rows(data: dict) -> list[dict]:
    """``workbench bench --json`` -> one row per side (each engine configuration: ``reference``,
    ``loop``, ``compile``, ``cuda-graphs`` ...; then ``transformers.generate``): the side's numbers
    (ttft_ms_p50, decode_tokens_per_s_p50 / min / max, jitter, its ratio and verdict against
    transformers, token agreement with the reference configuration ...), then the run's
    comparison and settings (device, dtype, threads, backend, sizes, versions) on each row."""
    configs = data.get("configs")
    if isinstance(configs, dict) and configs:
        sides = list(configs.items())
    else:                                # before engine configurations were sides
        sides = [("workbench", data.get("workbench"))]
    sides.append(("transformers.generate", data.get("transformers_generate")))
    shared: dict[str, Any] = {}
    for k, v in data.items():            # the comparison and the run: every top-level scalar
        if k not in ("workbench", "transformers_generate", "configs") and _scalar(v):
            shared[k] = v
    policy = data.get("threads_policy")
    if isinstance(policy, dict) and "policy" in policy:
        shared.setdefault("threads_policy", policy["policy"])
    backends = data.get("backends")
    if isinstance(backends, dict):
        for k in ("backends", "triton_interpreter"):
            if k in backends:
                shared.setdefault(f"backend_{k}" if k == "backends" else k, backends[k])
    for k, v in (data.get("config") or {}).items():   # sizes: prompt_tokens, max_tokens, repeats ...
        if _scalar(v) and k not in shared and v is not None:
            shared[k] = v
    rows = []
    for name, side in sides:
        if not isinstance(side, dict):
            continue
        row = {"side": name}
        row.update({k: v for k, v in side.items() if _scalar(v)})
        row.update({k: v for k, v in shared.items() if k not in row})
        rows.append(row)
    return rows


def long_rows(data: dict) -> list[dict]:
    """A nested benchmark JSON -> rows ``section, config, metric, value`` (long format).

    ``section`` is the top-level key (top-level scalars go to section ``run``); nested dicts
    give dotted metric names (``off.ttft_ms_p50``); a list of dicts is one configuration per
    item, named by its first key (``window_ms=5.0``, ``chunked_prefill=True``).  Lists of plain
    values are raw samples and are left out (the summary statistics next to them stay), except
    in section ``config`` where they are settings (``windows_ms = "0.0 5.0"``)."""
    rows: list[dict] = []

    def walk(section: str, config: str, prefix: str, value) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(section, config, f"{prefix}.{k}" if prefix else str(k), v)
        elif isinstance(value, list):
            if value and all(isinstance(x, dict) for x in value):
                for item in value:
                    first = next(iter(item), None)
                    name = f"{first}={item[first]}" if first is not None and _scalar(item[first]) else ""
                    rest = {k: v for k, v in item.items() if k != first} if name else item
                    walk(section, f"{config};{name}" if config and name else (name or config), prefix, rest)
            elif section == "config" and all(_scalar(x) for x in value):
                rows.append({"section": section, "config": config, "metric": prefix,
                             "value": " ".join(str(x) for x in value)})
        else:
            rows.append({"section": section, "config": config, "metric": prefix, "value": value})

    for key, value in data.items():
        if _scalar(value):
            rows.append({"section": "run", "config": "", "metric": key, "value": value})
        else:
            walk(key, "", "", value)
    return rows


def write_csv(rows: list[dict], path: str | Path, columns: list[str] | None = None) -> Path:
    """Rows -> CSV (columns: ``columns``, else every key in order of first appearance)."""
    if columns is None:
        columns = []
        for r in rows:
            columns += [k for k in r if k not in columns]
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    with open(p, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    return p


def read_json_output(path: str | Path) -> dict:
    """The JSON object a ``--json`` command printed (stdout; a line of text before it is skipped)."""
    text = Path(path).read_text()
    start = text.find("{")
    if start < 0:
        raise ValueError(f"{path}: no JSON object in the output")
    obj, _ = json.JSONDecoder().raw_decode(text[start:])
    if not isinstance(obj, dict):
        raise ValueError(f"{path}: the output is not a JSON object")
    return obj


def read_steps(path: str | Path) -> list[dict]:
    """``steps.tsv`` (tab-separated, written by device_check.sh: step, status, seconds, limit_s,
    then where present gpu_cap_s and the compile columns of :data:`SUMMARY_COLUMNS`)."""
    rows = []
    p = Path(path)
    if not p.is_file():
        return rows
    for line in p.read_text().splitlines():
        parts = line.rstrip("\n").split("\t")
        if len(parts) >= 4 and parts[0] != "step":
            rows.append(dict(zip(SUMMARY_COLUMNS, parts)))
    return rows


def _tail(path: Path, lines: int) -> list[str]:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return []
    return text[-lines:]


# ---- what a step leaves when it is stopped ---------------------------------------------------------

def save_partial(data: dict, path: str | Path | None = None) -> Path | None:
    """Write what a step has measured so far (``data``: the JSON its command would print) to
    ``path`` (default ``$WORKBENCH_PARTIAL_OUT``, which device_check.sh sets per step; nothing
    when neither is set).  Atomic (a temporary file renamed), so a step killed mid-write leaves
    the previous version.  The benchmarks call it after each row or section."""
    target = path or os.environ.get(PARTIAL_ENV)
    if not target:
        return None
    p = Path(target)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text(json.dumps({**data, "partial": True}, default=str))
    os.replace(tmp, p)
    return p


def _step_data(work: Path, step: str, status: str) -> tuple[dict | None, str]:
    """The JSON of a step (its stdout when it finished, else what it saved as it went) and how
    complete it is: ``ok`` or ``partial (step <status>)``; (None, why) when there is nothing."""
    if status == "ok":
        try:
            return read_json_output(work / f"{step}.out"), "ok"
        except (OSError, ValueError):
            if not (work / f"{step}.partial.json").is_file():
                raise
    partial = work / f"{step}.partial.json"
    if partial.is_file():
        data = json.loads(partial.read_text())
        return data, "ok" if status == "ok" else f"partial (step {status})"
    return None, f"step {status}"


def _rows_of(step: str, data: dict) -> tuple[list[dict], list[str] | None]:
    """A step's JSON -> (rows, columns or None for every key in order)."""
    if step == "quant_bench":                   # already one flat row per measurement
        return [{k: v for k, v in r.items() if _scalar(v)} for r in data["kernels"]], None
    if step in ROW_STEPS:                        # one row per configuration (and batch / skipped layer / case)
        return [{k: v for k, v in r.items() if _scalar(v)} for r in data["rows"]], None
    if step == "calibrate":                      # one row per measured mix
        res = data["result"]
        rec = (res.get("recommendation") or {}).get("key")     # None in a partial result: nothing recommended yet
        return [{k: v for k, v in r.items() if _scalar(v)} | {"recommended": rec is not None and r["key"] == rec}
                for r in res["candidates"]], None
    if step in ENGINE_STEPS:
        return engine_rows(data), None
    return long_rows(data), LONG_COLUMNS


def _csv_has_rows(path: Path) -> bool:
    try:
        with open(path, newline="") as f:
            return sum(1 for _ in csv.reader(f)) > 1
    except OSError:
        return False


def write_tables(out_dir: str | Path, work_dir: str | Path) -> dict[str, str]:
    """Turn one device check's raw outputs (``work_dir``: ``<step>.out`` = the command's stdout,
    ``<step>.log`` = its stderr, ``<step>.partial.json`` = what a step saved as it went,
    ``kernel_bench.csv`` (appended row by row), ``steps.tsv``) into the tables of ``out_dir``.
    Returns {table: "ok" | "partial (step timeout)" | why not}.  A step that ran out of time or
    failed writes what it saved before it stopped (a partial table, said so in meta.json's
    ``tables``); a step that saved nothing writes no table, so the previous run's stays the latest."""
    out, work = Path(out_dir), Path(work_dir)
    out.mkdir(parents=True, exist_ok=True)
    steps = read_steps(work / "steps.tsv")
    status = {s["step"]: s["status"] for s in steps}
    done: dict[str, str] = {}
    by_table: dict[str, list[str]] = {}
    for step, table in TABLES.items():
        by_table.setdefault(table, []).append(step)
    for table, producers in by_table.items():
        ran = [p for p in producers if p in status]
        if not ran:
            done[table] = "not run"
            continue
        incomplete = [f"{p} {status[p]}" for p in ran if status[p] != "ok"]
        try:
            if table == "kernel_bench":            # the steps appended rows to one CSV as they went
                src = work / "kernel_bench.csv"
                if not _csv_has_rows(src):
                    done[table] = f"step {'; '.join(incomplete)}" if incomplete else f"error: {src} has no rows"
                    continue
                if src.resolve() != (out / "kernel_bench.csv").resolve():
                    shutil.copyfile(src, out / "kernel_bench.csv")
                done[table] = f"partial (step {'; '.join(incomplete)})" if incomplete else "ok"
                continue
            merged: dict = {}
            how = []
            for p in ran:                           # later producers' sections win
                data, state = _step_data(work, p, status[p])
                how.append(state)
                if data is not None:
                    if len(ran) == 1:
                        merged = data
                    else:
                        merged.update({k: v for k, v in data.items() if k != "partial"})
            merged.pop("partial", None)             # said in meta.json's tables, not a column / run row
            if not merged:                          # killed before it saved a row
                done[table] = "; ".join(h.replace("partial (", "nothing saved (") for h in how)
                continue
            rows, columns = _rows_of(ran[-1], merged)      # a table's producers share one format
            bad = [h for h in how if h != "ok"]
            if not rows and bad:                    # stopped before its first row: keep the previous run's table
                done[table] = "; ".join(h.replace("partial (", "nothing saved (") for h in how)
                continue
            write_csv(rows, out / f"{table}.csv", columns)
            done[table] = "ok" if not bad else "partial (" + "; ".join(
                h.removeprefix("partial (").removesuffix(")") for h in bad) + ")"
        except Exception as e:  # noqa: BLE001 - one table's problem must not lose the others
            done[table] = f"error: {type(e).__name__}: {e}"
    write_csv(steps, out / "summary.csv", SUMMARY_COLUMNS)
    # one small log: the tail of every step's stderr and stdout
    log = []
    for s in steps:
        for kind in ("log", "out"):
            tail = _tail(work / f"{s['step']}.{kind}", LOG_TAIL_LINES)
            if tail:
                log.append(f"==== {s['step']} ({s['status']}, {s['seconds']} s of {s['limit_s']}): "
                           f"last {len(tail)} lines of {'stderr' if kind == 'log' else 'stdout'}")
                log += tail
    (out / LOG_NAME).write_text("\n".join(log) + "\n")
    meta = read_meta(out)
    if meta:
        meta["tables"] = done
        (out / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    return done


# ---- JIT and compile seconds of a step --------------------------------------------------------------

class CompileLog:
    """Seconds a process spends compiling: Triton JIT (``JITFunction._do_compile``: a compile, or
    a load from Triton's cache; ``triton_compiles`` counts them), Triton autotuning
    (``Autotuner._bench``: benchmarking one config, its compile included, so not counted again in
    ``triton_jit_s``) and inductor (``torch.compile``: dynamo's ``_compile.compile_inner``, read at
    the end).  ``compile_s`` is their sum.  :meth:`install` patches the Triton classes (what exists in this Triton is
    patched; a missing API is left alone); :meth:`dump` writes the totals as JSON."""

    def __init__(self) -> None:
        self.triton_compiles = 0
        self.triton_jit_s = 0.0
        self.autotune_s = 0.0
        self.autotunes = 0
        self._depth = 0

    def install(self) -> "CompileLog":
        import time

        try:
            from triton.runtime.jit import JITFunction
        except Exception:  # noqa: BLE001 - no triton: inductor only
            return self
        log = self

        def wrap(fn, bench: bool):
            def wrapper(*a, **k):
                t0 = time.perf_counter()
                if bench:
                    log._depth += 1
                try:
                    return fn(*a, **k)
                finally:
                    dt = time.perf_counter() - t0
                    if bench:
                        log._depth -= 1
                        log.autotunes += 1
                        log.autotune_s += dt
                    else:
                        log.triton_compiles += 1
                        if not log._depth:           # inside autotuning: counted in autotune_s
                            log.triton_jit_s += dt
            wrapper.__wrapped__ = fn
            return wrapper

        if hasattr(JITFunction, "_do_compile"):
            if not hasattr(JITFunction._do_compile, "__wrapped__"):
                JITFunction._do_compile = wrap(JITFunction._do_compile, False)
        else:               # a Triton without it: the compile entry point a kernel's binder picks up on first run
            try:
                import triton.compiler as tc

                if not hasattr(tc.compile, "__wrapped__"):
                    tc.compile = wrap(tc.compile, False)
            except Exception:  # noqa: BLE001
                pass
        try:
            from triton.runtime.autotuner import Autotuner

            if hasattr(Autotuner, "_bench") and not hasattr(Autotuner._bench, "__wrapped__"):
                Autotuner._bench = wrap(Autotuner._bench, True)
        except Exception:  # noqa: BLE001
            pass
        return self

    @staticmethod
    def inductor_seconds() -> float:
        import sys

        utils = sys.modules.get("torch._dynamo.utils")
        metrics = getattr(utils, "compilation_time_metrics", None) or {}
        for key in ("_compile.compile_inner", "compile_inner"):
            if key in metrics:
                return float(sum(metrics[key]))
        return 0.0

    def totals(self) -> dict:
        inductor = self.inductor_seconds()
        return {"compile_s": round(self.triton_jit_s + self.autotune_s + inductor, 2),
                "triton_compiles": self.triton_compiles, "triton_jit_s": round(self.triton_jit_s, 2),
                "autotune_s": round(self.autotune_s, 2), "autotunes": self.autotunes, "inductor_s": round(inductor, 2)}

    def dump(self, path: str | Path | None = None) -> None:
        target = path or os.environ.get(COMPILE_ENV)
        if target:
            try:
                Path(target).write_text(json.dumps(self.totals()))
            except OSError:
                pass


def read_compile_log(path: str | Path) -> dict:
    """A step's compile totals (empty when the step wrote none)."""
    try:
        d = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}
    return d if isinstance(d, dict) else {}


# ---- the output folder and meta.json --------------------------------------------------------------

def _git(*args: str) -> str | None:
    try:
        r = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout.strip() if r.returncode == 0 else None


def git_commit() -> str | None:
    """HEAD's commit (with ``-dirty`` when tracked files differ from it), or ``$GIT_COMMIT``
    where the checkout has no .git (a plain copy on a GPU machine)."""
    commit = _git("rev-parse", "HEAD")
    if commit is None:
        return os.environ.get("GIT_COMMIT") or None
    dirty = _git("status", "--porcelain", "--untracked-files=no")
    return commit + ("-dirty" if dirty else "")


def output_dir(device_name: str, now: datetime, root: str | Path | None = None) -> Path:
    """``<root>/<slug>-<YYYY-MM-DD>``; a second run of the day gets ``-2``, ``-3`` ..."""
    root = Path(root) if root is not None else RESULTS_ROOT
    base = f"{slug(device_name)}-{now:%Y-%m-%d}"
    folder, n = root / base, 1
    while folder.exists():
        n += 1
        folder = root / f"{base}-{n}"
    return folder


def start(probe: dict, out: str | Path | None = None, root: str | Path | None = None,
          dry_run_dir: str | Path | None = None, now: datetime | None = None) -> tuple[bool, Path]:
    """Choose and create the output folder, write its ``meta.json``; returns (cuda, folder).
    With CUDA: a new ``results/gpu/<device>-<date>`` (or ``out``); without: ``runs/device_check``
    (or ``out``), never ``results/gpu``."""
    now = now or datetime.now(timezone.utc)
    cuda = bool(probe.get("cuda_available"))
    name = probe.get("device_name") or ("unknown GPU" if cuda else "cpu")
    if out:
        folder = Path(out)
    elif cuda:
        folder = output_dir(name, now, root)
    else:
        folder = Path(dry_run_dir) if dry_run_dir is not None else DRY_RUN_DIR
        if folder.is_dir():      # a dry run replaces the previous dry run's tables
            for p in folder.iterdir():
                if p.is_file() and (p.suffix in (".csv", ".log") or p.name == "meta.json"):
                    p.unlink()
    folder.mkdir(parents=True, exist_ok=True)
    meta = {
        "device_name": name,
        "date": f"{now:%Y-%m-%d}",
        "utc_time": now.strftime("%Y-%m-%dT%H:%M:%SZ"),
        "torch": probe.get("torch"),
        "triton": probe.get("triton"),
        "cuda": probe.get("cuda"),
        "git_commit": git_commit(),
        "python": probe.get("python") or platform.python_version(),
        "dry_run": not cuda,
    }
    for k in ("transformers", "numpy", "gpu", "host_cpus"):
        if probe.get(k) is not None:
            meta[k] = probe[k]
    (folder / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    return cuda, folder
