"""``workbench bench``'s text report (:mod:`workbench.bench.vs_transformers`): one line per side,
the verdicts, first divergences, the front's overhead, the fastest rows, the other batch sizes."""

from __future__ import annotations

from collections.abc import Mapping


def _ppl_text(q) -> str:
    """A row's perplexity against the unquantized model: ``+0.3% +-0.2`` (or "=" for the same weights)."""
    if isinstance(q, dict):
        return f"{100 * q['rel_ppl']:+.2f}% +-{100 * q['rel_ppl_se']:.2f}"
    return "=" if isinstance(q, str) else "-"


def format_bench(res: Mapping) -> str:
    """The table ``workbench bench`` prints, from :func:`~workbench.bench.vs_transformers.run_bench`'s
    :class:`~workbench.bench.vs_types.BenchResult` or its JSON (``workbench bench --json`` read back):
    both are read by key."""
    h = res["transformers_generate"]
    lines = [f"model {res['model']} on {res['device']} ({res['device_name']}), {res['dtype']}, "
             f"{res['threads']} threads; prompt {res['config']['prompt_tokens']} tokens, "
             f"{res['config']['max_tokens']} new tokens, {res['config']['num_prompts']} prompts x "
             f"{res['config']['repeats']} repeats; workbench backends: {res['backends']['backends']}"
             + (" (Triton interpreter)" if res["backends"].get("triton_interpreter") else ""),
             f"{'engine':<24}{'TTFT p50 ms':>14}{'TTFT jitter':>13}{'decode tok/s p50':>18}{'min..max':>18}"
             f"{'vs HF':>8}{'agree':>8}{'ppl vs fp32':>17}"]
    rows = [(name, c, f"{c['decode_vs_transformers']:.2f}x", f"{c['token_agreement_vs_reference']:.0%}",
             _ppl_text(c.get("quality"))) for name, c in res["configs"].items()]
    rows += [("transformers.generate", h, "1.00x", "", "")]
    for name, r, ratio, agree, ppl in rows:
        lines.append(f"{name:<24}{r['ttft_ms_p50']:>14.2f}{r['ttft_ms_jitter']:>13.2f}"
                     f"{r['decode_tokens_per_s_p50']:>18.1f}"
                     f"{r['decode_tokens_per_s_min']:>9.1f}..{r['decode_tokens_per_s_max']:<8.1f}{ratio:>8}{agree:>8}"
                     f"{ppl:>17}")
    lines.append(f"decode speed-up (reference configuration / transformers): {res['decode_speedup']:.2f}x "
                 f"({res['decode_verdict']}); TTFT ratio: {res['ttft_ratio']:.2f} ({res['ttft_verdict']}); "
                 f"greedy token agreement: {res['greedy_token_agreement']:.1%}")
    for name, c in res["configs"].items():
        if name != "reference":
            lines.append(f"  {name}: {c['description']}; {c['decode_verdict']}")
            for d in c["first_divergence"]:
                lines.append(f"    first divergence at token {d['position']}: margin {d['margin']:.2e} "
                             f"(reference top-2 gap {d['top2_gap']:.2e})")
    for name, why in res.get("skipped", {}).items():
        lines.append(f"  {name}: not measured ({why})")
    fo = res.get("front_overhead")
    if fo:
        lines.append(f"LLM front + engine per decode token: {fo['engine_ms_per_token']:.3f} ms vs the bare loop "
                     f"{fo['loop_ms_per_token']:.3f} ms: {fo['overhead_ms_per_token']:+.3f} ms "
                     f"({fo['overhead_pct']:+.0f}%; {fo['verdict']})")
    fast = res["configs"][res["fastest"]]
    q = fast.get("quality")
    over = (f"; perplexity {100 * q['rel_ppl']:+.2f} %, beyond the +{100 * res['max_rel_ppl']:g} % bound"
            if isinstance(q, dict) and res.get("max_rel_ppl") is not None and q["rel_ppl"] > res["max_rel_ppl"] else "")
    lines.append(f"fastest configuration: {res['fastest']} ({fast['decode_vs_transformers']:.2f}x transformers{over})")
    best = res.get("fastest_within_quality")
    if best and (best != res["fastest"] or res.get("vs_llamacpp")):
        c = res["configs"][best]
        lines.append(f"fastest within +{100 * res['max_rel_ppl']:g} % perplexity: {best} "
                     f"({c['decode_vs_transformers']:.2f}x transformers"
                     + "".join(f"; {r:.2f}x {n}" for n, r in res["vs_llamacpp"].items()) + ")")
    for b, pb in res.get("batches", {}).items():
        if int(b) == res.get("batch", 1):
            continue
        h = pb["transformers_generate"]
        lines.append(f"batch {b} (prompts submitted together; the reference configuration runs them one at a time):")
        for name, r in [*pb["configs"].items(), ("transformers.generate", h)]:
            ratio = f"{r['decode_vs_transformers']:.2f}x" if "decode_vs_transformers" in r else "1.00x"
            agree = f"{r['token_agreement_vs_reference']:.0%}" if "token_agreement_vs_reference" in r else ""
            lines.append(f"  {name:<22}{r['ttft_ms_p50']:>14.2f}{r['ttft_ms_jitter']:>13.2f}"
                         f"{r['decode_tokens_per_s_p50']:>18.1f}{r['decode_tokens_per_s_min']:>9.1f}.."
                         f"{r['decode_tokens_per_s_max']:<8.1f}{ratio:>8}{agree:>8}")
    for b, pairs in res.get("paged_vs_contiguous", {}).items():
        for pair, c in pairs.items():
            lines.append(f"batch {b}: {pair}: decode {c['ratio']:.2f}x ({c['verdict']})")
    pol = res.get("threads_policy") or {}
    if pol.get("step_ms"):
        steps = ", ".join(f"{t}: {ms:.2f} ms" for t, ms in pol["step_ms"].items())
        lines.append(f"threads: {res['threads']} ({pol['policy']}; decode step by thread count {steps})")
    return "\n".join(lines)
