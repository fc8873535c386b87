"""The serving claims measured on the engine alone (no HTTP): the prefix cache seen from TTFT
(claim 1, ``prefix_ttft_spread``) and the micro-batch window (claim 2, ``microbatch_window``).
Shared pieces and the method: :mod:`~workbench.bench.claims.serving_setup`."""

from __future__ import annotations

import statistics

from workbench.bench.claims.core import FAILS, HOLDS, ClaimContext, Finding
from workbench.bench.claims.serving_rules import (
    compare_statistic,
    idle_fraction,
    sample_sd,
)
from workbench.bench.claims.serving_setup import (
    LOAD_MAX_TOKENS,
    LOAD_PROMPT_TOKENS,
    _engine,
    _pct,
    _windows,
)


# =================================================================================================
# 1. prefix_ttft_spread
# =================================================================================================
def measure_prefix_ttft_spread(ctx: ClaimContext) -> Finding:
    _ = ctx.noise                                  # the run's noise probe, before any comparison
    from workbench.bench.prefix import PrefixBenchConfig, shared_prefix_prompts
    from workbench.engine.sampling import SamplingParams
    from workbench.kv.paged import PagedKVConfig
    from workbench.measure.compare import compare_samples

    # 49 warm requests a side in both modes: with 11 two smoke runs gave opposite verdicts; with 49, 4 of 5
    # smoke runs here called the ~2x narrowing and 1 found the sd's intervals touching (so: does not hold)
    n = 50
    system_tokens = ctx.size(320, 896)
    tok = ctx.llm().tokenizer
    _, prompts = shared_prefix_prompts(tok, PrefixBenchConfig(num_requests=n, system_tokens=system_tokens))
    engines = {on: _engine(ctx, kv=PagedKVConfig(block_size=16, enable_prefix_caching=on), max_num_seqs=4,
                           max_num_batched_tokens=1024, batch_invariant=False) for on in (False, True)}
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    warm = _windows(ctx, 1, system_tokens, seed=5)[0]
    for e in engines.values():
        e.generate([warm], params)                  # code paths warm, then a cold pool
        e.kv_pool.reset()
    outs = {False: [], True: []}
    for i, p in enumerate(prompts):                 # request by request, the order alternating
        for on in ((False, True) if i % 2 == 0 else (True, False)):
            outs[on].append(engines[on].generate([p], params)[0])
    ttft = {on: [o.metrics.ttft * 1e3 for o in outs[on]] for on in outs}
    warm_t = {on: ttft[on][1:] for on in ttft}      # after the first request, which cannot hit
    names = ("prefix cache off", "prefix cache on")
    sd = compare_statistic(warm_t[False], warm_t[True], names=names, noise=ctx.noise, metric="TTFT sd", unit="ms")
    p50 = compare_samples(warm_t[False], warm_t[True], names=names, noise=ctx.noise, metric="TTFT", unit="ms")
    on_outs = outs[True]
    cached = [o.num_cached_tokens for o in on_outs]
    prompt_toks = [len(o.prompt_token_ids) for o in on_outs]
    hit_steady = sum(cached[1:]) / sum(prompt_toks[1:])
    hit_all = sum(cached) / sum(prompt_toks)
    sd_all = {on: sample_sd(ttft[on]) for on in ttft}
    same = sum(a.token_ids == b.token_ids for a, b in zip(outs[False], outs[True]))
    narrows = sd.winner == names[1]
    hit_ok = hit_steady > 0.92
    verdict = HOLDS if narrows and hit_ok else FAILS
    sd_off, sd_on = sd.median(names[0]), sd.median(names[1])
    rule = ("would flag it as 'reuse not working'" if sd_off > 15 else "would not flag it (sd below 15 ms)")
    if sd_all[True] > sd_all[False]:
        cold = (f"counting the cold first request the 'on' sd is {sd_all[True]:.1f} ms, wider than {sd_all[False]:.1f} "
                f"ms off: one miss dominates the spread, so the narrowing needs a warm cache")
    else:
        cold = f"counting the cold first request too: sd {sd_all[False]:.1f} ms off, {sd_all[True]:.1f} ms on"
    figure = (f"TTFT sd {sd_off:.1f} -> {sd_on:.1f} ms, p50 {p50.median(names[0]):.0f} -> "
              f"{p50.median(names[1]):.1f} ms; hit rate {hit_steady:.1%} ({n - 1} warm requests, "
              f"{system_tokens}-token shared prefix)")
    reason = (
        f"{n} prompts = one {system_tokens}-token system prompt + a different question, each run alone on two "
        f"paged engines (prefix cache off / on), request by request in alternating order; the first request of the "
        f"'on' side is cold. TTFT sd of the {n - 1} requests after it: {sd.describe()}. TTFT median: {p50.verdict}. "
        f"Hit rate (cached / prompt tokens, counted by the block manager): {hit_steady:.1%} after the first request, "
        f"{hit_all:.1%} with it; {cold}. The sd and the hit rate are separate measurements: a narrower spread does "
        f"not 'prove' a hit rate - it narrows because most of the prefill, whose time is what varies, is skipped. "
        f"A §4.1's 15 ms rule is an absolute for their "
        f"hardware: here, reuse off gave sd {sd_off:.1f} ms, so the rule {rule}. "
        f"Greedy first tokens identical off vs on: {same}/{n} (float32 attention, batch_invariant=False: the float64 "
        f"batch-invariant attention makes a {system_tokens}-token prefill several times slower on this CPU). "
        f"Checked: the direction (spread and median fall with reuse) and the hit rate; the article's +-42 / +-8 ms "
        f"are its hardware's.")
    table = [{"prefix_cache": name, "ttft_p50_ms": statistics.median(warm_t[on]), "ttft_sd_ms": sample_sd(warm_t[on]),
              "ttft_sd_ci_ms": list(sd.spread(name)), "ttft_sd_with_first_ms": sd_all[on],
              "ttft_p95_ms": _pct(warm_t[on], 95), "requests": len(ttft[on])}
             for on, name in ((False, names[0]), (True, names[1]))]
    return Finding(verdict, figure, reason, values={
        "requests": n, "system_tokens": system_tokens, "ttft_sd_ms": {"off": sd_off, "on": sd_on},
        "ttft_sd_with_first_ms": {"off": sd_all[False], "on": sd_all[True]},
        "ttft_p50_ms": {"off": p50.median(names[0]), "on": p50.median(names[1])},
        "hit_rate_steady": hit_steady, "hit_rate_all": hit_all, "identical_first_tokens": same,
        "sd_comparison": sd.as_dict(), "p50_comparison": p50.as_dict(), "noise": ctx.noise}, table=table)


# =================================================================================================
# 2. microbatch_window
# =================================================================================================
def measure_microbatch_window(ctx: ClaimContext) -> Finding:
    _ = ctx.noise                                  # the run's noise probe, before any comparison
    from workbench.engine.sampling import SamplingParams
    from workbench.engine.traces import Trace, replay
    from workbench.kv.paged import PagedKVConfig
    from workbench.measure.compare import compare, compare_quantile

    n, rate, repeats = ctx.size(10, 32), ctx.size(40.0, 24.0), ctx.size(3, 4)
    prompts = _windows(ctx, n, LOAD_PROMPT_TOKENS, seed=21)
    params = SamplingParams(temperature=0.0, max_tokens=LOAD_MAX_TOKENS, ignore_eos=True)
    trace = Trace.poisson(prompts, rate, n, params, seed=2)
    windows = {"0.8 ms": 0.0008, "16 ms": 0.016}
    # one engine per window (no prefix caching: every replay computes the same prompts again)
    engines = {name: _engine(ctx, kv=PagedKVConfig(block_size=16, enable_prefix_caching=False), max_num_seqs=8,
                             max_num_batched_tokens=256, micro_batch_window_s=w) for name, w in windows.items()}
    for e in engines.values():
        e.generate([prompts[0]], SamplingParams(temperature=0.0, max_tokens=2))            # warm-up

    def run(name: str) -> dict:
        engines[name].step_records.clear()               # replay() frames only this replay's steps
        res = replay(engines[name], trace, timeout_s=120.0)   # workbench.engine.traces: the trace in real time
        idle = idle_fraction(res.steps)
        busy = res.steps[res.steps["num_seqs"] > 0]
        return {"queue_ms": [o.metrics.time_in_queue * 1e3 for o in res.outputs], **idle,
                "idle_ms_per_request": idle["idle_s"] * 1e3 / n, "mean_batch": float(busy["num_seqs"].mean()),
                "steps": len(busy), "step_ms": float((busy["model_s"] * 1e3).median())}

    idle = compare({name: (lambda name=name: run(name)) for name in windows}, repeats=repeats,
                   key=lambda r: r["idle_ms_per_request"], noise=ctx.noise,
                   metric="engine idle while requests wait, per request", unit="ms")
    rows = idle.results
    pooled = {name: [q for r in rows[name] for q in r["queue_ms"]] for name in windows}
    queue = compare_quantile(pooled["0.8 ms"], pooled["16 ms"], q=0.5, names=tuple(windows), noise=ctx.noise,
                             metric="queue wait median", unit="ms")
    med = lambda name, key: statistics.median(r[key] for r in rows[name])
    share = {name: med(name, "idle_fraction") for name in windows}
    mean_q = {name: statistics.mean(pooled[name]) for name in windows}
    holds = queue.winner == "0.8 ms" and idle.winner == "0.8 ms"
    verdict = HOLDS if holds else FAILS
    figure = (f"queue wait median {queue.median('16 ms'):.1f} -> {queue.median('0.8 ms'):.1f} ms (mean "
              f"{mean_q['16 ms']:.1f} -> {mean_q['0.8 ms']:.1f}); engine idle while requests wait {share['16 ms']:.1%} "
              f"-> {share['0.8 ms']:.1%} of its busy time (window 16 -> 0.8 ms, {rate:g} req/s Poisson)")
    reason = (
        f"One seeded Poisson trace ({n} requests, {rate:g}/s, {LOAD_PROMPT_TOKENS}-token prompts, {LOAD_MAX_TOKENS} "
        f"tokens each) replayed in real time (workbench.engine.traces.replay) on two engines that differ only in the "
        f"micro-batch window, 0.8 ms and 16 ms; {repeats} replays each, interleaved. Queue wait (arrival -> first "
        f"scheduled, every request of every replay): {queue.describe()}. Idle = time with requests waiting while no "
        f"step computes (the window holding them), from the engine's step records: {idle.describe()}; as a share of "
        f"that time plus the steps': {share['16 ms']:.2%} vs {share['0.8 ms']:.2%}. What the 16 ms window buys: mean "
        f"batch {med('16 ms', 'mean_batch'):.2f} vs {med('0.8 ms', 'mean_batch'):.2f}, {med('16 ms', 'steps'):.0f} vs "
        f"{med('0.8 ms', 'steps'):.0f} steps. With 0.8 ms the wait is set by the step a request arrives during (a step "
        f"takes ~{med('0.8 ms', 'step_ms'):.0f} ms here), not by the window; a 0.12 ms mean wait needs steps far "
        f"shorter than that. The article's 0.12 ms at 1000 QPS and 11.3 % -> 1.7 % idle are its GPU's; checked here: "
        f"the direction of both (a shorter window waits less and idles less).")
    table = [{"window": name, "queue_ms_p50": queue.median(name), "queue_ms_mean": mean_q[name],
              "queue_ms_p95": _pct(pooled[name], 95), "idle_ms_per_request": idle.median(name),
              "idle_share": share[name], "mean_batch": med(name, "mean_batch"), "steps": med(name, "steps")}
             for name in windows]
    return Finding(verdict, figure, reason, values={
        "rate": rate, "requests": n, "replays": repeats, "queue_comparison": queue.as_dict(),
        "idle_comparison": idle.as_dict(), "idle_share": share, "queue_ms_mean": mean_q, "noise": ctx.noise},
        table=table)
