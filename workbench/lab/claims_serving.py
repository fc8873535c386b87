"""Claims of the source articles (see workbench.lab.claims): serving.

Ten claims about the serving side - the prefix cache seen from TTFT, the micro-batch window,
latency under load, request parameters, the stream's wire format, circuit breakers, priorities
and concurrency - each measured on this machine with the package's own parts: the engine
(:class:`~workbench.engine.core.LLMEngine` on the one loaded model, ``ctx.llm().loaded``), its
scheduler, ``workbench serve`` (:func:`~workbench.serve.server.start_server`, in this process on a
free port) and the load generator (:mod:`workbench.load`).

**What is compared, and how.**  Every A/B comparison goes through :mod:`workbench.measure.compare`
with the run's noise floor (``ctx.noise``): interleaved repeats whose ranges must not overlap
(:func:`~workbench.measure.compare.compare`), or, for one load run a side, bootstrap intervals of a
percentile (:func:`~workbench.measure.compare.compare_quantile`) or of another statistic
(:func:`compare_statistic`: the standard deviation of TTFT).  Wire-format and determinism claims
are exact counts (bytes, identical tokens and log-probabilities).  A claimed effect this run
cannot separate from the noise *does not hold here*, and the finding says how large an effect
the run could have seen (:func:`detectable_ratio`).  The articles' absolute numbers (ms, QPS of
a hosted service on H100s / A100s) are not this machine's: the load claims scale the offered
load to the capacity measured here, and each finding says which part of the claim it checks.

**The server** (claims 3, 5, 6, 7, 9, 10) is started once per run (:func:`serving_server`, cached
in ``ctx.scratch``) and stopped by ``ctx.close()`` (which :func:`~workbench.lab.claims.run_claims`
calls; an ``atexit`` hook is the fallback).  Its engine: the paged pool without prefix caching
(so that a prompt sent twice, in an A/B pair of load runs, is computed twice), up to
:data:`SERVER_SEQS` sequences at once (more wait in its queue, where priorities act), a
512-token step budget.  The load generator runs in the same process: its own work (httpx, SSE
parsing) and the server's event loop share the two cores - and Python's GIL - with the engine
thread, which is part of what a load run here measures (the engine's steps are slower under HTTP
load than the same batch computed alone).

The pure decision rules (:func:`compare_statistic`, :func:`detectable_ratio`, :func:`load_knee`,
:func:`sweet_spot`, :class:`ErrorRateBreaker`, :func:`degradation_onset`, :func:`idle_fraction`,
:func:`sse_report`) are
unit-tested on synthetic samples in ``tests/lab/test_claims_serving.py``.
"""

from __future__ import annotations

import atexit
import json
import math
import statistics
import time
from collections.abc import Callable

from workbench.lab.claims import FAILS, HOLDS, Claim, ClaimContext, Finding

MODEL_NAME = "bundled"            # the served model's name (GET /v1/models)
SERVER_SEQS = 16                  # the shared server's max_num_seqs (beyond it requests wait in its queue)
SERVER_BUDGET = 512               # its max_num_batched_tokens
LOAD_PROMPT_TOKENS = 32           # prompts of the load claims (token ids of held-out text)
LOAD_MAX_TOKENS = 8               # tokens per request in the load claims
GREEDY = {"temperature": 0.0, "ignore_eos": True}


# =================================================================================================
# Decision rules (pure: unit-tested on synthetic samples)
# =================================================================================================
def sample_sd(values) -> float:
    """The sample standard deviation (ddof 1), as :func:`workbench.engine.metrics.jitter` defines it."""
    from workbench.engine.metrics import jitter

    return jitter(values)


def compare_statistic(a, b, stat: Callable = sample_sd, names: tuple[str, str] = ("A", "B"), resamples: int = 2000,
                      confidence: float = 0.9, seed: int = 0, noise: float | None = None, **kw):
    """:func:`~workbench.measure.compare.compare_quantile` for any statistic of one set of values a
    side (the standard deviation of TTFT, a mean): a seeded bootstrap ``confidence`` interval of
    ``stat`` per side; the verdict needs the intervals apart and the ratio of the point estimates
    beyond ``1 + noise`` (the same :class:`~workbench.measure.compare.Comparison` rules).  Needs at
    least 5 values a side."""
    import numpy as np

    from workbench.measure.compare import Comparison

    vals = {names[0]: [float(v) for v in a], names[1]: [float(v) for v in b]}
    for n, v in vals.items():
        if len(v) < 5:
            raise ValueError(f"compare_statistic: side {n!r} has {len(v)} values; need at least 5")
    rng = np.random.default_rng(seed)
    lo_q, hi_q = (1 - confidence) / 2, 1 - (1 - confidence) / 2
    est, ivl = {}, {}
    for n, v in vals.items():
        arr = np.asarray(v)
        boot = [stat(arr[idx]) for idx in rng.integers(0, arr.size, size=(resamples, arr.size))]
        est[n] = float(stat(arr))
        ivl[n] = (float(np.quantile(boot, lo_q)), float(np.quantile(boot, hi_q)))
    return Comparison(names=tuple(names), samples=vals, noise=noise, estimate=est, interval=ivl,
                      confidence=confidence, **kw)


def detectable_ratio(cmp, worse: str | None = None) -> float:
    """The smallest worse / better ratio this comparison would have called a difference: the
    noise floor, or what it takes to pull the sides' ranges (or bootstrap intervals) apart when
    ``worse`` is the slower one - the larger of the two.  ``worse``: the side the claim says is
    worse (default: the one measured worse)."""
    a, b = cmp.names
    if worse is None:
        worse = cmp._better_first()[1]
    better = b if worse == a else a
    (blo, bhi), (wlo, whi) = cmp.spread(better), cmp.spread(worse)
    if cmp.lower_is_better:
        apart = bhi / wlo if wlo > 0 else math.inf    # scale the worse side up until its lowest clears
    else:
        apart = whi / blo if blo > 0 else math.inf
    # the sides' own ranges, as if no difference: any effect within them cannot separate
    span = max(bhi / blo if blo > 0 else math.inf, whi / wlo if wlo > 0 else math.inf)
    return max(1 + cmp.noise, min(max(apart, 1.0), span) if math.isfinite(span) else apart)


def load_knee(rates: list[float], comparisons: list) -> float | None:
    """The first offered rate whose latency percentile is higher than the lowest rate's beyond the
    noise (``comparisons[i]``: lowest rate vs ``rates[i]``, the lowest rate's name first), or None
    when no rate of the sweep is (a flat curve)."""
    for r, cmp in zip(rates, comparisons):
        if cmp is not None and cmp.winner == cmp.names[0]:
            return r
    return None


def closed_loop_power(values) -> float:
    """Kleinrock's power (throughput / latency, in requests/s per second) of a closed loop from its
    requests' E2E in ms divided by the square root of the number of users (``E2E_ms / sqrt(users)``):
    with no think time Little's law gives throughput ``users / R``, so power = ``users / R**2``."""
    m = sum(values) / len(values)
    return 1e6 / (m * m) if m > 0 else math.inf


def sweet_spot(levels: list[int], latency: dict, noise: float) -> dict:
    """The sweet spot of a closed-loop concurrency sweep (``latency[c]``: the E2E in ms of each
    request run at ``c`` users, no think time): the concurrency with the highest *power*,
    throughput / latency (Kleinrock's optimal operating point: below it more users buy throughput at
    little latency, past it they buy latency and little throughput).  Throughput per level by
    Little's law, ``c / mean E2E``.  ``found``: the best power is at a level below the largest one
    and beats the largest level's beyond the noise (bootstrap intervals, :func:`compare_statistic`);
    ``latency_rises``: P95 latency at the largest level is higher than at the sweet spot beyond the
    noise (bootstrap intervals of P95)."""
    from workbench.measure.compare import compare_quantile

    levels = sorted(levels)
    scaled = {c: [v / math.sqrt(c) for v in latency[c]] for c in levels if len(latency.get(c, [])) >= 5}
    usable = [c for c in levels if c in scaled]
    empty = {"best": None, "sweet_spot": None, "found": False, "latency_rises": False, "power_comparison": None,
             "latency_comparison": None, "throughput": {}, "power": {}}
    if not usable:
        return {**empty, "why": "fewer than 5 completed requests at every level"}
    mean = {c: statistics.mean(latency[c]) for c in usable}
    tput = {c: c * 1e3 / mean[c] for c in usable}
    power = {c: closed_loop_power(scaled[c]) for c in usable}
    star = max(usable, key=lambda c: power[c])
    best = max(usable, key=lambda c: tput[c])
    top = levels[-1]
    pw = lat = None
    why = None
    if star >= top:
        why = f"throughput / latency is highest at the largest level ({top} users)"
    elif top not in scaled:
        why = f"fewer than 5 completed requests at {top} users"
    else:
        pw = compare_statistic(scaled[star], scaled[top], stat=closed_loop_power,
                               names=(f"{star} users", f"{top} users"), noise=noise, lower_is_better=False,
                               metric="throughput / latency", better_word="higher")
        lat = compare_quantile(latency[star], latency[top], q=0.95, names=(f"{star} users", f"{top} users"),
                               noise=noise, metric="E2E P95", unit="ms")
        if pw.winner != pw.names[0]:
            why = f"throughput / latency at {top} users is within noise of the best ({pw.verdict})"
    found = pw is not None and pw.winner == pw.names[0]
    rises = lat is not None and lat.winner == lat.names[0]
    return {"best": best, "sweet_spot": star, "found": found, "latency_rises": rises, "power_comparison": pw,
            "latency_comparison": lat, "throughput": tput, "power": power, "why": why}


class ErrorRateBreaker:
    """The breaker the article replaces: open when the share of failed requests among the last
    ``window`` (at least ``min_samples`` seen) exceeds ``threshold`` (A §4.2's old rule:
    ``error_rate > 5 %``).  ``record(failed, now)`` returns whether it is open."""

    def __init__(self, threshold: float = 0.05, window: int = 20, min_samples: int = 10) -> None:
        from collections import deque

        self.threshold, self.min_samples = threshold, min_samples
        self.recent = deque(maxlen=window)
        self.opened_at: float | None = None
        self.seen = 0

    def record(self, failed: bool, now: float) -> bool:
        self.seen += 1
        self.recent.append(bool(failed))
        if self.opened_at is None and len(self.recent) >= self.min_samples \
                and sum(self.recent) / len(self.recent) > self.threshold:
            self.opened_at = now
        return self.opened_at is not None

    @property
    def open(self) -> bool:
        return self.opened_at is not None


def degradation_onset(steps, since: float, until: float | None, share: float = 0.75) -> float | None:
    """When requests began to wait for good: the earliest step start ``t`` in ``[since, until]`` with
    requests waiting after it, such that from ``t`` to ``until`` at least ``share`` of the steps
    left requests waiting (``steps``: step records with ``start`` and ``waiting``; a queue that
    empties for a step now and then still counts as full).  None when no such stretch exists."""
    rows = [(st["start"], st["waiting"]) if isinstance(st, dict) else (st.start, st.waiting) for st in steps]
    rows = [(t, w) for t, w in rows if t >= since and (until is None or t <= until)]
    onset, waiting = None, 0
    for total, (t, w) in enumerate(reversed(rows), 1):   # from the end: the share of waiting steps from t on
        waiting += w > 0
        if w > 0 and waiting >= share * total:
            onset = t
    return onset


def idle_fraction(steps) -> dict:
    """Of the time requests were in the engine, the share in which it computed nothing although
    requests were waiting (the micro-batch window holding them): from an engine's step records
    (``steps_frame``: a step with ``num_seqs == 0`` and ``waiting > 0`` lasts until the next
    step starts).  Returns idle and busy seconds and the fraction."""
    rows = steps.sort_values("start").to_dict("records") if hasattr(steps, "to_dict") else list(steps)
    idle = busy = 0.0
    for r, nxt in zip(rows, rows[1:] + [None]):
        if r["num_seqs"] > 0:
            busy += r["schedule_s"] + r["model_s"] + r["post_s"]
        elif r["waiting"] > 0 and nxt is not None:
            idle += nxt["start"] - r["start"]
    total = idle + busy
    return {"idle_s": idle, "busy_s": busy, "idle_fraction": idle / total if total > 0 else 0.0}


def sse_report(chunks: list[bytes]) -> dict:
    """What a client sees of one SSE body read chunk by chunk (``chunks``: the pieces as they came
    off the connection): the first chunk's size, each event's size (``data: ...`` up to its blank
    line), how many chunks were not exactly one whole event, whether line-by-line parsing
    (``readline()``: split at ``\\n``) gives every ``data:`` line as complete JSON, and how many
    events a client reading fixed 64-byte pieces (A §3.2's ``read(64)``) would cut."""
    body = b"".join(chunks)
    events = [e for e in body.split(b"\n\n") if e.strip()]
    sizes = [len(e) + 2 for e in events]
    whole = sum(1 for c in chunks if c.endswith(b"\n\n") and c.count(b"\n\n") == 1 and c.startswith(b"data:"))
    lines = [ln for ln in body.split(b"\n") if ln.startswith(b"data:")]
    parsed = 0
    for ln in lines:
        data = ln[5:].strip()
        if data == b"[DONE]":
            parsed += 1
            continue
        try:
            json.loads(data)
            parsed += 1
        except ValueError:
            pass
    # read(64): fixed pieces; an event is cut when a piece boundary falls inside it
    cut, pos = 0, 0
    for s in sizes:
        start, end = pos, pos + s
        if start // 64 != (end - 1) // 64 or s > 64:
            cut += 1
        pos = end
    return {"chunks": len(chunks), "first_chunk_bytes": len(chunks[0]) if chunks else 0,
            "chunk_bytes": [len(c) for c in chunks], "events": len(events), "event_bytes": sizes,
            "first_event_bytes": sizes[0] if sizes else 0, "chunks_one_whole_event": whole,
            "data_lines": len(lines), "lines_parsed_whole": parsed, "events_cut_by_read64": cut}


# =================================================================================================
# Shared pieces: prompts, engines, the server, the load generator
# =================================================================================================
class _MemoTokenizer:
    """The run's tokenizer with ``encode`` remembered per text: :func:`workbench.data.heldout_token_windows`
    encodes the whole held-out corpus on every call (~0.5 s here), and the claims draw windows many times."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self._ids = tokenizer, {}

    def encode(self, text: str, **kw) -> list[int]:
        key = (text, tuple(sorted(kw.items())))
        if key not in self._ids:
            self._ids[key] = self.tokenizer.encode(text, **kw)
        return self._ids[key]


def _windows(ctx: ClaimContext, n: int, length: int, seed: int) -> list[list[int]]:
    """``n`` token windows of ``length`` tokens of held-out text (seeded; cached per run)."""
    key = ("serving.windows", n, length, seed)
    if key not in ctx.scratch:
        from workbench.data import heldout_token_windows

        tok = ctx.scratch.get("serving.tokenizer")
        if tok is None:
            tok = ctx.scratch["serving.tokenizer"] = _MemoTokenizer(ctx.llm().tokenizer)
        ctx.scratch[key] = heldout_token_windows(tok, n, length, seed=seed)
    return ctx.scratch[key]


def _engine(ctx: ClaimContext, kv=None, **sched):
    from workbench.engine.core import LLMEngine
    from workbench.kv.paged import PagedKVConfig
    from workbench.sched.config import SchedulerConfig

    batch_invariant = sched.pop("batch_invariant", None)
    return LLMEngine(ctx.llm().loaded, kv=kv or PagedKVConfig(block_size=16), scheduler=SchedulerConfig(**sched),
                     batch_invariant=batch_invariant)


def serving_server(ctx: ClaimContext):
    """``workbench serve`` on a free port of 127.0.0.1 in this process, over an engine on the run's
    loaded model; started once per run (``ctx.scratch``), stopped by ``ctx.close()``."""
    h = ctx.scratch.get("serving.server")
    if h is not None and h.running:
        return h
    from workbench.kv.paged import PagedKVConfig
    from workbench.serve.app import ServerConfig
    from workbench.serve.server import start_server

    eng = _engine(ctx, kv=PagedKVConfig(block_size=16, enable_prefix_caching=False), max_num_seqs=SERVER_SEQS,
                  max_num_batched_tokens=SERVER_BUDGET)
    h = start_server(eng, ServerConfig(port=0, model_name=MODEL_NAME))
    atexit.register(h.stop)

    def stop() -> None:
        ctx.scratch.pop("serving.server", None)
        ctx.scratch.pop("serving.capacity", None)
        atexit.unregister(h.stop)
        h.stop()

    ctx.on_close(stop)
    ctx.scratch["serving.server"] = h
    return h


class _Prompts:
    """Distinct prompts for a load run: window ``offset + i`` of a held-out pool (a fresh range per
    run, so no two requests of a claim share a prompt unless a pair of runs asks for it)."""

    def __init__(self, ctx: ClaimContext, offset: int) -> None:
        self.pool = _windows(ctx, 2048, LOAD_PROMPT_TOKENS, seed=11)
        self.offset = offset

    def __call__(self, i: int) -> list[int]:
        return self.pool[(self.offset + i) % len(self.pool)]


def _next_offset(ctx: ClaimContext, n: int) -> int:
    off = ctx.scratch.get("serving.prompt_offset", 0)
    ctx.scratch["serving.prompt_offset"] = off + n
    return off


def _http_load(ctx: ClaimContext, prompts=None, **cfg):
    """One run of the load generator against the shared server (:class:`~workbench.load.HTTPTarget`).
    Every run is bounded (``max_duration_s``, default 120 s; a read times out after 60 s): a stuck
    request ends as ``cancelled`` / ``error`` instead of holding the claims run."""
    from workbench.load import HTTPTarget, LoadConfig, run_load_sync

    srv = serving_server(ctx)
    cfg.setdefault("max_tokens", LOAD_MAX_TOKENS)
    cfg.setdefault("sampling", dict(GREEDY))
    cfg.setdefault("max_duration_s", 120.0)
    prompts = prompts or _Prompts(ctx, _next_offset(ctx, 512))
    return run_load_sync(HTTPTarget(srv.url, model=MODEL_NAME, timeout=60.0), LoadConfig(prompts=prompts, **cfg))


def _ok(res, field: str = "e2e") -> list[float]:
    """A load run's ``ok`` requests' TTFT or E2E, in ms."""
    return [getattr(r, field) * 1e3 for r in res.records if r.status == "ok" and getattr(r, field) is not None]


def serving_capacity(ctx: ClaimContext) -> dict:
    """The shared server's capacity: requests/s completed by a closed loop of ``SERVER_SEQS`` users
    (one per sequence slot; cached per run)."""
    cap = ctx.scratch.get("serving.capacity")
    if cap is None:
        users = SERVER_SEQS
        dur = ctx.size(1.0, 2.5)
        _http_load(ctx, mode="closed", concurrency=min(4, users), max_requests=8)       # warm-up
        res = _http_load(ctx, mode="closed", concurrency=users, max_duration_s=dur)
        ok = [r for r in res.records if r.status == "ok"]
        # completions per second after the first wave (all users start together)
        t_end = res.duration_s
        late = [r for r in ok if r.end is not None and r.end >= 0.25 * t_end]
        span = t_end - 0.25 * t_end
        qps = len(late) / span if span > 0 and late else len(ok) / max(t_end, 1e-9)
        cap = {"qps": max(qps, 1.0), "users": users, "seconds": dur, "ok": len(ok),
               "tokens_per_s": float(res.summary().loc["all", "tokens_per_s"])}
        ctx.scratch["serving.capacity"] = cap
    return cap


def _first_tokens(engine, prompt, params, k: int) -> dict:
    """Run one request alone on ``engine`` until it has ``k`` tokens (then abort it): TTFT and the
    mean gap of those tokens (TPOT over them), in ms."""
    rid = engine.add_request(prompt, params)
    out = engine.get_output(rid)
    while engine.has_unfinished():
        engine.step()
        if len(out.metrics.token_times) >= k or out.finish_reason is not None:
            break
    engine.abort(rid, "measured enough tokens")
    engine.drain_events()
    while engine.has_unfinished():
        engine.step()
    engine.release(rid)
    m = out.metrics
    tt = m.token_times[:k]
    return {"ttft_ms": m.ttft * 1e3, "tpot_ms": (tt[-1] - tt[0]) / (len(tt) - 1) * 1e3 if len(tt) > 1 else math.nan,
            "tokens": list(out.token_ids[:k])}


def _pct(values, q: float) -> float:
    import numpy as np

    return float(np.percentile(values, q)) if len(values) else math.nan


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


# =================================================================================================
# 3. p95_vs_load
# =================================================================================================
def measure_p95_vs_load(ctx: ClaimContext) -> Finding:
    _ = ctx.noise                                  # the run's noise probe, before any comparison
    from workbench.measure.compare import compare_quantile

    cap = serving_capacity(ctx)
    # low and high rates interleaved; smoke spans 4x (it can refute flatness, not confirm a 16x claim)
    fractions = ctx.size((0.2, 0.8), (0.05, 0.8, 0.1, 0.4, 0.2))
    seconds, min_n = ctx.size(0.8, 2.0), ctx.size(8, 16)
    runs = {}
    for k, f in enumerate(fractions):
        rate = f * cap["qps"]
        res = _http_load(ctx, mode="poisson", rate=rate, max_requests=max(min_n, int(rate * seconds)), seed=30 + k)
        runs[f] = {"rate": rate, "e2e": _ok(res), "ttft": _ok(res, "ttft"),
                   "not_ok": sum(r.status != "ok" for r in res.records)}
    order = sorted(fractions)
    low = order[0]
    comps = [None]
    for f in order[1:]:
        a, b = runs[low], runs[f]
        comps.append(compare_quantile(a["e2e"], b["e2e"], q=0.95, names=(f"{a['rate']:.1f} QPS", f"{b['rate']:.1f} QPS"),
                                      noise=ctx.noise, metric="E2E P95", unit="ms")
                     if len(a["e2e"]) >= 5 and len(b["e2e"]) >= 5 else None)
    knee = load_knee(order, comps)
    top = comps[-1]
    p95 = {f: _pct(runs[f]["e2e"], 95) for f in order}
    ratio = p95[order[-1]] / p95[low] if p95[low] else math.nan
    range_x = order[-1] / low
    flat = knee is None and top is not None
    verdict = HOLDS if flat and range_x >= 16 - 1e-9 else FAILS
    knee_txt = (f"P95 rises beyond the noise from {runs[knee]['rate']:.1f} QPS ({knee:.0%} of capacity)"
                if knee is not None else "no rate's P95 above the lowest's beyond the noise")
    figure = (f"E2E P95 {p95[low]:.0f} -> {p95[order[-1]]:.0f} ms ({ratio:.2f}x) from {runs[low]['rate']:.1f} to "
              f"{runs[order[-1]]['rate']:.1f} QPS ({range_x:.0f}x, up to {order[-1]:.0%} of capacity); {knee_txt}")
    scope = ("" if range_x >= 16 - 1e-9 else
             f" This run spans {range_x:.0f}x only (smoke sizes): a rise within it refutes the claim, a flat curve "
             f"could not confirm a 16x one.")
    reason = (
        f"Capacity of `workbench serve` here (a closed loop of {cap['users']} users, one per sequence slot, "
        f"{LOAD_MAX_TOKENS}-token greedy completions): {cap['qps']:.1f} requests/s. Poisson load over HTTP at "
        f"{', '.join(f'{f:.0%}' for f in order)} of it (a {range_x:.0f}x range; the article's 50 -> 800 QPS is 16x), "
        f"P95 of E2E latency per rate with 90 % bootstrap intervals over its requests; each rate against the lowest: "
        + "; ".join(c.verdict for c in comps[1:] if c is not None)
        + f". Highest vs lowest: {top.describe() if top is not None else 'too few requests'}.{scope} A continuous-"
        f"batching engine's step grows with the batch, and requests queue as the rate nears capacity, so P95 can "
        f"only be flat well below it. The article's 0.45-0.49 s and QPS are its service's; checked here: whether P95 "
        f"stays flat (no rise beyond the noise) over a 16x range of offered load scaled to this server's capacity. The "
        f"load generator runs in the server's process and shares its cores.")
    table = [{"fraction_of_capacity": f, "offered_qps": runs[f]["rate"], "ok": len(runs[f]["e2e"]),
              "not_ok": runs[f]["not_ok"], "ttft_p50_ms": _pct(runs[f]["ttft"], 50),
              "ttft_p95_ms": _pct(runs[f]["ttft"], 95), "e2e_p50_ms": _pct(runs[f]["e2e"], 50), "e2e_p95_ms": p95[f],
              "vs_lowest": None if c is None else c.verdict} for f, c in zip(order, comps)]
    return Finding(verdict, figure, reason, values={
        "capacity_qps": cap["qps"], "fractions": list(order), "rates": [runs[f]["rate"] for f in order],
        "range": range_x, "e2e_p95_ms": [p95[f] for f in order], "ratio_top_low": ratio,
        "knee_qps": None if knee is None else runs[knee]["rate"],
        "top_comparison": None if top is None else top.as_dict(), "noise": ctx.noise}, table=table)


# =================================================================================================
# 4. max_tokens_fast_path
# =================================================================================================
def measure_max_tokens_fast_path(ctx: ClaimContext) -> Finding:
    _ = ctx.noise                                  # the run's noise probe, before any comparison
    from workbench.engine.sampling import SamplingParams
    from workbench.kv.paged import PagedKVConfig
    from workbench.measure.compare import compare, compare_samples

    n_in, k, repeats = ctx.size(64, 300), ctx.size(8, 24), ctx.size(3, 6)
    prompt = _windows(ctx, 1, n_in, seed=41)[0]
    eng = _engine(ctx, kv=PagedKVConfig(block_size=16, enable_prefix_caching=False), max_num_seqs=4,
                  max_num_batched_tokens=512)            # no prefix cache: every run computes its prompt
    ratios = (1.7, 1.9)
    names = tuple(f"max_tokens={int(r * n_in)} ({r}x)" for r in ratios)
    params = {nm: SamplingParams(temperature=0, max_tokens=int(r * n_in), ignore_eos=True) for nm, r in zip(names, ratios)}
    _first_tokens(eng, prompt, params[names[0]], 2)                       # warm-up
    cmp_all = compare({nm: (lambda nm=nm: _first_tokens(eng, prompt, params[nm], k)) for nm in names},
                      repeats=repeats, key=lambda r: r["tpot_ms"], noise=ctx.noise, metric=f"TPOT (first {k} tokens)",
                      unit="ms")
    ttft = compare_samples([r["ttft_ms"] for r in cmp_all.results[names[0]]],
                           [r["ttft_ms"] for r in cmp_all.results[names[1]]], names=names, noise=ctx.noise,
                           metric="TTFT", unit="ms")
    same = all(a["tokens"] == b["tokens"] for a, b in zip(cmp_all.results[names[0]], cmp_all.results[names[1]]))
    faster_above = cmp_all.winner == names[1] or ttft.winner == names[1]
    verdict = HOLDS if faster_above else FAILS
    claimed = 0.63 / 0.47
    det_tpot, det_ttft = detectable_ratio(cmp_all, worse=names[0]), detectable_ratio(ttft, worse=names[0])
    figure = (f"input {n_in} tokens: TPOT {cmp_all.median(names[0]):.2f} vs {cmp_all.median(names[1]):.2f} ms, TTFT "
              f"{ttft.median(names[0]):.1f} vs {ttft.median(names[1]):.1f} ms at max_tokens {ratios[0]}x vs {ratios[1]}x "
              f"input ({cmp_all.verdict.split(' (')[0]}; TTFT {ttft.verdict.split(' (')[0]})")
    reason = (
        f"One {n_in}-token prompt (the article's 500 does not fit 1.9x output in this model's 1024-token context), "
        f"greedy, alone on the paged engine (no prefix cache), with max_tokens just below and just above 1.8x the input; {repeats} runs "
        f"a side, interleaved; each measured over its first {k} tokens (a path chosen at admission would show from the "
        f"first token on), then aborted. {cmp_all.describe()}. {ttft.describe()}. Tokens identical: {same}. "
        f"The article's effect (0.63 s vs 0.47 s P95, mostly decode time at 500 -> 900 tokens) is {claimed:.2f}x; this "
        f"run would have called a TPOT difference beyond {det_tpot:.2f}x and a TTFT difference beyond {det_ttft:.2f}x "
        f"(the noise floor is {ctx.noise:.0%}). The engine uses max_tokens only as the stop length and in the check that prompt + "
        f"max_tokens fits the KV pool: no path depends on the ratio.")
    table = [{"max_tokens": params[nm].max_tokens, "ratio": r, "tpot_ms_median": cmp_all.median(nm),
              "tpot_ms_range": list(cmp_all.spread(nm)), "ttft_ms_median": ttft.median(nm),
              "ttft_ms_range": list(ttft.spread(nm))} for nm, r in zip(names, ratios)]
    return Finding(verdict, figure, reason, values={
        "input_tokens": n_in, "tokens_measured": k, "tpot_comparison": cmp_all.as_dict(), "ttft_comparison": ttft.as_dict(),
        "identical_tokens": same, "claimed_ratio": claimed, "detectable_ratio": {"tpot": det_tpot, "ttft": det_ttft},
        "noise": ctx.noise}, table=table)


# =================================================================================================
# 5. temperature_float
# =================================================================================================
def _post(client, body: dict) -> tuple[float, dict]:
    """POST /v1/completions with the body serialized by ``json.dumps`` (0.1 + 0.2 stays
    ``0.30000000000000004`` on the wire); (seconds, response JSON)."""
    data = json.dumps(body).encode()
    t0 = time.perf_counter()
    r = client.post("/v1/completions", content=data, headers={"content-type": "application/json"})
    dt = time.perf_counter() - t0
    r.raise_for_status()
    return dt, r.json()


def measure_temperature_float(ctx: ClaimContext) -> Finding:
    _ = ctx.noise                                  # the run's noise probe, before any comparison
    import httpx

    from workbench.engine.sampling import SamplingParams
    from workbench.kv.paged import PagedKVConfig
    from workbench.measure.compare import compare

    t_std, t_odd = 0.3, 0.1 + 0.2
    assert t_odd != t_std and json.dumps(t_odd) == "0.30000000000000004"
    k, repeats = ctx.size(8, 16), ctx.size(3, 8)
    prompt = _windows(ctx, 1, LOAD_PROMPT_TOKENS, seed=51)[0]
    names = ("temperature 0.3", "temperature 0.30000000000000004")
    temps = dict(zip(names, (t_std, t_odd)))
    eng = _engine(ctx, kv=PagedKVConfig(block_size=16, enable_prefix_caching=False), max_num_seqs=4,
                  max_num_batched_tokens=512)            # no prefix cache: every run computes its prompt
    calls = dict.fromkeys(names, 0)                 # the i-th call of each side uses seed 1000 + i: pairs

    def inproc(nm):
        seed = 1000 + calls[nm]
        calls[nm] += 1
        out = eng.generate([prompt], SamplingParams(temperature=temps[nm], seed=seed, max_tokens=k, ignore_eos=True))[0]
        return {"ms": out.metrics.e2e * 1e3, "tokens": list(out.token_ids), "seed": seed}

    eng.generate([prompt], SamplingParams(temperature=0.3, seed=1, max_tokens=2))         # warm-up
    local = compare({nm: (lambda nm=nm: inproc(nm)) for nm in names}, repeats=repeats, key=lambda r: r["ms"],
                    noise=ctx.noise, metric="E2E in-process", unit="ms")
    srv = serving_server(ctx)
    http_calls = dict.fromkeys(names, 0)
    with httpx.Client(base_url=srv.url, timeout=60) as client:
        def over_http(nm):
            seed = 2000 + http_calls[nm]
            http_calls[nm] += 1
            dt, js = _post(client, {"model": MODEL_NAME, "prompt": prompt, "max_tokens": k, "temperature": temps[nm],
                                    "seed": seed, "ignore_eos": True})
            return {"ms": dt * 1e3, "text": js["choices"][0]["text"], "seed": seed}

        over_http(names[0])                                                                # warm-up
        http_calls[names[0]] = 0
        remote = compare({nm: (lambda nm=nm: over_http(nm)) for nm in names}, repeats=repeats, key=lambda r: r["ms"],
                         noise=ctx.noise, metric="E2E over HTTP", unit="ms")
    same_local = sum(a["tokens"] == b["tokens"] for a, b in zip(local.results[names[0]], local.results[names[1]]))
    same_http = sum(a["text"] == b["text"] for a, b in zip(remote.results[names[0]], remote.results[names[1]]))
    slower = local.winner == names[0] or remote.winner == names[0]
    verdict = HOLDS if slower else FAILS
    det_local, det_http = detectable_ratio(local, worse=names[1]), detectable_ratio(remote, worse=names[1])
    import torch

    f32_equal = torch.tensor(t_std, dtype=torch.float32).item() == torch.tensor(t_odd, dtype=torch.float32).item()
    figure = (f"{local.median(names[1]) / local.median(names[0]) - 1:+.1%} in-process, "
              f"{remote.median(names[1]) / remote.median(names[0]) - 1:+.1%} over HTTP (claimed +18 %); same seeds gave "
              f"identical tokens {same_local + same_http}/{2 * repeats}")
    reason = (
        f"{k}-token sampled completions of one prompt, temperature 0.3 vs 0.1 + 0.2 (sent as 0.30000000000000004: "
        f"json.dumps keeps every digit), each pair with the same seed, {repeats} runs a side interleaved, on the "
        f"paged engine and through `workbench serve`. {local.describe()}. {remote.describe()}. Identical tokens for "
        f"the same seed: {same_local}/{repeats} in-process, {same_http}/{repeats} over HTTP - the sampler divides "
        f"float32 logits by the temperature, and both values are the same float32 ({f32_equal}). This run would have "
        f"called a slowdown beyond {det_local:.2f}x in-process and {det_http:.2f}x over HTTP (the claim: 1.18x; the "
        f"noise floor is {ctx.noise:.0%}). There is no fixed-point path to fall back from.")
    table = [{"side": nm, "temperature_json": json.dumps(temps[nm]), "inproc_ms_median": local.median(nm),
              "inproc_ms_range": list(local.spread(nm)), "http_ms_median": remote.median(nm),
              "http_ms_range": list(remote.spread(nm))} for nm in names]
    return Finding(verdict, figure, reason, values={
        "inproc_comparison": local.as_dict(), "http_comparison": remote.as_dict(), "identical_inproc": same_local,
        "identical_http": same_http, "rounds": repeats, "float32_equal": f32_equal,
        "detectable_ratio": {"inproc": det_local, "http": det_http},
        "noise": ctx.noise}, table=table)


# =================================================================================================
# 6. temperature_zero_top_p
# =================================================================================================
def measure_temperature_zero_top_p(ctx: ClaimContext) -> Finding:
    _ = ctx.noise                                  # the run's noise probe, before any comparison
    import httpx

    from workbench.engine.sampling import SamplingParams

    k, repeats, nprompts = ctx.size(8, 16), ctx.size(2, 3), 4
    prompts = _windows(ctx, nprompts, LOAD_PROMPT_TOKENS, seed=61)
    srv = serving_server(ctx)
    tops = (1.0, 0.99)
    http: dict[float, list] = {p: [] for p in tops}
    with httpx.Client(base_url=srv.url, timeout=60) as client:
        for r in range(repeats):
            for p in (tops if r % 2 == 0 else tops[::-1]):
                _, js = _post(client, {"model": MODEL_NAME, "prompt": prompts, "max_tokens": k, "temperature": 0,
                                       "top_p": p, "logprobs": 1, "ignore_eos": True})
                http[p].append([(c["logprobs"]["tokens"], c["logprobs"]["token_logprobs"])
                                for c in sorted(js["choices"], key=lambda c: c["index"])])
    eng = _engine(ctx, max_num_seqs=nprompts, max_num_batched_tokens=512)
    local: dict[float, list] = {p: [] for p in tops}
    for r in range(repeats):
        for p in (tops if r % 2 == 0 else tops[::-1]):
            outs = eng.generate(prompts, SamplingParams(temperature=0, top_p=p, max_tokens=k, logprobs=1, ignore_eos=True))
            local[p].append([(list(o.token_ids), [e["logprob"] for e in o.logprobs]) for o in outs])
    alone = [eng.generate([pr], SamplingParams(temperature=0, top_p=0.99, max_tokens=k, logprobs=1,
                                               ignore_eos=True))[0] for pr in prompts]
    alone_runs = [(list(o.token_ids), [e["logprob"] for e in o.logprobs]) for o in alone]

    def max_diff(runs_a, runs_b) -> tuple[int, int, float]:
        """(completions compared, identical token sequences, max |logprob difference|)."""
        n = same = 0
        worst = 0.0
        for ra, rb in zip(runs_a, runs_b):
            for (ta, la), (tb, lb) in zip(ra, rb):
                n += 1
                same += ta == tb
                if ta == tb:
                    worst = max(worst, max((abs(x - y) for x, y in zip(la, lb)), default=0.0))
        return n, same, worst

    across = [max_diff(http[1.0], http[0.99]), max_diff(local[1.0], local[0.99])]
    repeat = [max_diff(http[p][:1] * (repeats - 1), http[p][1:]) for p in tops] + \
             [max_diff(local[p][:1] * (repeats - 1), local[p][1:]) for p in tops]
    batch_vs_alone = max_diff(local[0.99][:1], [alone_runs])
    n_across = sum(a[0] for a in across)
    same_across = sum(a[1] for a in across)
    diff_across = max(a[2] for a in across)
    n_rep, same_rep = sum(a[0] for a in repeat), sum(a[1] for a in repeat)
    diff_rep = max(a[2] for a in repeat)
    rep_1 = repeat[0][1] + repeat[2][1] == repeat[0][0] + repeat[2][0] and max(repeat[0][2], repeat[2][2]) == 0
    rep_99 = repeat[1][1] + repeat[3][1] == repeat[1][0] + repeat[3][0] and max(repeat[1][2], repeat[3][2]) == 0
    holds = rep_99 and not rep_1        # 0.99 repeatable where 1.0 is not: the 'stable mode'
    verdict = HOLDS if holds else FAILS
    figure = (f"top_p 1.0 vs 0.99 at temperature 0: identical tokens {same_across}/{n_across}, max |d logprob| "
              f"{diff_across:.1g}; repeats identical {same_rep}/{n_rep} (max |d| {diff_rep:.1g})")
    reason = (
        f"{nprompts} prompts, {k} greedy tokens with log-probabilities, top_p 1.0 and 0.99 interleaved, {repeats} "
        f"times each, over HTTP (one request with the 4 prompts: batched) and in-process; also each prompt alone. "
        f"Across top_p: {same_across}/{n_across} completions token-identical, largest log-probability difference "
        f"{diff_across:g}. Repeats of one setting: {same_rep}/{n_rep} identical, largest difference {diff_rep:g}. "
        f"Batched vs alone (top_p 0.99): {batch_vs_alone[1]}/{batch_vs_alone[0]} identical, max |d| "
        f"{batch_vs_alone[2]:g}. Temperature 0 is greedy (an argmax: top_p never applies) and log-probabilities come "
        f"from the raw logits, so there is no less stable mode for top_p=0.99 to switch off; repeatability comes from "
        f"the engine's batch-invariant attention. Exact counts; the article's '2+2=3.999999' is about a hosted model's "
        f"arithmetic, not testable with this model.")
    table = [{"compared": "top_p 1.0 vs 0.99 (HTTP)", "completions": across[0][0], "identical": across[0][1],
              "max_abs_logprob_diff": across[0][2]},
             {"compared": "top_p 1.0 vs 0.99 (in-process)", "completions": across[1][0], "identical": across[1][1],
              "max_abs_logprob_diff": across[1][2]},
             {"compared": "repeats (all)", "completions": n_rep, "identical": same_rep, "max_abs_logprob_diff": diff_rep},
             {"compared": "batched vs alone", "completions": batch_vs_alone[0], "identical": batch_vs_alone[1],
              "max_abs_logprob_diff": batch_vs_alone[2]}]
    return Finding(verdict, figure, reason, values={
        "completions_across": n_across, "identical_across": same_across, "max_logprob_diff_across": diff_across,
        "completions_repeats": n_rep, "identical_repeats": same_rep, "max_logprob_diff_repeats": diff_rep,
        "repeatable_top_p_1": rep_1, "repeatable_top_p_099": rep_99}, table=table)


# =================================================================================================
# 7. first_sse_chunk_64b
# =================================================================================================
def measure_first_sse_chunk_64b(ctx: ClaimContext) -> Finding:
    _ = ctx.noise                                  # the run's noise probe, before any comparison
    import httpx

    srv = serving_server(ctx)
    k = ctx.size(8, 16)
    prompts = _windows(ctx, 3, LOAD_PROMPT_TOKENS, seed=71)
    tok = ctx.llm().tokenizer
    bodies = [("/v1/completions", {"model": MODEL_NAME, "prompt": p, "max_tokens": k, "stream": True, **GREEDY})
              for p in prompts]
    bodies.append(("/v1/chat/completions", {"model": MODEL_NAME, "messages": [{"role": "user", "content":
                                                                                 tok.decode(prompts[0])}],
                                            "max_tokens": k, "stream": True, **GREEDY}))
    reports = []
    with httpx.Client(base_url=srv.url, timeout=60) as client:
        for path, body in bodies:
            with client.stream("POST", path, json=body) as resp:
                resp.raise_for_status()
                chunks = [c for c in resp.iter_raw() if c]
                rep = sse_report(chunks)
                rep.update(path=path, content_type=resp.headers.get("content-type"),
                           x_chunk_type=resp.headers.get("x-chunk-type"))
                reports.append(rep)
    firsts = [r["first_chunk_bytes"] for r in reports]
    first_events = [r["first_event_bytes"] for r in reports]
    n_lines = sum(r["data_lines"] for r in reports)
    n_parsed = sum(r["lines_parsed_whole"] for r in reports)
    n_events = sum(r["events"] for r in reports)
    n_cut = sum(r["events_cut_by_read64"] for r in reports)
    fixed_64 = all(f == 64 for f in firsts)
    readline_stalls = n_parsed < n_lines
    verdict = HOLDS if fixed_64 or readline_stalls else FAILS
    figure = (f"first chunk {', '.join(map(str, firsts))} bytes (not 64); line parsing read {n_parsed}/{n_lines} "
              f"data lines as whole JSON; read(64) would cut {n_cut}/{n_events} events")
    reason = (
        f"{len(reports)} streamed requests ({len(prompts)} completions, 1 chat) to `workbench serve`, the body read "
        f"with httpx's iter_raw (each piece as it came off the connection). First chunk: {firsts} bytes; first event "
        f"(data line + blank line): {first_events} bytes - its size follows the response id, model name and the "
        f"token's text, nothing fixes it at 64. Chunks that were exactly one whole event: "
        f"{sum(r['chunks_one_whole_event'] for r in reports)}/{sum(r['chunks'] for r in reports)} (the server writes "
        f"one event per body message). Split at newlines, {n_parsed}/{n_lines} data lines parsed as complete JSON: an "
        f"SSE event ends with a blank line and its JSON holds no raw newline, so readline() returns only whole lines; "
        f"reading fixed 64-byte pieces instead would split {n_cut} of {n_events} events. x-chunk-type header: "
        f"{reports[0]['x_chunk_type']!r}. Exact byte counts.")
    table = [{"path": r["path"], "first_chunk_bytes": r["first_chunk_bytes"], "first_event_bytes": r["first_event_bytes"],
              "chunks": r["chunks"], "events": r["events"], "chunks_one_whole_event": r["chunks_one_whole_event"],
              "data_lines_parsed": f"{r['lines_parsed_whole']}/{r['data_lines']}",
              "events_cut_by_read64": r["events_cut_by_read64"],
              "event_bytes_min_max": [min(r["event_bytes"]), max(r["event_bytes"])]} for r in reports]
    return Finding(verdict, figure, reason, values={
        "first_chunk_bytes": firsts, "first_event_bytes": first_events, "data_lines": n_lines,
        "lines_parsed_whole": n_parsed, "events": n_events, "events_cut_by_read64": n_cut,
        "content_type": reports[0]["content_type"]}, table=table)


# =================================================================================================
# 8. ewma_breaker
# =================================================================================================
def measure_ewma_breaker(ctx: ClaimContext) -> Finding:
    _ = ctx.noise                                  # the run's noise probe, before any comparison
    from workbench.engine.sampling import SamplingParams
    from workbench.kv.paged import PagedKVConfig
    from workbench.load import EngineTarget, LoadConfig, LoadRun
    from workbench.measure.compare import compare_quantile
    from workbench.serve.slo import OPEN, GuardedTarget, SLOConfig, SLOGuard

    prompt_len, max_tokens, slots = 48, 16, 4
    blocks = slots * -(-(prompt_len + max_tokens) // 16)
    eng = _engine(ctx, kv=PagedKVConfig(block_size=16, num_blocks=blocks), max_num_seqs=32, max_num_batched_tokens=256)
    pool = _windows(ctx, 600, prompt_len, seed=81)
    eng.generate([pool[-1]], SamplingParams(temperature=0, max_tokens=2))                   # warm-up
    target = EngineTarget(eng)
    try:                                            # capacity now: a closed loop of one user per KV slot
        capacity_run = LoadRun(target, LoadConfig(mode="closed", concurrency=slots, max_requests=4 * slots,
                                                  max_tokens=max_tokens, prompts=lambda i: pool[-2 - i],
                                                  sampling=dict(GREEDY), max_duration_s=60.0)).run()
    except BaseException:
        target.close()
        raise
    done = [r for r in capacity_run.records if r.status == "ok"]
    cap = len(done) / capacity_run.duration_s if done else 1.0
    lo, hi = 0.4 * cap, ctx.size(2.0, 1.6) * cap       # a steeper ramp in the shorter smoke run
    # the warm stage long enough for ~12 healthy requests (the rise is compared from 5 on), however slow the machine
    warm_s, ramp_s = max(ctx.size(1.5, 2.5), 12.0 / lo), ctx.size(1.5, 3.0)
    # the real guard in front of the engine, in shadow: priority 0 bypasses it, so it opens (its state machine
    # runs on every request's TTFT) but sheds nothing and the degradation runs on for everyone to see
    cfg = SLOConfig(factor=2.5, window=20, min_samples=10, cooldown_s=600.0, probes=3, bypass_priorities=(0,))
    guard = SLOGuard(cfg)
    breaker = ErrorRateBreaker(threshold=0.05, window=20, min_samples=10)

    def watch(run, rec) -> None:                    # the error-rate breaker sees every result as it comes
        if rec is not None and rec.status in ("ok", "error"):
            breaker.record(rec.status == "error", run.t_start + (rec.end or 0.0))

    try:
        run = LoadRun(GuardedTarget(target, guard),
                      LoadConfig(mode="poisson", rate=lo, stages=[(warm_s, lo, "warm"), (ramp_s, hi, "ramp")],
                                 max_tokens=max_tokens, prompts=lambda i: pool[i % (len(pool) - 40)], seed=8,
                                 sampling=dict(GREEDY), tick_s=0.05, max_duration_s=warm_s + ramp_s + 30.0),
                      observers=[watch])
        res = run.run()
    finally:
        target.close()
    t0 = run.t_start
    recs = res.records
    errors = sum(r.status == "error" for r in recs)
    trip = next((t for t, _a, b, _why in guard.transitions if b == OPEN), None)
    trip_why = next((why for _t, _a, b, why in guard.transitions if b == OPEN), None)
    # the degradation's onset: from when on requests were waiting for KV in most steps, up to the trip
    onset = degradation_onset(list(eng.step_records), since=t0, until=trip)
    ok = sorted((r for r in recs if r.status == "ok" and r.ttft is not None), key=lambda r: r.token_times[0])
    warm_ttft = [r.ttft * 1e3 for r in ok if r.stage == 0]
    end_ttft = [r.ttft * 1e3 for r in ok[-cfg.window:]]     # the last requests served: the end of the ramp
    rise = (compare_quantile(warm_ttft, end_ttft, q=0.5, names=("warm", "end of the ramp"), noise=ctx.noise,
                             metric="TTFT median", unit="ms") if len(warm_ttft) >= 5 and len(end_ttft) >= 5 else None)
    rose = rise is not None and rise.winner == "warm"
    tripped = trip is not None
    false_alarm = tripped and (onset is None or trip < onset)
    verdict = HOLDS if (errors == 0 and tripped and not false_alarm and rose and not breaker.open) else FAILS
    delay = (trip - onset) if tripped and onset is not None and not false_alarm else None
    delay_req = sum(1 for r in recs if delay is not None and onset <= t0 + r.sent <= trip)
    p50_w, p50_e = _pct(warm_ttft, 50), _pct(end_ttft, 50)
    snap = guard.snapshot()
    if delay is not None:
        caught = (f"opened {delay:.2f} s ({delay_req} request{'' if delay_req == 1 else 's'} sent) after requests began "
                  "waiting for KV")
    elif false_alarm:
        caught = "opened before the pool filled (a false alarm)"
    else:
        caught = "never opened"
    figure = (f"TTFT p50 {p50_w:.0f} -> {p50_e:.0f} ms with {errors} errors in {len(recs)} requests: error-rate breaker "
              f"{'opened' if breaker.open else 'never opened'}; EWMA SLO guard {caught}")
    reason = (
        f"An engine whose KV pool holds {slots} requests ({blocks} blocks of 16; {prompt_len}-token prompts, "
        f"{max_tokens} tokens each) under Poisson load: {warm_s:.1f} s at {lo:.1f}/s, then a ramp to {hi:.1f}/s over "
        f"{ramp_s:g} s (capacity {cap:.1f}/s, measured just before by a closed loop of {slots} users). In front of it the real SLO guard (workbench.serve.slo.GuardedTarget + SLOGuard: P95 TTFT over "
        f"{cfg.window} requests vs {cfg.factor:g}x an EWMA baseline learned while healthy), in shadow (it opens but "
        f"admits everyone, so the same run shows what happens without shedding). As the pool fills, requests wait for "
        f"blocks and nothing fails: {errors} errors, so the error-rate breaker (> {breaker.threshold:.0%} of the last "
        f"20) saw {breaker.seen} results and {'opened' if breaker.open else 'never opened'}. TTFT: "
        f"{rise.describe() if rise is not None else 'too few requests'}. The guard learned a baseline of "
        f"{(snap['baseline_s'] or 0) * 1e3:.1f} ms and {'opened: ' + trip_why if tripped else 'never opened'}; its "
        f"detection delay is measured from the degradation's onset: the first engine step from which 3 in 4 steps "
        f"left requests waiting for KV (the pool full). Checked: the mechanism on this engine (a slow degradation with 0 errors, caught by the latency "
        f"breaker, missed by the error-rate one); the article's 75 -> 220 ms are its service's.")
    table = [{"phase": "warm", "requests_ok": len(warm_ttft), "ttft_p50_ms": p50_w, "ttft_p95_ms": _pct(warm_ttft, 95)},
             {"phase": "end of the ramp", "requests_ok": len(end_ttft), "ttft_p50_ms": p50_e,
              "ttft_p95_ms": _pct(end_ttft, 95)}]
    return Finding(verdict, figure, reason, values={
        "capacity_qps": cap, "errors": errors, "requests": len(recs), "guard_opened": tripped,
        "false_alarm": false_alarm, "error_breaker_opened": breaker.open, "detection_delay_s": delay,
        "detection_delay_requests": delay_req, "baseline_ms": (snap["baseline_s"] or 0) * 1e3,
        "ttft_p50_ms": {"warm": p50_w, "end": p50_e}, "rise_comparison": None if rise is None else rise.as_dict(),
        "trip_reason": trip_why, "noise": ctx.noise}, table=table)


# =================================================================================================
# 9. priority_header
# =================================================================================================
def measure_priority_header(ctx: ClaimContext) -> Finding:
    _ = ctx.noise                                  # the run's noise probe, before any comparison
    from workbench.measure.compare import compare_quantile

    cap = serving_capacity(ctx)
    rate = 3.0 * cap["qps"]
    n = ctx.size(48, 128)
    every = 4
    prompts = _Prompts(ctx, _next_offset(ctx, n))             # the same prompts in both runs
    marked = lambda i: i % every == 0
    order = ctx.size(("priority", "none"), ("priority", "none", "none", "priority"))
    runs: dict[str, list] = {"priority": [], "none": []}
    for k, side in enumerate(order):
        prio = (lambda i: 1 if marked(i) else 0) if side == "priority" else 0
        res = _http_load(ctx, prompts=prompts, mode="poisson", rate=rate, max_requests=n, seed=90,
                         priority=prio)
        runs[side].append(res)

    def vals(side, field, want_marked=True):
        return [getattr(r, field) * 1e3 for res in runs[side] for r in res.records
                if r.status == "ok" and marked(r.id) == want_marked and getattr(r, field) is not None]

    names = ("no priority", "x-priority: 1")
    ttft = compare_quantile(vals("none", "ttft"), vals("priority", "ttft"), q=0.95, names=names, noise=ctx.noise,
                            metric="TTFT P95 of the marked requests", unit="ms")
    e2e = compare_quantile(vals("none", "e2e"), vals("priority", "e2e"), q=0.95, names=names, noise=ctx.noise,
                           metric="E2E P95 of the marked requests", unit="ms")
    others = compare_quantile(vals("none", "e2e", False), vals("priority", "e2e", False), q=0.95, names=names,
                              noise=ctx.noise, metric="E2E P95 of the other requests", unit="ms")
    holds = e2e.winner == names[1]
    verdict = HOLDS if holds else FAILS
    cut_e2e = 1 - e2e.median(names[1]) / e2e.median(names[0])
    cut_ttft = 1 - ttft.median(names[1]) / ttft.median(names[0])
    not_ok = {s: sum(r.status != "ok" for res in runs[s] for r in res.records) for s in runs}
    figure = (f"marked requests' P95 E2E {e2e.median(names[0]):.0f} -> {e2e.median(names[1]):.0f} ms ({-cut_e2e:+.0%}), "
              f"TTFT {ttft.median(names[0]):.0f} -> {ttft.median(names[1]):.0f} ms ({-cut_ttft:+.0%}) at "
              f"{rate / cap['qps']:.1f}x capacity (claimed -22 %)")
    reason = (
        f"Overload: Poisson at {rate:.1f} requests/s ({rate / cap['qps']:.1f}x the {cap['qps']:.1f}/s capacity) for "
        f"{n} requests over HTTP, every {every}th marked; the same seeded trace and prompts run with the marked "
        f"requests sending `x-priority: 1` and with no priority ({len(order)} runs, {'/'.join(order)}). This server "
        f"reads `x-priority` (an integer, higher first: admission order and preemption), not the article's "
        f"`X-Request-Priority: high`. {e2e.describe()}. {ttft.describe()}. The cost moves to the others: "
        f"{others.describe()}. Requests not completed: {not_ok}. Checked: the direction under overload; the size depends on the "
        f"load and on the share of marked requests (the article's -22 % is its service's).")
    table = [{"requests": label, "side": nm, "p95_ttft_ms": c1.median(nm), "p95_e2e_ms": c2.median(nm)}
             for label, c1, c2 in (("marked", ttft, e2e),) for nm in names] + \
            [{"requests": "others", "side": nm, "p95_e2e_ms": others.median(nm)} for nm in names]
    return Finding(verdict, figure, reason, values={
        "rate": rate, "capacity_qps": cap["qps"], "requests": n, "e2e_cut": cut_e2e, "ttft_cut": cut_ttft,
        "e2e_comparison": e2e.as_dict(), "ttft_comparison": ttft.as_dict(), "others_comparison": others.as_dict(),
        "not_ok": not_ok, "noise": ctx.noise}, table=table)


# =================================================================================================
# 10. concurrency_sweet_spot
# =================================================================================================
def measure_concurrency_sweet_spot(ctx: ClaimContext) -> Finding:
    _ = ctx.noise                                  # the run's noise probe, before any comparison
    levels = list(ctx.size((2, 8, 32), (1, 2, 4, 6, 8, 12, 16, 24, 32)))
    per_user, min_n = ctx.size(3, 5), ctx.size(8, 16)
    serving_server(ctx)
    _http_load(ctx, mode="closed", concurrency=4, max_requests=8)              # warm-up
    lat, rows = {}, []
    for c in levels:
        res = _http_load(ctx, mode="closed", concurrency=c, max_requests=max(min_n, per_user * c))
        # Little's law wants the steady state: each user's first request (all users start at once) is left out
        firsts = {min((r for r in res.records if r.user == u), key=lambda r: r.sent).id
                  for u in {r.user for r in res.records}}
        lat[c] = [r.e2e * 1e3 for r in res.records if r.status == "ok" and r.id not in firsts and r.e2e is not None]
        s = res.summary().loc["all"]
        rows.append({"concurrency": c, "requests_measured": len(lat[c]), "tokens_per_s": float(s["tokens_per_s"]),
                     "e2e_mean_ms": statistics.mean(lat[c]) if lat[c] else math.nan, "e2e_p50_ms": _pct(lat[c], 50),
                     "e2e_p95_ms": _pct(lat[c], 95), "ttft_p95_ms": float(s["ttft_p95_ms"])})
    spot = sweet_spot(levels, lat, ctx.noise)
    for r in rows:
        r["requests_per_s"] = spot["throughput"].get(r["concurrency"], math.nan)
        r["power"] = spot["power"].get(r["concurrency"], math.nan)
    star, top, best = spot["sweet_spot"], levels[-1], spot["best"]
    verdict = HOLDS if spot["found"] else FAILS
    pw, lc = spot["power_comparison"], spot["latency_comparison"]
    row = {r["concurrency"]: r for r in rows}
    tp = spot["throughput"]
    if star is None:
        figure = f"no sweet spot measured ({spot['why']})"
    else:
        figure = (f"{'sweet spot' if spot['found'] else 'no sweet spot below the largest level; best throughput / latency'}"
                  f" at {star} users ({tp[star]:.1f} req/s, P95 {row[star]['e2e_p95_ms']:.0f} ms); at {top}: "
                  f"{tp[top]:.1f} req/s ({tp[top] / tp[star] - 1:+.0%}), P95 {row[top]['e2e_p95_ms']:.0f} ms"
                  if top in tp else f"best throughput / latency at {star} users")
    if star is None or star == SERVER_SEQS:
        slot_note = "at that limit is set by it"
    elif star < SERVER_SEQS:
        slot_note = "below that limit is the engine and the process saturating"
    else:
        slot_note = "above that limit means users waiting in the queue still paid off"
    reason = (
        f"Closed loop over HTTP at {', '.join(map(str, levels))} users ({LOAD_MAX_TOKENS}-token greedy completions, "
        f"no think time, {per_user} requests per user, at least {min_n}; each user's first request, sent by all users "
        f"at once, left out). Throughput per level by Little's law (users / mean E2E); the sweet spot = the most "
        f"throughput per unit of latency (Kleinrock's power, throughput / mean E2E): below it users add throughput "
        f"almost for free, past it mostly latency. Best power at {star} users (max throughput at {best}). "
        f"{pw.describe() if pw is not None else spot['why']}. "
        f"{lc.describe() + '. ' if lc is not None else ''}The server runs up to {SERVER_SEQS} sequences at once (more "
        f"users wait in its queue): a sweet spot {slot_note}; the load generator shares the process. The article's 6 "
        f"users, P95 1.3 s on an A100 and mean 2.1 s at 10 are its hardware's; checked here: that a sweet spot exists "
        f"(past it latency climbs faster than throughput) and where it lies on this machine.")
    return Finding(verdict, figure, reason, values={
        "levels": levels, "sweet_spot": star, "best_throughput_at": best, "found": spot["found"],
        "requests_per_s": {c: tp.get(c) for c in levels}, "power": {c: spot["power"].get(c) for c in levels},
        "e2e_p95_ms": {c: row[c]["e2e_p95_ms"] for c in levels},
        "power_comparison": None if pw is None else pw.as_dict(),
        "latency_comparison": None if lc is None else lc.as_dict(), "noise": ctx.noise}, table=rows)


# =================================================================================================
CLAIMS = [
    Claim("prefix_ttft_spread",
          "50 prompts with the same opening and different endings: cross-request KV reuse narrows the TTFT spread "
          "from +-42 ms to +-8 ms, 'proving a hit rate above 92 %'; with a ~1000-token system prompt and 50 user "
          "queries, a TTFT standard deviation above 15 ms means reuse is not working",
          "A §2 (layer 2), §4.1", "prefix cache", "cpu", measure_prefix_ttft_spread),
    Claim("microbatch_window",
          "vLLM schedules at 16 ms granularity, a 0.8 ms micro-batch window instead gives a mean queue wait of "
          "0.12 ms at 1000 QPS and cuts GPU idle time from 11.3 % to 1.7 %",
          "A §2 (layer 4)", "scheduler", "cpu", measure_microbatch_window),
    Claim("p95_vs_load",
          "P95 latency stays flat at 0.45-0.49 s from 50 to 800 QPS (traditional services: P95 x2-3 from 100 to "
          "500 QPS)", "A §3.1", "serving", "cpu", measure_p95_vs_load),
    Claim("max_tokens_fast_path",
          "max_tokens >= 1.8 x input tokens activates the optimal path: input 500, max_tokens 900 -> P95 0.47 s; "
          "max_tokens 512 -> 0.63 s", "A §3.2", "serving", "cpu", measure_max_tokens_fast_path),
    Claim("temperature_float",
          "temperature 0.30000000000000004 (not a 'standard' float) triggers a software fallback path: +18 % latency",
          "A §3.2", "serving", "cpu", measure_temperature_float),
    Claim("temperature_zero_top_p",
          "temperature=0 needs top_p=0.99 to activate a 'numerically stable mode'",
          "A §5.2 (tip 2)", "serving", "cpu", measure_temperature_zero_top_p),
    Claim("first_sse_chunk_64b",
          "the first stream chunk is a fixed 64 bytes including metadata; readline() may stall on half a JSON "
          "object, so read(64) first", "A §3.2", "serving", "cpu", measure_first_sse_chunk_64b),
    Claim("ewma_breaker",
          "the typical failure is slow degradation (KV pool full: TTFT 75 -> 220 ms with 0 % errors), so circuit "
          "breakers must trip on a latency threshold learned by EWMA, not on error rate",
          "A §4.2", "serving", "cpu", measure_ewma_breaker),
    Claim("priority_header",
          "the header X-Request-Priority: high lowers P95 latency by 22 % under high load",
          "B §5.3", "scheduler", "cpu", measure_priority_header),
    Claim("concurrency_sweet_spot",
          "the best concurrency is 6 (A100, P95 1.3 s); past 8 latency climbs steeply; 10 concurrent -> mean 2.1 s",
          "B §5.3", "serving", "cpu", measure_concurrency_sweet_spot),
]
