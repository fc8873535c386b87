"""The OpenAI-compatible HTTP app over an :class:`~workbench.sched.AsyncEngine` (Starlette).

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (JSON or ``stream: true``
Server-Sent Events), ``GET /v1/models``, ``GET /health``, ``GET /metrics``, and one of
workbench's own (no OpenAI-compatible server has it): ``GET /v1/workbench/kv``, the engine's
live paged KV pool as JSON (:func:`~workbench.serve.health.kv_pool_report`; ``workbench kv-inspect
--url`` shows it).

A request's path through the server: the body is read (at most ``max_body_bytes``, else 413), its
Content-Type checked (JSON or none, else 415), parsed (:mod:`~workbench.serve.protocol`: too
deeply nested, not UTF-8, lone surrogates: 400) and validated (:mod:`~workbench.serve.requests`:
400 naming the field); then :class:`~workbench.serve.state.ServerState` checks its model name
(404), its prompt measured against the context - first from its byte length alone (a lower bound
on its tokens, :attr:`~workbench.model.tokenizer.Tokenizer.max_token_bytes`), then tokenized - and
against the KV pool (prompt + ``max_tokens`` must fit it: a request that never can is a 400
``context_length_exceeded`` at once, not a failure later) and the ``max_tokens`` cap (400).
Parsing, tokenizing and checking run on worker threads
(:data:`~workbench.serve.state.PREP_THREADS` at once), never on the event loop, which relays every
open stream: a 1 MiB prompt must not stall them (tokenizing one takes ~0.6 s;
``Tokenizer.encode_nogil`` does it with the GIL released).  Then
:class:`~workbench.serve.completion.Completion` submits its choices to the engine (``n`` samples
of each prompt, forked from one prefill) and relays the engine's events (their text is detokenized
on the engine thread).  A request the engine ends before any token ("rejected": queue full -> 429
with ``Retry-After``; rejected for any other reason, e.g. too big for the KV pool -> 400, which
clients do not retry, since retrying cannot help; "error" -> 500) is answered with that HTTP
status even when streaming, because the stream's headers are sent with the first token; after
that, such an ending is an SSE ``data: {"error": ...}`` event before ``data: [DONE]``.  When the
client disconnects, the request is aborted and its KV blocks go back to the pool.

Errors are always in OpenAI's JSON shape (:class:`~workbench.serve.protocol.APIError`; answers:
:mod:`~workbench.serve.responses`): an unexpected exception is a 500 with code
``internal_error`` (its traceback goes to the ``workbench.serve`` logger), and a stream already
under way ends with an error event.  ``/health`` shows the engine's ``last_error`` only while it
is current - until the engine produces a token after it - and ``engine_error`` tells the last one
with when it was seen and whether (and when) the engine recovered
(:class:`~workbench.serve.health.EngineErrors`).

Every response carries ``x-model-info``: one line of JSON describing the engine that served it
(model, device, dtype, KV pool, scheduler, per-op backends when known) and ``x-request-id`` for
completions.  ``x-priority: <int>`` (higher first) sets the request's scheduling priority.  With an
API key, ``/v1/*`` needs ``Authorization: Bearer <key>`` (the scheme in any case, RFC 7235).

An optional SLO guard (:mod:`workbench.serve.guard`; e.g. :class:`workbench.serve.slo.SLOGuard`)
is asked before each valid request reaches the engine: when it sheds, the answer is ``503`` with its
reason and ``Retry-After``; every first token's TTFT is fed back to it, and its state is on
``/metrics``.  With the guard's queue policy (``SLOConfig(policy="queue")``) a deferred request
is held instead - the server sleeps the guard's ``retry_after`` and asks again - and is served
once admitted, or answered ``503`` when the guard's ``queue_timeout_s`` has passed; a client
that disconnects while held is dropped (nothing reaches the engine).  Time held is not part of
the request's TTFT (that counts from arrival at the engine); ``/metrics`` counts held requests
and their time held (:meth:`~workbench.serve.state.ServerState.admit`).

Here: :func:`create_app` (the routes) and :class:`ServerConfig`; around the app, API-key check,
``x-model-info`` and per-path counters (``_Outer``).
"""

from __future__ import annotations

import hmac
import logging
from dataclasses import dataclass, replace

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from workbench.errors import ConfigError
from workbench.kv.inspect import KV_POOL_PATH
from workbench.engine.sampling import SamplingParams
from workbench.serve import protocol as P
from workbench.serve.completion import Completion, engine_alive, internal_error, send_json
from workbench.serve.guard import check_guard
from workbench.serve.limits import MAX_LOGPROB_ENTRIES, MAX_REPLY_BYTES, check_request
from workbench.serve.health import kv_pool_report, model_info  # noqa: F401 - model_info: also imported from here
from workbench.serve.requests import CompletionRequest, parse_chat, parse_completion
from workbench.serve.responses import now_s
from workbench.serve.state import ServerState

LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
log = logging.getLogger("workbench.serve")


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
    # what one request may ask (workbench.serve.limits): 400 request_too_large / reply_too_large beyond
    max_request_tokens: int | None = None    # prompt tokens x n + max_tokens x n; None: 16 x the model's context
    max_logprob_entries: int = MAX_LOGPROB_ENTRIES   # (echoed prompt + max_tokens) x n x (top-k + 1)
    max_reply_bytes: int = MAX_REPLY_BYTES   # a whole reply's bytes, or a stream's
    # connections (workbench.serve.connections): slow or idle sockets cannot exhaust file descriptors
    max_connections: int | None = None       # open at once; more are closed on arrival. None: see connections
    request_timeout_s: float = 30.0          # a request's headers and body must arrive within this
    keep_alive_s: float = 5.0                # an idle keep-alive connection is closed after this
    # who may do what
    metrics_public: bool = False             # with api_key: /metrics (and /health's details) without the key too
    trust_priority_header: bool = False      # honour x-priority without an API key (any client may then jump
                                             # the queue and pass the SLO guard's bypass priorities)

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
        optional = ("max_tokens_cap", "max_request_tokens", "max_connections")
        for name in ("max_tokens_cap", "max_body_bytes", "default_max_tokens", "max_request_tokens",
                     "max_logprob_entries", "max_reply_bytes", "max_connections"):
            v = getattr(self, name)
            need((v is None and name in optional) or (isinstance(v, int) and not isinstance(v, bool) and v >= 1),
                 name, "must be an integer >= 1" + (" or None" if name in optional else ""))
        for name in ("request_timeout_s", "keep_alive_s"):
            v = getattr(self, name)
            need(isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < float("inf"), name,
                 "must be a number of seconds > 0")
        for name in ("metrics_public", "trust_priority_header"):
            need(isinstance(getattr(self, name), bool), name, "must be True or False")
        need(self.log_level in LOG_LEVELS, "log_level", f"must be one of {', '.join(LOG_LEVELS)}")
        if self.guard is not None:
            check_guard(self.guard)


class _Dropped:
    """The answer to a client that went away before it was answered: nothing is sent."""

    async def __call__(self, scope, receive, send) -> None:
        return None


def _json_response(status: int, obj: dict, headers: dict | None = None) -> Response:
    return Response(P.json_bytes(obj), status_code=status, headers=headers or None, media_type="application/json")


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


def _parse_body(raw: bytearray, parse) -> CompletionRequest:
    """Decode, parse and validate a request body (for a worker thread)."""
    return parse(P.load_json(raw))


PRIORITY_IGNORED = (b"x-priority-ignored", b"the server trusts x-priority only from clients with its API key "
                                           b"(--api-key) or when started with --trust-priority-header")


def _priority(request: Request, trusted: bool) -> tuple[int, bool]:
    """(the request's priority, whether an ``x-priority`` header was ignored).  The header is
    honoured only from a trusted client (the server has an API key, which this request passed,
    or ``trust_priority_header``): otherwise any client could run ahead of the others and pass
    the SLO guard's bypass priorities.  An ignored header says so in ``x-priority-ignored``."""
    raw = request.headers.get("x-priority")
    if raw is None or not raw.strip():
        return 0, False
    try:
        value = int(raw.strip())
    except ValueError:
        raise P.APIError(400, f"header 'x-priority': {raw!r} is not an integer (higher runs first)",
                         "x-priority", "invalid_value") from None
    return (value, False) if trusted else (0, value != 0)


def create_app(aengine, config: ServerConfig | None = None, source: str | None = None, guard=None):
    """The ASGI app over a started (or to-be-started) AsyncEngine.  ``source``: the model's
    folder or preset, for the served name and ``x-model-info``; ``guard``: an SLO guard (overrides
    ``config.guard``)."""
    config = config or ServerConfig()
    if guard is not None:
        config = replace(config, guard=guard)
    srv = ServerState(aengine, config, source)

    async def complete(request: Request, parse) -> Completion:
        try:
            raw = await _read_body(request, srv.config.max_body_bytes)
        except _ClientGone:                        # left mid-body: nothing to answer (499 on /metrics)
            return _Dropped()
        P.check_content_type(request.headers.get("content-type"))
        req = await srv.off_loop(_parse_body, raw, parse)      # up to 1 MiB of JSON: not on the loop
        srv.check_model(req.model)
        priority, ignored = _priority(request, srv.trusts_priority)
        plans = await srv.off_loop(srv.prepare, req)
        check_request(req, plans, srv.max_request_tokens, srv.config.max_logprob_entries)
        try:
            SamplingParams(**req.sampling)         # a value the wire checks let through: said before the guard
        except ConfigError as e:
            raise P.APIError(400, str(e), None, "invalid_value") from None
        probe = await srv.admit(priority, request.receive)   # last: only valid requests reach the guard
        if probe is None:                          # the client left while the guard's queue held it
            return _Dropped()
        completion = Completion(srv, req, plans, req.sampling, priority, probe)
        if ignored:
            completion.headers.append(PRIORITY_IGNORED)
        return completion

    async def completions(request: Request):
        return await complete(request, parse_completion)

    async def chat_completions(request: Request):
        return await complete(request, parse_chat)

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
        if not request.scope.get(AUTHORIZED, True):   # a liveness probe without the key: alive or not, nothing more
            return JSONResponse({"status": "ok" if alive else "engine thread is not running", "engine_alive": alive},
                                status_code=200 if alive else 503)
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

    started = now_s()
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


AUTHORIZED = "workbench.authorized"   # scope key: the request carried the API key (or the server has none)


class _Outer:
    """ASGI wrapper: the API-key check, the x-model-info header on every response to a client
    with the key (or every response without one), and per-path response counters.

    With an API key: ``/v1/*`` and ``/metrics`` need it (``/metrics`` not with
    ``metrics_public``); ``/health`` answers everyone, but only whether the engine is alive
    unless the key came with it (or ``metrics_public``); a 401 tells nothing about the model."""

    def __init__(self, app: Starlette, srv: ServerState, known_paths: set[str]) -> None:
        self.app, self.srv, self.known = app, srv, known_paths
        self.state = app.state
        key = srv.config.api_key
        self._key = key.encode() if key else None
        self._public = ("/health",) + (("/metrics",) if srv.config.metrics_public else ())

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        srv, status = self.srv, [499]             # 499 (as nginx logs it): the client left before any answer
        done = False                              # the whole response was sent
        path = scope["path"]
        authorized = self._key is None or self._authorized(scope)
        shown = authorized or (srv.config.metrics_public and path == "/health")

        async def send_with_info(msg) -> None:
            nonlocal done
            if msg["type"] == "http.response.start":
                status[0] = msg["status"]
                if shown:
                    msg = {**msg, "headers": [*msg.get("headers", []), (b"x-model-info", srv.info_header)]}
            elif msg["type"] == "http.response.body" and not msg.get("more_body", False):
                done = True
            await send(msg)

        try:
            if not authorized and not path.startswith(self._public):
                err = P.APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'", None,
                                 "invalid_api_key")
                await send_json(send_with_info, 401, err.body(), [(b"www-authenticate", b"Bearer")])
            else:
                await self.app({**scope, AUTHORIZED: shown}, receive, send_with_info)
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
