"""The serving claims' shared pieces: held-out prompts, engines on the run's one loaded model, the
server, the load generator (see :mod:`workbench.bench.claims.catalogue` for the claims).

Ten claims about the serving side - the prefix cache seen from TTFT, the micro-batch window,
latency under load, request parameters, the stream's wire format, circuit breakers, priorities
and concurrency - each measured on this machine with the package's own parts: the engine
(:class:`~workbench.engine.core.LLMEngine` on the one loaded model, ``ctx.llm().loaded``), its
scheduler, ``workbench serve`` (:func:`~workbench.serve.server.start_server`, in this process on a
free port) and the load generator (:mod:`workbench.load`).  They are measured in
:mod:`~workbench.bench.claims.serving_engine` (claims 1-2), :mod:`~workbench.bench.claims.serving_load`
(3, 8-10) and :mod:`~workbench.bench.claims.serving_requests` (4-7).

**What is compared, and how.**  Every A/B comparison goes through :mod:`workbench.measure.compare`
with the run's noise floor (``ctx.noise``): interleaved repeats whose ranges must not overlap
(:func:`~workbench.measure.compare.compare`), or, for one load run a side, bootstrap intervals of a
percentile (:func:`~workbench.measure.compare.compare_quantile`) or of another statistic
(:func:`~workbench.bench.claims.serving_rules.compare_statistic`: the standard deviation of TTFT).
Wire-format and determinism claims are exact counts (bytes, identical tokens and
log-probabilities).  A claimed effect this run cannot separate from the noise *does not hold
here*, and the finding says how large an effect the run could have seen
(:func:`~workbench.bench.claims.serving_rules.detectable_ratio`).  The articles' absolute numbers
(ms, QPS of a hosted service on H100s / A100s) are not this machine's: the load claims scale the
offered load to the capacity measured here, and each finding says which part of the claim it checks.

**The server** (claims 3, 5, 6, 7, 9, 10) is started once per run (:func:`serving_server`, cached
in ``ctx.scratch``) and stopped by ``ctx.close()`` (which :func:`~workbench.bench.claims.core.run_claims`
calls; an ``atexit`` hook is the fallback).  Its engine: the paged pool without prefix caching
(so that a prompt sent twice, in an A/B pair of load runs, is computed twice), up to
:data:`SERVER_SEQS` sequences at once (more wait in its queue, where priorities act), a
512-token step budget.  The load generator runs in the same process: its own work (httpx, SSE
parsing) and the server's event loop share the two cores - and Python's GIL - with the engine
thread, which is part of what a load run here measures (the engine's steps are slower under HTTP
load than the same batch computed alone).
"""

from __future__ import annotations

import atexit
import math

from workbench.bench.claims.core import ClaimContext

MODEL_NAME = "bundled"            # the served model's name (GET /v1/models)
SERVER_SEQS = 16                  # the shared server's max_num_seqs (beyond it requests wait in its queue)
SERVER_BUDGET = 512               # its max_num_batched_tokens
LOAD_PROMPT_TOKENS = 32           # prompts of the load claims (token ids of held-out text)
LOAD_MAX_TOKENS = 8               # tokens per request in the load claims
GREEDY = {"temperature": 0.0, "ignore_eos": True}

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
    # its own loopback server, whose clients are this run's: the priority claim sends x-priority
    h = start_server(eng, ServerConfig(port=0, model_name=MODEL_NAME, trust_priority_header=True))
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
