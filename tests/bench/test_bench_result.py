"""workbench bench's result: a BenchResult whose as_dict() is the --json object (same keys, same order) and
which reads like that dict (result["key"], .get, in, iteration)."""

import json

import pytest

from workbench.bench.vs_format import format_bench
from workbench.bench.vs_results import _result, _stats
from workbench.bench.vs_types import BenchResult

# the keys of `workbench bench --json --raw`, in order, as scripts and the claims code read them
JSON_KEYS = ["model", "device", "device_name", "dtype", "threads", "threads_policy", "noise", "torch", "transformers",
             "config", "batch", "workbench", "transformers_generate", "decode_speedup", "ttft_ratio", "decode_verdict",
             "ttft_verdict", "decode_winner", "ttft_winner", "greedy_token_agreement", "configs", "skipped", "fastest",
             "fastest_within_quality", "max_rel_ppl", "vs_llamacpp", "backends", "quality", "batches",
             "paged_vs_contiguous", "raw", "front_overhead"]


@pytest.fixture(scope="module")
def llm():
    from workbench.engine.llm import LLM

    return LLM("preset:tiny", device="cpu")


def _raw(*rates):
    return [{"repeat": 0, "prompt": i, "ttft_ms": 1e3 / r, "decode_tokens_per_s": r} for i, r in enumerate(rates)]


def _batch(sides: dict) -> dict:
    """One batch size's rows as _batch_rows builds them, from decode rates per side."""
    raw = {name: _raw(*rates) for name, rates in sides.items()}
    stats = {name: _stats(rows) for name, rows in raw.items()}
    hf = stats["transformers"]["decode_tokens_per_s_p50"]
    configs = {name: {**stats[name], "description": name,
                      "decode_vs_transformers": stats[name]["decode_tokens_per_s_p50"] / hf, "decode_verdict": "v",
                      "decode_winner": None, "token_agreement_vs_reference": 1.0,
                      "token_agreement_vs_transformers": 1.0, "first_divergence": []}
               for name in sides if name != "transformers"}
    return {"stats": stats, "configs": configs, "raw": raw, "paged_vs_contiguous": {},
            "fastest": max(configs, key=lambda c: configs[c]["decode_tokens_per_s_p50"]),
            "reference_vs_hf": {"decode_verdict": "dv", "ttft_verdict": "tv", "decode_winner": "workbench",
                                "ttft_winner": None},
            "reference_agreement": 0.75}


HEAD = {"model": "preset:tiny", "device": "cpu", "device_name": "cpu", "dtype": "float32", "threads": 1,
        "threads_policy": {"policy": "argument"}, "noise": {"threshold": 0.05}, "torch": "t", "transformers": "hf",
        "config": {"prompt_tokens": 8, "max_tokens": 4, "num_prompts": 2, "repeats": 1}}


def test_as_dict_is_the_json_object_with_its_keys_in_order(llm):
    per_batch = {1: _batch({"reference": [40, 60], "loop": [80, 100], "transformers": [20, 30]}),
                 4: _batch({"reference": [50, 50], "loop": [90, 90], "transformers": [100, 100]})}
    res = _result(HEAD, [1, 4], per_batch, {}, 0.01, llm, {"llama.cpp": "not installed"})
    assert isinstance(res, BenchResult)
    d = res.as_dict()
    assert list(d) == JSON_KEYS == list(res) and len(res) == len(JSON_KEYS)
    assert json.loads(json.dumps(d)) == d                                      # JSON-ready as it is
    # typed fields and the dict view are the same values
    assert res.decode_speedup == res["decode_speedup"] == 50 / 25
    assert res.ttft_ratio == pytest.approx(res.workbench["ttft_ms_p50"] / res.transformers_generate["ttft_ms_p50"])
    assert (res.decode_verdict, res.ttft_winner, res.greedy_token_agreement) == ("dv", None, 0.75)
    assert res.fastest == "loop" == res.fastest_within_quality and res.skipped == {"llama.cpp": "not installed"}
    assert list(res.batches) == ["1", "4"] and list(res.raw) == ["1", "4"] and res.batch == 1
    assert res.configs["loop"]["quality"] == "the reference's weights"
    assert res.front_overhead["overhead_ms_per_token"] == pytest.approx(1e3 / 50 - 1e3 / 90)
    assert res.get("front_overhead") is res.front_overhead and "front_overhead" in res
    assert format_bench(res) == format_bench(json.loads(json.dumps(d)))     # the table from either


def test_without_the_bare_loop_there_is_no_front_overhead_key(llm):
    res = _result(HEAD, [1], {1: _batch({"reference": [40], "transformers": [20]})}, {}, 0.01, llm, {})
    assert res.front_overhead is None and "front_overhead" not in res and res.get("front_overhead", 7) == 7
    assert list(res.as_dict()) == JSON_KEYS[:-1] == list(res) and len(res) == len(JSON_KEYS) - 1
    with pytest.raises(KeyError):
        res["front_overhead"]
    with pytest.raises(KeyError):
        res["no such key"]
    assert list(res.raw) == ["reference", "transformers"]                    # one batch size: its rows directly
    assert "fastest configuration: reference (2.00x transformers)" in format_bench(res)
