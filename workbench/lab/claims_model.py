"""Claims of the source articles (see workbench.lab.claims): the model, its KV memory and its
precision -- measured on this machine's CPU with the bundled model (and, where the claim is
arithmetic about a real checkpoint's shape, a real allocation of that shape).

Each claim has a *rule* (a pure function of the measured numbers, unit-tested on synthetic
inputs: :func:`share_rule`, :func:`slope_rule`, :func:`kv_size_rule`, :func:`release_rule`,
:func:`reuse_rule`, :func:`domain_rule`) and a *measurement* (``measure_*``, on ``ctx.llm()``'s
model) that feeds it.  The measurements live in ``workbench.bench`` (``request_profile``,
``prefill_scaling``, ``kv_sizing``, ``request_memory``, ``tier_reuse``) and
``workbench.quant.calibrate_report``; this module only sizes them by mode, states the rule and
words the finding.
"""

from __future__ import annotations

import math
import statistics
from contextlib import contextmanager

from workbench.lab.claims import FAILS, HOLDS, Claim, ClaimContext, Finding

GB, GiB, MiB = 1e9, 2 ** 30, 2 ** 20


def _pct(x: float | None, digits: int = 1) -> str:
    return "n/a" if x is None else f"{100 * x:.{digits}f} %"


def _ms(s: float | None) -> str:
    return "n/a" if s is None else f"{s * 1e3:.3f} ms"


def _cap(text: str) -> str:
    return text[:1].upper() + text[1:]


@contextmanager
def _one_thread():
    """One torch thread while a quality-only measurement runs (its timing is not the point, and on a
    shared 2-core machine two threads can stall for minutes); the engine's choice is restored."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _prompt(ctx: ClaimContext, length: int, seed: int = 0) -> list[int]:
    """``length`` token ids of held-out text (random ids when the model has no tokenizer)."""
    llm = ctx.llm()
    if llm.tokenizer is not None:
        from workbench.data import heldout_token_windows

        w = heldout_token_windows(llm.tokenizer, 1, length, seed=seed)
        if w:
            return w[0]
    import random

    rng = random.Random(seed)
    return [rng.randrange(1, llm.model.config.vocab_size) for _ in range(length)]


def _reference_engine(ctx: ClaimContext, kv="contiguous"):
    """A new engine on the shared model: one request at a time, the whole prompt in one step."""
    from workbench.engine.core import LLMEngine
    from workbench.engine.llm import reference_scheduler

    loaded = ctx.llm().loaded
    return LLMEngine(loaded, kv=kv, scheduler=reference_scheduler(loaded.max_model_len))


# =====================================================================================================
# 11. compute_share -- B §2.1: pure compute is 36 % of a 1K-token request's end-to-end time
# =====================================================================================================

CLAIMED_COMPUTE_SHARE = 0.36
PRIMARY_SETTING = "in-process"      # declared in advance: the verdict's setting in both modes (HTTP is reported)


def share_rule(shares: list[float], claimed: float, noise: float) -> tuple[str, str]:
    """The measured forward share of E2E against ``claimed``: ``does not hold`` when every share lies
    beyond ``claimed`` by more than the noise floor on one side (above ``claimed x (1 + noise)`` or
    below ``claimed / (1 + noise)``), ``holds`` when ``claimed`` lies within the measured range
    widened by ``1 + noise``.  Both ways: the figure ruled on is the one measured (the forward's
    share), not the article's 'pure compute', which the forward only bounds from above."""
    lo, hi = min(shares), max(shares)
    if lo > claimed * (1 + noise):
        return FAILS, (f"every request spent more than the claimed {_pct(claimed, 0)} of its E2E in the model's forward "
                       f"(lowest {_pct(lo)}, above {_pct(claimed, 0)} x (1 + {noise:.0%} noise))")
    if hi < claimed / (1 + noise):
        return FAILS, (f"every request spent less than the claimed {_pct(claimed, 0)} of its E2E in the model's forward "
                       f"(highest {_pct(hi)}, below {_pct(claimed, 0)} / (1 + {noise:.0%} noise))")
    return HOLDS, (f"the claimed {_pct(claimed, 0)} lies within the measured forward shares {_pct(lo)}..{_pct(hi)} "
                   f"widened by the {noise:.0%} noise floor")


def pure_compute_bound(shares: list[float], claimed: float, noise: float) -> str:
    """What the forward share says about the article's *pure compute* share, which it bounds from
    above (pure compute <= forward; overhead outside the model <= the article's overhead): only a
    forward share below ``claimed`` beyond noise says something (pure compute is below it too)."""
    hi = max(shares)
    if hi < claimed / (1 + noise):
        return (f"since pure compute is at most the forward, it is below {_pct(claimed, 0)} here too (the overhead is "
                f"above {_pct(1 - claimed, 0)})")
    return (f"a forward share at or above {_pct(claimed, 0)} says nothing about the article's 'pure compute' (the "
            f"forward includes dispatch and Python inside the model, so it is only an upper bound on pure compute, and "
            f"the {_pct(1 - max(shares))}..{_pct(1 - min(shares))} outside the model only a lower bound on the "
            f"article's {_pct(1 - claimed, 0)} overhead)")


def measure_compute_share(ctx: ClaimContext) -> Finding:
    from workbench.bench.request_profile import (
        forward_timer,
        http_request,
        request_breakdown,
    )
    from workbench.engine.sampling import SamplingParams

    llm = ctx.llm()
    loaded = llm.loaded
    n_new = ctx.size(8, 24)
    plen = min(1000, loaded.max_model_len - n_new)
    prompt = _prompt(ctx, plen)
    repeats = ctx.size(3, 5)
    engine = _reference_engine(ctx)
    params = SamplingParams(temperature=0, max_tokens=n_new, ignore_eos=True)
    http_rows: list[dict] = []
    with forward_timer(loaded.model) as ft:
        request_breakdown(engine, prompt, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), ft)  # warm-up
        rows = [request_breakdown(engine, prompt, params, ft) for _ in range(repeats)]
        if not ctx.smoke:            # the same request over HTTP (the server on a thread of this process): reported
            from workbench.serve.server import start_server

            with start_server(_reference_engine(ctx), model_name="claims") as srv:
                http_request(srv.base_url, "claims", prompt, 2, ft)              # warm-up
                http_rows = [http_request(srv.base_url, "claims", prompt, n_new, ft) for _ in range(repeats)]
    noise = ctx.noise
    shares = [r["forward_share"] for r in rows]
    verdict, why = share_rule(shares, CLAIMED_COMPUTE_SHARE, noise)          # the primary setting only
    bound = pure_compute_bound(shares, CLAIMED_COMPUTE_SHARE, noise)
    h_shares = [r["forward_share"] for r in http_rows]
    med = {k: statistics.median(r[k] / r["e2e_s"] for r in rows) for k in
           ("forward_s", "sampling_s", "schedule_s", "post_s", "outside_s")}
    e2e_ms = statistics.median(r["e2e_s"] for r in rows) * 1e3
    fig = (f"forward {_pct(statistics.median(shares))} of E2E in-process ({_pct(min(shares))}..{_pct(max(shares))}), "
           f"outside the model {_pct(1 - statistics.median(shares))}"
           + (f"; over HTTP {_pct(statistics.median(h_shares))} ({_pct(min(h_shares))}..{_pct(max(h_shares))}, "
              "reported)" if h_shares else "")
           + f"; claimed {_pct(CLAIMED_COMPUTE_SHARE, 0)} / {_pct(1 - CLAIMED_COMPUTE_SHARE, 0)}")
    reason = (f"Checked here (the article: 'on an A100 80GB with 1K tokens of input, pure compute is only 36 % of the "
              f"end-to-end time, the other 64 % goes to data movement, memory copies and Python object lifetimes'): the "
              f"share of a ~1K-token request's end-to-end time spent in the model's forward calls for this engine on this "
              f"CPU, against 36 %.  Primary setting, declared in advance and the only one the verdict rests on: "
              f"{PRIMARY_SETTING} ({repeats} requests of {plen} prompt + {n_new} generated tokens, one at a time on the "
              f"reference configuration -- contiguous KV, {llm.threads} thread(s); E2E median {e2e_ms:.0f} ms -- after a "
              f"warm-up; hooks on the model time its {rows[0]['forward_calls']} forward calls per request).  Median "
              f"shares of E2E: forward {_pct(med['forward_s'])}, sampling and the token's host read "
              f"{_pct(med['sampling_s'])}, scheduler {_pct(med['schedule_s'], 2)}, detokenize / stop checks "
              f"{_pct(med['post_s'], 2)}, outside the steps {_pct(med['outside_s'], 2)}"
              + (f"; over HTTP (a non-streaming /v1/completions with the same token ids, timed at an httpx client, the "
                 f"server on a thread of this process) forward is {_pct(statistics.median(h_shares))} of the client's "
                 f"E2E -- reported, not ruled on" if h_shares else "; over HTTP: reported in full mode, not ruled on")
              + f".  {_cap(why)}: {verdict} here.  About the article's figure: {bound}.  The A100 part is a GPU "
              "question: there the forward is far faster while host-side costs are not (the engine vs the bare loop "
              "in results/gpu engine_bench).")
    return Finding(verdict, fig, reason,
                   values={"claimed_share": CLAIMED_COMPUTE_SHARE, "primary": PRIMARY_SETTING, "shares": shares,
                           "noise": noise, "http_shares": h_shares, "median_shares": med,
                           "prompt_tokens": plen, "new_tokens": n_new, "e2e_ms_median": e2e_ms},
                   table=rows + [{"setting": "http", **r} for r in http_rows])


# =====================================================================================================
# 12. prefill_scaling -- B §2.1: 512 -> 2048 tokens, eager O(n^2), fused ~O(n)
# =====================================================================================================

SLOPE_BOUNDARY = 1.5      # halfway between linear (1) and quadratic (2) on a log-log plot


def slope_rule(eager: dict, fused: dict, boundary: float = SLOPE_BOUNDARY) -> tuple[str, str]:
    """``holds`` only when the per-round slopes are separated by ``boundary``: eager's lowest round
    above it (closer to O(n^2)) and fused's highest round below it (closer to O(n)).  A side whose
    rounds straddle the boundary is within noise: ``does not hold``, with the ranges."""
    e_lo, e_hi, f_lo, f_hi = eager["min"], eager["max"], fused["min"], fused["max"]
    ranges = f"eager rounds {e_lo:.2f}..{e_hi:.2f}, fused rounds {f_lo:.2f}..{f_hi:.2f}"
    parts = []
    if not e_lo > boundary:
        parts.append(f"eager's lowest round ({e_lo:.2f}) is not above {boundary}")
    if not f_hi < boundary:
        parts.append(f"fused's highest round ({f_hi:.2f}) is not below {boundary}")
    if parts:
        return FAILS, f"{'; '.join(parts)} (within noise: {ranges})"
    return HOLDS, f"every eager round's slope is above {boundary} and every fused round's below it ({ranges})"


def measure_prefill_scaling(ctx: ClaimContext) -> Finding:
    from workbench.bench.prefill_scaling import prefill_scaling
    from workbench.measure.compare import compare_samples

    model = ctx.llm().model
    lengths = ctx.size((256, 512, 768), (256, 512, 1024, 2048))
    fit = ctx.size((256, 512, 768), (512, 1024, 2048))           # at least 3 fit lengths in both modes
    res = prefill_scaling(model, lengths, repeats=3, fit_lengths=fit, threads=1)
    s, a = res["slopes"], res["attention_slopes"]
    verdict, why = slope_rule(s["math"], s["flash"])
    rows = {(r["backend"], r["tokens"]): r for r in res["rows"]}
    top = fit[-1]
    cmp = compare_samples(res["samples_ms"][f"math@{top}"], res["samples_ms"][f"flash@{top}"], names=("eager", "fused"),
                          noise=ctx.noise, metric=f"prefill of {top} tokens", unit="ms")
    em, fl = rows[("math", top)], rows[("flash", top)]
    beyond = res["beyond_context"]
    fig = (f"log-log slope {fit[0]}..{fit[-1]} tokens: eager {s['math']['of_medians']:.2f} "
           f"(rounds {s['math']['min']:.2f}..{s['math']['max']:.2f}), fused {s['flash']['of_medians']:.2f} "
           f"(rounds {s['flash']['min']:.2f}..{s['flash']['max']:.2f}); attention {_pct(em['attention_share'], 0)} / "
           f"{_pct(fl['attention_share'], 0)} of prefill at {top} tokens")
    reason = (f"Prefill of the bundled model (one call, fresh cache, {res['threads']} thread -- robust to a busy core --, "
              f"{res['dtype']}) at {', '.join(map(str, res['lengths']))} tokens, 3 interleaved rounds; 'eager' = torch "
              f"SDPA's math kernel (the [heads, n, n] score matrix materialised), 'fused' = its flash kernel (no score "
              f"matrix), chosen with sdpa_kernel around the unchanged model call; the slope of log time on log length is "
              f"fitted over {', '.join(map(str, fit))} (the article's range is 512..2048) per round; the verdict needs "
              f"the rounds' ranges separated by {SLOPE_BOUNDARY} (the fits through each length's fastest and median "
              f"round are reported).  {_cap(why)}: {verdict} here.  {cmp.describe()}.  "
              f"The attention core alone (RoPE, KV write and SDPA, timed in place by hooks: each self_attn minus its "
              f"projections) grows with slope {a['math']['of_medians']:.2f} eager and {a['flash']['of_medians']:.2f} fused: the flash kernel still does O(n^2) "
              f"FLOPs and only avoids the score matrix's memory traffic; the fused prefill grows near-linearly because its "
              f"attention is only {_pct(fl['attention_share'], 0)} of it at {top} tokens and the rest -- the linear layers "
              f"of this small model -- grows as O(n) (eager: attention {_pct(em['attention_share'], 0)} of the prefill).  At longer contexts the fused "
              f"attention share rises and its slope with it."
              + (f"  Lengths {beyond} exceed the model's trained context ({res['max_position_embeddings']}); they are "
                 f"timed only (the cost of a step does not depend on the values)." if beyond else
                 f"  The model's trained context is {res['max_position_embeddings']} tokens."))
    return Finding(verdict, fig, reason,
                   values={"slopes": s, "attention_slopes": a, "fit_lengths": fit, "lengths": res["lengths"],
                           "boundary": SLOPE_BOUNDARY, "comparison": cmp.as_dict(),
                           "max_position_embeddings": res["max_position_embeddings"], "beyond_context": beyond},
                   table=res["rows"])


# =====================================================================================================
# 13. kv_size_llama2_7b_32k -- B §2.2: ~18 GB of K+V at 32K tokens; 4 sequences at most on 80 GB
# =====================================================================================================

A100_80GB_BYTES = 81920 * MiB      # what nvidia-smi reports for an A100 80GB (80 GiB)


def kv_size_rule(exact_bytes: int, claimed_gb: float, weight_bytes: int, card_bytes: list[int], cap: int,
                 tolerance: float = 0.10) -> dict:
    """The size holds when ``claimed_gb`` (decimal GB) is within ``tolerance`` of the exact bytes;
    the cap holds when the memory sets exactly that cap: whole sequences of ``exact_bytes`` next to the
    weights number exactly ``cap`` on the largest reading of the card's capacity (so no reading allows
    more, and the cap is not lower than claimed on every reading).  Returns the verdict and the figures."""
    rel_gb = claimed_gb * GB / exact_bytes - 1
    rel_gib = claimed_gb * GiB / exact_bytes - 1
    fits = [int((c - weight_bytes) // exact_bytes) for c in card_bytes]
    size_ok = abs(rel_gb) <= tolerance
    cap_ok = max(fits) == cap
    why = []
    why.append(f"~{claimed_gb:g} GB is {rel_gb:+.1%} off the exact {exact_bytes / GB:.2f} GB "
               + ("(within" if size_ok else "(beyond") + f" {tolerance:.0%}); read as GiB it would be {rel_gib:+.1%}")
    why.append(f"sequences that fit beside {weight_bytes / GB:.2f} GB of weights: "
               + ", ".join(f"{n} in {c / GiB:.1f} GiB" for n, c in zip(fits, card_bytes))
               + (f" -- exactly {cap} at most" if cap_ok else
                  f" -- {'more' if max(fits) > cap else 'fewer'} than the claimed {cap}"))
    return {"verdict": HOLDS if size_ok and cap_ok else FAILS, "size_ok": size_ok, "cap_ok": cap_ok,
            "rel_gb": rel_gb, "rel_gib": rel_gib, "fits": fits, "why": "; ".join(why)}


def measure_kv_size(ctx: ClaimContext) -> Finding:
    from workbench.bench.kv_sizing import kv_size
    from workbench.model.presets import preset_config

    cfg = preset_config("llama-2-7b")
    tokens = 32768
    allocs = ctx.size([(1, 8192), (cfg.num_hidden_layers, 256)], [(1, tokens), (cfg.num_hidden_layers, 2048)])
    res = kv_size(cfg, tokens, "float16", allocs)
    exact = res["formula_bytes"]
    consistent = (res["layout_bytes"] == exact and res["per_layer_token_equal"]
                  and res["extrapolated_bytes"] == exact)
    weights = cfg.num_parameters() * 2
    cards = [A100_80GB_BYTES, int(80 * GB)]
    rule = kv_size_rule(exact, 18, weights, cards, 4)
    verdict = rule["verdict"] if consistent else FAILS
    a0 = res["allocations"][0]
    alloc_txt = "; ".join(f"{a['layers']} layer(s) x {a['tokens']:,} tokens: paged {a['paged_bytes'] / MiB:,.0f} MiB "
                          f"(tensor {a['paged_tensor_shape']}), contiguous {a['contiguous_bytes'] / MiB:,.0f} MiB, resident "
                          f"set +{(a['paged_rss_growth'] or 0) / MiB:,.0f} / +{(a['contiguous_rss_growth'] or 0) / MiB:,.0f} MiB"
                          for a in res["allocations"]) + " (a later allocation may reuse pages the allocator kept)"
    fig = (f"K+V of Llama-2-7B at 32K tokens, fp16: {exact / GB:.2f} GB = {exact / GiB:.2f} GiB (formula = layout = "
           f"allocation x {cfg.num_hidden_layers} layers); claimed ~18 GB ({rule['rel_gb']:+.1%}); fits beside "
           f"{weights / GB:.2f} GB of weights: {rule['fits'][0]} (80 GiB) / {rule['fits'][1]} (80x10^9 B); claimed cap 4")
    reason = (f"Formula {cfg.num_hidden_layers} layers x 2 x {cfg.num_key_value_heads} KV heads x {cfg.head_dim} x "
              f"{tokens:,} tokens x 2 bytes = {exact:,} B; workbench.kv.layout gives {res['layout_bytes']:,} B "
              f"({res['layout_bytes_per_token']:,} B per token).  Real allocations of the preset's shape on this CPU "
              f"(zero-filled, bytes from the tensors' storages): {alloc_txt}.  Each gives "
              f"{a0['bytes_per_layer_token']:,.0f} B per layer and token, so the full cache is that times "
              f"{cfg.num_hidden_layers} layers x {tokens:,} tokens -- a linear extrapolation, exact because every "
              f"allocation agrees on the per-(layer, token) figure"
              + ("" if consistent else " (IT DOES NOT: the package's layout disagrees with the formula)")
              + f".  {_cap(rule['why'])}.  Weights: {cfg.num_parameters():,} parameters x 2 bytes (fp16); activations "
              f"and workspace are not counted, so the real room is smaller still.  Verdict {verdict}: the claim is "
              "arithmetic on a published shape, so it is checked exactly, size and cap both: the cap holds when the most sequences that fit on either "
              "reading of the A100's 80 GB (the 81,920 MiB nvidia-smi reports, 80x10^9 B) is exactly 4.")
    return Finding(verdict, fig, reason,
                   values={"exact_bytes": exact, "exact_gb": exact / GB, "exact_gib": exact / GiB,
                           "layout_bytes": res["layout_bytes"], "extrapolated_bytes": res["extrapolated_bytes"],
                           "consistent": consistent, "weight_bytes": weights, **{k: v for k, v in rule.items() if k != "why"}},
                   table=res["allocations"])


# =====================================================================================================
# 14. request_memory_release -- B §3.2: 2.1 GB -> 0.8 GB per 1K-token request; released < 5 ms vs 1.2 s
# =====================================================================================================

INSTANT_S = 0.005
CLAIMED_BYTES = (2.1, 0.8)                       # GB per 1K-token request: old architecture, new
CLAIMED_BYTE_RATIO = CLAIMED_BYTES[0] / CLAIMED_BYTES[1]     # 2.625
BYTE_RATIO_TOLERANCE = 0.15                      # the article's GB are rounded to 0.1 (0.8 may be 0.75..0.85)


def release_rule(paged_release: list[float], contiguous_release: list[float], paged_bytes: int, contiguous_bytes: int,
                 noise: float, instant: float = INSTANT_S, claimed_ratio: float = CLAIMED_BYTE_RATIO,
                 tolerance: float = BYTE_RATIO_TOLERANCE) -> tuple[str, list[str]]:
    """All three parts must reproduce: the old layout (a contiguous cache) holds ``claimed_ratio`` x the
    paged request's KV bytes, within ``tolerance`` (exact bytes); the paged KV is verified free within
    ``instant`` of the request's end (every request; the times are upper bounds, so they can confirm
    'instant'); and the contiguous one's release is delayed -- beyond ``instant`` in every request and
    beyond the noise of the paged one."""
    from workbench.measure.compare import compare_samples

    parts, ok = [], True
    ratio = contiguous_bytes / paged_bytes
    if abs(ratio / claimed_ratio - 1) <= tolerance:
        parts.append(f"the contiguous cache holds {ratio:.2f}x the paged request's KV bytes, within {tolerance:.0%} of "
                     f"the claimed {claimed_ratio:.2f}x")
    else:
        ok = False
        parts.append(f"the contiguous cache holds {ratio:.2f}x the paged request's KV bytes, "
                     f"{ratio / claimed_ratio - 1:+.0%} off the claimed {claimed_ratio:.2f}x (beyond {tolerance:.0%})")
    if max(paged_release) < instant:
        parts.append(f"paged KV verified free within {_ms(max(paged_release))} of the end (< {instant * 1e3:g} ms)")
    else:
        ok = False
        parts.append(f"paged KV took up to {_ms(max(paged_release))} to be verified free (not < {instant * 1e3:g} ms)")
    delayed = min(contiguous_release) >= instant
    if len(paged_release) >= 3 and len(contiguous_release) >= 3:
        c = compare_samples(contiguous_release, paged_release, names=("contiguous", "paged"), noise=noise,
                            metric="release")
        delayed = delayed and c.winner == "paged"
    if delayed:
        parts.append(f"the contiguous cache's release is delayed ({_ms(min(contiguous_release))} or more)")
    else:
        ok = False
        parts.append(f"the contiguous cache is verified free within {_ms(max(contiguous_release))} too (no delayed "
                     "release)")
    return (HOLDS if ok else FAILS), parts


def _rss_text(rss_c: list[int], rss_p: list[int]) -> str:
    """The resident-set change after each layout's requests, in words."""
    if not rss_c or not rss_p:
        return "the process's resident set is not readable here (no /proc)"
    c, p = statistics.median(rss_c), statistics.median(rss_p)
    kept = ("the allocator keeps freed pages for reuse" if c > 0.5 * MiB else
            "the allocator returned the cache's pages, or reused pages it already held")
    return (f"right after the release the process's resident set is {c / MiB:+.1f} MiB from its level before a "
            f"contiguous request ({kept}) and {p / MiB:+.1f} MiB for a paged one (the pool is allocated already)")


def measure_request_memory(ctx: ClaimContext) -> Finding:
    from workbench.bench.request_memory import request_memory
    from workbench.engine.sampling import SamplingParams
    from workbench.kv.layout import KVLayout
    from workbench.kv.paged import PagedKVConfig
    from workbench.model.presets import preset_config

    loaded = ctx.llm().loaded
    ctx_len = loaded.max_model_len
    # the article's request scaled to this model: 1K tokens of a 4K context (Llama-2-7B's), i.e. a quarter
    # of the context; the old architecture reserves the whole context (a server that does not know the
    # output length reserves what is left of it), the request stops after n_new tokens (its client stops)
    n_new = 16
    total = max(ctx_len // 4, n_new + 16)
    plen = total - n_new
    prompt = _prompt(ctx, plen, seed=1)
    engines = {"contiguous": _reference_engine(ctx),
               "paged": _reference_engine(ctx, PagedKVConfig(block_size=16, enable_prefix_caching=False))}
    params = SamplingParams(temperature=0, max_tokens=ctx_len - plen, ignore_eos=True)
    repeats = ctx.size(3, 5)
    rows: list[dict] = []
    for eng in engines.values():                          # warm-up: first allocations, kernels
        request_memory(eng, prompt[:32], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), abort_after=2)
    for r in range(repeats):
        for name in (("contiguous", "paged") if r % 2 == 0 else ("paged", "contiguous")):
            rows.append(request_memory(engines[name], prompt, params, abort_after=n_new))
    by = {n: [r for r in rows if r["layout"] == n] for n in engines}
    rel = {n: [r["free_verified_s"] for r in by[n]] for n in engines}
    kvb = {n: by[n][0]["kv_bytes"] for n in engines}
    if any(x is None for n in engines for x in rel[n]):
        return Finding(FAILS, "a request's KV was not freed within 2 s", "a request's KV was still held 2 s after it "
                       f"ended: {[r for r in rows if r['free_verified_s'] is None]}", table=rows)
    verdict, parts = release_rule(rel["paged"], rel["contiguous"], kvb["paged"], kvb["contiguous"], ctx.noise)
    ratio = kvb["contiguous"] / kvb["paged"]
    rss_c = [r["rss_delta_after"] for r in by["contiguous"] if r["rss_delta_after"] is not None]
    rss_p = [r["rss_delta_after"] for r in by["paged"] if r["rss_delta_after"] is not None]
    pool_mib = by["paged"][0]["pool_bytes"] / MiB
    bpt = engines["paged"].pool.layout.bytes_per_token
    lay7 = KVLayout.from_model_config(preset_config("llama-2-7b"), 16, "float16")
    gb_own, gb_ctx = lay7.bytes_for_tokens(1024) / GB, lay7.bytes_for_tokens(4096) / GB
    fig = (f"KV of a {plen}+{n_new}-token request in a {ctx_len}-token context: contiguous (whole context reserved) "
           f"{kvb['contiguous'] / MiB:.2f} MiB vs paged {kvb['paged'] / MiB:.2f} MiB = {ratio:.2f}x (claimed 2.1 / 0.8 "
           f"GB = {CLAIMED_BYTE_RATIO:.2f}x +-{BYTE_RATIO_TOLERANCE:.0%}); KV verified free "
           f"{_ms(statistics.median(rel['contiguous']))} / {_ms(statistics.median(rel['paged']))} after the client's "
           f"stop (claimed 1.2 s / < 5 ms)")
    reason = (f"Checked here (the article: a 1K-token request adds 2.1 GB in the old architecture vs 0.8 GB in the new, "
              f"and its memory is released 'instantly' (< 5 ms) vs 1.2 s later): the ratio of the KV bytes the two "
              f"layouts hold for one request, and the time from the request's end until its KV is verified free.  The "
              f"old architecture is taken to be a contiguous cache that reserves the whole context for every request "
              f"(the article's 2.1 GB is what Llama-2-7B in fp16 reserves for its whole 4,096-token context, "
              f"{gb_ctx:.2f} GB; a 1K-token request's own KV is {gb_own:.2f} GB, so the article's 0.8 GB is "
              f"{0.8 / gb_own:.1f}x that).  Scaled to this model, the request is a quarter of its {ctx_len}-token "
              f"context: {plen} prompt tokens, max_tokens = the rest of the context, stopped by the client after "
              f"{n_new} tokens (engine.abort); {repeats} requests per layout, interleaved, each alone on a "
              f"reference-configuration engine over the shared model.  Bytes from the allocations (exact): the "
              f"contiguous cache's tensor storages (prompt + max_tokens positions, reserved when the request is "
              f"scheduled), the paged request's block table x {bpt:,} B per token (the pool, {pool_mib:.0f} MiB, is "
              f"allocated once with the engine).  The ratio follows from the sizes (the whole context over the "
              f"request's tokens rounded up to 16-token blocks); what is measured is that each layout allocates "
              f"exactly that.  Release = from the client's stop (the abort call) to the first poll (every 0.2 ms) that "
              f"finds the KV free: the paged blocks back on the pool's free list, the contiguous cache's finalizer run "
              f"(its storages returned to torch's CPU allocator) -- an upper bound.  "
              + _cap("; ".join(parts)) + f": {verdict} here.  Both layouts free a request's KV synchronously on the "
              f"engine's end event.  What the OS sees: {_rss_text(rss_c, rss_p)}.  Not visible here: the GPU "
              "allocator.  The 1.2 s the article read from nvidia-smi is the device memory PyTorch's CUDA caching "
              "allocator keeps after the tensors are freed (nvidia-smi counts it as used until it is reused or "
              "emptied): that part of the claim needs a GPU and is not checked.")
    return Finding(verdict, fig, reason,
                   values={"kv_bytes": kvb, "byte_ratio": ratio, "claimed_ratio": CLAIMED_BYTE_RATIO,
                           "tolerance": BYTE_RATIO_TOLERANCE, "release_s": rel, "noise": ctx.noise,
                           "rss_delta_after": {"contiguous": rss_c, "paged": rss_p},
                           "pool_bytes": by["paged"][0]["pool_bytes"], "bytes_per_token": bpt,
                           "prompt_tokens": plen, "new_tokens": n_new, "context": ctx_len,
                           "instant_s": INSTANT_S, "parts": parts},
                   table=rows)


# =====================================================================================================
# 15. cold_zone_reuse -- B §6.2: cold-zone reuse below 15 % means the pruning is too aggressive
# =====================================================================================================

REUSE_THRESHOLD = 0.15


def reuse_rule(rows: list[dict], threshold: float = REUSE_THRESHOLD) -> tuple[str, str, list[dict]]:
    """The claim read one way: reuse below ``threshold`` => the setting loses quality.  ``holds`` when
    there are settings below ``threshold`` and every one of them loses quality beyond 2 standard
    errors (``loses_quality``); ``does not hold`` when none is below it (nothing to check) or one
    below it keeps its quality within 2 se (within noise: the run could not see a smaller loss).
    Settings at or above ``threshold`` that lose quality do not contradict a one-way marker; they
    are counted.  Returns the verdict, why, and the settings below ``threshold`` that keep quality."""
    rated = [r for r in rows if r.get("cold_reuse") is not None]
    low = [r for r in rated if r["cold_reuse"] < threshold]
    high_losing = [r for r in rated if r["cold_reuse"] >= threshold and r["loses_quality"]]
    extra = (f"; {len(high_losing)} of the {len(rated) - len(low)} setting(s) at or above {threshold:.0%} lose quality "
             "too (a one-way marker does not rule on them)" if len(rated) > len(low) else "")
    if not low:
        return FAILS, f"no setting's reuse is below {threshold:.0%}: the marker is never triggered here{extra}", []
    wrong = [r for r in low if not r["loses_quality"]]
    if wrong:
        return FAILS, (f"{len(wrong)} of the {len(low)} setting(s) below {threshold:.0%} reuse keep their quality within "
                       f"2 standard errors ({', '.join(_loss_txt(r) for r in wrong)}){extra}"), wrong
    return HOLDS, (f"all {len(low)} setting(s) below {threshold:.0%} reuse lose quality beyond 2 standard errors"
                   f"{extra}"), wrong


def _loss_txt(r: dict) -> str:
    """A setting's name and, when known, its loss and the smallest loss the run could have seen (2 se)."""
    if r.get("rel_ppl") is None or r.get("rel_ppl_se") is None:
        return r["name"]
    return (f"{r['name']}: ppl {100 * r['rel_ppl']:+.1f} ± {100 * r['rel_ppl_se']:.1f} %, so a loss under "
            f"{200 * r['rel_ppl_se']:.1f} % goes unseen")


def measure_cold_zone_reuse(ctx: ClaimContext) -> Finding:
    from workbench.bench.tier_eval import heldout_split
    from workbench.bench.tier_reuse import reuse_sweep
    from workbench.kv.pca import fit_pca_from_model
    from workbench.kv.tier_config import TierConfig

    llm = ctx.llm()
    model = llm.model
    context = min(ctx.size(512, 1024), model.config.max_position_embeddings)
    docs, scored = ctx.size(1, 2), ctx.size(128, 256)
    split = heldout_split(llm.tokenizer, context)
    basis = fit_pca_from_model(model, split["calibration"][:2], key_space="pre_rope", source="heldout_split calibration")

    def T(warm, budget):
        return TierConfig(window=32, rank=8, warm_tokens=warm, chunk=16, block=16, budget=budget, key_space="pre_rope")

    grid = ctx.size([(0, 16), (0, 128), (256, 64)], [(0, 16), (0, 64), (0, 128), (64, 64), (256, 64), (256, 16)])
    with _one_thread():
        rows = reuse_sweep(model, basis, split["evaluation"][:docs], [T(w, b) for w, b in grid], eval_tokens=scored)
    verdict, why, wrong = reuse_rule(rows)
    lines = ", ".join(f"warm {r['warm_tokens']}/budget {r['budget']}: reuse {_pct(r['cold_reuse'], 0)}, ppl "
                      f"{100 * r['rel_ppl']:+.1f}±{100 * r['rel_ppl_se']:.1f} %" + (" (loses)" if r["loses_quality"] else "")
                      for r in rows)
    fig = f"{lines}; claimed: reuse < 15 % => quality lost"
    min_se = min(r["rel_ppl_se"] for r in rows)
    reason = (f"The tiered cache (window 32, PCA rank 8 pre-RoPE, 16-token chunks and routing blocks) on {docs} held-out "
              f"window(s) of {context} tokens, the last {scored} predictions scored against the full cache; the knob the "
              "article calls cold_zone_threshold is warm_tokens (how long a token stays warm before it turns cold), next "
              "to the routing budget (tokens fetched back exactly per step, layer and KV head).  Cold-zone reuse = the "
              "share of the cold tokens at a step that routing fetched back for it or one of the 2 steps before (the "
              "article's 'last 3 generations'), averaged over the scored steps, layers and KV heads "
              "(workbench.bench.tier_reuse).  A setting loses quality when its perplexity increase exceeds 2 paired "
              f"standard errors (the smallest se here: {100 * min_se:.1f} points, so smaller losses go unseen).  The "
              "claim is read one way -- reuse below 15 % means the pruning is too aggressive, i.e. the setting loses "
              "quality -- and the verdict is about the settings below 15 %: each must lose quality beyond 2 se (a "
              f"'too aggressive' this run can see).  {_cap(why)}: {verdict} here.  Reuse follows the routing budget (a larger budget fetches more cold blocks "
              "back) more than warm_tokens, and quality follows both.")
    return Finding(verdict, fig, reason,
                   values={"threshold": REUSE_THRESHOLD, "misclassified": [r["name"] for r in wrong],
                           "context": context, "docs": docs, "scored_tokens": scored},
                   table=[{k: v for k, v in r.items() if k != "config"} for r in rows])


# =====================================================================================================
# 16. calibrator_domain -- B §6.3: W4A8 best for finance, W4A16 for creative writing
# =====================================================================================================

DOMAINS = ("reference", "prose")
DOMAIN_SCHEMES = ("w4a16:g128", "w4a8")
# the claim's domains mapped to the shipped sets, declared in advance: the markup-heavy technical reference
# text stands for finance (structured, symbol-sensitive) -> W4A8 best; prose stands for creative writing -> W4A16 best
EXPECTED_BEST = {"reference": "w4a8", "prose": "w4a16:g128"}


def domain_rule(rows: list[dict], names=DOMAINS, schemes=DOMAIN_SCHEMES, expected: dict | None = None) -> dict:
    """Does the domain move the best scheme the way the claim says?  ``rows``:
    :func:`~workbench.quant.calibrate_report.uniform_on_texts` rows (text, scheme, degradation, se).
    ``holds`` when, on every text, the better of the two schemes is the one ``expected`` names for it
    (:data:`EXPECTED_BEST`) and that preference is beyond 2 standard errors of the paired difference;
    a flip the other way, or a preference within noise, ``does not hold``."""
    expected = expected or EXPECTED_BEST
    deg = {(r["text"], r["scheme"]): (r["degradation"], r["se"]) for r in rows}
    a, b = schemes
    pref = {}
    for t in names:
        (da, sa), (db, sb) = deg[(t, a)], deg[(t, b)]
        d, se = db - da, math.hypot(sa, sb)
        better = a if d > 0 else b
        pref[t] = {"better": better, "expected": expected[t], "as_expected": better == expected[t],
                   "difference": d, "se": se, "beyond_2se": abs(d) > 2 * se}
    gaps = {}
    for s in schemes:
        (d0, s0), (d1, s1) = deg[(names[0], s)], deg[(names[1], s)]
        gaps[s] = {"gap": d0 - d1, "se": math.hypot(s0, s1), "beyond_2se": abs(d0 - d1) > 2 * math.hypot(s0, s1)}
    flips = pref[names[0]]["better"] != pref[names[1]]["better"] and all(pref[t]["beyond_2se"] for t in names)
    ok = all(p["as_expected"] and p["beyond_2se"] for p in pref.values())
    wrong_way = flips and not ok
    return {"verdict": HOLDS if ok else FAILS, "preference": pref, "gaps": gaps, "flips": flips,
            "as_expected": ok, "wrong_way": wrong_way}


def _char_shares(path) -> dict:
    """The shares of digits and of markup characters in a JSONL text file's texts."""
    import json

    with open(path, encoding="utf-8") as f:
        text = "".join(json.loads(line).get("text", "") for line in f if line.strip())
    n = max(len(text), 1)
    return {"digits": sum(c.isdigit() for c in text) / n, "markup": sum(c in "<>[]{}|#*`=_/\\" for c in text) / n}


def measure_calibrator_domain(ctx: ClaimContext) -> Finding:
    from workbench.data import calibration_set, jsonl_windows
    from workbench.quant.calibrate_report import compare_domains, uniform_on_texts

    llm = ctx.llm()
    context, windows = ctx.size(128, 256), ctx.size(6, None)
    texts = {n: jsonl_windows(calibration_set(n), llm.tokenizer, context, windows, "evaluation")[0] for n in DOMAINS}
    cal = None
    with _one_thread():
        rows = uniform_on_texts(texts, list(DOMAIN_SCHEMES), model=ctx.model, device=ctx.device)
        if not ctx.smoke:          # the calibrator itself on both sets, the claim's two schemes (notebook 05's smoke sizes)
            from workbench.quant.calibrate import calibrate

            res = {n: calibrate(calibration_set(n), "ppl", "2%", ",".join(DOMAIN_SCHEMES), objective="memory",
                                model=ctx.model, device=ctx.device, context=128, eval_windows=4, calib_windows=2,
                                max_measured=6) for n in DOMAINS}
            cal = compare_domains(res[DOMAINS[0]], res[DOMAINS[1]], DOMAINS)
    rule = domain_rule(rows)
    deg = {(r["text"], r["scheme"]): r for r in rows}
    tokens = {n: deg[(n, DOMAIN_SCHEMES[0])]["tokens"] for n in DOMAINS}
    fig = "; ".join(f"{s}: ppl {100 * deg[(DOMAINS[0], s)]['degradation']:+.2f} % {DOMAINS[0]} vs "
                    f"{100 * deg[(DOMAINS[1], s)]['degradation']:+.2f} % {DOMAINS[1]} (gap "
                    f"{100 * rule['gaps'][s]['gap']:+.2f} ± {100 * rule['gaps'][s]['se']:.2f} points)" for s in DOMAIN_SCHEMES)
    fig += ("; better: " + ", ".join(f"{t} {rule['preference'][t]['better']}" for t in DOMAINS)
            + "; claimed: " + ", ".join(f"{t} {EXPECTED_BEST[t]}" for t in DOMAINS))
    pref_txt = "; ".join(f"on {t}, {p['better']} is better by {100 * abs(p['difference']):.2f} ± {100 * p['se']:.2f} points "
                         + ("(beyond 2 se)" if p["beyond_2se"] else "(within 2 se)") for t, p in rule["preference"].items())
    gap_txt = "; ".join(f"{s} {'moves' if g['beyond_2se'] else 'does not move'} beyond 2 se between the texts"
                        for s, g in rule["gaps"].items())
    cal_txt = ""
    if cal is not None:
        cal_txt = (f"  Reported, not ruled on: the calibrator (memory objective, ppl within 2 %, W4A16 g128 or W4A8 per "
                   f"layer) on each set recommends {cal['recommendations'][0]} ({DOMAINS[0]}) vs "
                   f"{cal['recommendations'][1]} ({DOMAINS[1]}); " + " ".join(cal["explanation"][-1:]).rstrip(".") + ".")
    share = {n: _char_shares(calibration_set(n)) for n in DOMAINS}
    outcome = ("each text prefers the scheme the claim names, beyond noise" if rule["as_expected"] else
               "the domain flips the better scheme, but the wrong way round" if rule["wrong_way"] else
               "not every text prefers the scheme the claim names beyond noise")
    reason = (f"Checked here (the article: the calibrator finds W4A8 best for finance, which is digit-sensitive, and "
              f"W4A16 for creative writing): whether the text's domain moves the better of W4A16 (g128) and W4A8 the "
              f"way the claim says, on the two shipped calibration sets, mapped in advance: {DOMAINS[0]} (markup-heavy "
              f"technical reference text: {_pct(share[DOMAINS[0]]['markup'])} markup characters, "
              f"{_pct(share[DOMAINS[0]]['digits'])} digits) stands for finance -> W4A8 expected best; {DOMAINS[1]} "
              f"({_pct(share[DOMAINS[1]]['markup'])} markup, {_pct(share[DOMAINS[1]]['digits'])} digits) for creative "
              f"writing -> W4A16 expected best.  No finance set is shipped, and the reference set is not the "
              f"digit-heavier one, so 'W4A8 for digits' itself is not tested.  Each scheme everywhere (round-to-nearest) "
              f"against the unquantized model on the evaluation rows, {context}-token windows, "
              f"{tokens[DOMAINS[0]]:,} / {tokens[DOMAINS[1]]:,} scored tokens "
              f"(workbench.quant.calibrate_report.uniform_on_texts).  {_cap(pref_txt)}; {gap_txt}.  Verdict "
              f"{rule['verdict']}: {outcome}.{cal_txt}")
    return Finding(rule["verdict"], fig, reason,
                   values={k: v for k, v in rule.items() if k != "verdict"} | {"context": context, "tokens": tokens,
                                                                               "expected_best": EXPECTED_BEST,
                                                                               "char_shares": share,
                                                                               "calibrator": cal and {
                                                                                   "recommendations": cal["recommendations"],
                                                                                   "explanation": cal["explanation"]}},
                   table=rows)


CLAIMS = [
    Claim("compute_share", "The model's forward is 36 % of a ~1K-token request's end-to-end time; the other 64 % is the "
          "serving stack's overhead around the model (the article: on an A100, 'pure compute' is 36 %, 64 % goes to data "
          "movement, copies and Python object management; checked here: the forward's share on this CPU)", "B §2.1",
          "model", device="cpu", measure=measure_compute_share),
    Claim("prefill_scaling", "From 512 to 2048 input tokens the old architecture's latency grows O(n^2), the fused one's "
          "close to O(n) (checked here: the log-log slope of prefill time, eager SDPA vs flash, rounds separated by 1.5)",
          "B §2.1", "model", device="cpu", measure=measure_prefill_scaling),
    Claim("kv_size_llama2_7b_32k", "Llama 2 7B at 32K tokens: K+V cache ~18 GB in FP16, so concurrency on an 80 GB A100 "
          "is capped at 4", "B §2.2", "KV memory", device="cpu", measure=measure_kv_size),
    Claim("request_memory_release", "A 1K-token request adds 2.1 GB in the old architecture vs 0.8 GB in the new "
          "(2.6x); its KV is released < 5 ms after the request ends vs 1.2 s delayed (checked here: the KV byte ratio of "
          "a whole-context contiguous cache vs paged blocks, and the time until each is verified free; the nvidia-smi "
          "part is the GPU allocator's)", "B §3.2", "KV memory", device="cpu", measure=measure_request_memory),
    Claim("cold_zone_reuse", "When the cold-zone reuse rate is below 15 % the pruning is too aggressive (raise "
          "cold_zone_threshold); checked one way: reuse < 15 % => quality lost beyond noise", "B §6.2", "KV tiers",
          device="cpu", measure=measure_cold_zone_reuse),
    Claim("calibrator_domain", "The precision calibrator finds W4A8 best for finance (digit-sensitive) and W4A16 for "
          "creative writing (checked here: markup-heavy reference text prefers W4A8, prose W4A16, each beyond noise)",
          "B §6.3", "quantization", device="cpu", measure=measure_calibrator_domain),
]
