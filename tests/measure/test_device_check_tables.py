"""The device check's tables against their readers: every table a notebook, ``workbench claims`` or
the report asks for (``gpu_results.latest(...)``, ``ctx.gpu_table(...)``, the front page's list) is
one that scripts/device_check.sh writes, with the columns (for long tables: the section / metric
rows) the reader uses.  The tables are written by ``gpu_results.write_tables`` from outputs of the
steps' own code at small sizes (the quantized-kernel rows under the Triton interpreter, the prefetch
bench on the bundled model), then read back by the real readers (the GPU claims, the quantization
verdicts, notebook 03's and 05's selections); a last test runs the writer on the script's dry run
(``runs/device_check/raw``) when one is there.  Also: a step stopped by its time cap leaves a
partial table, two steps can write one table, and ``gpu_results run`` records compile seconds."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from workbench.measure import gpu_results as gr

ROOT = Path(__file__).resolve().parents[2]

# ---- who reads what ---------------------------------------------------------------------------------
# table -> columns its readers use (workbench/bench/claims/gpu_*.py, workbench/bench/quant.py claim_verdicts,
# notebooks 00-06); long-format tables: (section, metric) rows, a metric ending in "*" a prefix.
COLUMNS = {
    "kernel_bench": ["section", "op", "provider", "status", "dtype", "sizes", "ms_median", "ms_min", "ms_max",
                     "achieved", "bytes", "ceiling", "frac_of_ceiling", "launches_per_step", "max_err"],
    "quant_bench": ["N", "K", "m", "dense_ms", "dense_ms_min", "dense_ms_max", "w4a16_ms", "w4a16_ms_min",
                    "w4a16_ms_max", "w4a16_speedup", "w8a16_speedup", "w4a8_speedup", "w8a16_ms_min", "w8a16_ms_max",
                    "w4a8_ms_min", "w4a8_ms_max"],
    "engine_bench": ["side", "ttft_ms_p50", "decode_tokens_per_s_p50", "decode_tokens_per_s_min",
                     "decode_tokens_per_s_max"],
    "engine_fast_bench": ["side", "ttft_ms_p50", "decode_tokens_per_s_p50", "decode_tokens_per_s_min",
                          "decode_tokens_per_s_max"],
    "e2e": ["config", "status", "stack_step", "ttft_ms_p95", "e2e_ms_p95", "tpot_ms_p50", "tokens_per_s",
            "vs baseline: TTFT p95", "vs baseline: E2E p95"],
    "decode_stack": ["config", "batch", "status", "decode_tok_s_p50", "decode_tok_s_min", "decode_tok_s_max",
                     "frac_of_ceiling", "vs_baseline", "agreement_vs_baseline"],
}
LONG = {
    "prefetch_bench": [("verdict", "hit_rate.measured.median"), ("verdict", "hit_rate.measured.min"),
                       ("verdict", "hit_rate.measured.max"), ("verdict", "hit_rate.config"),
                       ("verdict", "link_use.measured_best.median"), ("verdict", "link_use.measured_sync.median"),
                       ("verdict", "link_use.comparison"), ("streaming", "rows.tokens_per_s.median"),
                       ("streaming", "rows.prefetch_hit_rate.median"), ("streaming", "rows.prefetch_efficiency.median"),
                       ("streaming", "rows.link_busy.median"), ("link", "rows.gbps_median"),
                       ("run", "ceiling_gbps")],
}


def _reader_tables() -> set[str]:
    """Every table name a reader in the package or a notebook asks for."""
    names: set[str] = set()
    pat = re.compile(r"""(?:latest|gpu_table|describe)\(\\?["']([a-z0-9_]+)\\?["']""")
    for path in list((ROOT / "workbench").rglob("*.py")) + list((ROOT / "notebooks").glob("*.ipynb")):
        if path.name == "gpu_results.py":
            continue
        names |= set(pat.findall(path.read_text(errors="replace")))
    from workbench.lab.front_page import GPU_TABLES

    return names | set(GPU_TABLES)


def test_every_table_a_reader_asks_for_is_written_by_the_device_check():
    written = set(gr.TABLES.values()) | {"summary"}
    asked = _reader_tables()
    assert asked >= {"engine_bench", "kernel_bench", "prefetch_bench", "quant_bench", "e2e", "sched_bench",
                     "prefix_bench"}, asked
    assert asked <= written, f"read but never written: {sorted(asked - written)}"
    # every step of the script writes a table the writer knows, every table's producers are steps of the script
    script = (ROOT / "scripts" / "device_check.sh").read_text()
    steps = re.findall(r"^step (\w+) \d+ \d+ ", script, re.M)
    assert set(steps) - {"tests"} == set(gr.TABLES), (steps, gr.TABLES)


def _kernel_csv(work: Path, providers=("eager", "fused", "fused+graphs")) -> None:
    from workbench.bench.kernel_timing import ROW_FIELDS

    base = {"device": "cuda", "device_name": "NVIDIA H200", "dtype": "bfloat16", "status": "ok"}
    rows = [{**base, "section": "ceilings", "op": "copy", "provider": "torch", "metric": "GB/s", "achieved": 4000.0},
            {**base, "section": "ceilings", "op": "matmul", "provider": "torch", "metric": "TFLOP/s",
             "achieved": 800.0}]
    for prov, ms, launches in zip(providers, (10.0, 4.0, 2.0), (600, 120, 40)):
        rows.append({**base, "section": "decode", "op": "decode_step", "provider": prov, "ms_median": ms,
                     "ms_min": 0.98 * ms, "ms_max": 1.02 * ms, "launches_per_step": launches,
                     "frac_of_ceiling": 1.9 / ms, "sizes": "batch=1 context=1024 layers=16 hidden=2048",
                     "ceiling": 4000.0, "bytes": 2.5e9})
    gr.write_csv(rows, work / "kernel_bench.csv", ROW_FIELDS)


def test_the_kernel_csv_has_every_column_its_readers_use():
    from workbench.bench.kernel_timing import ROW_FIELDS

    assert set(COLUMNS["kernel_bench"]) <= set(ROW_FIELDS)


def test_decode_stack_rows_have_every_column_its_readers_use():
    from workbench.bench.decode_stack import ROW_FIELDS

    assert set(COLUMNS["decode_stack"]) <= set(ROW_FIELDS)


@pytest.fixture(scope="module")
def quant_step_rows():
    """Rows of the quant_bench step's own code (``shape_rows`` under the interpreter, a host timer)."""
    import torch

    from workbench.bench import quant_kernels as qk
    from workbench.bench.kernel_timing import environment

    dev = torch.device("cpu")
    return qk.shape_rows(128, 128, (1, 4), 64, torch.float32, dev, qk.host_timer, environment(dev), reps=1,
                         repeats=2, warmup=1)


@pytest.fixture(scope="module")
def prefetch_step_output(bundled_llm):
    """The prefetch_link and prefetch_bench steps' JSON, at the smallest sizes (the bundled model)."""
    from workbench.bench import prefetch as P

    link = P.link_step("cpu")
    link["link"]["rows"] = [r for r in link["link"]["rows"] if r["block_bytes"] <= 64 << 10] or link["link"]["rows"]
    bench = P.prefetch_bench(smoke=True, device="cpu", candidates=[dict(model=None, workload=P.Workload(1, 4, 2))],
                             options=(), repeats=1, link=link)
    return link, bench


@pytest.fixture(scope="module")
def results(tmp_path_factory, quant_step_rows, prefetch_step_output):
    """A results root with one GPU run written by start + write_tables from the steps' outputs."""
    tmp = tmp_path_factory.mktemp("gpu_tables")
    root, work = tmp / "gpu", tmp / "raw"
    work.mkdir()
    cuda, folder = gr.start({"cuda_available": True, "device_name": "NVIDIA H200", "torch": "2.11.0",
                             "triton": "3.6.0", "cuda": "13.0"}, root=root)
    link, bench = prefetch_step_output
    (work / "prefetch_link.out").write_text(json.dumps(link, default=str))
    (work / "prefetch_bench.out").write_text("[prefetch-stream] a progress line\n" + json.dumps(bench, default=str))
    (work / "quant_bench.out").write_text(json.dumps({"kernels": quant_step_rows, "kernels_table": "..."}, default=str))
    _kernel_csv(work)
    lines = [f"{s}\tok\t10\t40\t40\t1.5\t3\t1.0\t0.5\t0.0" for s in
             ("decode_roofline", "kernels_bench", "quant_bench", "prefetch_link", "prefetch_bench")]
    (work / "steps.tsv").write_text("\n".join(lines) + "\n")
    done = gr.write_tables(folder, work)
    return root, folder, done


def test_written_tables_have_the_columns_their_readers_use(results):
    root, folder, done = results
    assert {t: done[t] for t in ("kernel_bench", "quant_bench", "prefetch_bench")} == dict.fromkeys(
        ("kernel_bench", "quant_bench", "prefetch_bench"), "ok")
    for table in ("kernel_bench", "quant_bench"):
        frame = gr.latest(table, root=root).frame
        missing = [c for c in COLUMNS[table] if c not in frame.columns]
        assert not missing, f"{table}.csv lacks {missing}"
    frame = gr.latest("prefetch_bench", root=root).frame
    have = set(zip(frame["section"], frame["metric"]))
    missing = [pair for pair in LONG["prefetch_bench"] if pair not in have]
    assert not missing, f"prefetch_bench.csv lacks {missing}"
    assert set(frame["section"]) >= {"link", "pick", "streaming", "verdict", "sweep"}   # both steps' sections
    summary = gr.latest("summary", root=root).frame
    assert list(summary.columns) == gr.SUMMARY_COLUMNS and summary["gpu_cap_s"].notna().all()


def test_the_readers_find_their_figures(results):
    """The GPU claims and the quantization verdicts read the written tables: none says its table
    or its rows are missing."""
    from workbench.bench import claims as lab
    from workbench.bench.claims.gpu_tables import STEPS
    from workbench.bench.quant import claim_verdicts

    root, folder, _ = results
    res = {r.id: r for r in lab.run_claims(["fused_launches", "prefetch_bandwidth", "w4a16_speed",
                                            "decode_bandwidth_bound"], ctx=lab.ClaimContext(gpu_root=root))}
    for r in res.values():
        assert "no committed GPU run" not in r.reason and " has no " not in r.reason, (r.id, r.reason)
        assert f"results/gpu/{folder.name}/" in r.reason
    assert res["fused_launches"].verdict == lab.HOLDS and res["decode_bandwidth_bound"].verdict == lab.HOLDS
    assert STEPS.keys() >= {"kernel_bench", "prefetch_bench", "quant_bench"}
    rows = gr.latest("quant_bench", root=root).frame.to_dict("records")
    gpu = [v for v in claim_verdicts(None, None, rows) if "GPU" in v["claim"]]
    assert gpu and gpu[0]["verdict"] != "not measured here" and "W4A16 vs bf16" in gpu[0]["measured"]


def test_notebook_selections_find_rows(results):
    """The selections notebooks 03 and 05 make on the GPU tables (their cells' code) are not empty."""
    import pandas as pd

    root, _, _ = results
    gf = gr.latest("prefetch_bench", root=root).frame
    keys = {"rows.tokens_per_s.median": "tokens/s", "rows.prefetch_hit_rate.median": "hit rate",
            "rows.prefetch_efficiency.median": "efficiency", "rows.link_busy.median": "link busy"}
    g = gf[(gf["section"] == "streaming") & gf["config"].astype(str).str.startswith("config=")
           & gf["metric"].isin(keys)]
    g = g.pivot_table(index="config", columns="metric", values="value", aggfunc="first").rename(columns=keys)
    assert set(g.columns) == set(keys.values()) and {"config=d=0", "config=resident"} <= set(g.index)
    gv = gf[(gf["section"] == "verdict") & gf["metric"].astype(str).str.endswith((".claim", ".verdict",
                                                                                 "hidden_share.measured"))]
    assert len(gv) >= 3
    frame = gr.latest("quant_bench", root=root).frame
    for r in frame.to_dict("records"):
        for c in (c for c in frame.columns if c.endswith("_speedup")):
            p = c.removesuffix("_speedup")
            assert pd.notna(r[c]) and all(pd.notna(r.get(k)) for k in ("dense_ms_min", "dense_ms_max",
                                                                        f"{p}_ms_min", f"{p}_ms_max"))


# ---- a step stopped by its cap; two steps writing one table -----------------------------------------

def test_a_stopped_step_leaves_a_partial_table(tmp_path, monkeypatch):
    work, out = tmp_path / "raw", tmp_path / "out"
    work.mkdir()
    monkeypatch.setenv(gr.PARTIAL_ENV, str(work / "decode_stack.partial.json"))
    rows = [{"config": "paged+graphs", "batch": 1, "status": "ok", "decode_tok_s_p50": 250.0, "nested": [1]}]
    assert gr.save_partial({"rows": rows}) == work / "decode_stack.partial.json"
    gr.save_partial({"rows": rows * 2})                       # replaced whole: the last save wins
    (work / "decode_stack.out").write_text("")                # killed: printed nothing
    _kernel_csv(work, providers=("eager",))                  # the decode roofline appended a row, then timed out
    (work / "steps.tsv").write_text("decode_roofline\ttimeout\t35\t35\t35\t\t\t\t\t\n"
                                    "decode_stack\ttimeout\t35\t35\t35\t2.0\t4\t1.0\t1.0\t0.0\n"
                                    "tier_bench\tfailed rc=1\t3\t20\t20\t\t\t\t\t\n")
    done = gr.write_tables(out, work)
    assert done["decode_stack"] == "partial (step timeout)"
    assert done["kernel_bench"] == "partial (step decode_roofline timeout)"
    assert done["tier_bench"] == "step failed rc=1" and not (out / "tier_bench.csv").exists()
    import csv

    with open(out / "decode_stack.csv", newline="") as f:
        got = list(csv.DictReader(f))
    assert len(got) == 2 and got[0]["decode_tok_s_p50"] == "250.0"
    assert "nested" not in got[0] and "partial" not in got[0]
    assert (out / "kernel_bench.csv").is_file()


def test_two_steps_write_one_table(tmp_path):
    work, out = tmp_path / "raw", tmp_path / "out"
    work.mkdir()
    (work / "prefetch_link.out").write_text(json.dumps({"link": {"ceiling_gbps": {"cuda": 50.0}},
                                                        "ceiling_gbps": 50.0}))
    (work / "prefetch_bench.partial.json").write_text(json.dumps({"ceiling_gbps": 50.0,
                                                                  "pick": {"chosen": {"ratio": 1.1}},
                                                                  "partial": True}))
    (work / "steps.tsv").write_text("prefetch_link\tok\t5\t15\nprefetch_bench\ttimeout\t25\t25\n")
    done = gr.write_tables(out, work)
    assert done["prefetch_bench"] == "partial (step timeout)"
    text = (out / "prefetch_bench.csv").read_text()
    assert "link,,ceiling_gbps.cuda,50.0" in text and "pick,,chosen.ratio,1.1" in text and "partial" not in text


# ---- compile seconds ----------------------------------------------------------------------------------

def _run_step(tmp_path, code: str, *, term_after: float | None = None) -> tuple[int, dict]:
    log = tmp_path / "c.json"
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), gr.COMPILE_ENV: str(log)}
    p = subprocess.Popen([sys.executable, "-m", "workbench.cli.gpu_results", "run", "--", "-c", code, "arg1"],
                         cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if term_after is not None:
        deadline = time.time() + 60
        while not log.exists() and time.time() < deadline and p.poll() is None:
            time.sleep(term_after)
            if (tmp_path / "started").exists():
                p.send_signal(signal.SIGTERM)
                break
    out, err = p.communicate(timeout=120)
    return p.returncode, gr.read_compile_log(log) | {"stdout": out, "stderr": err}


def test_run_passes_argv_and_exit_status_and_writes_the_compile_log(tmp_path):
    rc, got = _run_step(tmp_path, "import sys; print(sys.argv[1:]); sys.exit(3)")
    assert rc == 3 and got["stdout"].strip() == "['arg1']"
    assert got["compile_s"] == 0.0 and got["triton_compiles"] == 0 and "inductor_s" in got


def test_run_writes_the_compile_log_when_its_cap_stops_it(tmp_path):
    code = f"import pathlib, time; pathlib.Path({str(tmp_path / 'started')!r}).touch(); time.sleep(60)"
    rc, got = _run_step(tmp_path, code, term_after=0.2)
    assert rc == 128 + signal.SIGTERM and "compile_s" in got


def test_compile_log_counts_autotuning_apart_from_jit():
    log = gr.CompileLog()

    class Fake:
        def _do_compile(self, *a):
            time.sleep(0.01)

        def _bench(self, *a):
            self._do_compile()            # an autotuned config compiles inside its benchmark

    from types import SimpleNamespace

    jit = SimpleNamespace(JITFunction=Fake)
    auto = SimpleNamespace(Autotuner=Fake)
    import unittest.mock as um

    with um.patch.dict(sys.modules, {"triton.runtime.jit": jit, "triton.runtime.autotuner": auto,
                                     "triton": SimpleNamespace(), "triton.runtime": SimpleNamespace()}):
        log.install()
    f = Fake()
    f._do_compile()
    f._bench()
    t = log.totals()
    assert t["triton_compiles"] == 2 and t["autotunes"] == 1
    assert 0.009 < t["triton_jit_s"] < t["autotune_s"] + 0.02 and t["compile_s"] >= t["triton_jit_s"] + t["autotune_s"]


# ---- the dry run's own outputs ------------------------------------------------------------------------

def test_the_dry_runs_outputs_become_every_table(tmp_path):
    """On the outputs of ``bash scripts/device_check.sh`` without CUDA (when a dry run is there):
    every step ok, every table written with its readers' columns."""
    work = ROOT / "runs" / "device_check" / "raw"
    steps = gr.read_steps(work / "steps.tsv")
    if not steps or any(s["status"] != "ok" for s in steps) or len(steps) < len(set(gr.TABLES)):
        pytest.skip("no complete dry run in runs/device_check/raw (bash scripts/device_check.sh writes one)")
    done = gr.write_tables(tmp_path, work)
    assert set(done.values()) == {"ok"}, done
    import pandas as pd

    for table, cols in COLUMNS.items():
        frame = pd.read_csv(tmp_path / f"{table}.csv")
        # the dry run's kernel table has no measured CUDA-graph rows, its e2e no CUDA layers: columns only
        missing = [c for c in cols if c not in frame.columns]
        assert not missing, f"{table}.csv lacks {missing}"
    frame = pd.read_csv(tmp_path / "prefetch_bench.csv")
    have = set(zip(frame["section"], frame["metric"]))
    assert not [p for p in LONG["prefetch_bench"] if p not in have]
