"""workbench bench's text report: the fastest row's headline says when its perplexity is beyond the bound."""

from workbench.bench.vs_format import format_bench


def _row(rate, rel_ppl=None):
    return {"ttft_ms_p50": 5.0, "ttft_ms_jitter": 0.1, "decode_tokens_per_s_p50": rate, "decode_tokens_per_s_min": rate,
            "decode_tokens_per_s_max": rate, "decode_vs_transformers": rate / 100, "token_agreement_vs_reference": 1.0,
            "quality": "=" if rel_ppl is None else {"rel_ppl": rel_ppl, "rel_ppl_se": 0.001},
            "description": "d", "decode_verdict": "v", "first_divergence": []}


def _result(q_ppl):
    configs = {"reference": _row(100.0), "q:w8a8:head": _row(500.0, q_ppl)}
    return {"transformers_generate": _row(100.0), "model": "m", "device": "cpu", "device_name": "cpu",
            "dtype": "float32", "threads": 1,
            "config": {"prompt_tokens": 8, "max_tokens": 8, "num_prompts": 1, "repeats": 1},
            "backends": {"backends": "eager"}, "configs": configs, "decode_speedup": 1.0, "decode_verdict": "v",
            "ttft_ratio": 1.0, "ttft_verdict": "v", "greedy_token_agreement": 1.0, "fastest": "q:w8a8:head",
            "fastest_within_quality": "q:w8a8:head" if q_ppl <= 0.01 else "reference", "max_rel_ppl": 0.01,
            "vs_llamacpp": {}}


def test_the_fastest_line_flags_a_row_beyond_the_perplexity_bound():
    text = format_bench(_result(0.0309))
    assert "fastest configuration: q:w8a8:head (5.00x transformers; perplexity +3.09 %, beyond the +1 % bound)" in text
    assert "fastest within +1 % perplexity: reference" in text
    ok = format_bench(_result(0.002))
    assert "fastest configuration: q:w8a8:head (5.00x transformers)" in ok
