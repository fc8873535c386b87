"""The server's state and the checks that need the engine, between a validated request and
:class:`~workbench.serve.completion.Completion`.

:class:`ServerState` (one per app, ``app.state.server``) holds the served name, the metrics,
the engine's errors, the model's chat template and ``x-model-info``.  It checks the model name
(404), renders chat with the model's template, tokenizes each prompt and checks it against the
context, the vocabulary and the KV pool, works out ``max_tokens`` (the default, the cap, the
context, the pool: 400 ``context_length_exceeded`` when it can never fit), all on worker threads
(:meth:`ServerState.off_loop`, :data:`PREP_THREADS` at once); and asks the SLO guard
(:meth:`ServerState.admit`), holding a deferred request under the guard's queue policy.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

import anyio
import anyio.to_thread

from workbench.errors import WorkbenchError
from workbench.model.tokenizer import utf8_len
from workbench.serve import protocol as P
from workbench.serve.chat_template import ChatTemplate, TemplateError
from workbench.serve.completion import PromptPlan
from workbench.serve.guard import GuardHook
from workbench.serve.health import EngineErrors, model_info
from workbench.serve.limits import REQUEST_TOKENS_PER_CONTEXT
from workbench.serve.metrics import ServerMetrics
from workbench.serve.requests import CompletionRequest

if TYPE_CHECKING:
    from workbench.serve.app import ServerConfig

# Request bodies parsed and prompts tokenized at once, on worker threads (more wait their turn, the
# event loop free meanwhile): one per 4 cores, 1 to 4, so that big prompts leave the engine its cores.
# Not more: work that holds the GIL (JSON parsing; a tokenizer that does not release it) on two
# threads at once starves the engine thread of the GIL (measured: a 0.3 s GIL-holding tokenization on
# each of 2 threads gave a stream 90-320 ms gaps; on 1 thread, 50-90 ms; alone 10-20 ms).
PREP_THREADS = max(1, min(4, (os.cpu_count() or 1) // 4))


async def _wait_disconnect(receive) -> None:
    """Return when the client disconnects (the request body has been read already)."""
    while (await receive())["type"] != "http.disconnect":
        pass


class ServerState:
    """What the app keeps between requests, and the checks that need the engine."""

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
        self._reply: anyio.CapacityLimiter | None = None   # the same for building large replies
        self.max_request_tokens = config.max_request_tokens or REQUEST_TOKENS_PER_CONTEXT * llm.max_model_len
        # x-priority from any client only when told; with an API key every /v1 request has passed it
        self.trusts_priority = config.trust_priority_header or config.api_key is not None
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

    async def off_loop_reply(self, fn, *args):
        """``fn(*args)`` on the reply thread (one at a time): building a large whole reply (tens of
        thousands of log-probability entries take seconds).  Not on the prepare threads, so that
        new requests are not parsed and tokenized only after someone else's reply is built."""
        if self._reply is None:
            self._reply = anyio.CapacityLimiter(1)
        return await anyio.to_thread.run_sync(fn, *args, limiter=self._reply)

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

    def prepare(self, req: CompletionRequest) -> list[PromptPlan]:
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
            text = (prompt if isinstance(prompt, str) else self._decode(ids)) if req.echo else None
            plans.append(PromptPlan(ids, max_tokens, echo_only, text))
        return plans

    def _decode(self, ids: list[int]) -> str:
        tok = self.llm.tokenizer
        return tok.decode(ids) if tok is not None else ""      # as generated text: special tokens skipped

    def tokenize(self, req: CompletionRequest, i: int = 0) -> list[int]:
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

    def max_tokens(self, req: CompletionRequest, prompt_tokens: int, i: int = 0) -> tuple[int, bool]:
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
