"""The OpenAI-compatible HTTP app over an :class:`~workbench.sched.AsyncEngine` (Starlette).

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (JSON or ``stream: true``
Server-Sent Events), ``GET /v1/models``, ``GET /health``, ``GET /metrics``, and one of
workbench's own (no OpenAI-compatible server has it): ``GET /v1/workbench/kv``, the engine's
live paged KV pool as JSON (:func:`kv_pool_report`; ``workbench kv-inspect --url`` shows it).

A request's path through the server: the body is read (at most ``max_body_bytes``, else 413),
its Content-Type checked (JSON or none, else 415), parsed and validated (:mod:`.protocol`: 400
naming the field; too deeply nested, not UTF-8, lone surrogates: 400 too), its model name checked
(404), its prompt measured against the context - first from its byte length alone (a lower bound
on its tokens, :attr:`~workbench.model.tokenizer.Tokenizer.max_token_bytes`), then tokenized - and
against the KV pool (prompt + ``max_tokens`` must fit it: a request that never can is a 400
``context_length_exceeded`` at once, not a failure later) and the ``max_tokens`` cap (400).
Parsing, tokenizing and checking run on worker threads (:data:`PREP_THREADS` at once), never on
the event loop, which relays every open stream: a 1 MiB prompt must not stall them (tokenizing
one takes ~0.6 s; ``Tokenizer.encode_nogil`` does it with the GIL released).  Then
:class:`~.completion.Completion` submits its choices to the engine (``n`` samples of each prompt, forked
from one prefill) and relays the engine's events (their text is detokenized on the engine thread).  A request the engine ends before any token ("rejected": queue full -> 429 with
``Retry-After``; rejected for any other reason, e.g. too big for the KV pool -> 400, which clients
do not retry, since retrying cannot help; "error" -> 500) is answered
with that HTTP status even when streaming, because the stream's headers are sent with the first
token; after that, such an ending is an SSE ``data: {"error": ...}`` event before
``data: [DONE]``.  When the client disconnects, the request is aborted and its KV blocks go back
to the pool.

Errors are always in OpenAI's JSON shape: an unexpected exception is a 500 with code
``internal_error`` (its traceback goes to the ``workbench.serve`` logger), and a stream already
under way ends with an error event.  ``/health`` shows the engine's ``last_error`` only while it
is current - until the engine produces a token after it - and ``engine_error`` tells the last one
with when it was seen and whether (and when) the engine recovered (:class:`EngineErrors`).

Every response carries ``x-model-info``: one line of JSON describing the engine that served it
(model, device, dtype, KV pool, scheduler, per-op backends when known) and ``x-request-id`` for
completions.  ``x-priority: <int>`` (higher first) sets the request's scheduling priority.  With an
API key, ``/v1/*`` needs ``Authorization: Bearer <key>`` (the scheme in any case, RFC 7235).

An optional SLO guard (:mod:`.guard`; e.g. :class:`workbench.serve.slo.SLOGuard`) is asked
before each valid request reaches the engine: when it sheds, the answer is ``503`` with its
reason and ``Retry-After``; every first token's TTFT is fed back to it, and its state is on
``/metrics``.  With the guard's queue policy (``SLOConfig(policy="queue")``) a deferred request
is held instead - the server sleeps the guard's ``retry_after`` and asks again - and is served
once admitted, or answered ``503`` when the guard's ``queue_timeout_s`` has passed; a client
that disconnects while held is dropped (nothing reaches the engine).  Time held is not part of
the request's TTFT (that counts from arrival at the engine); ``/metrics`` counts held requests
and their time held.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path

import anyio
import anyio.to_thread
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from workbench.errors import ConfigError, WorkbenchError
from workbench.kv.inspect import KV_POOL_OBJECT, KV_POOL_PATH, pool_report_from_thread
from workbench.engine.sampling import SamplingParams
from workbench.model.tokenizer import utf8_len
from workbench.serve import protocol as P
from workbench.serve.chat_template import ChatTemplate, TemplateError
from workbench.serve.completion import Completion, PromptPlan, engine_alive, internal_error, send_json
from workbench.serve.guard import GuardHook, check_guard
from workbench.serve.metrics import ServerMetrics

LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
log = logging.getLogger("workbench.serve")

# Request bodies parsed and prompts tokenized at once, on worker threads (more wait their turn, the
# event loop free meanwhile): one per 4 cores, 1 to 4, so that big prompts leave the engine its cores.
# Not more: work that holds the GIL (JSON parsing; a tokenizer that does not release it) on two
# threads at once starves the engine thread of the GIL (measured: a 0.3 s GIL-holding tokenization on
# each of 2 threads gave a stream 90-320 ms gaps; on 1 thread, 50-90 ms; alone 10-20 ms).
PREP_THREADS = max(1, min(4, (os.cpu_count() or 1) // 4))


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"            # 0.0.0.0 exposes the server to the network: set api_key then
    port: int = 8000                   # 0: pick a free port
    model_name: str | None = None      # the served name (GET /v1/models); None: from the model's source
    api_key: str | None = None         # require "Authorization: Bearer <key>" on /v1/*
    max_tokens_cap: int | None = None  # the largest max_tokens a request may ask for; None: the model's context
    max_body_bytes: int = 1 << 20      # larger request bodies get 413
    default_max_tokens: int = 16       # /v1/completions without max_tokens (OpenAI's default); chat: to the context
    log_level: str = "warning"         # uvicorn's
    guard: object | None = None        # an SLO guard (admit/record, see .guard): sheds with 503 + Retry-After,
                                       # or holds requests first when its config.policy is "queue"

    def __post_init__(self) -> None:
        def need(ok: bool, name: str, why: str) -> None:
            if not ok:
                raise ConfigError(f"ServerConfig.{name}={getattr(self, name)!r} {why}")
        need(isinstance(self.host, str) and bool(self.host), "host", "must be a host name or IP address")
        need(isinstance(self.port, int) and 0 <= self.port <= 65535, "port", "must be an integer in [0, 65535]")
        need(self.model_name is None or (isinstance(self.model_name, str) and bool(self.model_name)), "model_name",
             "must be a non-empty string or None")
        need(self.api_key is None or (isinstance(self.api_key, str) and bool(self.api_key)), "api_key",
             "must be a non-empty string or None")
        for name in ("max_tokens_cap", "max_body_bytes", "default_max_tokens"):
            v = getattr(self, name)
            need((v is None and name == "max_tokens_cap") or (isinstance(v, int) and v >= 1), name,
                 "must be an integer >= 1" + (" or None" if name == "max_tokens_cap" else ""))
        need(self.log_level in LOG_LEVELS, "log_level", f"must be one of {', '.join(LOG_LEVELS)}")
        if self.guard is not None:
            check_guard(self.guard)


def model_info(aengine, name: str, source: str | None = None, guard: GuardHook | None = None,
               chat_template: ChatTemplate | None = None) -> dict:
    """The engine configuration that serves requests (the ``x-model-info`` header, as a dict)."""
    eng = aengine.engine
    llm, pool, cfg = eng.llm, eng.pool, eng.config
    folder = Path(llm.tokenizer.path).parent if llm.tokenizer is not None else None
    info = {"model": name, "path": source or (str(folder) if folder else None),
            "architecture": getattr(eng.model.config, "architecture", None), "device": str(eng.device),
            "dtype": str(eng.model.lm_head.weight.dtype).removeprefix("torch."), "max_model_len": llm.max_model_len,
            "block_size": pool.block_size, "num_blocks": pool.num_blocks,
            "prefix_caching": pool.config.enable_prefix_caching,
            "scheduler": {k: getattr(cfg, k) for k in ("max_num_seqs", "max_num_batched_tokens", "chunked_prefill",
                                                        "micro_batch_window_s", "preemption_mode",
                                                        "priority_preemption", "max_queue_len")},
            "chat_template": chat_template.origin if chat_template is not None else P.CHAT_TEMPLATE_NAME}
    if hasattr(eng, "fast_paths"):    # KV layout, static decode / compile / CUDA graphs, sampling backend
        info["engine"] = eng.fast_paths()
    choice = getattr(llm, "thread_choice", None)
    if choice is not None:   # torch intra-op threads and why (workbench.measure.threads)
        info["threads"] = choice.threads
        info["threads_policy"] = choice.policy
    try:
        from workbench.transforms import backends         # another layer; may be absent or still changing
    except Exception as e:  # noqa: BLE001 - the header must not take the server down
        info["backends_error"] = f"cannot import workbench.transforms.backends: {type(e).__name__}: {e}"
    else:
        describe = (getattr(backends, "describe_backends", None) if hasattr(backends, "describe_backends")
                    else getattr(backends, "current_backends", None))
        if describe is not None:
            try:
                info["backends"] = describe(eng.model)
            except Exception as e:  # noqa: BLE001
                info["backends_error"] = f"{type(e).__name__}: {e}"
    if guard is not None:
        info["slo_guard"] = guard.describe()
    return info


def kv_pool_report(aengine, name: str) -> dict:
    """``GET /v1/workbench/kv``: :func:`~workbench.kv.inspect.pool_report` of the engine's live
    paged KV pool (``block_states`` included: one state per physical block, for a block map),
    each live request's prefix reuse, plus ``object`` ("workbench.kv_pool") and ``server``:
    the served model, whether the engine thread runs, its last stats and how the snapshot was
    taken.

    The engine thread changes the pool during a step without a lock (as ``/metrics`` it is not
    stopped for a reader), so the report is read by
    :func:`~workbench.kv.inspect.pool_report_from_thread`: retried while the pool changes under
    it, kept when nothing changed during the read and its parts agree (``server.snapshot.stable``);
    503 with ``Retry-After`` if every read failed.  Blocking (it
    sleeps between tries): the route runs it on a worker thread, off the event loop."""
    eng = aengine.engine
    pool = getattr(eng, "kv_pool", None)
    if pool is None or not hasattr(pool, "manager"):
        kind = getattr(eng, "kv_mode", "another")
        raise P.APIError(501, f"this engine keeps KV in a {kind} cache per request, not a paged pool: nothing to "
                              "inspect here", None, "no_kv_pool")
    try:
        rep = pool_report_from_thread(pool)
    except WorkbenchError as e:                 # every read was torn: the engine is busy, ask again
        raise P.APIError(503, str(e), None, "kv_pool_busy", {"Retry-After": "1"}) from None
    snapshot = rep.pop("snapshot")
    alive = engine_alive(aengine)
    return {"object": KV_POOL_OBJECT, **rep,
            "server": {"model": name, "engine_alive": alive, "last_error": aengine.last_error,
                       "engine": aengine.stats(), "snapshot": snapshot}}


class _Dropped:
    """The answer to a client that went away before it was answered: nothing is sent."""

    async def __call__(self, scope, receive, send) -> None:
        return None


async def _wait_disconnect(receive) -> None:
    """Return when the client disconnects (the request body has been read already)."""
    while (await receive())["type"] != "http.disconnect":
        pass


def _json_response(status: int, obj: dict, headers: dict | None = None) -> Response:
    return Response(P.json_bytes(obj), status_code=status, headers=headers or None, media_type="application/json")


# ---- engine errors, as /health tells them -------------------------------------------------------------
class EngineErrors:
    """The engine's last error and whether it is still current, for ``/health``.

    :class:`~workbench.sched.AsyncEngine` keeps ``last_error`` forever (no time, never cleared), so
    the server follows it: an error is new when ``last_error`` changes or the engine's
    ``last_step_error`` is another exception (a step that failed again the same way); it is
    noticed when an event ends a request with "error" (a failed step ends the requests it held)
    or when ``/health`` is asked, and stays current until the engine produces a token after it
    (on the engine's clock: a token computed before the error and delivered late does not count).
    An error that repeats a message word for word outside a step (``last_error`` unchanged) is not
    told apart.  Updated on the event loop only."""

    def __init__(self, aengine) -> None:
        self.aengine = aengine
        self.message: str | None = None   # the last error
        self.at: float | None = None      # when the server noticed it (Unix time)
        self.engine_at = 0.0              # ... on the engine's clock: tokens after this show recovery
        self.recovered_at: float | None = None
        self._seen: tuple = (None, None)  # (last_error, last_step_error) when last looked
        self.sync(aengine.engine.clock())

    @property
    def current(self) -> bool:
        return self.message is not None and self.recovered_at is None

    def sync(self, engine_at: float) -> None:
        """Notice an error not seen yet (``engine_at``: the engine's clock when it happened, or now)."""
        msg = self.aengine.last_error
        step_error = getattr(self.aengine.engine, "last_step_error", None)
        if msg == self._seen[0] and step_error is self._seen[1]:
            return
        self._seen = (msg, step_error)
        if msg is None and step_error is None:
            return
        self.message = msg or f"{type(step_error).__name__}: {step_error}"
        self.at, self.engine_at, self.recovered_at = time.time(), engine_at, None

    def event(self, ev) -> None:
        """One engine event of a request this server runs (cheap unless it matters)."""
        if ev.finish_reason == "error":
            self.sync(ev.time)
        elif ev.token_id >= 0 and self.current and ev.time > self.engine_at:
            self.recovered_at = time.time()

    def report(self, alive: bool) -> tuple[str | None, dict | None]:
        """(``last_error`` while current, else None; the last error with its times, or None)."""
        self.sync(self.aengine.engine.clock())
        if self.message is None:
            return None, None
        recovered = alive and self.recovered_at is not None
        return (None if recovered else self.message), {
            "message": self.message, "at": self.at, "recovered": recovered,
            "recovered_at": self.recovered_at if recovered else None}


# ---- the app ---------------------------------------------------------------------------------------
class _State:
    def __init__(self, aengine, config: ServerConfig, source: str | None) -> None:
        self.aengine, self.config = aengine, config
        llm = aengine.engine.llm
        default = "bundled" if source in (None, "bundled") else source
        self.name = config.model_name or default
        self.llm = llm
        self.metrics = ServerMetrics()
        self.errors = EngineErrors(aengine)
        getattr(llm.tokenizer, "max_token_bytes", None)    # worked out now (it reads the vocabulary), not per request
        folder = Path(llm.tokenizer.path).parent if llm.tokenizer is not None else None
        self.chat_template = ChatTemplate.from_folder(folder) if folder is not None else None
        self._prep: anyio.CapacityLimiter | None = None    # made on the event loop, at first use
        self.guard = GuardHook(config.guard) if config.guard is not None else None
        self.info = model_info(aengine, self.name, None if source in (None, "bundled") else source, self.guard,
                               self.chat_template)
        self.info_header = json.dumps(self.info, separators=(",", ":")).encode()   # ASCII: json escapes the rest

    def refresh_model_info(self) -> dict:
        """Recompute ``x-model-info`` (e.g. after switching op backends in a notebook)."""
        self.info = model_info(self.aengine, self.name, self.info.get("path"), self.guard, self.chat_template)
        self.info_header = json.dumps(self.info, separators=(",", ":")).encode()
        return self.info

    async def off_loop(self, fn, *args):
        """``fn(*args)`` on a worker thread (at most :data:`PREP_THREADS` at once): parsing bodies,
        tokenizing and checking prompts.  The loop only waits; other streams go on."""
        if self._prep is None:
            self._prep = anyio.CapacityLimiter(PREP_THREADS)
        return await anyio.to_thread.run_sync(fn, *args, limiter=self._prep)

    def guard_call(self, fn, *args) -> None:
        """Feed the guard; a failing guard is counted on /metrics, never fails the request."""
        try:
            fn(*args)
        except Exception as e:  # noqa: BLE001
            self.metrics.guard_error(f"{type(e).__name__}: {e}")

    def _ask(self, priority: int):
        try:
            return self.guard.admit(priority)
        except Exception as e:  # noqa: BLE001 - a broken guard is a server error, said plainly
            self.metrics.guard_error(f"{type(e).__name__}: {e}")
            raise P.APIError(500, f"the SLO guard failed: {type(e).__name__}: {e}", None, "slo_guard_error") from None

    async def admit(self, priority: int, receive=None) -> bool | None:
        """Ask the SLO guard.  Returns whether this is a half-open probe, or None when the
        client disconnected while the guard's queue held the request (``receive``: the ASGI
        receive, watched while holding); raises the 503 when the guard sheds it - at once, or,
        with the queue policy, when its ``queue_timeout_s`` has passed."""
        if self.guard is None:
            return False
        a = self._ask(priority)
        held = timeout = outcome = None
        if not a.admitted and a.retry_after is not None:
            timeout = self.guard.queue_timeout_s()
            if timeout is not None:
                a, held, outcome = await self._hold(a, priority, timeout, receive)
                if outcome == "disconnected":
                    return None
        if a.admitted:
            return a.probe
        self.metrics.shed()
        wait = self.guard.retry_after_s(a)
        reason, code = a.reason or "no reason given", "slo_guard_shed"
        if held is not None:
            reason += f"; held {held:.2f} s by its queue"
            if outcome == "timed_out":
                reason += f", whose timeout is {timeout:g} s"
                code = "slo_guard_queue_timeout"
        raise P.APIError(503, f"shed by the SLO guard: {reason} (retry after {wait} s)", None, code,
                         {"Retry-After": str(wait)})

    async def _hold(self, a, priority: int, timeout: float, receive):
        """Hold a request the guard deferred: sleep its ``retry_after``, ask again, until admitted,
        refused outright, ``timeout`` seconds have passed or the client disconnects.  Returns
        (the last admission, seconds held, outcome: one of metrics.HOLD_OUTCOMES)."""
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        deadline = t0 + timeout
        gone = loop.create_task(_wait_disconnect(receive)) if receive is not None else None
        self.metrics.hold_started()
        outcome = "error"                          # unless one of the returns below says otherwise
        try:
            while True:
                left = deadline - loop.time()
                if left <= 0:
                    outcome = "timed_out"
                    return a, loop.time() - t0, outcome
                nap = min(a.retry_after if a.retry_after >= 1e-3 else 1e-3, left)   # (NaN: 1 ms)
                if gone is None:
                    await asyncio.sleep(nap)
                else:
                    await asyncio.wait({gone}, timeout=nap)
                    if gone.done():
                        if not gone.cancelled():
                            gone.exception()       # retrieved: a failing receive also means the client is gone
                        outcome = "disconnected"
                        return a, loop.time() - t0, outcome
                a = self._ask(priority)
                if a.admitted or a.retry_after is None:
                    outcome = "admitted" if a.admitted else "refused"
                    return a, loop.time() - t0, outcome
        finally:
            if gone is not None and not gone.done():
                gone.cancel()
            self.metrics.hold_ended(outcome, loop.time() - t0)

    # -- validation that needs the engine: model name, tokens, context, pool, max_tokens
    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.name:
            raise P.APIError(404, f"model {model!r} does not exist; this server serves {self.name!r} "
                                  "(see GET /v1/models)", "model", "model_not_found")

    def prepare(self, req: P.CompletionRequest) -> list[PromptPlan]:
        """Each prompt checked and tokenized, with what to generate for it.  Blocking (a long
        prompt takes up to ~0.6 s to tokenize): run it with :meth:`off_loop`.  A chat request is
        rendered with the model's own template here when it has one."""
        if req.kind == "chat" and self.chat_template is not None:
            try:
                req.prompts = [self.chat_template.render(req.messages)]
            except TemplateError as e:
                raise P.bad("messages", str(e)) from None
            req.add_special_tokens = False      # the template writes its own special tokens
        plans = []
        for i, prompt in enumerate(req.prompts):
            ids = self.tokenize(req, i)
            max_tokens, echo_only = self.max_tokens(req, len(ids), i)
            text = prompt if isinstance(prompt, str) else self._decode(ids)
            plans.append(PromptPlan(ids, max_tokens, echo_only, text if req.echo else None))
        return plans

    def _decode(self, ids: list[int]) -> str:
        tok = self.llm.tokenizer
        return tok.decode(ids) if tok is not None else ""      # as generated text: special tokens skipped

    def tokenize(self, req: P.CompletionRequest, i: int = 0) -> list[int]:
        """Prompt ``i``'s token ids, checked against the context, vocabulary and KV pool.

        A text prompt is measured cheaply first: with a byte-level BPE no token covers more than
        ``tokenizer.max_token_bytes`` (L) bytes, so a prompt of B UTF-8 bytes has at least
        ceil(B / L) tokens (a lower bound, so it never refuses a prompt that fits); when that is
        already the context or more, it is refused without tokenizing.  Otherwise it is tokenized
        with the GIL released (``encode_nogil``) and its exact count decides."""
        param, llm, prompt = req.prompt_param(i), self.llm, req.prompts[i]
        ctx = llm.max_model_len

        def too_long(n: int, how: str = "") -> P.APIError:
            return P.APIError(400, f"'{param}': the prompt has {n} tokens{how}; this model's context is {ctx} "
                                   f"tokens (prompt + completion), so a prompt may have at most {ctx - 1}",
                              param, "context_length_exceeded")

        if isinstance(prompt, str):
            tok = llm.tokenizer
            if tok is None:
                raise P.bad(param, "this model has no tokenizer (a shape preset?): send the prompt as token ids "
                                   "to /v1/completions")
            least = tok.min_tokens(prompt) if hasattr(tok, "min_tokens") else 0
            if least >= ctx:
                raise too_long(least, f" or more (it is {utf8_len(prompt)} bytes of UTF-8 and no token "
                                      f"covers more than {tok.max_token_bytes})")
            special = req.add_special_tokens
            if hasattr(tok, "encode_nogil"):
                n, ids = tok.encode_nogil(prompt, add_special_tokens=special, limit=ctx)
            else:                                  # another tokenizer: plain encode (on this worker thread)
                ids = tok.encode(prompt, add_special_tokens=special)
                n = len(ids)
            if n >= ctx:
                raise too_long(n)
        else:
            if len(prompt) >= ctx:
                raise too_long(len(prompt))
            ids = list(prompt)
        try:
            llm.encode(ids)                        # the engine's own checks: empty, vocabulary range
        except WorkbenchError as e:
            raise P.bad(param, str(e)) from None
        m = self.aengine.engine.pool.manager
        need = -(-len(ids) // m.block_size)
        if need > m.num_blocks:
            raise P.bad(param, f"the prompt needs {need} KV blocks but the pool has {m.num_blocks} "
                               f"(block size {m.block_size}); start the server with more --num-blocks",
                        "context_length_exceeded")
        return ids

    def max_tokens(self, req: P.CompletionRequest, prompt_tokens: int, i: int = 0) -> tuple[int, bool]:
        """(tokens the engine generates for prompt ``i``, whether only the prompt is returned:
        ``max_tokens: 0`` with ``echo``, for which the engine still samples one token, dropped)."""
        ctx = self.llm.max_model_len
        cap, room, param = self.config.max_tokens_cap or ctx, ctx - prompt_tokens, req.max_tokens_param
        m = self.aengine.engine.pool.manager
        pool_room = m.num_blocks * m.block_size - prompt_tokens      # tokens the KV pool can hold after the prompt
        if req.max_tokens is None:
            want = self.config.default_max_tokens if req.kind == "completion" else cap
            return self._fits_pool(param, prompt_tokens, max(1, min(want, cap, room, pool_room)), False), False
        asked = max(req.max_tokens, 1)
        if asked > cap:
            raise P.bad(param, f"{req.max_tokens} is over this server's cap of {cap} (--max-tokens-cap)")
        if asked > room:
            where = f" (prompt {i})" if len(req.prompts) > 1 else ""
            raise P.APIError(400, f"'{param}': this model's context is {ctx} tokens; you asked for "
                                  f"{prompt_tokens + req.max_tokens}{where} ({prompt_tokens} in the prompt, "
                                  f"{req.max_tokens} to generate): lower {param} or shorten the prompt", param,
                             "context_length_exceeded")
        return self._fits_pool(param, prompt_tokens, asked, True), req.max_tokens == 0

    def _fits_pool(self, param: str, prompt_tokens: int, max_tokens: int, asked: bool) -> int:
        """``max_tokens``, or a 400 when prompt + max_tokens can never fit the KV pool (the engine
        would reject the request only later, possibly after generating tokens)."""
        m = self.aengine.engine.pool.manager
        need = -(-(prompt_tokens + max_tokens) // m.block_size)
        if need > m.num_blocks:
            what = f"{param}={max_tokens}" if asked else f"at least {max_tokens} token to generate"
            raise P.APIError(400, f"'{param}': the prompt ({prompt_tokens} tokens) plus {what} needs {need} KV "
                                  f"blocks but the pool has {m.num_blocks} (block size {m.block_size}, "
                                  f"{m.num_blocks * m.block_size} tokens); lower {param}, shorten the prompt, or "
                                  "start the server with more --num-blocks", param, "context_length_exceeded")
        return max_tokens


class _ClientGone(Exception):
    """The client disconnected before its request body was read."""


async def _read_body(request: Request, limit: int) -> bytearray:
    """The request body (413 over ``limit`` bytes); parsing is :func:`protocol.load_json`'s, off the loop."""
    too_big = P.APIError(413, f"the request body is larger than this server's limit of {limit} bytes "
                              "(--max-body-bytes)", None, "request_too_large")
    size = request.headers.get("content-length")
    buf, seen = bytearray(), 0
    try:
        async for part in request.stream():    # read everything (so the client sees our answer), keep <= limit
            seen += len(part)
            if seen <= limit:
                buf += part
            elif seen > 64 * limit:
                break
    except ClientDisconnect:
        raise _ClientGone() from None
    if seen > limit or (size is not None and size.isdigit() and int(size) > limit):
        raise too_big
    return buf


def _parse_body(raw: bytearray, parse) -> P.CompletionRequest:
    """Decode, parse and validate a request body (for a worker thread)."""
    return parse(P.load_json(raw))


def _priority(request: Request) -> int:
    raw = request.headers.get("x-priority")
    if raw is None or not raw.strip():
        return 0
    try:
        return int(raw.strip())
    except ValueError:
        raise P.APIError(400, f"header 'x-priority': {raw!r} is not an integer (higher runs first)",
                         "x-priority", "invalid_value") from None


def create_app(aengine, config: ServerConfig | None = None, source: str | None = None, guard=None):
    """The ASGI app over a started (or to-be-started) AsyncEngine.  ``source``: the model's
    folder or preset, for the served name and ``x-model-info``; ``guard``: an SLO guard (overrides
    ``config.guard``)."""
    config = config or ServerConfig()
    if guard is not None:
        config = replace(config, guard=guard)
    srv = _State(aengine, config, source)

    async def complete(request: Request, parse) -> Completion:
        try:
            raw = await _read_body(request, srv.config.max_body_bytes)
        except _ClientGone:                        # left mid-body: nothing to answer (499 on /metrics)
            return _Dropped()
        P.check_content_type(request.headers.get("content-type"))
        req = await srv.off_loop(_parse_body, raw, parse)      # up to 1 MiB of JSON: not on the loop
        srv.check_model(req.model)
        priority = _priority(request)
        plans = await srv.off_loop(srv.prepare, req)
        try:
            SamplingParams(**req.sampling)         # a value the wire checks let through: said before the guard
        except ConfigError as e:
            raise P.APIError(400, str(e), None, "invalid_value") from None
        probe = await srv.admit(priority, request.receive)   # last: only valid requests reach the guard
        if probe is None:                          # the client left while the guard's queue held it
            return _Dropped()
        return Completion(srv, req, plans, req.sampling, priority, probe)

    async def completions(request: Request):
        return await complete(request, P.parse_completion)

    async def chat_completions(request: Request):
        return await complete(request, P.parse_chat)

    def model_card() -> dict:
        return {"id": srv.name, "object": "model", "created": started, "owned_by": "workbench",
                "root": srv.info.get("path"), "max_model_len": srv.llm.max_model_len}

    async def models(request: Request):
        return JSONResponse({"object": "list", "data": [model_card()]})

    async def model_get(request: Request):
        srv.check_model(request.path_params["model_id"])
        return JSONResponse(model_card())

    async def health(request: Request):
        alive = engine_alive(aengine)
        last_error, history = srv.errors.report(alive)
        body = {"status": "ok" if alive else "engine thread is not running", "engine_alive": alive,
                "model": srv.name, "last_error": last_error, "engine_error": history, **aengine.stats()}
        if srv.guard is not None:
            body["slo_guard"] = srv.guard.snapshot().get("state")
        return JSONResponse(body, status_code=200 if alive else 503)

    async def metrics(request: Request):
        guard = None if srv.guard is None else srv.guard.snapshot()
        return PlainTextResponse(srv.metrics.render(aengine.stats(), engine_alive(aengine), guard),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    async def kv_pool(request: Request):
        return JSONResponse(await run_in_threadpool(kv_pool_report, aengine, srv.name))

    async def api_error(request: Request, exc: P.APIError):
        return _json_response(exc.status, exc.body(), exc.headers)

    async def http_error(request: Request, exc: HTTPException):
        return _json_response(exc.status_code, P.APIError(exc.status_code, f"{request.method} {request.url.path}: "
                                                          f"{exc.detail}", None, None).body(), exc.headers)

    async def unexpected(request: Request, exc: Exception):
        """Any other exception: a 500 in OpenAI's shape (Starlette's own would be plain text), logged."""
        log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        return _json_response(500, internal_error(exc).body())

    started = P.now_s()
    routes = [Route("/v1/completions", completions, methods=["POST"]),
              Route("/v1/chat/completions", chat_completions, methods=["POST"]),
              Route("/v1/models", models, methods=["GET"]),
              Route("/v1/models/{model_id:path}", model_get, methods=["GET"]),
              Route("/health", health, methods=["GET"]),
              Route("/metrics", metrics, methods=["GET"]),
              Route(KV_POOL_PATH, kv_pool, methods=["GET"])]
    app = Starlette(routes=routes, exception_handlers={P.APIError: api_error, HTTPException: http_error,
                                                      Exception: unexpected})
    app.state.server = srv
    known = {r.path for r in routes if "{" not in r.path}
    return _Outer(app, srv, known)


class _Outer:
    """ASGI wrapper: API-key check on /v1/*, the x-model-info header on every response, and
    per-path response counters."""

    def __init__(self, app: Starlette, srv: _State, known_paths: set[str]) -> None:
        self.app, self.srv, self.known = app, srv, known_paths
        self.state = app.state
        key = srv.config.api_key
        self._key = key.encode() if key else None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        srv, status = self.srv, [499]             # 499 (as nginx logs it): the client left before any answer
        done = False                              # the whole response was sent

        async def send_with_info(msg) -> None:
            nonlocal done
            if msg["type"] == "http.response.start":
                status[0] = msg["status"]
                msg = {**msg, "headers": [*msg.get("headers", []), (b"x-model-info", srv.info_header)]}
            elif msg["type"] == "http.response.body" and not msg.get("more_body", False):
                done = True
            await send(msg)

        path = scope["path"]
        try:
            if self._key is not None and path.startswith("/v1") and not self._authorized(scope):
                err = P.APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'", None,
                                 "invalid_api_key")
                await send_json(send_with_info, 401, err.body(), [(b"www-authenticate", b"Bearer")])
            else:
                await self.app(scope, receive, send_with_info)
        except Exception as e:  # noqa: BLE001 - never a plain-text 500 (nor a traceback per request from uvicorn)
            if status[0] == 499:                  # nothing answered yet (the failure was outside Starlette)
                log.error("%s %s failed", scope.get("method"), path, exc_info=e)
                try:
                    await send_json(send_with_info, 500, internal_error(e).body())
                except OSError:
                    pass
            elif not done:                        # cut off mid-response (logged where it was answered)
                raise
            # else: answered (Starlette's handler for unexpected exceptions sent the 500 and logged it)
        finally:
            label = path if path in self.known else ("/v1/models/{id}" if path.startswith("/v1/models/") else "other")
            srv.metrics.http_response(label, status[0])

    def _authorized(self, scope) -> bool:
        """``Authorization: Bearer <key>``; the scheme is case-insensitive (RFC 7235), and may be
        followed by more than one space."""
        got = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        parts = got.split(None, 1)
        ok_scheme = len(parts) == 2 and parts[0].lower() == b"bearer"
        cred = parts[1].strip() if ok_scheme else b""
        return hmac.compare_digest(cred, self._key) and ok_scheme
