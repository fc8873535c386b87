"""The rows of ``workbench bench`` (:mod:`workbench.bench.vs_transformers`): per batch size each
configuration's statistics against transformers (ratio, verdict, greedy agreement and the logit
margin at each first divergence), the paged pool against contiguous KV; the quantized rows'
perplexity against the unquantized model, the fastest row within quality, and the run's result
(:class:`~workbench.bench.vs_types.BenchResult`; also what a partial save writes)."""

from __future__ import annotations

import statistics

from workbench.bench.vs_configs import LLAMACPP
from workbench.bench.vs_types import BenchResult
from workbench.engine.llm import LLM
from workbench.engine.metrics import jitter

# (paged side, contiguous side) compared at every batch size
PAGED_PAIRS = (("paged+compile", "compile"), ("paged+graphs", "cuda-graphs"))


def _batch_rows(llm: LLM, raw: dict, tokens: dict, groups: list, info: dict, ours: dict) -> dict:
    """One batch size's rows: stats per side, each configuration against transformers (ratio and
    verdict), its greedy agreement with the reference configuration and with transformers (and the
    logit margin at each first divergence), the fastest, the paged pool against contiguous KV."""
    from workbench.measure.agreement import agreement, divergence_margin
    from workbench.measure.compare import compare_samples

    stats = {side: _stats(rows) for side, rows in raw.items()}
    rates = {side: [x["decode_tokens_per_s"] for x in rows] for side, rows in raw.items()}
    prompts = [p for g in groups for p in g]
    configs = {}
    for name in (n for n in ours if n in raw):
        cmp = compare_samples(rates[name], rates["transformers"], names=(name, "transformers.generate"),
                              metric="decode tokens/s", lower_is_better=False, better_word="faster")
        margins = [divergence_margin(llm.model, p, a, b) for p, a, b in zip(prompts, tokens["reference"], tokens[name])]
        configs[name] = {**stats[name], "description": info["described"][name],
                         "decode_vs_transformers": stats[name]["decode_tokens_per_s_p50"]
                         / stats["transformers"]["decode_tokens_per_s_p50"],
                         "decode_verdict": cmp.verdict, "decode_winner": cmp.winner,
                         "token_agreement_vs_reference": agreement(tokens["reference"], tokens[name])["rate"],
                         "token_agreement_vs_transformers": agreement(tokens["transformers"], tokens[name])["rate"],
                         "first_divergence": [m for m in margins if m is not None]}
    names_cmp = ("workbench", "transformers.generate")
    decode_cmp = compare_samples(rates["reference"], rates["transformers"], names=names_cmp, metric="decode tokens/s",
                                 lower_is_better=False, better_word="faster")
    ttft_cmp = compare_samples([x["ttft_ms"] for x in raw["reference"]], [x["ttft_ms"] for x in raw["transformers"]],
                               names=names_cmp, metric="TTFT", unit="ms")
    paged = {}
    for a, b in PAGED_PAIRS:
        if a in configs and b in configs:
            cmp = compare_samples(rates[a], rates[b], names=(a, b), metric="decode tokens/s", lower_is_better=False,
                                  better_word="faster")
            paged[f"{a} vs {b}"] = {"ratio": stats[a]["decode_tokens_per_s_p50"] / stats[b]["decode_tokens_per_s_p50"],
                                    "verdict": cmp.verdict, "winner": cmp.winner}
    return {"stats": stats, "configs": configs, "raw": raw, "paged_vs_contiguous": paged,
            "fastest": max(configs, key=lambda c: configs[c]["decode_tokens_per_s_p50"] if c not in LLAMACPP else -1),
            "reference_vs_hf": {"decode_verdict": decode_cmp.verdict, "ttft_verdict": ttft_cmp.verdict,
                                "decode_winner": decode_cmp.winner, "ttft_winner": ttft_cmp.winner},
            "reference_agreement": agreement(tokens["reference"], tokens["transformers"])["rate"]}


def _result(head: dict, batches: list[int], per_batch: dict, quality: dict, max_rel_ppl: float, llm: LLM,
            skipped: dict) -> BenchResult:
    """:func:`run_bench`'s result from the run's facts (``head``), each batch size's rows
    (:func:`_batch_rows`; the smallest size is the top level), the quantized rows' perplexity
    (``quality``; ``{}``: not measured yet) and the sides not measured (``skipped``: name -> why)."""
    for pb in per_batch.values():
        for name, c in pb["configs"].items():
            c["quality"] = quality.get(name) if name.startswith("q:") else "the reference's weights"
    first = per_batch[batches[0]]
    res, configs = first["stats"], first["configs"]
    raw = first["raw"]
    front_overhead = None
    if "loop" in configs:                # what the LLM front + engine add to each token, vs the bare loop
        from workbench.measure.compare import compare_samples

        ref_rates = [x["decode_tokens_per_s"] for x in raw["reference"]]
        cmp = compare_samples([1e3 / x for x in ref_rates], [1e3 / x["decode_tokens_per_s"] for x in raw["loop"]],
                              names=("engine (reference)", "bare loop"), metric="ms per decode token", unit="ms")
        ms_ref = 1e3 / res["reference"]["decode_tokens_per_s_p50"]
        ms_loop = 1e3 / res["loop"]["decode_tokens_per_s_p50"]
        front_overhead = {"engine_ms_per_token": ms_ref, "loop_ms_per_token": ms_loop,
                          "overhead_ms_per_token": ms_ref - ms_loop,
                          "overhead_pct": 100 * (ms_ref - ms_loop) / ms_loop, "verdict": cmp.verdict}
    return BenchResult(
        **head,
        batch=batches[0], workbench=res["reference"], transformers_generate=res["transformers"],
        decode_speedup=res["reference"]["decode_tokens_per_s_p50"] / res["transformers"]["decode_tokens_per_s_p50"],
        ttft_ratio=res["reference"]["ttft_ms_p50"] / res["transformers"]["ttft_ms_p50"],
        **first["reference_vs_hf"],
        greedy_token_agreement=first["reference_agreement"],
        configs=configs, skipped=skipped,
        fastest=max(configs, key=lambda c: configs[c]["decode_tokens_per_s_p50"] if c not in LLAMACPP else -1),
        **_fastest_within(configs, max_rel_ppl),
        backends=_backends_row(llm.model), quality=quality,
        batches={str(b): {k: v for k, v in pb.items() if k in ("configs", "fastest", "paged_vs_contiguous")}
                 | {"transformers_generate": pb["stats"]["transformers"]} for b, pb in per_batch.items()},
        paged_vs_contiguous={str(b): pb["paged_vs_contiguous"] for b, pb in per_batch.items()
                             if pb["paged_vs_contiguous"]},
        raw=raw if len(batches) == 1 else {str(b): pb["raw"] for b, pb in per_batch.items()},
        front_overhead=front_overhead)


def bench_quality(llm: LLM, models: dict, windows: int, length: int = 256) -> dict:
    """Held-out perplexity of each quantized row's model against the unquantized one, paired token by
    token (:func:`workbench.bench.e2e_measure.numerics_quality`): relative change with its standard
    error, KL and top-1 agreement; ``{}`` without a tokenizer (a shape preset has no text to score)."""
    from workbench.bench.e2e_measure import numerics_quality, scored_logprobs
    from workbench.data import heldout_split

    if not models or llm.tokenizer is None or windows < 1:
        return {}
    length = min(length, llm.max_model_len)
    wins = heldout_split(llm.tokenizer, length)["evaluation"][:windows]
    ref = [scored_logprobs(llm.model, w, length - 1) for w in wins]
    return {name: numerics_quality(m, wins, ref, length - 1) for name, m in models.items()}


def _fastest_within(configs: dict, max_rel_ppl: float) -> dict:
    """The fastest of our rows whose held-out perplexity is within ``max_rel_ppl`` of the unquantized
    model (rows on its weights count as within; a quantized row without a measurement does not),
    and its decode rate as a fraction of each llama.cpp row's."""
    ok = [n for n, c in configs.items() if n not in LLAMACPP
          and (isinstance(c.get("quality"), str) or (isinstance(c.get("quality"), dict)
                                                    and c["quality"]["rel_ppl"] <= max_rel_ppl))]
    if not ok:
        return {"fastest_within_quality": None, "max_rel_ppl": max_rel_ppl, "vs_llamacpp": {}}
    best = max(ok, key=lambda n: configs[n]["decode_tokens_per_s_p50"])
    rate = configs[best]["decode_tokens_per_s_p50"]
    return {"fastest_within_quality": best, "max_rel_ppl": max_rel_ppl,
            "vs_llamacpp": {n: rate / configs[n]["decode_tokens_per_s_p50"] for n in LLAMACPP if n in configs}}


def _stats(rows: list[dict]) -> dict:
    return {"ttft_ms_p50": statistics.median(x["ttft_ms"] for x in rows),
            "decode_tokens_per_s_p50": statistics.median(x["decode_tokens_per_s"] for x in rows),
            "ttft_ms_jitter": jitter([x["ttft_ms"] for x in rows]),
            "decode_tokens_per_s_min": min(x["decode_tokens_per_s"] for x in rows),
            "decode_tokens_per_s_max": max(x["decode_tokens_per_s"] for x in rows)}


def _backends_row(model) -> dict:
    """The per-op backends of the measured model, as every benchmark row records them."""
    from workbench.transforms.backends import describe_backends

    return describe_backends(model)
