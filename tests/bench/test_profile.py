"""Decode-step profile: every component measured, the parts never exceed the whole."""

from __future__ import annotations

import pytest

pytest.importorskip("pandas")

import workbench  # noqa: E402
from workbench.bench.profile import COMPONENTS, describe_overhead, op_profile, profile_decode_step  # noqa: E402

PROMPT = [3, 17, 42, 99, 7, 256, 1, 11]


@pytest.fixture(scope="module")
def llm():
    return workbench.LLM("preset:tiny")


def test_breakdown_rows_and_invariants(llm):
    df = profile_decode_step(llm, PROMPT, steps=6, warmup=1)
    assert list(df.index) == list(COMPONENTS)
    assert (df["ms"] >= 0).all() and (df["share"] >= 0).all()
    assert df["share"].sum() == pytest.approx(1.0, abs=1e-9)
    a = df.attrs
    parts = df.drop(index="other")["ms"].sum()
    assert parts <= a["hooked_step_ms"] + 1e-9 or df.loc["other", "ms"] == 0.0
    assert a["plain_step_ms"] > 0 and a["hooked_step_ms"] > 0
    assert a["hook_overhead_ms"] == pytest.approx(a["hooked_step_ms"] - a["plain_step_ms"])
    assert a["prompt_tokens"] == len(PROMPT) and a["steps"] == 6
    # every hooked module ran once per step: 2 layers in the tiny preset
    layers = llm.model.config.num_hidden_layers
    assert df.loc["attention", "calls_per_step"] == layers + 1       # + the shared RoPE table lookup
    assert df.loc["mlp", "calls_per_step"] == layers
    assert df.loc["norm", "calls_per_step"] == 2 * layers + 1
    assert df.loc["embedding", "calls_per_step"] == df.loc["lm_head", "calls_per_step"] == 1
    assert "hooks add" in describe_overhead(df)


def test_hooks_are_removed_and_generation_unchanged(llm):
    params = workbench.SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    before = llm.generate([PROMPT], params)[0].token_ids
    profile_decode_step(llm, PROMPT, steps=2, warmup=0)
    for m in llm.model.modules():
        assert not m._forward_hooks and not m._forward_pre_hooks
    assert llm.generate([PROMPT], params)[0].token_ids == before


def test_too_many_steps_is_a_clear_error(llm):
    with pytest.raises(workbench.WorkbenchError, match="context"):
        profile_decode_step(llm, PROMPT, steps=2000)


def test_op_profile_top_ops(llm):
    df = op_profile(llm, PROMPT, steps=2, top=5)
    assert 0 < len(df) <= 5
    assert (df["self_cpu_ms_per_step"] >= 0).all()
    assert df["self_cpu_ms_per_step"].is_monotonic_decreasing
