"""What the load generator talks to: a *target* that streams tokens for one request.

The load generator knows nothing about engines or servers; it calls ::

    async for ev in target.send(prompt, max_tokens, priority=0, **sampling):
        ...   # TokenEvent(time, text, token_id, finished, finish_reason, error, ...)

Two implementations:

* :class:`HTTPTarget` - an OpenAI-compatible server (``/v1/completions`` or
  ``/v1/chat/completions`` with ``stream: true``), read with httpx's async streaming client.
  The request priority travels in the ``x-priority`` header.
* :class:`CallableTarget` - any async generator function ``fn(prompt, max_tokens, priority,
  **sampling)`` in this process (the continuous-batching engine provides one); it may yield
  TokenEvents or anything with the same attributes (the engine's ``StreamEvent``).

Event contract: a target yields one event per streamed token (``tokens=1``; a chunk carrying
several tokens says so), and ends with exactly one event that has ``finished=True``.  A
problem is an event with ``error`` set (and ``finished=True``); a target that *refuses* a
request (HTTP 429/503, an admission controller, the SLO guard) sets ``rejected=True`` too,
with the reason in ``error``.  Times are ``time.perf_counter()`` values.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable
from collections.abc import AsyncIterator, Callable

from workbench.errors import ConfigError

Prompt = str | list[int]

# HTTP statuses that mean "the server refused to take this request now" (not a failure of it)
REJECT_STATUSES = (429, 503)


@dataclass
class TokenEvent:
    time: float                      # perf_counter() when the client saw it
    text: str = ""
    token_id: int | None = None
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None         # set: the request failed (or was rejected), with the reason
    rejected: bool = False           # refused by admission control / 429 / 503 (error holds why)
    tokens: int = 1                  # tokens this event carries (0: a bare finish / error marker)


@runtime_checkable
class Target(Protocol):
    def send(self, prompt: Prompt, max_tokens: int, priority: int = 0, **sampling) -> AsyncIterator[TokenEvent]:
        ...


def _as_event(obj: Any) -> TokenEvent:
    """A TokenEvent from a TokenEvent, a dict, or an object with its attribute names
    (the engine's ``StreamEvent``: time, text, token_id, finished, finish_reason)."""
    if isinstance(obj, TokenEvent):
        return obj
    get = obj.get if isinstance(obj, dict) else (lambda k, d=None: getattr(obj, k, d))
    t = get("time")
    return TokenEvent(time=time.perf_counter() if t is None else float(t), text=get("text", "") or "",
                      token_id=get("token_id"), finished=bool(get("finished", False)),
                      finish_reason=get("finish_reason"), error=get("error"),
                      rejected=bool(get("rejected", False)), tokens=int(get("tokens", 1)))


class CallableTarget:
    """Wrap ``fn(prompt, max_tokens, priority=0, **sampling) -> async iterator`` as a target.

    ``metrics_fn`` (optional, ``() -> dict``) is exposed as :meth:`metrics` for live views
    (queue_len, running, kv_usage, ...).  A stream that ends without a finished event is
    closed with one (finish_reason None)."""

    def __init__(self, fn: Callable[..., AsyncIterator], metrics_fn: Callable[[], dict] | None = None) -> None:
        if not callable(fn):
            raise ConfigError(f"CallableTarget: fn must be an async generator function, got {type(fn).__name__}")
        self.fn, self._metrics_fn = fn, metrics_fn

    async def send(self, prompt: Prompt, max_tokens: int, priority: int = 0, **sampling) -> AsyncIterator[TokenEvent]:
        stream = self.fn(prompt, max_tokens, priority=priority, **sampling)
        if not hasattr(stream, "__aiter__"):
            raise ConfigError(f"CallableTarget: {getattr(self.fn, '__name__', self.fn)!r} returned "
                              f"{type(stream).__name__}, expected an async iterator (an `async def` with `yield`)")
        finished = False
        try:
            async for obj in stream:
                ev = _as_event(obj)
                finished = ev.finished or ev.error is not None
                yield ev
                if finished:
                    return
        finally:
            if hasattr(stream, "aclose"):
                await stream.aclose()
        if not finished:
            yield TokenEvent(time=time.perf_counter(), finished=True, tokens=0)

    def metrics(self) -> dict:
        return dict(self._metrics_fn()) if self._metrics_fn else {}


# ---- OpenAI-compatible HTTP ---------------------------------------------------------------------
def parse_sse_chunk(payload: dict, chat: bool) -> tuple[str, int, str | None, str | None]:
    """One decoded ``data:`` object -> (text, tokens, finish_reason, error).

    Completions: ``choices[0].text``; chat: ``choices[0].delta.content``.  A chunk counts as a
    token when it carries text, or carries an empty string while not finishing (a token whose
    text the server holds back, e.g. half a UTF-8 character).  The chat stream's opening
    ``{"role": "assistant", "content": ""}`` chunk, a final empty chunk with the finish
    reason, and a usage-only chunk (``choices: []``) carry no token.  A ``{"error": ...}``
    object mid-stream (as vLLM sends) is an error."""
    if "error" in payload:
        err = payload["error"]
        return "", 0, None, (err.get("message") if isinstance(err, dict) else None) or str(err)
    choices = payload.get("choices") or []
    if not choices:
        return "", 0, None, None
    c = choices[0]
    finish = c.get("finish_reason")
    if chat:
        delta = c.get("delta") or {}
        text = delta.get("content")
        is_token = bool(text) or (text == "" and "role" not in delta and finish is None)
    else:
        text = c.get("text")
        is_token = bool(text) or (text == "" and finish is None)
    ids = c.get("token_ids")      # vLLM's optional extension: the chunk's token ids
    tokens = len(ids) if isinstance(ids, list) and ids else int(is_token)
    return text or "", tokens, finish, None


def _error_message(status: int, body: bytes) -> str:
    try:
        err = json.loads(body)
        msg = err.get("error", err) if isinstance(err, dict) else err
        msg = msg.get("message", msg) if isinstance(msg, dict) else msg
    except (ValueError, AttributeError):
        msg = body.decode("utf-8", "replace").strip()
    return f"HTTP {status}: {str(msg)[:300] or 'no body'}"


class HTTPTarget:
    """An OpenAI-compatible streaming endpoint.

    ``HTTPTarget("http://127.0.0.1:8000", model="bundled")`` posts to ``/v1/completions``
    (``chat=True``: ``/v1/chat/completions`` with the prompt as one user message) with
    ``stream: true``, ``max_tokens`` and the sampling keyword arguments in the body, and the
    priority in the ``x-priority`` header.  ``timeout`` bounds connecting and each read
    (seconds).  ``transport`` is passed to httpx (tests use ``httpx.MockTransport``).

    The client is created per event loop (the sync load wrapper runs its own loop in a
    thread) and allows unlimited connections: a client-side connection pool that queued
    requests would add its wait to the TTFT we measure and blame it on the server.
    """

    def __init__(self, base_url: str, model: str, api_key: str | None = None, chat: bool = False,
                 timeout: float = 60.0, headers: dict | None = None, transport=None) -> None:
        if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
            raise ConfigError(f"HTTPTarget: base_url={base_url!r} must start with http:// or https://")
        if not model:
            raise ConfigError("HTTPTarget: model is empty (the server's model name, as in GET /v1/models)")
        if not timeout > 0:
            raise ConfigError(f"HTTPTarget: timeout={timeout!r} must be > 0 seconds")
        base = base_url.rstrip("/")
        self.base_url = base if base.endswith("/v1") else base + "/v1"
        self.url = self.base_url + ("/chat/completions" if chat else "/completions")
        self.model, self.chat, self.timeout = model, chat, timeout
        self.headers = {"Accept": "text/event-stream", **(headers or {})}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        self._transport = transport
        self._clients: dict = {}     # event loop -> httpx.AsyncClient

    def _client(self):
        import httpx

        loop = asyncio.get_running_loop()
        client = self._clients.get(loop)
        if client is None or client.is_closed:
            client = httpx.AsyncClient(timeout=httpx.Timeout(self.timeout), transport=self._transport,
                                       limits=httpx.Limits(max_connections=None, max_keepalive_connections=256))
            self._clients = {lp: c for lp, c in self._clients.items() if not lp.is_closed()}
            self._clients[loop] = client
        return client

    async def aclose(self) -> None:
        """Close this event loop's client (a later send opens a new one)."""
        client = self._clients.pop(asyncio.get_running_loop(), None)
        if client is not None:
            await client.aclose()

    def body(self, prompt: Prompt, max_tokens: int, **sampling) -> dict:
        if self.chat:
            if not isinstance(prompt, str):
                raise ConfigError("HTTPTarget(chat=True): the prompt must be text, got a list of token ids "
                                  "(use chat=False for /v1/completions, which accepts token ids)")
            req = {"messages": [{"role": "user", "content": prompt}]}
        else:
            req = {"prompt": prompt}
        return {"model": self.model, **req, "max_tokens": max_tokens, "stream": True, **sampling}

    async def send(self, prompt: Prompt, max_tokens: int, priority: int = 0, **sampling) -> AsyncIterator[TokenEvent]:
        import httpx

        body = self.body(prompt, max_tokens, **sampling)
        headers = {**self.headers, "x-priority": str(int(priority))}
        now = time.perf_counter
        try:
            async with self._client().stream("POST", self.url, json=body, headers=headers) as resp:
                if resp.status_code != 200:
                    msg = _error_message(resp.status_code, await resp.aread())
                    yield TokenEvent(now(), finished=True, finish_reason="rejected" if resp.status_code in
                                     REJECT_STATUSES else None, error=msg,
                                     rejected=resp.status_code in REJECT_STATUSES, tokens=0)
                    return
                finish = None
                async for line in resp.aiter_lines():
                    t = now()
                    if not line.startswith("data:"):
                        continue                      # blank separators, ": keep-alive" comments, event: lines
                    data = line[5:].strip()
                    if data == "[DONE]":
                        yield TokenEvent(t, finished=True, finish_reason=finish, tokens=0)
                        return
                    try:
                        payload = json.loads(data)
                    except ValueError:
                        yield TokenEvent(t, finished=True, error=f"bad SSE data from {self.url}: {data[:200]!r}",
                                         tokens=0)
                        return
                    text, n, reason, err = parse_sse_chunk(payload, self.chat)
                    if err is not None:
                        yield TokenEvent(t, finished=True, error=f"server error mid-stream: {err}", tokens=0)
                        return
                    finish = reason or finish
                    if n:
                        yield TokenEvent(t, text=text, tokens=n)
                # no [DONE]: fine if the server already said why it finished, a cut stream otherwise
                yield TokenEvent(now(), finished=True, finish_reason=finish, tokens=0,
                                 error=None if finish else f"stream from {self.url} ended without 'data: [DONE]'")
        except httpx.HTTPError as e:   # connect / read timeouts, refused connections, protocol errors
            yield TokenEvent(now(), finished=True, error=f"{type(e).__name__}: {e or 'no detail'} ({self.url})",
                             tokens=0)
