"""workbench.measure: the thread policy, the noise probe and the noise-aware comparison."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

import workbench
from workbench.errors import ConfigError
from workbench.model.decoder import CausalLM, init_weights
from workbench.measure import compare as C
from workbench.measure import threads as T
from workbench.measure.probe import last_probe, noise_probe


# ---- compare ------------------------------------------------------------------------------------
def test_separated_samples_give_a_verdict_with_the_ratio_of_medians():
    c = C.compare_samples([10.0, 11.0, 12.0], [30.0, 33.0, 36.0], names=("on", "off"), metric="TTFT", unit="ms",
                          noise=0.0)
    assert c.separated and c.winner == "on" and c.favours("on") and not c.favours("off")
    assert c.ratio == pytest.approx(33.0 / 11.0)
    assert c.verdict == "on lower by 3.00x"
    assert "on 11.0 ms [10.0..12.0]" in c.describe() and "3 runs each" in c.describe()


def test_overlapping_ranges_are_within_noise_whatever_the_medians_say():
    c = C.compare_samples([10.0, 20.0, 11.0], [12.0, 13.0, 14.0], names=("a", "b"), noise=0.0)
    assert c.ratio > 1.1 and not c.separated
    assert c.winner is None and c.verdict.startswith("within noise") and "ranges overlap" in c.verdict


def test_noise_floor_turns_a_small_separated_difference_into_within_noise():
    a, b = [100.0, 100.5, 101.0], [102.0, 102.5, 103.0]
    assert C.compare_samples(a, b, noise=0.0).winner == "A"
    c = C.compare_samples(a, b, noise=0.05)
    assert c.separated and c.winner is None and "noise floor" in c.verdict


def test_higher_is_better_metrics():
    c = C.compare_samples([200.0, 210.0, 205.0], [100.0, 105.0, 98.0], names=("engine", "hf"),
                          lower_is_better=False, better_word="faster", noise=0.0)
    assert c.winner == "engine" and c.verdict == "engine faster by 2.05x"
    assert c.ratio == pytest.approx(205.0 / 100.0)


def test_paired_rounds_survive_drift_that_makes_ranges_overlap():
    # The machine slows down over the run; B is 20 % slower than A in every round.
    drift = [1, 1.5, 2, 2.5, 3, 3.5]
    a = [10.0 * d for d in drift]
    b = [12.0 * d for d in drift]
    c = C.compare_samples(a, b, noise=0.0)
    assert not c.separated and c.paired and c.winner == "A"
    assert min(c.round_ratios) == pytest.approx(1.2)
    # five rounds are not enough for the paired rule
    assert C.compare_samples(a[:5], b[:5], noise=0.0).winner is None
    # a steady 1 % difference over 6 rounds is below a 5 % noise floor
    assert C.compare_samples(a, [x * 1.01 for x in a], noise=0.05).winner is None


@pytest.mark.parametrize("n", [1, 2])
def test_one_or_two_runs_a_side_never_give_a_verdict(n):
    c = C.compare_samples([1.0] * n, [100.0] * n, noise=0.0)
    assert not c.separated and c.winner is None
    assert c.verdict == f"within noise (100.00x, {n} run{'s' if n > 1 else ''} a side: too few for a verdict)"
    assert C.compare_samples([1.0] * 3, [100.0] * 3, noise=0.0).winner == "A"


def test_a_missing_measurement_is_a_clear_error():
    with pytest.raises(ValueError, match="side 'b', run 1: the measured value is None"):
        C.compare({"a": lambda: {"p95": 1.0}, "b": lambda: {"p95": None}}, repeats=1, key=lambda r: r["p95"], noise=0.0)


def test_compare_interleaves_the_sides_and_keeps_what_each_call_returned():
    calls = []

    def side(name, value):
        def run():
            calls.append(name)
            return {"v": value, "name": name}
        return run

    c = C.compare({"a": side("a", 1.0), "b": side("b", 2.0)}, repeats=4, warmup=1, key=lambda r: r["v"], noise=0.0)
    assert calls == ["a", "b", "a", "b", "b", "a", "a", "b", "b", "a"]
    assert c.samples == {"a": [1.0] * 4, "b": [2.0] * 4}
    assert [r["name"] for r in c.results["b"]] == ["b"] * 4
    d = c.as_dict()
    assert d["winner"] == "a" and d["median"] == {"a": 1.0, "b": 2.0} and json.dumps(d)
    assert c.row()["verdict"] == c.verdict


@pytest.mark.parametrize("kw, needle", [
    (dict(a=[], b=[1.0]), "no samples"),
    (dict(a=[1.0], b=[float("nan")]), "NaN"),
    (dict(a=[1.0], b=[2.0], names=("x", "x")), "different names"),
    (dict(a=[1.0], b=[2.0], noise=-0.1), "noise"),
])
def test_bad_samples_are_refused_with_a_clear_error(kw, needle):
    with pytest.raises(ValueError, match=needle):
        C.compare_samples(**kw)


def test_compare_refuses_other_than_two_sides_and_bad_repeats():
    with pytest.raises(ValueError, match="exactly two"):
        C.compare({"a": lambda: 1.0}, repeats=2)
    with pytest.raises(ValueError, match="repeats"):
        C.compare({"a": lambda: 1.0, "b": lambda: 2.0}, repeats=0)


# ---- probe --------------------------------------------------------------------------------------
def test_noise_probe_measures_a_spread_and_becomes_the_default_noise_floor(monkeypatch):
    from workbench.measure import probe as P

    monkeypatch.setattr(P, "_LAST", None)      # restored afterwards: other tests keep their floor
    p = noise_probe(repeats=8, task_ms=1.0)
    assert p.task_ms > 0 and p.spread >= p.iqr >= 0 and p.worst >= 1 and p.cores >= 1
    assert p.threshold == min(0.25, max(0.05, p.iqr))
    assert last_probe() is p
    assert "machine noise" in p.describe() and json.dumps(p.as_dict())
    c = C.compare({"a": lambda: 1.0, "b": lambda: 2.0}, repeats=3)
    assert c.noise == p.threshold
    assert C.compare_samples([1.0] * 3, [2.0] * 3).noise == p.threshold
    assert C.compare_samples([1.0] * 3, [2.0] * 3, noise=0.0).noise == 0.0
    with pytest.raises(ValueError, match="repeats"):
        noise_probe(repeats=2)


def test_a_bimodal_machine_caps_the_noise_floor(monkeypatch):
    from workbench.measure import probe as P

    monkeypatch.setattr(P, "_LAST", None)
    times = iter([0.016, 0.032] * 8)             # half the runs twice as slow
    monkeypatch.setattr(P, "_time", lambda fn, *a: next(times))
    monkeypatch.setattr(P, "_calibrate", lambda target: 1)
    p = P.noise_probe(repeats=16, parallel=False)
    assert p.iqr > 0.5 and p.threshold == P.MAX_THRESHOLD and "cap" in p.describe()


# ---- threads ------------------------------------------------------------------------------------
@pytest.mark.parametrize("steps, chosen", [
    ({1: 5.0, 2: 4.8}, 1),          # idle: equal -> fewer threads
    ({1: 5.0, 2: 15.0}, 1),         # a core is busy: one thread
    ({1: 10.0, 2: 5.5}, 2),         # a big model on idle cores: more threads clearly win
    ({1: 10.0, 2: 6.0, 4: 5.5}, 2),  # within 15 % of the fastest: the fewer
])
def test_pick_threads_takes_the_fewest_within_the_margin(steps, chosen):
    assert T.pick_threads(steps) == chosen


@pytest.mark.parametrize("value, expected", [(None, None), ("auto", None), (" AUTO ", None), (3, 3), ("2", 2)])
def test_parse_threads(value, expected):
    assert T.parse_threads(value) == expected


@pytest.mark.parametrize("value", [0, -1, "two", 1.5, True])
def test_parse_threads_refuses_bad_values(value):
    with pytest.raises(ConfigError, match="positive integer"):
        T.parse_threads(value, where="--threads")


def test_candidates_reach_every_available_core(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert T.candidate_threads(1) == [1]
    assert T.candidate_threads(2) == [1, 2]
    assert T.candidate_threads(6) == [1, 2, 4, 6]
    monkeypatch.setenv("OMP_NUM_THREADS", "2")          # a Ray task's CPUs: never measured past them
    assert T.candidate_threads(6) == [1, 2]
    monkeypatch.setenv("OMP_NUM_THREADS", "lots")       # not a count: ignored
    assert T.candidate_threads(6) == [1, 2, 4, 6]


@pytest.fixture
def keep_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_measured_policy_times_every_candidate_and_caches_per_model_shape(random_llm, monkeypatch, keep_threads):
    monkeypatch.delenv(T.ENV, raising=False)
    monkeypatch.setattr(T, "_CACHE", {})
    model = init_weights(CausalLM(random_llm.model.config)).eval()     # no engine chose for it yet
    choice = T.apply_thread_policy(model)
    assert choice.policy == "measured"
    assert set(choice.step_ms) == set(T.candidate_threads()) or choice.note == "one core available"
    if choice.step_ms:
        assert choice.threads == T.pick_threads(choice.step_ms)
        assert all(lo <= choice.step_ms[t] <= hi for t, (lo, hi) in choice.spread_ms.items())
    assert torch.get_num_threads() == choice.threads
    assert model.thread_choice is choice
    again = T.apply_thread_policy(model)
    assert again.policy == "inherited" and again.threads == choice.threads
    # another model object of the same shape: the process-wide cache, not a new measurement
    twin = init_weights(CausalLM(model.config)).eval()
    cached = T.apply_thread_policy(twin)
    assert cached.policy == "cached" and cached.threads == choice.threads and cached.step_ms == choice.step_ms
    # a different shape misses the cache and is measured
    other = init_weights(CausalLM(dataclasses.replace(model.config, num_hidden_layers=1))).eval()
    assert T.apply_thread_policy(other).policy in ("measured", "single candidate")
    assert T.apply_thread_policy(model, remeasure=True).policy in ("measured", "single candidate")
    assert choice.describe().startswith(f"{choice.threads} thread") and "measured in" in choice.describe()
    assert "measured in" not in cached.describe()


def test_an_engine_on_a_loaded_model_keeps_its_threads(random_llm, monkeypatch, keep_threads):
    # LLM(threads=2), then an engine built on its model (as prefix-bench and kv-inspect do): still 2
    monkeypatch.delenv(T.ENV, raising=False)
    model = init_weights(CausalLM(random_llm.model.config)).eval()
    workbench.LLM(model, tokenizer=random_llm.tokenizer, threads=2)
    paged = workbench.LLM(model, tokenizer=random_llm.tokenizer)
    assert (paged.threads, paged.thread_choice.policy) == (2, "inherited") and torch.get_num_threads() == 2


def test_a_failed_measurement_restores_the_thread_count(random_llm, monkeypatch, keep_threads):
    model = random_llm.model
    torch.set_num_threads(1)
    real, calls = model.forward, []

    def failing(*a, **k):
        calls.append(torch.get_num_threads())
        if len(calls) == 3:
            raise RuntimeError("boom")
        return real(*a, **k)

    monkeypatch.setattr(model, "forward", failing)
    with pytest.raises(RuntimeError, match="boom"):
        T._step_times(model, [2, 1], budget_s=0.05)
    assert calls[0] == 2 and torch.get_num_threads() == 1


def test_argument_beats_environment_beats_measurement(random_llm, monkeypatch, keep_threads):
    monkeypatch.setenv(T.ENV, "1")
    assert T.apply_thread_policy(random_llm.model).policy == "environment"
    assert torch.get_num_threads() == 1
    c = T.apply_thread_policy(random_llm.model, threads=2)
    assert (c.threads, c.policy) == (2, "argument") and torch.get_num_threads() == 2
    monkeypatch.setenv(T.ENV, "lots")
    with pytest.raises(ConfigError, match="WORKBENCH_THREADS"):
        T.apply_thread_policy(random_llm.model)


def test_llm_reports_its_threads_in_every_request_row(random_llm, keep_threads):
    llm = workbench.LLM(random_llm.model, tokenizer=random_llm.tokenizer, threads=1)
    assert llm.threads == 1 and llm.thread_choice.policy == "argument"
    out = llm.generate([[5, 6, 7]], workbench.SamplingParams(temperature=0, max_tokens=3))[0]
    assert out.metrics.threads == 1 and out.metrics.as_dict()["threads"] == 1
    assert (llm.requests_frame([out])["threads"] == 1).all()
    with pytest.raises(ConfigError, match="LLM\\(threads"):
        workbench.LLM(random_llm.model, threads=0)


def test_batched_engine_rows_and_server_header_carry_the_threads(random_llm, keep_threads):
    from workbench.engine import LLMEngine
    from workbench.serve.app import model_info

    llm = workbench.LLM(random_llm.model, tokenizer=random_llm.tokenizer, threads=1)
    eng = LLMEngine(llm)
    out = eng.generate([[5, 6, 7]], workbench.SamplingParams(temperature=0, max_tokens=2))[0]
    assert out.metrics.threads == 1

    class _Async:      # model_info reads only .engine
        engine = eng
    info = model_info(_Async(), "test")
    assert info["threads"] == 1 and info["threads_policy"] == "argument"
    with pytest.raises(ConfigError, match="threads"):
        LLMEngine(llm, threads=2)     # a loaded LLM has chosen already


def test_cli_threads_flag_reaches_bench_json_and_bad_values_exit_2(capsys, monkeypatch, keep_threads):
    from workbench.cli.main import main

    monkeypatch.setenv(T.ENV, "auto")      # restored afterwards: main() sets it from --threads
    rc = main(["bench", "--model", "preset:tiny", "--device", "cpu", "--prompt-tokens", "8", "--max-tokens", "4",
               "--num-prompts", "1", "--repeats", "1", "--threads", "1", "--json"])
    assert rc == 0
    res = json.loads(capsys.readouterr().out)
    assert res["threads"] == 1 and res["threads_policy"]["policy"] == "argument"
    # one prompt x one repeat: one run a side, never a verdict
    assert res["decode_verdict"].startswith("within noise") and "too few" in res["decode_verdict"]
    assert res["decode_winner"] is None and 0.05 <= res["noise"]["threshold"] <= 0.25
    assert main(["bench", "--model", "preset:tiny", "--threads", "0"]) == 2
    assert "--threads" in capsys.readouterr().err


def test_measurement_cost_is_bounded_for_a_slow_model(random_llm, monkeypatch, keep_threads):
    # A model whose forward takes ~30 ms: 4 x the 0.05 s budget stops after the first round.
    model = random_llm.model
    real = model.forward

    def slow(*a, **k):
        import time
        time.sleep(0.03)
        return real(*a, **k)

    monkeypatch.setattr(model, "forward", slow)
    times = T._step_times(model, [1, 2], budget_s=0.05)
    assert all(len(v) >= 1 for v in times.values())
    assert all(len(v) < 3 for v in times.values())
    assert all(math.isfinite(x) for v in times.values() for x in v)


def test_quantile_comparison_uses_bootstrap_intervals_of_one_run_each():
    import random

    rng = random.Random(0)
    fast = [rng.uniform(10, 20) for _ in range(60)]
    slow = [rng.uniform(40, 80) for _ in range(60)]
    c = C.compare_quantile(fast, slow, q=0.95, names=("guard", "no guard"), metric="P95 TTFT", unit="ms", noise=0.05)
    lo, hi = c.spread("guard")
    assert lo <= c.median("guard") <= hi and hi < c.spread("no guard")[0]
    assert c.winner == "guard" and "bootstrap 90% intervals" in c.describe()
    assert c.round_ratios == [] and not c.paired
    same = C.compare_quantile(fast, [v * 1.01 for v in fast], noise=0.0)
    assert same.winner is None and same.verdict.startswith("within noise")
    again = C.compare_quantile(fast, slow, q=0.95, noise=0.05)
    assert again.spread("A") == c.spread("guard")          # seeded: the same intervals every time
    with pytest.raises(ValueError, match="at least 5"):
        C.compare_quantile([1.0, 2.0], slow)
