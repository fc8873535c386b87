"""OpenAI response shapes: whole responses, stream chunks, usage and log-probabilities, as
plain dicts in OpenAI's exact shape; :func:`sse` frames one as a Server-Sent Event (no web
framework in here).

Log-probabilities (completions, the legacy shape): ``{"tokens", "token_logprobs",
"top_logprobs", "text_offset"}``, one entry per token; a prompt's first token has ``null``
(nothing precedes it); each ``top_logprobs`` entry holds the top-k *and* the chosen token, as
vLLM does (so ``logprobs: 0`` still names the token).  Chat: ``{"content": [{"token",
"logprob", "bytes", "top_logprobs": [top-k]}]}`` as OpenAI.  Token strings are each token
decoded alone (a token that ends inside a UTF-8 character shows U+FFFD; ``bytes`` has its
real bytes).  :class:`TextOffsets` places each token in its choice's text.
"""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from workbench.serve.requests import CompletionRequest


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _head(req: CompletionRequest, rid: str, created: int, model: str, chunk: bool) -> dict:
    obj = ("chat.completion.chunk" if chunk else "chat.completion") if req.kind == "chat" else "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": model}


def completion_choice(req: CompletionRequest, index: int, text: str, finish: str | None,
                      logprobs: dict | None = None) -> dict:
    """One choice of a whole response (chat: the assistant's message)."""
    if req.kind == "chat":
        return {"index": index, "message": {"role": "assistant", "content": text}, "finish_reason": finish,
                "logprobs": logprobs}
    return {"index": index, "text": text, "finish_reason": finish, "logprobs": logprobs}


def response(req: CompletionRequest, rid: str, created: int, model: str, choices: list[dict],
             prompt_tokens: int, completion_tokens: int) -> dict:
    """A whole (non-streamed) completion."""
    return {**_head(req, rid, created, model, False), "choices": choices,
            "usage": usage(prompt_tokens, completion_tokens)}


def chunk(req: CompletionRequest, rid: str, created: int, model: str, text: str | None, finish: str | None = None,
          role: bool = False, index: int = 0, logprobs: dict | None = None, usage_now: dict | None = None) -> dict:
    """One stream chunk of choice ``index``: a token's text (possibly ""), or its last one
    (text None, finish set).  ``usage_now``: the usage so far (``continuous_usage_stats``)."""
    if req.kind == "chat":
        delta = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
        choice = {"index": index, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
    else:
        choice = {"index": index, "text": text or "", "finish_reason": finish, "logprobs": logprobs}
    obj = {**_head(req, rid, created, model, True), "choices": [choice]}
    if usage_now is not None:
        obj["usage"] = usage_now
    elif req.include_usage:
        obj["usage"] = None                 # as OpenAI: null on every chunk but the usage one
    return obj


def usage_chunk(req: CompletionRequest, rid: str, created: int, model: str, prompt_tokens: int,
                completion_tokens: int) -> dict:
    return {**_head(req, rid, created, model, True), "choices": [], "usage": usage(prompt_tokens, completion_tokens)}


def completion_logprobs(entries: list, name, offsets: list[int]) -> dict:
    """The legacy completions shape for ``entries`` (per token ``{"token_id", "logprob", "top"}``;
    ``"logprob": None`` for a prompt's first token, which has no log-probability).
    ``name(token_id)``: the token's text; ``offsets``: where each token starts in the choice's
    text (:class:`TextOffsets`).  Each ``top_logprobs`` entry holds the top-k and the chosen
    token (vLLM's convention)."""
    tokens, lps, tops = [], [], []
    for e in entries:
        tokens.append(name(e["token_id"]))
        if e.get("logprob") is None:
            lps.append(None)
            tops.append(None)
            continue
        lps.append(e["logprob"])
        top = {}
        for tid, lp in sorted({**e["top"], e["token_id"]: e["logprob"]}.items(), key=lambda kv: -kv[1]):
            top.setdefault(name(tid), lp)     # two ids that print the same: the likelier one
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": list(offsets)}


class TextOffsets:
    """Where each token of a choice starts in its text, in characters.  Tokens are pieces of
    bytes (``shown(token_id)``: the bytes a token adds to the text, b"" for a special token the
    text skips); a token that starts inside a multi-byte UTF-8 character starts at that
    character.  Decoding each token alone would count such a piece as one U+FFFD and drift."""

    def __init__(self, shown) -> None:
        self.shown = shown
        self.chars = 0              # characters begun so far (UTF-8 lead bytes seen)

    def next(self, token_id: int) -> int:
        b = self.shown(token_id)
        inside = bool(b) and (b[0] & 0xC0) == 0x80 and self.chars > 0
        at = self.chars - inside
        self.chars += sum((x & 0xC0) != 0x80 for x in b)
        return at


def chat_logprobs(entries: list, name, raw) -> dict:
    """OpenAI's chat shape: ``{"content": [{"token", "logprob", "bytes", "top_logprobs"}]}``;
    ``raw(token_id)``: the token's bytes."""
    def one(tid: int, lp: float) -> dict:
        return {"token": name(tid), "logprob": lp, "bytes": list(raw(tid))}

    return {"content": [{**one(e["token_id"], e["logprob"]),
                         "top_logprobs": [one(t, lp) for t, lp in sorted(e["top"].items(), key=lambda kv: -kv[1])]}
                        for e in entries]}


def sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def now_s() -> int:
    return int(time.time())
