"""The end-to-end ablation (notebook 06's measuring code) at a tiny size.

Timings are this machine's and are not asserted.  What is asserted holds whatever the timing:
the workload is deterministic and has its mix; configurations the engine cannot build are
recorded with its reason, never forced; every measured run has every metric; exact layers give
exactly the reference configuration's greedy tokens when the engine is batch invariant; memory
counts move the way the layers say; the recommendation rule picks, ties and refuses as stated.
"""

from __future__ import annotations

import json

import pytest

from workbench.bench.end_to_end import (
    ALONE_ONLY,
    KINDS,
    LAYERS,
    REQUIRES,
    SLO,
    Ablation,
    E2EConfig,
    Spec,
    WorkloadConfig,
    add_layer,
    build_workload,
    device_layers,
    device_quant,
    recommend,
    report_rows,
    run_ablation,
)
from workbench.errors import ConfigError


@pytest.fixture(scope="module")
def tok():
    import workbench

    return workbench.Tokenizer(workbench.BUNDLED_MODEL)


# ---- the workload -------------------------------------------------------------------------------

def test_workload_is_deterministic_and_has_its_mix(tok):
    cfg = WorkloadConfig(conversations=3, turns=3, system_prompts=2, documents=2, short=4, seed=7)
    a, b = build_workload(tok, cfg, 1024), build_workload(tok, cfg, 1024)
    assert a.prompts == b.prompts and a.info == b.info
    other = build_workload(tok, WorkloadConfig(conversations=3, turns=3, system_prompts=2, documents=2, short=4,
                                               seed=8), 1024)
    assert other.prompts != a.prompts
    kinds = [i["kind"] for i in a.info]
    assert {k: kinds.count(k) for k in KINDS} == {"chat": 9, "doc": 2, "short": 4}
    ats = [i["at"] for i in a.info]
    assert ats == sorted(ats) and ats[0] == 0.0
    trace = a.trace()
    assert [r.at for r in trace.requests] == ats and [r.prompt for r in trace.requests] == a.prompts
    assert {r.priority for r, i in zip(trace.requests, a.info) if i["kind"] == "chat"} == {cfg.chat_priority}
    assert {r.priority for r in a.trace(priorities=False).requests} == {0}
    for p, sp, i in zip(a.prompts, a.params, a.info):
        assert len(p) == i["prompt_tokens"] and len(p) + sp.max_tokens <= 1024
        assert sp.temperature == 0.0 and sp.ignore_eos and sp.max_tokens == i["max_tokens"]
        if i["kind"] == "doc":                       # near the context: all of it but the tokens it asks for
            assert len(p) + sp.max_tokens >= 1024 - 10
    chat = [(i["conversation"], i["turn"], i["system"], p) for p, i in zip(a.prompts, a.info) if i["kind"] == "chat"]
    by = {(c, t): (s, p) for c, t, s, p in chat}
    for (c, t), (s, p) in by.items():
        assert s == c % cfg.system_prompts
        if t > 0:                                    # each turn re-sends the previous one, token for token
            prev = by[(c, t - 1)][1]
            assert p[:len(prev)] == prev and len(p) > len(prev)
            assert a.info[a.prompts.index(p)]["at"] > a.info[a.prompts.index(prev)]["at"]
    systems = {}
    for _, t, s, p in chat:                          # conversations on one system prompt share its tokens
        if t == 0:
            systems.setdefault(s, []).append(p[:cfg.system_tokens + 1])
    assert all(len(set(map(tuple, v))) == 1 for v in systems.values()) and len(systems) == 2
    assert "9 chat turns" in a.describe() and a.frame().shape[0] == 15


def test_workload_errors_name_the_field(tok):
    with pytest.raises(ConfigError, match="turns"):
        WorkloadConfig(turns=0)
    with pytest.raises(ConfigError, match="user_tokens"):
        WorkloadConfig(user_tokens=(10, 5))
    with pytest.raises(ConfigError, match="rate"):
        WorkloadConfig(rate=0)
    with pytest.raises(ConfigError, match="no request"):
        WorkloadConfig(conversations=0, documents=0, short=0)
    with pytest.raises(ConfigError, match="exceeds the context"):
        build_workload(tok, WorkloadConfig(turns=6, system_tokens=200), 256)
    with pytest.raises(ConfigError, match="tokenizer"):
        build_workload(None, WorkloadConfig())
    with pytest.raises(ConfigError, match="mode"):
        WorkloadConfig.preset("huge")


# ---- the configurations -------------------------------------------------------------------------

def test_layers_by_device_and_their_options():
    singles, stack, not_here = device_layers("cpu")
    assert "compile" in singles and "triton" not in singles and "triton" in not_here
    assert "cuda_graphs" in singles          # tried, so that the engine's own refusal is what the table says
    gpu_singles, gpu_stack, gpu_not = device_layers("cuda:0")
    assert {"triton", "cuda_graphs"} <= set(gpu_singles) and "compile" not in gpu_singles and not gpu_not
    assert set(stack) <= set(LAYERS) and set(gpu_stack) <= set(LAYERS)
    assert stack.index("paged") < stack.index("prefix_cache") < stack.index("kv_offload")
    cfg, ctx = E2EConfig(), {"offload_blocks": 12, "layers": 6}
    s = add_layer(add_layer(Spec(), "paged", cfg, ctx), "prefix_cache", cfg, ctx)
    assert s.kv.enable_prefix_caching and s.kv.block_size == cfg.block_size
    off = add_layer(s, "kv_offload", cfg, ctx)
    assert (off.kv.offload, off.kv.num_blocks, off.kv.lookahead) == ("host", 12, cfg.lookahead)
    with pytest.raises(ConfigError, match="enable_prefix_caching"):   # PagedKVConfig's own reason
        add_layer(add_layer(Spec(), "paged", cfg, ctx), "kv_offload", cfg, ctx)
    assert add_layer(Spec(), "compile", E2EConfig(compile=False), ctx).static_decode
    assert add_layer(Spec(), "compile", cfg, ctx).compile
    assert add_layer(Spec(), "weight_streaming", cfg, ctx).stream_weights.resident_layers == 3
    assert add_layer(Spec(), "quant:w4a16:g128", cfg, ctx).quant == "w4a16:g128"
    assert add_layer(Spec(), "window", cfg, ctx).window_s == cfg.window_ms / 1e3
    q = add_layer(Spec(), "quant", cfg, ctx)
    assert q.fresh_model and q.numerics == "quant w8a8" and not Spec().fresh_model and Spec().numerics is None
    assert device_quant("cpu") == "w8a8" and device_quant("cuda:0") == "w4a16:g128"      # each device's fastest
    assert stack[-1] == "quant" and "compile" in stack and not set(ALONE_ONLY) & set(stack)
    assert REQUIRES["kv_offload"] == ("paged", "prefix_cache")
    with pytest.raises(ConfigError, match="unknown layer"):
        add_layer(Spec(), "warp_drive", cfg, ctx)
    with pytest.raises(ConfigError, match="stack"):
        E2EConfig(stack=("paged", "warp_drive"))


# ---- one tiny ablation ------------------------------------------------------------------------------

TINY_WL = {"conversations": 2, "turns": 2, "system_prompts": 1, "system_tokens": 48, "user_tokens": (6, 12),
           "reply_tokens": 8, "chat_max_tokens": 4, "documents": 1, "doc_tokens": 160, "doc_max_tokens": 4, "short": 1,
           "short_tokens": (8, 24), "short_max_tokens": 4, "rate": 40.0, "reply_s": 0.05, "think_s": 0.02}


@pytest.fixture(scope="module")
def tiny():
    """A tiny ablation, batch invariant (so exact layers must give the reference's tokens exactly)."""
    from workbench.engine.llm import LLM

    llm = LLM(None, device="cpu")
    wl = build_workload(llm.tokenizer, WorkloadConfig(**TINY_WL), llm.max_model_len)
    cfg = E2EConfig(repeats=2, max_num_seqs=4, compile=False, quant_variants=(), batch_invariant=True, eval_docs=1,
                    eval_context=128, eval_tokens=48, offload_pool_factor=2)
    return llm, wl, run_ablation(llm, wl, cfg, noise=0.05)


METRIC_COLUMNS = ("ttft_ms_p50", "ttft_ms_p95", "tpot_ms_p50", "tpot_ms_p95", "e2e_ms_p50", "e2e_ms_p95", "itl_ms_p95",
                  "ttft_jitter_ms", "tpot_jitter_ms", "itl_jitter_ms", "e2e_jitter_ms", "ttft_ms_p95_chat",
                  "ttft_ms_p95_doc", "ttft_ms_p95_short", "tokens_per_s", "requests_per_s", "wall_s", "prefix_hit_rate",
                  "preemptions", "mean_batch", "kv_bytes", "kv_used_bytes", "weights_bytes", "rss_bytes")


def test_every_run_has_every_metric_and_every_request_finishes(tiny):
    _, wl, ab = tiny
    assert not [s for s in ab.skipped if s["kind"] == "failed"], ab.skipped
    names = {c.name for c in ab.configs}
    assert {"reference LLM()", "baseline", "+paged", "+paged +prefix_cache", "+paged +prefix_cache +kv_offload",
            "+compile", "+tiers", "+weight_streaming", "+window", "+priorities", "+quant"} <= names
    for c in ab.configs:
        assert len(c.runs) == 2 and [r["round"] for r in c.runs] == [1, 2]
        for r in c.runs:
            missing = [k for k in METRIC_COLUMNS if r.get(k) is None]
            assert not missing, (c.name, missing)
            assert r["finished"] == r["requests"] == len(wl.prompts)
        assert [len(t) for t in c.tokens[0]] == [sp.max_tokens for sp in wl.params]
    summary = ab.summary()
    assert list(summary.index) == [c.name for c in ab.configs]
    assert summary.loc["baseline", "vs baseline: TTFT p95"] == "-"
    assert all(isinstance(v, str) and v for v in summary["vs baseline: throughput"])
    frame = ab.runs_frame()
    assert len(frame) == 2 * len(ab.configs)


def test_refused_combinations_are_recorded_with_the_engines_reason(tiny):
    _, _, ab = tiny
    sk = ab.skipped_frame()
    reason = {(r.stage, r.layer): r.reason for r in sk.itertuples()}
    assert "CUDA device" in reason[("one at a time", "cuda_graphs")]
    assert "interpreter" in reason[("one at a time", "triton")]
    assert not [r for r in sk.itertuples() if r.stage == "stack"], sk      # the static step runs over the pool now
    stacked = [s["layer"] for s in ab.stack if s["config"] is not None]
    assert stacked == ["baseline", "paged", "prefix_cache", "kv_offload", "compile", "window", "priorities", "quant"]
    table = ab.stack_frame()
    skipped = table[table["status"] == "skipped"]
    assert len(skipped) == 2 and skipped["reason"].str.startswith("measured alone: a memory layer").all()
    steps = ab.waterfall("ttft_ms_p95")
    assert steps[0]["kind"] == "start" and steps[-1]["kind"] == "total"
    assert [s["layer"] for s in steps if s["kind"] == "skipped"] == ["tiers", "weight_streaming"]
    for prev, s in zip([x for x in steps if x["kind"] in ("start", "step")],
                       [x for x in steps if x["kind"] in ("start", "step")][1:]):
        assert s["prev"] == prev["value"] and s["delta"] == pytest.approx(s["value"] - prev["value"])
        assert s["within_noise"] == (s["winner"] is None) and s["verdict"]
    assert steps[-1]["prev"] == steps[0]["value"]


def test_exact_layers_give_exactly_the_references_tokens(tiny):
    _, _, ab = tiny
    for name in ("baseline", "+paged", "+paged +prefix_cache", "+paged +prefix_cache +kv_offload", "+window",
                 "+priorities", "+weight_streaming"):
        q = ab.config(name).quality
        assert q["agreement"] == 1.0 and q["identical"], (name, q)
        assert "rel_ppl" not in q                          # nothing changed numerics: no perplexity to compare
    for name in ("+quant", "+tiers"):                      # numerics change: measured against the unchanged model
        q = ab.config(name).quality
        assert 0 <= q["agreement"] <= 1 and q["kl"] >= 0 and q["scored"] == 48 and abs(q["rel_ppl"]) < 0.5
    assert ab.config("+paged +prefix_cache").runs[0]["prefix_hit_rate"] > 0      # the shared system prompt


def test_memory_moves_the_way_the_layers_say(tiny):
    _, _, ab = tiny
    s = ab.summary()
    base = s.loc["baseline"]
    assert s.loc["+quant", "weights_bytes"] < 0.6 * base["weights_bytes"]          # int8 weights + scales
    assert s.loc["+weight_streaming", "weights_bytes"] < base["weights_bytes"]
    pool = ab.config("+paged +prefix_cache +kv_offload").front.engine.pool
    assert s.loc["+paged +prefix_cache +kv_offload", "kv_bytes"] == pool.nbytes() == \
        ab.ctx["offload_blocks"] * pool.layout.bytes_per_block
    assert s.loc["+paged +prefix_cache +kv_offload", "kv_bytes"] < s.loc["+paged +prefix_cache", "kv_bytes"]
    assert s.loc["+tiers", "kv_bytes"] < s.loc["+tiers", "kv_used_bytes"]         # resident zones < full blocks
    assert s.loc["+compile", "kv_bytes"] > base["kv_bytes"]                       # whole static rows


def test_report_rows_are_flat_and_become_the_gpu_table(tiny, tmp_path):
    from workbench.measure import gpu_results as gr

    _, _, ab = tiny
    rows = report_rows(ab)
    measured = [r for r in rows if r["status"] == "measured"]
    assert len(measured) == len(ab.configs) and len(rows) == len(ab.configs) + len(ab.skipped)
    assert all(v is None or isinstance(v, (str, int, float, bool)) for r in rows for v in r.values())
    assert {r["config"]: r["stack_step"] for r in measured}["+paged"] == 1
    work, out = tmp_path / "work", tmp_path / "out"
    work.mkdir()
    (work / "steps.tsv").write_text("e2e\tok\t30\t45\n")
    (work / "e2e.out").write_text("[e2e] progress on stderr, never here\n" + json.dumps({"rows": rows}, default=str))
    assert gr.write_tables(out, work)["e2e"] == "ok"
    import pandas as pd

    table = pd.read_csv(out / "e2e.csv")
    assert list(table["config"]) == [r["config"] for r in rows] and "ttft_ms_p95" in table


# ---- the recommendation rule --------------------------------------------------------------------

def _row(name, layers, ttft, tps, rel_ppl=None, mem=100, agreement=1.0):
    return {"name": name, "layers": list(layers), "ttft_ms_p95": ttft, "tokens_per_s": tps, "rel_ppl": rel_ppl,
            "agreement": agreement, "memory_bytes": mem}


ROWS = [
    _row("baseline", [], [120, 125, 130], [50, 51, 52]),
    _row("+a", ["a"], [90, 95, 92], [50.5, 51, 52.5]),                       # meets; throughput within noise of +a+b
    _row("+a+b", ["a", "b"], [80, 85, 88], [51, 52, 53], mem=50),
    _row("+fast", ["c"], [60, 70, 140], [90, 91, 92]),                       # meets at the median, not in every run
    _row("+lossy", ["d"], [50, 55, 60], [95, 96, 97], rel_ppl=0.05),         # too much quality lost
]


def test_recommend_breaks_throughput_ties_by_fewest_layers():
    rec = recommend(ROWS, SLO(ttft_p95_ms=100, max_rel_ppl=0.02), noise=0.05)
    assert rec["pick"] == "+a" and set(rec["tied"]) == {"+a", "+a+b"}
    why = {t["config"]: t for t in rec["table"]}
    assert not why["baseline"]["meets"] and "130 ms" in why["baseline"]["why"]
    assert not why["+fast"]["meets"] and "not in every run" in why["+fast"]["why"]
    assert not why["+lossy"]["meets"] and "perplexity" in why["+lossy"]["why"]
    assert "fewest layers" in rec["reason"] and "within noise" in rec["reason"]


def test_recommend_takes_a_throughput_win_beyond_noise():
    rows = ROWS[:3] + [_row("+a+b+c", ["a", "b", "c"], [70, 72, 75], [80, 81, 82])]
    rec = recommend(rows, SLO(ttft_p95_ms=100), noise=0.05)
    assert rec["pick"] == "+a+b+c" and rec["tied"] == ["+a+b+c"] and "highest throughput" in rec["reason"]
    strict = recommend(rows, SLO(ttft_p95_ms=100, min_agreement=0.99), noise=0.05)
    assert strict["pick"] == "+a+b+c"
    rows[-1]["agreement"] = 0.8
    assert recommend(rows, SLO(ttft_p95_ms=100, min_agreement=0.99), noise=0.05)["pick"] == "+a"


def test_recommend_says_when_no_configuration_meets_the_slo():
    rec = recommend(ROWS, SLO(ttft_p95_ms=10), noise=0.05)
    assert rec["pick"] is None and rec["tied"] == []
    assert "no configuration meets the SLO" in rec["reason"] and "+lossy" in rec["reason"]   # closest by P95 TTFT
    assert not any(t["meets"] for t in rec["table"])
    assert recommend([], SLO(ttft_p95_ms=10))["pick"] is None
    with pytest.raises(ConfigError):
        SLO(ttft_p95_ms=0)


def test_ablation_refuses_to_go_on_without_a_baseline(monkeypatch):
    from workbench.engine.llm import LLM

    llm = LLM(None, device="cpu")
    wl = build_workload(llm.tokenizer, WorkloadConfig(**TINY_WL), llm.max_model_len)
    ab = Ablation(llm, wl, E2EConfig(reference_row=False))

    def refuse(spec, net=None):
        raise ConfigError("no engine today")

    monkeypatch.setattr(ab, "_llm", refuse)
    with pytest.raises(ConfigError, match="baseline could not be built: no engine today"):
        ab.build()


# ---- where the time goes -----------------------------------------------------------------------------

def test_breakdown_splits_a_replay_into_its_parts(tiny):
    """One timed replay per configuration: the parts never exceed the wall time, matmuls and attention
    are seen, the paged pool's gathers show up where per-sequence caches have none."""
    from workbench.bench.e2e_breakdown import COLUMNS, OpTimer, breakdown

    _, _, ab = tiny
    bd = breakdown(ab, ["baseline", "+paged"])
    assert set(COLUMNS) <= set(bd.columns) and "error" not in bd
    for name, r in bd.iterrows():
        assert r["scheduling_ms"] + r["output_ms"] + r["model_ms"] <= 1.05 * r["wall_ms"], name
        parts = r["static_step_ms"] + r["matmul_ms"] + r["attention_ms"] + r["gather_ms"] + r["other_model_ms"]
        assert parts <= 1.001 * r["model_ms"] + r["timer_overhead_ms"], name
        assert r["matmul_ms"] > 0 and r["attention_ms"] > 0 and r["steps"] == r["decode_steps"] + r["mixed_steps"]
    assert bd.loc["+paged", "gather_ms"] > bd.loc["baseline", "gather_ms"]     # blocks read back by index
    import torch
    x, w = torch.ones(2, 4), torch.ones(3, 4)
    with OpTimer() as t, torch.inference_mode():
        torch.nn.functional.linear(x, w)
    assert t.ops >= 1 and t.ms["matmul"] > 0 and t.ms["attention"] == t.ms["gather"] == 0


def test_static_step_time_on_cuda_is_synchronized(monkeypatch):
    """A graph replay returns once enqueued: each timed decode call syncs the device at both ends."""
    import types

    import torch
    from fake_cuda import install

    from workbench.bench.e2e_breakdown import _time_static_steps

    calls = install(monkeypatch)
    dec = types.SimpleNamespace(decode=lambda *a, **k: calls.append(("decode", None)) or "logits")
    engine = types.SimpleNamespace(device=torch.device("cuda"), runner=types.SimpleNamespace(decoder=dec))
    spent = [0.0]
    undo = _time_static_steps(engine, spent)
    assert dec.decode([1], [2]) == "logits"
    assert [c[0] for c in calls] == ["synchronize", "decode", "synchronize"]
    assert spent[0] >= 0.0
    undo()


def test_alone_chooses_the_layers_measured_one_at_a_time(monkeypatch):
    from workbench.engine.llm import LLM

    with pytest.raises(ConfigError, match=r"E2EConfig.alone: unknown layer\(s\) \['warp'\]"):
        E2EConfig(alone=("paged", "warp"))
    llm = LLM(None, device="cpu")
    wl = build_workload(llm.tokenizer, WorkloadConfig(**TINY_WL), llm.max_model_len)
    ab = Ablation(llm, wl, E2EConfig(reference_row=False, quant_variants=(), alone=("paged", "quant")))
    built = []
    monkeypatch.setattr(ab, "_add", lambda name, *a, **k: built.append(name) or type("C", (), {"name": name})())
    ab.build()
    assert ab.singles == ["paged", "quant"]
    assert [n for n in built if not n.startswith("stack")] == ["baseline", "+paged", "+quant"]
    left = {s["layer"] for s in ab.skipped if s["kind"] == "left out"}
    assert left == set(device_layers("cpu")[0]) - {"paged", "quant"}
    assert any(n.startswith("stack") for n in built)                  # the stack is built as before
