"""The device check's tables: the raw outputs of one run of ``scripts/device_check.sh`` (each
step's ``--json`` stdout, what it saved as it went, the kernel bench's CSV, ``steps.tsv``) ->
the CSV tables, ``summary.csv`` and ``device_check.log`` of its results folder (each table is
described in :mod:`workbench.measure.gpu_results`, which re-exports these names).  A step that its time
cap stops keeps what it measured: the benchmarks call :func:`save_partial` as they go, and
:func:`write_tables` writes a partial table from it.  Standard library only."""

from __future__ import annotations

import csv
import json
import os
import shutil
from pathlib import Path
from typing import Any

from workbench.measure.gpu_latest import read_meta

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


# ---- JSON of the benchmarks -> CSV rows ------------------------------------------------------------

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


# ---- one device check's raw outputs -> its tables --------------------------------------------------

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
