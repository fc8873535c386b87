"""What a notebook scales down for a model, decided from its config alone."""

from __future__ import annotations

from workbench.lab.scale import CONTEXT_CAP, H100_BYTES, LARGE_RATIO, memory_fit, model_scale


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


def test_memory_fit_is_weights_plus_kv_by_formula():
    # Llama-3-8B in bf16: 8.03e9 parameters x 2 B, 32 layers x 8 KV heads x 128 x 2 (K, V) x 2 B = 128 KiB a token
    m = memory_fit("preset:llama-3-8b", kv_tokens=8192, weight_copies=2)
    assert m.weights == 2 * 2 * 8_030_261_248 and m.kv == 8192 * 128 * 1024
    assert m.fits and m.budget == H100_BYTES and "fits in 80 GB" in m.describe()
    assert not memory_fit("preset:llama-3-8b", kv_tokens=600_000).fits          # 79 GB of KV alone
    assert "does NOT fit" in memory_fit("preset:llama-3-8b", kv_tokens=600_000).describe()
    assert memory_fit(None, kv_tokens=24_000, weight_copies=2).total < 1e9     # the bundled model: a rounding error
