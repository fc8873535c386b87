"""The weight-streaming bench at tiny sizes: every experiment returns plain data with the
fields the tables and the verdict read, greedy tokens identical to all-resident, and the CLI
prints one JSON document or the tables."""

from __future__ import annotations

import json

import pytest

from workbench.bench import prefetch as P
from workbench.bench.prefetch import Workload
from workbench.cli.main import main
from workbench.cli.prefetch import format_prefetch_bench
from workbench.errors import ConfigError

W = Workload(1, 8, 3)


@pytest.fixture(scope="module")
def engine(bundled_llm):
    return P.make_engine(None, None, W, threads=1)


@pytest.fixture(scope="module")
def exp(engine):
    return P.streaming_experiment(engine=engine, resident_layers=2, distances=(0, 2), workload=W, repeats=2,
                                  transport="disk", ceiling_gbps=1.0)


def test_streaming_experiment_rows_and_hidden_share(exp):
    assert [r["config"] for r in exp["rows"]] == ["resident", "d=0", "d=2"]
    assert all(r["tokens_identical"] and r["runs"] == 2 for r in exp["rows"])
    res, sync, d2 = exp["rows"]
    assert "prefetch_hit_rate" not in res
    assert sync["prefetch_hit_rate"]["median"] == 0.0 and sync["demand"] == sync["uses"] > 0
    assert d2["demand"] == 0 and d2["resident_layers"] == 2 and d2["buffers"] == 3
    assert d2["resident_bytes"] < d2["all_resident_bytes"]
    for k in ("tokens_per_s", "wall_s", "stall_s", "prefetch_efficiency", "link_use", "link_busy"):
        assert d2[k]["min"] <= d2[k]["median"] <= d2[k]["max"], k
    assert exp["best"] == "d=2" and exp["best_distance"] == 2
    assert exp["t_resident"] > 0 and exp["t_ideal"] > 0 and exp["t_lane"] >= exp["t_resident"]
    if exp["t_sync"] > exp["t_ideal"]:
        hs = (exp["t_sync"] - exp["t_best"]) / (exp["t_sync"] - exp["t_ideal"])
        assert exp["hidden_share"] == pytest.approx(hs)
        lo, hi = exp["hidden_share_range"]
        assert lo <= hs <= hi
    assert exp["sync_vs_best"]["metric"] == "wall time"
    assert {e["lane"] for e in exp["timeline"]} <= {"copy", "compute", "stall"}


def test_verdict_states_each_claim(exp):
    v = P.verdict(exp)
    assert v["tokens_identical"] is True
    assert v["hit_rate"]["verdict"] in ("holds", "does not hold", "within noise")
    assert v["hit_rate"]["by_config"]["d=0"] == 0.0
    assert v["link_use"]["verdict"] in ("holds", "does not hold", "within noise")
    assert v["hidden_share"]["verdict"] in ("holds", "does not hold", "within noise", "not measured")


def test_claim_reading():
    assert P._claim(0.9, 1.0, 0.89) == "holds"
    assert P._claim(0.5, 0.8, 0.89) == "does not hold"
    assert P._claim(0.8, 0.95, 0.89) == "within noise"
    assert P._claim(None, None, 0.89) == "not measured"


def test_streaming_experiment_needs_the_sync_baseline(engine):
    with pytest.raises(ConfigError, match="must include 0"):
        P.streaming_experiment(engine=engine, distances=(1, 2), workload=W)


def test_pick_config_measures_the_ratio(engine):
    out = P.pick_config([dict(model=None, workload=W)], engines={None: engine}, transport="disk")
    (c,) = out["candidates"]
    assert out["chosen"] is c and c["model"] == "bundled" and c["layers"] == 6
    assert c["copy_ms"] > 0 and c["compute_ms_mean"] > 0 and c["executions"] == 5 * 3
    assert c["ratio"] == pytest.approx(c["copy_ms"] / c["compute_ms_mean"], rel=0.5)
    assert c["in_range"] == (0.5 <= c["ratio"] <= 2)


def test_resident_fraction_sweep(engine):
    out = P.resident_fraction_sweep(engine=engine, distance=1, workload=Workload(1, 4, 2), repeats=1,
                                    transport="host")
    assert [r["resident_layers"] for r in out["rows"]] == list(range(7))
    assert out["rows"][-1]["fraction"] == 1.0 and all(r["tokens_identical"] for r in out["rows"])
    mem = [r["resident_bytes"] for r in out["rows"][:-1]]
    assert mem == sorted(mem)


def test_block_size_experiment():
    out = P.block_size_experiment(sizes=(8 << 10, 64 << 10), total_bytes=512 << 10, repeats=1)
    assert [(r["transport"], r["block_bytes"]) for r in out["rows"]] == [
        ("disk", 8 << 10), ("disk", 64 << 10), ("host", 8 << 10), ("host", 64 << 10)]
    assert set(out["ceiling_gbps"]) == {"disk", "host"} and all(v > 0 for v in out["ceiling_gbps"].values())


def test_engine_options_eager_and_an_unknown_one():
    rows = P.engine_options_check(options=("eager", "bogus"), workload=Workload(2, 4, 3), transport="host")
    assert rows[0]["option"] == "eager" and rows[0]["ok"] and rows[0]["error"] is None
    assert not rows[1]["ok"] and "unknown option 'bogus'" in rows[1]["error"]


@pytest.fixture(scope="module")
def small_bench(bundled_llm):
    return P.prefetch_bench(smoke=True, device="cpu", candidates=[dict(model=None, workload=Workload(1, 4, 2))],
                            options=("eager",), repeats=1, link_bytes=1 << 20)


def test_prefetch_bench_small_end_to_end(small_bench):
    r = small_bench
    assert r["mode"] == "smoke" and r["device"] == "cpu" and r["ceiling_gbps"] == r["link"]["ceiling_gbps"]["disk"]
    assert r["pick"]["chosen"]["layer_bytes"] in {row["block_bytes"] for row in r["link"]["rows"]}
    assert [x["config"] for x in r["streaming"]["rows"]] == ["resident", "d=0", "d=1", "d=2", "d=3"]
    assert r["engine_options"][0]["ok"] and set(r["verdict"]) >= {"hit_rate", "hidden_share", "tokens_identical"}
    json.dumps(r)                                          # plain data throughout
    text = format_prefetch_bench(r)
    for needle in ("link: GB/s per block size", "hidden share", "resident fraction", "engine options", "verdict"):
        assert needle in text


def test_cli_json_and_out_file(small_bench, monkeypatch, capsys, tmp_path):
    seen = {}

    def fake(**kw):
        seen.update(kw)
        return small_bench

    monkeypatch.setattr(P, "prefetch_bench", fake)
    out = tmp_path / "r.json"
    assert main(["prefetch-bench", "--json", "--full", "--device", "cpu", "--out", str(out)]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["mode"] == "smoke" and json.loads(out.read_text()) == doc
    assert seen["smoke"] is False and seen["device"] == "cpu" and seen["progress"] is None
    assert main(["prefetch-bench", "--quiet"]) == 0
    assert "verdict" in capsys.readouterr().out
