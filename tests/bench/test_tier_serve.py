"""A served run of the physical tiered cache: two `workbench serve --tiers` processes (accounted
and physical), streamed HTTP requests, the server's own memory gauges."""

from __future__ import annotations

import pytest

from workbench.bench.tier_serve import format_served_run, served_tier_run
from workbench.errors import WorkbenchError

TIER = dict(window=16, sink=4, rank=4, warm_tokens=16, chunk=8, block=8, budget=16, key_space="pre_rope")


def test_served_run_accounted_vs_physical(bundled_llm):
    res = served_tier_run(stores=("accounted", "host"), tier=TIER, requests=3, concurrency=3, prompt_tokens=96,
                          max_tokens=6, sample_s=0.01)
    acc, host = res["runs"]
    assert acc["errors"] == host["errors"] == [] and acc["tokens"] == host["tokens"] == 18
    assert res["identical_texts"]                      # the physical cache is bit-identical to the accounted one
    assert acc["memory_peak"] is None                  # the accounted cache has no memory gauges: it only counts
    m = host["memory_peak"]
    assert m["resident_kv"] == m["formula_kv"] < m["full"] and m["samples"] > 0
    assert host["prefetch"]["uses_total"] > 0 and 0 <= host["prefetch"]["hit_rate"] <= 1
    assert host["ttft_ms_p95"] >= host["ttft_ms_p50"] > 0 and host["tokens_per_s"] > 0
    text = format_served_run(res)
    assert "host" in text and "accounted" in text


def test_served_run_rejects_nonsense():
    with pytest.raises(WorkbenchError, match="requests and concurrency"):
        served_tier_run(requests=0)
