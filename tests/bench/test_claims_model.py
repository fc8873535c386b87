"""The model / memory claims (workbench.bench.claims.model_*): each measured once in smoke mode (one
module fixture: about 20 s on 2 cores) to a verdict with a figure; the exact-bytes claim against
its formula; every verdict rule on synthetic inputs, both ways."""

from __future__ import annotations

import pytest

from workbench.bench import claims as lab
from workbench.bench.claims import model_compute, model_memory, model_quality
from workbench.bench.claims.catalogue import MODEL

IDS = ["compute_share", "prefill_scaling", "kv_size_llama2_7b_32k", "request_memory_release", "cold_zone_reuse",
       "calibrator_domain"]


@pytest.fixture(scope="module")
def smoke():
    # one torch thread: a test must not depend on the thread count measured at load (on a shared
    # 2-core machine two threads can be 10x slower for minutes; the claims' own rules are what is tested)
    ctx = lab.ClaimContext(mode="smoke", threads=1)
    results = lab.run_claims(IDS, ctx=ctx)
    for r in results:
        print(f"{r.id}: {r.verdict} in {r.seconds:.1f} s")
    return {r.id: r for r in results}


def test_the_six_claims_are_registered_for_the_cpu():
    ids = [c.id for c in MODEL]
    assert ids == IDS
    assert all(c.device == "cpu" and c.source.startswith("B §") for c in MODEL)
    assert set(IDS) <= {c.id for c in lab.all_claims()}


@pytest.mark.parametrize("cid", IDS)
def test_each_claim_gets_a_measured_verdict(smoke, cid):
    r = smoke[cid]
    assert r.verdict in (lab.HOLDS, lab.FAILS), (r.verdict, r.error, r.reason)
    assert r.figure.strip("- ") and len(r.reason) > 80
    assert r.verdict == _rule_verdict(r)               # the verdict is the claim's rule on the numbers it recorded
    assert f": {r.verdict} here" in r.reason or f"Verdict {r.verdict}" in r.reason


def _rule_verdict(r) -> str:
    """The verdict each claim's rule gives on the figures the finding recorded (values / table)."""
    v = r.values
    if r.id == "compute_share":
        return model_compute.share_rule(v["shares"], v["claimed_share"], v["noise"])[0]
    if r.id == "prefill_scaling":
        return model_compute.slope_rule(v["slopes"]["math"], v["slopes"]["flash"])[0]
    if r.id == "kv_size_llama2_7b_32k":
        return lab.HOLDS if v["consistent"] and v["size_ok"] and v["cap_ok"] else lab.FAILS
    if r.id == "request_memory_release":
        return model_memory.release_rule(v["release_s"]["paged"], v["release_s"]["contiguous"], v["kv_bytes"]["paged"],
                               v["kv_bytes"]["contiguous"], v["noise"])[0]
    if r.id == "cold_zone_reuse":
        return model_quality.reuse_rule(r.table)[0]
    if r.id == "calibrator_domain":
        return model_quality.domain_rule(r.table)["verdict"]
    raise AssertionError(r.id)


def test_the_smoke_run_is_complete(smoke):
    assert lab.problems(list(smoke.values())) == []
    doc = lab.claims_report(list(smoke.values()))
    assert [c["id"] for c in doc["claims"]] == IDS


def test_kv_size_is_the_formula_in_exact_bytes(smoke):
    v = smoke["kv_size_llama2_7b_32k"].values
    formula = 32 * 2 * 32 * 128 * 32768 * 2                # layers x K,V x kv heads x head_dim x tokens x fp16
    assert v["exact_bytes"] == v["layout_bytes"] == v["extrapolated_bytes"] == formula == 17_179_869_184
    assert v["consistent"] and v["size_ok"] and v["cap_ok"] and v["fits"] == [4, 3]
    assert smoke["kv_size_llama2_7b_32k"].verdict == lab.HOLDS
    for alloc in smoke["kv_size_llama2_7b_32k"].table:   # real allocations: layers x K,V x tokens x 32 x 128 x 2 bytes
        want = alloc["layers"] * 2 * alloc["tokens"] * 32 * 128 * 2
        assert alloc["paged_bytes"] == alloc["contiguous_bytes"] == want


def test_compute_share_and_release_figures_are_measured(smoke):
    v = smoke["compute_share"].values
    assert len(v["shares"]) == 3 and all(0 < s <= 1 for s in v["shares"])
    assert v["primary"] == "in-process" and v["http_shares"] == []          # smoke: no HTTP, one setting ruled on
    m = smoke["request_memory_release"].values
    assert m["kv_bytes"]["contiguous"] > 0 and m["kv_bytes"]["paged"] > 0
    assert all(x is not None and x >= 0 for xs in m["release_s"].values() for x in xs)
    # the old layout reserves the whole context, the paged request its tokens rounded up to 16-token blocks
    assert m["kv_bytes"]["contiguous"] == m["context"] * m["bytes_per_token"]
    toks = m["prompt_tokens"] + m["new_tokens"] - 1                     # the last token is never written
    assert m["kv_bytes"]["paged"] == -(-toks // 16) * 16 * m["bytes_per_token"]
    assert m["byte_ratio"] == pytest.approx(4.0)                        # a quarter of the context: 4x, not 2.6x


def test_prefill_fits_at_least_three_lengths(smoke):
    v = smoke["prefill_scaling"].values
    assert len(v["fit_lengths"]) >= 3 and len(v["slopes"]["math"]["per_repeat"]) == 3


# ---- the rules, on synthetic numbers ---------------------------------------------------------------

def test_share_rule_both_ways():
    assert model_compute.share_rule([0.33, 0.37, 0.40], 0.36, 0.1)[0] == lab.HOLDS
    v, why = model_compute.share_rule([0.90, 0.95, 0.97], 0.36, 0.1)
    assert v == lab.FAILS and "more than the claimed" in why
    assert model_compute.share_rule([0.10, 0.12], 0.36, 0.1)[0] == lab.FAILS
    assert model_compute.share_rule([0.30, 0.31], 0.36, 0.25)[0] == lab.HOLDS          # within the noise floor


def test_the_forward_only_bounds_pure_compute_from_above():
    # a forward share above 36 % says nothing about pure compute; one below it puts pure compute below too
    assert "says nothing" in model_compute.pure_compute_bound([0.80, 0.85], 0.36, 0.1)
    assert "below 36 % here too" in model_compute.pure_compute_bound([0.20, 0.25], 0.36, 0.1)


def _slopes(lo, hi):
    return {"per_repeat": [lo, hi], "min": lo, "max": hi, "median": (lo + hi) / 2, "of_minima": (lo + hi) / 2,
            "of_medians": (lo + hi) / 2}


def test_slope_rule_needs_the_rounds_separated():
    assert model_compute.slope_rule(_slopes(1.8, 2.1), _slopes(0.9, 1.2))[0] == lab.HOLDS
    v, why = model_compute.slope_rule(_slopes(1.2, 1.3), _slopes(1.05, 1.1))
    assert v == lab.FAILS and "eager's lowest round (1.20)" in why
    # the smoke run's straddling fused rounds
    v, why = model_compute.slope_rule(_slopes(1.8, 2.1), _slopes(0.54, 1.53))
    assert v == lab.FAILS and "fused's highest round (1.53)" in why and "within noise" in why
    v, why = model_compute.slope_rule(_slopes(1.45, 2.1), _slopes(0.9, 1.2))      # median 1.78 > 1.5, one round below
    assert v == lab.FAILS and "eager" in why


def test_prefill_loglog_slope_is_exact_on_power_laws():
    from workbench.bench.prefill_scaling import loglog_slope, slope_summary

    assert loglog_slope([256, 512, 1024], [n ** 2 * 1e-6 for n in (256, 512, 1024)]) == pytest.approx(2.0)
    s = slope_summary([512, 1024], {512: [1.0, 1.1, 5.0], 1024: [2.0, 2.1, 2.2]})     # one slow round at 512
    assert s["of_minima"] == pytest.approx(1.0) and s["min"] < 0 < s["of_medians"]


def test_kv_size_rule_both_ways():
    exact, weights = 17_179_869_184, 13_476_831_232
    cards = [model_memory.A100_80GB_BYTES, 80 * 10 ** 9]
    r = model_memory.kv_size_rule(exact, 18, weights, cards, 4)
    assert r["verdict"] == lab.HOLDS and r["fits"] == [4, 3] and r["rel_gb"] == pytest.approx(0.0477, abs=1e-3)
    assert model_memory.kv_size_rule(exact, 25, weights, cards, 4)["verdict"] == lab.FAILS       # size 45 % off
    r = model_memory.kv_size_rule(exact, 18, weights, cards, 2)
    assert r["verdict"] == lab.FAILS and not r["cap_ok"]                                 # 4 fit, more than 2
    r = model_memory.kv_size_rule(exact, 18, weights, cards, 8)
    assert r["verdict"] == lab.FAILS and not r["cap_ok"] and "fewer than" in r["why"]    # 4 fit: the cap is not 8


def test_release_rule_both_ways():
    mib = 2 ** 20
    v, parts = model_memory.release_rule([1e-4] * 3, [1.2, 1.3, 1.1], 800 * mib, 2100 * mib, noise=0.1)
    assert v == lab.HOLDS and len(parts) == 3 and "within 15%" in parts[0]
    v, parts = model_memory.release_rule([1e-4] * 3, [2e-4] * 3, 800 * mib, 2100 * mib, noise=0.1)     # both instant
    assert v == lab.FAILS and "no delayed release" in parts[-1]
    v, parts = model_memory.release_rule([1e-4] * 3, [1.2] * 3, 2100 * mib, 2100 * mib, noise=0.1)     # no byte saving
    assert v == lab.FAILS and "1.00x" in parts[0]
    # 4x: a saving, not 2.6x
    v, parts = model_memory.release_rule([1e-4] * 3, [1.2] * 3, 1024 * mib, 4096 * mib, noise=0.1)
    assert v == lab.FAILS and "+52%" in parts[0] and "beyond 15%" in parts[0]
    v, parts = model_memory.release_rule([0.02] * 3, [1.2] * 3, 800 * mib, 2100 * mib, noise=0.1)  # paged not instant
    assert v == lab.FAILS and "not < 5 ms" in parts[1]


def _row(name, reuse, loses):
    return {"name": name, "cold_reuse": reuse, "loses_quality": loses}


def test_reuse_rule_one_way():
    good = [_row("a", 0.05, True), _row("b", 0.10, True), _row("c", 0.30, False), _row("d", 0.2, False)]
    assert model_quality.reuse_rule(good)[0] == lab.HOLDS
    # a setting above 15 % that loses quality does not contradict "below 15 % => quality lost"
    v, why, _ = model_quality.reuse_rule(good + [_row("e", 0.4, True)])
    assert v == lab.HOLDS and "1 of the 3 setting(s) at or above 15% lose quality" in why
    v, why, wrong = model_quality.reuse_rule(good + [_row("f", 0.08, False)])      # below 15 %, quality within noise
    assert v == lab.FAILS and [r["name"] for r in wrong] == ["f"] and "1 of the 3 setting(s) below 15%" in why
    v, why, _ = model_quality.reuse_rule([_row("c", 0.3, False), _row("d", 0.2, True)])           # nothing below 15 %
    assert v == lab.FAILS and "never triggered" in why


def _udom(values):
    return [{"text": t, "scheme": s, "degradation": d, "se": se} for (t, s), (d, se) in values.items()]


def test_domain_rule_needs_the_claimed_direction():
    flip = _udom({("reference", "w4a16:g128"): (0.05, 0.005), ("reference", "w4a8"): (0.02, 0.005),
                  ("prose", "w4a16:g128"): (0.01, 0.005), ("prose", "w4a8"): (0.04, 0.005)})
    r = model_quality.domain_rule(flip)
    assert r["verdict"] == lab.HOLDS and r["preference"]["reference"]["better"] == "w4a8" and r["as_expected"]
    # the same flip the wrong way round: reference prefers W4A16, prose W4A8
    wrong = _udom({("reference", "w4a16:g128"): (0.02, 0.005), ("reference", "w4a8"): (0.05, 0.005),
                   ("prose", "w4a16:g128"): (0.04, 0.005), ("prose", "w4a8"): (0.01, 0.005)})
    r = model_quality.domain_rule(wrong)
    assert r["verdict"] == lab.FAILS and r["flips"] and r["wrong_way"]
    same = _udom({("reference", "w4a16:g128"): (0.020, 0.002), ("reference", "w4a8"): (0.022, 0.002),
                  ("prose", "w4a16:g128"): (0.019, 0.002), ("prose", "w4a8"): (0.021, 0.002)})
    r = model_quality.domain_rule(same)
    assert r["verdict"] == lab.FAILS and not r["flips"] and not r["gaps"]["w4a8"]["beyond_2se"]
    # the expected direction on one text, within noise on the other: no verdict
    half = _udom({("reference", "w4a16:g128"): (0.05, 0.005), ("reference", "w4a8"): (0.02, 0.005),
                  ("prose", "w4a16:g128"): (0.020, 0.005), ("prose", "w4a8"): (0.022, 0.005)})
    assert model_quality.domain_rule(half)["verdict"] == lab.FAILS


def test_cold_reuse_counts_the_routed_cold_tokens_of_the_last_steps():
    from types import SimpleNamespace

    import torch

    from workbench.bench.tier_reuse import cold_reuse
    from workbench.kv.tier_config import TierConfig

    cfg = TierConfig(window=4, sink=0, rank=1, warm_tokens=0, chunk=4, block=4, budget=4)
    sel = torch.zeros(1, 1, 3, 8, dtype=torch.bool)      # queries 29, 30, 31 route blocks 0, 1, 2
    for q in range(3):
        sel[0, 0, q, q] = True
    cache = SimpleNamespace(cfg=cfg, model_cfg=SimpleNamespace(num_hidden_layers=1), last_selection={0: sel})
    # cold tokens at p: whole 4-token chunks ending at or before p - 3 -> 24, 24, 28 tokens
    assert cold_reuse(cache, 32, 3, last=3)["reuse"] == pytest.approx((4 / 24 + 8 / 24 + 12 / 28) / 3)
    assert cold_reuse(cache, 32, 3, last=1)["reuse"] == pytest.approx((4 / 24 + 4 / 24 + 4 / 28) / 3)
    cache.last_selection = {}                              # no routing: nothing fetched back
    assert cold_reuse(cache, 32, 3)["reuse"] == 0.0
