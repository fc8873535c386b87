"""One completion request on the engine: its choices, their events, the JSON or SSE answer.

A request becomes one engine request per *choice*: ``n`` samples of each of its prompts
(completions take a batch of prompts).  Sample 0 of a prompt is submitted first; samples 1..n-1
are submitted as forks of it (``AsyncEngine.submit(fork_of=...)``), so the engine computes the
prompt once and the samples share its KV blocks.  Every choice's events arrive on one queue and
are relayed as they come: one stream chunk per token, tagged with the choice's ``index``.

The request fails as a whole: when any choice ends other than by ``stop`` / ``length`` (rejected,
aborted, a failed step), the answer is that error - a plain HTTP error before the stream has
started, else an SSE error event before ``[DONE]`` - and its other choices are aborted.  Whatever
happens (the client leaves, a bug here), every choice's engine request ends and its blocks go
back to the pool.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import uuid
from dataclasses import dataclass, field

from starlette.concurrency import run_in_threadpool

from workbench.errors import WorkbenchError
from workbench.engine.sampling import SamplingParams
from workbench.serve import protocol as P
from workbench.serve import responses as R     # through the module: tests patch R.response / R.chunk
from workbench.serve.limits import reply_too_large
from workbench.serve.requests import CompletionRequest, sample_seed

log = logging.getLogger("workbench.serve")

# A token-id prompt longer than this is handed to the engine (which checks the ids again, in Python)
# from a worker thread; shorter ones from the event loop (checking takes microseconds; a thread hop more).
INLINE_SUBMIT_IDS = 4096

# A stream's echoed prompt with more log-probability entries than this is formatted off the event loop.
INLINE_ECHO_ENTRIES = 256

_GONE, _DEAD = object(), object()   # queue sentinels: the client disconnected / the engine thread died


class _ReplyTooLarge(Exception):
    """A stream's next chunk would take it past ``max_reply_bytes``."""

    def __init__(self, nbytes: int) -> None:
        super().__init__(nbytes)
        self.nbytes = nbytes


def engine_alive(aengine) -> bool:
    """Whether the engine thread runs (AsyncEngine has no public flag for this yet)."""
    thread = getattr(aengine, "_thread", None)
    return thread is not None and thread.is_alive()


def internal_error(exc: BaseException) -> P.APIError:
    """The 500 for an unexpected exception: its type only (the details go to the log)."""
    return P.APIError(500, f"internal server error ({type(exc).__name__}); the server's log has the details", None,
                      "internal_error")


async def send_json(send, status: int, obj: dict | bytes, headers: list | None = None) -> None:
    body = obj if isinstance(obj, bytes) else P.json_bytes(obj)
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *(headers or [])]})
    await send({"type": "http.response.body", "body": body})


def ending_error(ev) -> P.APIError:
    """An engine ending other than stop / length, as the HTTP error it becomes."""
    if ev.finish_reason == "rejected":
        if (ev.error or "").startswith("queue full"):   # the scheduler's reason when max_queue_len is reached
            return P.APIError(429, f"rejected by the engine: {ev.error}", None, "engine_rejected",
                              {"Retry-After": "1"})
        # anything else (the request outgrew the KV pool) fails the same way every time: not retryable
        return P.APIError(400, f"rejected by the engine: {ev.error}", None, "context_length_exceeded")
    if ev.finish_reason == "abort":
        return P.APIError(503, f"aborted by the engine: {ev.error}", None, "aborted")
    return P.APIError(500, f"engine error: {ev.error}", None, "engine_error")


@dataclass
class PromptPlan:
    """One prompt of a request, checked: its token ids and what the engine generates for it."""
    ids: list[int]
    max_tokens: int            # what the engine generates (>= 1)
    echo_only: bool = False    # max_tokens 0 with echo: the prompt alone (the one generated token is dropped)
    text: str | None = None    # the prompt's text, for echo


@dataclass
class Choice:
    index: int
    plan: PromptPlan
    params: SamplingParams
    rid: str
    fork_of: str | None        # the engine request of sample 0 of the same prompt
    tokens: int = 0            # generated tokens (echo_only: not counted)
    parts: list = field(default_factory=list)        # text pieces
    entries: list = field(default_factory=list)      # log-probability entries of the returned tokens
    prompt_entries: list | None = None               # the prompt's, for echo + logprobs
    finish: str | None = None
    ended: bool = False
    echoed: bool = False       # stream: the prompt's chunk was sent
    offsets: R.TextOffsets | None = None   # completions' logprobs: where each token starts in the text

    @property
    def usage(self) -> dict:
        return R.usage(len(self.plan.ids), self.tokens)


def plan_choices(req: CompletionRequest, plans: list[PromptPlan], sampling: dict, rid: str) -> list[Choice]:
    """The request's choices, prompt by prompt, ``n`` each; sample j of a prompt seeded ``seed + j``."""
    out = []
    lp = req.logprobs
    for plan in plans:
        for j in range(req.n):
            kw = dict(sampling, seed=sample_seed(sampling.get("seed"), j))
            params = SamplingParams(max_tokens=plan.max_tokens, logprobs=lp,
                                    prompt_logprobs=lp if req.echo and lp is not None else None, **kw)
            index = len(out)
            parent = out[-j].rid if j else None
            engine_id = rid if req.num_choices == 1 else f"{rid}-{index}"   # one choice: the response's id
            out.append(Choice(index, plan, params, engine_id, parent))
    return out


class Completion:
    """An ASGI response that runs one request's choices on the engine and relays their events as
    JSON or SSE.  ``srv``: the server's state (engine, metrics, guard, tokenizer)."""

    def __init__(self, srv, req: CompletionRequest, plans: list[PromptPlan], sampling: dict,
                 priority: int, probe: bool = False) -> None:
        self.srv, self.req, self.priority = srv, req, priority
        self.rid = ("chatcmpl-" if req.kind == "chat" else "cmpl-") + uuid.uuid4().hex
        self.created = R.now_s()
        self.choices = plan_choices(req, plans, sampling, self.rid)
        self._by_rid = {c.rid: c for c in self.choices}
        self.prompt_tokens = sum(len(p.ids) for p in plans)   # each prompt once, however many samples
        self.probe = probe            # admitted by the SLO guard as a half-open probe
        self.first_token = False      # its first token arrived (its TTFT went to the guard)
        self.headers = [(b"x-request-id", self.rid.encode())]
        tok = srv.llm.tokenizer
        self._name = tok.token_to_str if tok is not None else (lambda t: f"token_id:{t}")
        self._raw = tok.token_bytes if tok is not None else (lambda t: f"token_id:{t}".encode())
        shown = tok.shown_bytes if tok is not None else (lambda t: b"")
        for c in self.choices:
            c.offsets = R.TextOffsets(shown)

    # ---- submitting and aborting
    def _submit_all(self, on_event) -> None:
        for c in self.choices:
            fork = {"fork_of": c.fork_of} if c.fork_of else {}     # only forks need the engine's fork support
            self.srv.aengine.submit(c.plan.ids, c.params, on_event, self.priority, c.rid, **fork)

    def _open(self) -> list[Choice]:
        return [c for c in self.choices if not c.ended]

    async def __call__(self, scope, receive, send) -> None:
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        watcher = loop.create_task(self._watch_disconnect(receive, q))
        started = finished = False                # the response's headers / its last part were sent

        async def tracked(msg) -> None:
            nonlocal started, finished
            started = started or msg["type"] == "http.response.start"
            finished = finished or (msg["type"] == "http.response.body" and not msg.get("more_body", False))
            await send(msg)

        try:
            submit = functools.partial(self._submit_all, lambda ev: loop.call_soon_threadsafe(q.put_nowait, ev))
            try:
                if sum(len(c.plan.ids) for c in self.choices) > INLINE_SUBMIT_IDS:
                    await run_in_threadpool(submit)     # the engine checks every id again, in Python
                else:
                    submit()
            except WorkbenchError as e:            # validated already; anything left is still the client's
                return await send_json(tracked, 400, P.bad(self.req.prompt_param(), str(e)).body(), self.headers)
            await (self._stream(q, tracked) if self.req.stream else self._whole(q, tracked))
        except OSError:
            pass                                   # the client went away while we were sending
        except Exception as e:  # noqa: BLE001 - a bug here: answer in OpenAI's shape, log it, free the request
            log.error("%s %s failed while answering %s", scope.get("method"), scope.get("path"), self.rid,
                      exc_info=e)
            err = internal_error(e)
            try:
                if not started:
                    await send_json(send, 500, err.body(), self.headers)
                elif self.req.stream and not finished:   # the stream's headers are out: end it with an error event
                    await send({"type": "http.response.body", "body": R.sse(err.body()) + R.SSE_DONE,
                                "more_body": False})
            except OSError:
                pass
        finally:
            watcher.cancel()
            for c in self._open():                 # also those never submitted: abort is a no-op for them
                c.ended = True
                self.srv.aengine.abort(c.rid)
                self.srv.metrics.ended(c.rid, "abort", 0 if c.fork_of else len(c.plan.ids))
            if self.probe and not self.first_token and self.srv.guard is not None:
                self.srv.guard_call(self.srv.guard.failed_probe)

    @staticmethod
    async def _watch_disconnect(receive, q: asyncio.Queue) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        q.put_nowait(_GONE)

    async def _next(self, q: asyncio.Queue):
        """(the next engine event, its choice), or (_GONE / _DEAD, None); the engine's liveness is
        checked every second while waiting."""
        while True:
            try:
                item = await asyncio.wait_for(q.get(), timeout=1.0)
            except TimeoutError:
                if not engine_alive(self.srv.aengine):
                    return _DEAD, None
                continue
            if item is _GONE or item is _DEAD:
                return item, None
            c = self._by_rid.get(item.request_id)
            if c is None or c.ended:               # cannot happen; never let it end another choice
                continue
            self.srv.metrics.observe(item, 0 if c.fork_of else len(c.plan.ids))
            self.srv.errors.event(item)
            if item.token_id >= 0 and not self.first_token:
                self.first_token = True
                if self.srv.guard is not None:
                    self.srv.guard_call(self.srv.guard.record, item.since_arrival, self.probe)
            if item.finished:
                c.ended = True
                c.finish = item.finish_reason
            return item, c

    def _dead(self) -> P.APIError:
        for c in self._open():                     # nothing left to abort
            c.ended = True
            self.srv.metrics.ended(c.rid, "error", 0 if c.fork_of else len(c.plan.ids))
        last = self.srv.aengine.last_error
        return P.APIError(500, "the engine thread is not running" + (f" (last error: {last})" if last else ""),
                          None, "engine_dead")

    # ---- what each token adds to its choice
    @staticmethod
    def _take_prompt(c: Choice, ev) -> None:
        """The prompt's log-probabilities, which come with the first token's event."""
        if ev.prompt_logprobs is not None:
            c.prompt_entries = [e if e is not None else {"token_id": t, "logprob": None}
                                for e, t in zip(ev.prompt_logprobs, c.plan.ids)]

    def _take(self, c: Choice, ev) -> tuple[str, list]:
        """Record token event ``ev`` of ``c`` (its prompt's entries already taken); returns (its
        text, its log-probability entries)."""
        if c.plan.echo_only:                       # the prompt alone: the generated token is not returned
            return "", []
        c.tokens += 1
        c.parts.append(ev.text)
        entries = [{"token_id": ev.token_id, **ev.logprobs}] if ev.logprobs is not None else []
        c.entries += entries
        return ev.text, entries

    def _format_logprobs(self, c: Choice, entries: list) -> dict | None:
        """``entries`` in the endpoint's shape; the next ones continue ``c``'s text offsets."""
        if self.req.logprobs is None:
            return None
        if self.req.kind == "chat":
            return R.chat_logprobs(entries, self._name, self._raw)
        return R.completion_logprobs(entries, self._name, [c.offsets.next(e["token_id"]) for e in entries])

    def _echo(self, c: Choice) -> tuple[str, list]:
        """The echoed prompt's text and log-probability entries ("" and [] without echo)."""
        if not self.req.echo:
            return "", []
        return c.plan.text, (c.prompt_entries or [])

    def _whole_choice(self, c: Choice) -> dict:
        echo_text, echo_entries = self._echo(c)
        return R.completion_choice(self.req, c.index, echo_text + "".join(c.parts), c.finish,
                                   self._format_logprobs(c, echo_entries + c.entries))

    # ---- answers
    async def _whole(self, q: asyncio.Queue, send) -> None:
        while self._open():
            ev, c = await self._next(q)
            if ev is _GONE:
                return
            if ev is _DEAD:
                err = self._dead()
                return await send_json(send, err.status, err.body(), self.headers)
            if ev.token_id >= 0:
                self._take_prompt(c, ev)
                self._take(c, ev)
            if ev.finished and ev.finish_reason not in ("stop", "length"):
                err = ending_error(ev)             # the request fails as a whole (the rest is aborted)
                return await send_json(send, err.status, err.body(), self.headers + err.raw_headers())
        body = await self.srv.off_loop_reply(self._whole_bytes) if self.req.logprobs is not None \
            else self._whole_bytes()
        limit = self.srv.config.max_reply_bytes
        if len(body) > limit:
            err = reply_too_large(len(body), limit)
            return await send_json(send, err.status, err.body(), self.headers)
        await send_json(send, 200, body, self.headers)

    def _whole_body(self) -> dict:
        return R.response(self.req, self.rid, self.created, self.srv.name,
                          [self._whole_choice(c) for c in self.choices], self.prompt_tokens,
                          sum(c.tokens for c in self.choices))

    def _whole_bytes(self) -> bytes:
        return P.json_bytes(self._whole_body())

    def _chunk(self, c: Choice, text: str | None, finish: str | None = None, logprobs: dict | None = None,
               role: bool = False) -> bytes:
        usage_now = c.usage if self.req.continuous_usage else None
        return R.sse(R.chunk(self.req, self.rid, self.created, self.srv.name, text, finish, role, c.index,
                             logprobs, usage_now))

    async def _stream(self, q: asyncio.Queue, send) -> None:
        ev, c = await self._next(q)
        if ev is _GONE:
            return
        if ev is _DEAD or (ev.finished and ev.token_id < 0):   # ended before any token: a plain HTTP error
            err = self._dead() if ev is _DEAD else ending_error(ev)
            return await send_json(send, err.status, err.body(), self.headers + err.raw_headers())
        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
            (b"x-accel-buffering", b"no"), *self.headers]})

        sent, limit = 0, self.srv.config.max_reply_bytes

        async def emit(data: bytes) -> None:
            nonlocal sent
            sent += len(data)
            if sent > limit:                       # the rest of the stream would pass --max-reply-bytes
                raise _ReplyTooLarge(sent)
            await send({"type": "http.response.body", "body": data, "more_body": True})

        try:
            await self._relay(ev, c, q, emit, send)
        except _ReplyTooLarge as e:                # an error event, [DONE]; the finally of __call__ aborts the rest
            await send({"type": "http.response.body", "more_body": False,
                        "body": R.sse(reply_too_large(e.nbytes, limit).body()) + R.SSE_DONE})

    async def _echo_chunk(self, c: Choice) -> bytes:
        """A stream's echoed prompt as one chunk; with many log-probability entries, built on the reply
        thread (a 1,000-token prompt with top-20 takes ~0.1 s, which the event loop must not spend)."""
        echo_text, echo_entries = self._echo(c)
        build = lambda: self._chunk(c, echo_text, logprobs=self._format_logprobs(c, echo_entries))  # noqa: E731
        return await self.srv.off_loop_reply(build) if len(echo_entries) > INLINE_ECHO_ENTRIES else build()

    async def _relay(self, ev, c: Choice, q: asyncio.Queue, emit, send) -> None:
        """The stream's chunks, from the first event (``ev`` of choice ``c``) to ``[DONE]``."""
        req = self.req
        if req.kind == "chat":
            for x in self.choices:
                await emit(self._chunk(x, None, role=True))
        while True:
            if ev is _GONE:
                return
            if ev is _DEAD:
                await emit(R.sse(self._dead().body()))
                break
            if ev.token_id >= 0:   # one chunk per token, "" while the text is held back (UTF-8, stop strings)
                self._take_prompt(c, ev)
                if req.echo and not c.echoed:      # the prompt first (its usage counts no token yet)
                    c.echoed = True
                    await emit(await self._echo_chunk(c))
                text, entries = self._take(c, ev)
                if not c.plan.echo_only:
                    await emit(self._chunk(c, text, logprobs=self._format_logprobs(c, entries)))
            if ev.finished:
                if ev.finish_reason not in ("stop", "length"):
                    await emit(R.sse(ending_error(ev).body()))
                    break
                await emit(self._chunk(c, None, ev.finish_reason))
                if not self._open():
                    if req.include_usage:
                        await emit(R.sse(R.usage_chunk(req, self.rid, self.created, self.srv.name,
                                                       self.prompt_tokens, sum(x.tokens for x in self.choices))))
                    break
            ev, c = await self._next(q)
        await send({"type": "http.response.body", "body": R.SSE_DONE, "more_body": False})
