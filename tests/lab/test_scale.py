"""What a notebook scales down for a model, decided from its config alone."""

from __future__ import annotations

from workbench.lab.scale import CONTEXT_CAP, LARGE_RATIO, model_scale


def test_the_bundled_model_keeps_every_size():
    s = model_scale(None, "cpu")
    assert s.ratio == 1.0 and not s.large and s.context is None
    assert "sizes as written" in s.describe({"trace": "ignored"})


def test_a_large_model_on_a_cpu_scales_down_and_says_what():
    s = model_scale("preset:llama-3.2-1b", "cpu")
    assert s.ratio >= LARGE_RATIO and s.large
    assert s.context == min(CONTEXT_CAP, s.max_position_embeddings)
    text = s.describe({"trace": "7 requests (40)", "context": "1024 tokens"})
    assert "scaled down" in text and "  trace: 7 requests (40)" in text and "  context: 1024 tokens" in text
    assert "keeps its smoke sizes" in s.describe()


def test_a_gpu_runs_the_sizes_as_written():
    s = model_scale("preset:llama-3.2-1b", "cuda:0")
    assert not s.large and s.context is None
