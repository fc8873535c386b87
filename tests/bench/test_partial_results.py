"""A benchmark stopped part way keeps what it measured: the six device-check steps whose result was
only printed at the end (e2e, engine_bench / engine_fast, sched_bench, prefix_bench, calibrate) save
it as they go (:func:`workbench.measure.gpu_results.save_partial` to ``$WORKBENCH_PARTIAL_OUT``), in
the shape of the finished JSON, and ``write_tables`` turns what a step stopped by its time cap
saved into a partial table with the rows measured so far.

Each benchmark runs at a tiny size on the bundled model and is stopped by a step of its own that
raises (a ``BaseException``, so no ``except Exception`` in the benchmark swallows it: what a kill
leaves) after its first configuration / round / section / mix."""

from __future__ import annotations

import csv
import json

import pytest

from tests.conftest import BUNDLED_READY
from workbench.measure import gpu_results as gr

pytestmark = pytest.mark.skipif(not BUNDLED_READY, reason="bundled model weights not present")


class Stopped(BaseException):
    """The time cap's kill, where the benchmark would have gone on."""


def _stop_on_call(monkeypatch, owner, name: str, n: int) -> list[int]:
    """``owner.name`` raises :class:`Stopped` on its ``n``-th call (the earlier calls run)."""
    real = getattr(owner, name)
    calls: list[int] = []

    def wrapped(*a, **k):
        calls.append(1)
        if len(calls) == n:
            raise Stopped(f"{name}, call {n}")
        return real(*a, **k)

    monkeypatch.setattr(owner, name, wrapped)
    return calls


@pytest.fixture
def work(tmp_path, monkeypatch):
    """The step's raw folder, ``$WORKBENCH_PARTIAL_OUT`` pointing into it (set per test: ``step``)."""
    w = tmp_path / "raw"
    w.mkdir()

    def step(name: str):
        monkeypatch.setenv(gr.PARTIAL_ENV, str(w / f"{name}.partial.json"))
        return w / f"{name}.partial.json"

    return w, step


def _partial(path) -> dict:
    assert path.is_file(), f"{path.name} was not saved"
    data = json.loads(path.read_text())
    assert data.pop("partial") is True
    return data


def _write(work, step: str, tmp_path) -> tuple[str, list[dict]]:
    """``write_tables`` on a work folder where ``step`` was stopped by its cap (printed nothing):
    its result and the table's rows."""
    (work / f"{step}.out").write_text("")
    (work / "steps.tsv").write_text(f"{step}\ttimeout\t45\t45\t45\t\t\t\t\t\n")
    out = tmp_path / "out"
    done = gr.write_tables(out, work)
    table = gr.TABLES[step]
    path = out / f"{table}.csv"
    rows = []
    if path.is_file():
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
    return done[table], rows


# ---- e2e: after every run (a configuration in a round) ---------------------------------------------

def test_e2e_saves_the_configurations_measured_so_far(work, tmp_path, monkeypatch):
    from workbench.bench import end_to_end as e2e

    w, step = work
    path = step("e2e")
    tiny_wl = {"conversations": 2, "turns": 2, "system_prompts": 1, "system_tokens": 48, "user_tokens": (6, 12),
               "reply_tokens": 8, "chat_max_tokens": 4, "documents": 1, "doc_tokens": 160, "doc_max_tokens": 4,
               "short": 1, "short_tokens": (8, 24), "short_max_tokens": 4, "rate": 40.0, "reply_s": 0.05,
               "think_s": 0.02}
    monkeypatch.setattr(e2e.WorkloadConfig, "preset", classmethod(lambda cls, mode, **o: cls(**tiny_wl)))
    monkeypatch.setattr(e2e.E2EConfig, "preset", classmethod(lambda cls, mode, **o: cls(
        repeats=2, max_num_seqs=4, compile=False, quant_variants=(), reference_row=False, eval_docs=1,
        eval_context=128, eval_tokens=48, alone=("paged",), stack=("paged",))))
    _stop_on_call(monkeypatch, e2e.Ablation, "_run_once", 3)      # round 1 (baseline, +paged) ran; round 2 stopped
    with pytest.raises(Stopped):
        e2e.run_end_to_end(device="cpu", mode="tiny")
    data = _partial(path)
    measured = [r for r in data["rows"] if r["status"] == "measured"]
    assert [(r["config"], r["runs"]) for r in measured] == [("baseline", 1), ("+paged", 1)]
    assert all(r["ttft_ms_p95"] > 0 and r["tokens_per_s"] > 0 for r in measured)
    assert measured[1]["vs baseline: TTFT p95"] not in (None, "-")
    assert {r["status"] for r in data["rows"]} >= {"measured", "left out"}
    assert data["stack"][0]["config"] == "baseline" and data["mode"] == "tiny" and data["device"] == "cpu"
    assert "waterfall" not in data and "recommendation" not in data            # they need every round
    how, rows = _write(w, "e2e", tmp_path)
    assert how == "partial (step timeout)"
    assert [r["config"] for r in rows] == [r["config"] for r in data["rows"]] and "partial" not in rows[0]
    assert rows[0]["ttft_ms_p95"] and rows[0]["status"] == "measured"


# ---- engine_bench / engine_fast: after every group of prompts every side has run -------------------

def test_engine_bench_saves_every_side_after_each_group(work, tmp_path, monkeypatch):
    from workbench.bench import vs_transformers as vt

    w, step = work
    path = step("engine_bench")
    # transformers runs once in the warm-up, once in group 1; its run in group 2 is stopped
    _stop_on_call(monkeypatch, vt, "_run_hf", 3)
    cfg = vt.BenchConfig(device="cpu", prompt_tokens=16, max_tokens=4, num_prompts=2, repeats=2,
                         configs="reference,loop", quality_windows=0)
    with pytest.raises(Stopped):
        vt.run_bench(cfg, progress=False)
    data = _partial(path)
    assert "raw" not in data                                  # as `workbench bench --json` prints it
    assert set(data["configs"]) == {"reference", "loop"} and data["config"]["num_prompts"] == 2
    for side in ("reference", "loop"):
        c = data["configs"][side]
        assert c["decode_tokens_per_s_min"] == c["decode_tokens_per_s_max"] > 0      # one run each so far
        assert c["token_agreement_vs_reference"] == 1.0 and c["decode_verdict"]
    assert data["transformers_generate"]["decode_tokens_per_s_p50"] > 0 and data["decode_speedup"] > 0
    assert data["front_overhead"]["verdict"]
    for step_name in ("engine_bench", "engine_fast"):     # the same command: one writer for both tables
        (w / f"{step_name}.partial.json").write_text(path.read_text())
        how, rows = _write(w, step_name, tmp_path)
        assert how == "partial (step timeout)", step_name
        assert [r["side"] for r in rows] == ["reference", "loop", "transformers.generate"]
        assert float(rows[0]["decode_tokens_per_s_p50"]) > 0 and "partial" not in rows[0]


# ---- sched_bench: after each experiment and each trace row ----------------------------------------

def test_sched_bench_saves_each_experiment_and_trace_row(work, tmp_path, monkeypatch, bundled_llm):
    from workbench.bench import sched

    w, step = work
    path = step("sched_bench")
    _stop_on_call(monkeypatch, sched, "trace_run", 2)         # chunked prefill off ran; on was stopped
    cfg = sched.SchedBenchConfig(streams=2, prompt_tokens=16, max_tokens=4, rounds=1, rate=50.0, trace_requests=4,
                                 long_prompt_tokens=64, long_every=2, windows_ms=(0.0, 5.0), overhead_batch=2,
                                 overhead_tokens=4)
    with pytest.raises(Stopped):
        sched.run_sched_bench(bundled_llm, cfg)
    data = _partial(path)
    assert data["throughput"]["speedup"] > 0 and data["throughput"]["identical_tokens"] is True
    assert [r["chunked_prefill"] for r in data["chunked"]] == [False]
    assert "tokens" not in data["chunked"][0] and data["chunked_identical_tokens"] is True
    assert "window" not in data and "overhead" not in data
    how, rows = _write(w, "sched_bench", tmp_path)
    assert how == "partial (step timeout)"
    have = {(r["section"], r["config"], r["metric"]) for r in rows}
    assert ("throughput", "", "speedup") in have and ("chunked", "chunked_prefill=False", "ttft_ms_p95") in have
    assert not [r for r in rows if r["metric"] == "partial"]


# ---- prefix_bench: after each round --------------------------------------------------------------------

def test_prefix_bench_saves_each_round(work, tmp_path, monkeypatch, bundled_llm):
    from workbench.bench import prefix

    w, step = work
    path = step("prefix_bench")
    _stop_on_call(monkeypatch, prefix, "_run_pair", 3)        # both shared-prefix rounds ran; no sharing stopped
    cfg = prefix.PrefixBenchConfig(num_requests=3, system_tokens=48, max_tokens=2, unique_prompt_tokens=24, rounds=2)
    with pytest.raises(Stopped):
        prefix.run_prefix_bench(bundled_llm, cfg, progress=False)
    data = _partial(path)
    s = data["shared_prefix"]
    assert s["hit_rate"] > 0 and s["identical_greedy_tokens"] is True and s["ttft_verdict"]
    assert "no_sharing" not in data and data["block_manager_stats_shared"]
    how, rows = _write(w, "prefix_bench", tmp_path)
    assert how == "partial (step timeout)"
    have = {(r["section"], r["metric"]) for r in rows}
    assert ("shared_prefix", "hit_rate") in have and ("shared_prefix", "on.ttft_ms_p50") in have
    assert not any(sec == "no_sharing" for sec, _ in have)


# ---- calibrate: after each measured mix, and once every mix has its measured cost -------------------

@pytest.mark.parametrize("stop", ["second mix", "confirmation"])
def test_calibrate_saves_each_measured_mix(work, tmp_path, monkeypatch, stop):
    import importlib

    from workbench.cli.main import main

    cal = importlib.import_module("workbench.quant.calibrate")   # the module (the package exports the function)
    rec = importlib.import_module("workbench.quant.recommend")

    w, step = work
    path = step("calibrate")
    if stop == "second mix":                                  # the unquantized model measured; uniform w8a16 stopped
        _stop_on_call(monkeypatch, cal, "measure", 2)
    else:                                                     # every mix measured and timed; the pick's check stopped
        _stop_on_call(monkeypatch, rec, "recommend", 1)
    with pytest.raises(Stopped):
        main(["calibrate-quant", "--device", "cpu", "--dataset", "reference", "--objective", "latency",
              "--search-space", "w8a16", "--context", "32", "--eval-windows", "1", "--calib-windows", "1",
              "--max-measured", "2", "--rounds", "3", "--decode-steps", "2", "--unit", "block",
              "--out", str(tmp_path / "calib"), "--json", "--quiet"])
    res = _partial(path)["result"]
    assert res["recommendation"] is None and res["objective"] == "latency" and res["sensitivity"]
    keys = [c["key"] for c in res["candidates"]]
    assert keys[0] == "unquantized" and res["candidates"][0]["degradation"] == 0.0
    if stop == "second mix":
        assert keys == ["unquantized"] and "cost" not in res["candidates"][0]
    else:
        assert "uniform w8a16" in keys and res["cost_offset"] is not None
        assert all(c["ms"] > 0 and c["cost"] == c["ms"] and len(c["samples"]) == 3 for c in res["candidates"])
    how, rows = _write(w, "calibrate", tmp_path)
    assert how == "partial (step timeout)"
    assert [r["key"] for r in rows] == keys and {r["recommended"] for r in rows} == {"False"}
    if stop == "confirmation":
        assert all(float(r["cost_vs_unquantized"]) > 0 for r in rows)


def test_a_step_stopped_before_its_first_row_keeps_the_previous_table(tmp_path):
    """A partial JSON without a row (a calibrate run stopped before its first mix) writes no table."""
    w = tmp_path / "raw"
    w.mkdir()
    (w / "calibrate.partial.json").write_text(json.dumps({"result": {"candidates": [], "recommendation": None},
                                                          "partial": True}))
    how, _ = _write(w, "calibrate", tmp_path)
    assert how == "nothing saved (step timeout)" and not (tmp_path / "out" / "calibrate.csv").exists()
