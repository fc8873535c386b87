"""The OpenAI wire format: request validation and response shapes (no web framework in here).

A request body becomes a :class:`CompletionRequest`, or an :class:`APIError` naming the field
and what is wrong with it.  Before that, :func:`check_content_type` (JSON, or no Content-Type:
else 415) and :func:`load_json` (strict UTF-8, at most :data:`MAX_JSON_DEPTH` levels of nesting,
no lone surrogates in any string, valid JSON: else 400) turn the raw bytes into JSON.  The
server answers errors in OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``.
Responses and stream chunks are plain dicts in OpenAI's exact shape; :func:`sse` frames one as a
Server-Sent Event.

Supported: ``max_tokens`` (chat also ``max_completion_tokens``), ``temperature`` [0, 2],
``top_p`` (0, 1], ``top_k`` (extension; 0 or -1 = off), ``seed``, ``stop`` (a string or a
list), ``ignore_eos`` (vLLM's extension), ``n`` = 1, ``stream`` + ``stream_options.include_usage``,
``prompt`` as text or token ids (completions), ``messages`` (chat).  ``user``, ``metadata``,
``store`` and ``service_tier`` are accepted and ignored.  Features we do not have (logprobs,
echo, suffix, best_of > 1, penalties, logit_bias, tools, JSON response formats) are refused
with a 400 when set to anything but their neutral value - never silently ignored - and so is
any field we do not know.

Chat template.  The bundled model was trained on plain prose and has no chat template, so
messages are rendered with a fixed, simple one (:func:`render_chat`)::

    System: You are terse.
    User: What is a list?
    Assistant:

one ``Role: content`` line per message (``developer`` is shown as ``System``), then
``Assistant:`` for the model to continue.  A ``chat_template`` in a model folder's
``tokenizer_config.json`` is not applied yet (the server says so at start and in
``x-model-info``).
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass

# OpenAI's error "type" per HTTP status (the client maps on the status; the type is for people)
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                413: "invalid_request_error", 429: "rate_limit_error", 500: "server_error",
                503: "service_unavailable"}

CHAT_TEMPLATE_NAME = "workbench-plain-v1"
CHAT_ROLES = {"system": "System", "developer": "System", "user": "User", "assistant": "Assistant"}


def error_type(status: int) -> str:
    """OpenAI's error "type" for an HTTP status: any other 4xx (405, 415, ...) is the client's
    request (invalid_request_error); only 5xx are server errors."""
    if status in _ERROR_TYPES:
        return _ERROR_TYPES[status]
    return "invalid_request_error" if 400 <= status < 500 else "server_error"


class APIError(Exception):
    """An HTTP error answered in OpenAI's JSON shape."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = dict(headers or {})      # extra response headers (e.g. Retry-After)

    def raw_headers(self) -> list[tuple[bytes, bytes]]:
        return [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in self.headers.items()]

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": error_type(self.status),
                          "param": self.param, "code": self.code}}


def bad(param: str, why: str, code: str | None = "invalid_value") -> APIError:
    return APIError(400, f"'{param}': {why}", param, code)


def json_bytes(obj) -> bytes:
    """JSON for a response body: ASCII (json escapes the rest), so any text, even a lone
    surrogate echoed from a request, can be sent."""
    return json.dumps(obj).encode()


# ---- the request body: media type, UTF-8, nesting, lone surrogates -----------------------------------
MAX_JSON_DEPTH = 64      # nesting levels a request body may have; OpenAI bodies need ~5 (messages[i].content[j])

_JSON_MEDIA = re.compile(r"application/(?:[\w.+-]+\+)?json")


def check_content_type(value: str | None) -> None:
    """415 unless the body is declared JSON (``application/json``, ``application/*+json``; a
    ``charset`` other than UTF-8 is refused: JSON is UTF-8, RFC 8259).  A body without a
    Content-Type is taken as JSON (minimal clients omit it; it must then parse)."""
    if value is None or not value.strip():
        return
    media, *params = value.split(";")
    hint = "send the body as JSON with 'Content-Type: application/json'"
    if not _JSON_MEDIA.fullmatch(media.strip().lower()):
        raise APIError(415, f"Content-Type {value.strip()!r} is not supported: {hint}", None, "unsupported_media_type")
    for p in params:
        k, _, v = p.partition("=")
        if k.strip().lower() == "charset" and v.strip().strip('"').lower() not in ("utf-8", "utf8"):
            raise APIError(415, f"Content-Type {value.strip()!r}: JSON must be UTF-8; {hint}", None,
                           "unsupported_media_type")


# A JSON string: to its closing quote or, unterminated, to the end of the text (so every try from a
# quote matches and a search is linear even on hostile input); then anything but brackets; then "[]"/"{}"
_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*\\?(?:"|\Z)', re.S)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_EMPTY_PAIR = re.compile(r"\[\]|\{\}")
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def json_too_deep(text: str, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether JSON ``text`` nests deeper than ``limit`` (checked before parsing, at C speed:
    Python's json recurses once per level and would raise RecursionError, or worse with a raised
    recursion limit).  Strings are dropped, then brackets only are kept and each pass removes
    every innermost ``[]``/``{}``: text of depth d is gone after d passes.  Brackets that never
    pair (not JSON) count as too deep only when more than ``limit`` of them open."""
    if text.count("[") + text.count("{") <= limit:
        return False
    s = _NOT_BRACKET.sub("", _JSON_STRING.sub("", text))
    for _ in range(limit):
        t = _EMPTY_PAIR.sub("", s)
        if not t:
            return False
        if t == s:                                  # unbalanced: nothing more pairs
            return t.count("[") + t.count("{") > limit
        s = t
    return True


def _has_lone_surrogate(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _printable(s: str) -> str:
    return s.encode("utf-8", "backslashreplace").decode("utf-8")


def lone_surrogate_field(body) -> tuple[str, bool] | None:
    """``(field, in its name)`` for the first field (``prompt``, ``messages[1].content[0].text``,
    ``stop[0]``...) whose text - or name - has a lone surrogate (a ``\\ud800`` escape without its
    pair: not Unicode text, and the tokenizer cannot take it), or None.  No recursion."""
    stack: list[tuple[str, object]] = [("", body)]
    while stack:
        path, v = stack.pop()
        if isinstance(v, str):
            if _has_lone_surrogate(v):
                return path or "(the body)", False
        elif isinstance(v, dict):
            for k in reversed(list(v)):
                where = f"{path}.{k}" if path else k
                if _has_lone_surrogate(k):
                    return _printable(where), True
                stack.append((where, v[k]))
        elif isinstance(v, list):
            stack.extend((f"{path}[{i}]", v[i]) for i in range(len(v) - 1, -1, -1))
    return None


def load_json(raw: bytes):
    """Parse a request body: strict UTF-8 (a leading BOM is ignored), at most ``MAX_JSON_DEPTH``
    levels, no lone surrogates in any string.  Each failure is a 400 in OpenAI's shape (a lone
    surrogate's names the field).  For a worker thread: parsing 1 MiB takes milliseconds
    (~2 ms for one long string, ~40 ms for 300k tiny arrays) and holds the GIL meanwhile."""
    if raw[:3] == b"\xef\xbb\xbf":
        raw = raw[3:]
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(400, f"the request body is not valid UTF-8 (byte {raw[e.start]:#04x} at offset {e.start}); "
                            "JSON must be UTF-8", None, "invalid_json") from None
    too_deep = APIError(400, f"the request body is nested deeper than {MAX_JSON_DEPTH} levels", None, "invalid_json")
    if json_too_deep(text):
        raise too_deep
    try:
        body = json.loads(text)
    except RecursionError:                         # not reached after json_too_deep; kept as a backstop
        raise too_deep from None
    except ValueError as e:
        raise APIError(400, f"the request body is not valid JSON: {e}", None, "invalid_json") from None
    if _SURROGATE_ESCAPE.search(text):             # else no string can hold one (the text is valid UTF-8)
        found = lone_surrogate_field(body)
        if found is not None:
            where, name = found
            raise APIError(400, f"'{where}': {'its name' if name else 'the text'} has a lone surrogate (a "
                                "\\ud800-\\udfff escape without its pair), which is not Unicode text", where,
                           "invalid_value")
    return body


@dataclass
class CompletionRequest:
    kind: str                      # "completion" or "chat"
    model: str | None              # None: the client did not name one (the served model answers)
    prompt: str | list[int]        # text or token ids; chat: the rendered template
    max_tokens: int | None         # None: not given (the server picks a default)
    sampling: dict                 # SamplingParams keyword arguments other than max_tokens
    stream: bool = False
    include_usage: bool = False
    max_tokens_param: str = "max_tokens"   # the field that gave max_tokens (for error messages)

    @property
    def prompt_param(self) -> str:
        return "messages" if self.kind == "chat" else "prompt"


# ---- validation -----------------------------------------------------------------------------------
_IGNORED = {"user", "metadata", "store", "service_tier"}
_COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "n", "stream", "stream_options",
           "ignore_eos", "presence_penalty", "frequency_penalty", "logit_bias", "logprobs"} | _IGNORED
_COMPLETION = _COMMON | {"prompt", "echo", "suffix", "best_of"}
_CHAT = _COMMON | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice", "functions",
                   "function_call", "parallel_tool_calls", "response_format"}


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _check_known(body: dict, known: set[str], endpoint: str) -> None:
    unknown = sorted(set(body) - known)
    if unknown:
        raise bad(unknown[0], f"unknown field for {endpoint} (supported: {', '.join(sorted(known - _IGNORED))})",
                  "unknown_field")


def _refuse_unless_neutral(body: dict, neutral: dict) -> None:
    """Fields for features we do not have: fine when absent or neutral, a 400 otherwise."""
    for name, ok in neutral.items():
        if name in body and body[name] is not None and not ok(body[name]):
            raise bad(name, f"{body[name]!r} is not supported by this server", "unsupported")


def _number(body: dict, name: str, lo: float, hi: float, lo_open: bool = False, integer: bool = False):
    v = body.get(name)
    if v is None:
        return None
    if not (_is_int(v) if integer else _is_num(v)):
        raise bad(name, f"must be {'an integer' if integer else 'a number'}, got {json.dumps(v)[:60]}", "invalid_type")
    if v != v:                                   # NaN (Python's json reads it): no range holds it
        raise bad(name, "must be a number, got NaN")
    if v < lo or v > hi or (lo_open and v == lo):
        rng = f"{'(' if lo_open else '['}{lo}, {hi}]"
        raise bad(name, f"{v} is out of range; must be in {rng}")
    return v


def _sampling(body: dict) -> dict:
    out = {}
    t = _number(body, "temperature", 0, 2)
    if t is not None:
        out["temperature"] = float(t)
    p = _number(body, "top_p", 0, 1, lo_open=True)
    if p is not None:
        out["top_p"] = float(p)
    k = _number(body, "top_k", -1, 2**31 - 1, integer=True)
    if k is not None:
        out["top_k"] = k
    seed = _number(body, "seed", -(2**63), 2**64 - 1, integer=True)
    if seed is not None:
        out["seed"] = seed
    stop = body.get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
            raise bad("stop", "must be a non-empty string or a list of non-empty strings", "invalid_type")
        out["stop"] = stops
    if body.get("ignore_eos") is not None:
        if not isinstance(body["ignore_eos"], bool):
            raise bad("ignore_eos", "must be true or false", "invalid_type")
        out["ignore_eos"] = body["ignore_eos"]
    return out


def _common(body: dict, kind: str, prompt, max_tokens_fields: tuple[str, ...]) -> CompletionRequest:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("model", "must be a string (a name from GET /v1/models)", "invalid_type")
    n = body.get("n")
    if n is not None and (not _is_int(n) or n != 1):
        raise bad("n", f"{json.dumps(n)} is not supported: this server returns one choice per request (n=1); "
                       "send several requests instead", "unsupported")
    max_tokens, max_tokens_param = None, max_tokens_fields[0]
    for name in max_tokens_fields:           # chat: max_completion_tokens wins over the older max_tokens
        v = _number(body, name, 1, 2**31 - 1, integer=True)
        if v is not None:
            max_tokens, max_tokens_param = v, name
            break
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise bad("stream", "must be true or false", "invalid_type")
    include_usage = False
    opts = body.get("stream_options")
    if opts is not None:
        if not stream:
            raise bad("stream_options", "is only allowed with \"stream\": true")
        if not isinstance(opts, dict) or set(opts) - {"include_usage", "continuous_usage_stats"}:
            raise bad("stream_options", "must be an object like {\"include_usage\": true}", "invalid_type")
        include_usage = opts.get("include_usage") is True
        if opts.get("continuous_usage_stats"):
            raise bad("stream_options", "continuous_usage_stats is not supported", "unsupported")
    return CompletionRequest(kind, model, prompt, max_tokens, _sampling(body), stream, include_usage,
                             max_tokens_param)


def _need_object(body) -> dict:
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object", None, "invalid_json")
    return body


def parse_completion(body) -> CompletionRequest:
    """Validate a ``POST /v1/completions`` body."""
    body = _need_object(body)
    _check_known(body, _COMPLETION, "/v1/completions")
    _refuse_unless_neutral(body, {"echo": lambda v: v is False, "suffix": lambda v: v == "",
                                  "best_of": lambda v: v == 1, "logprobs": lambda v: v is False or v == 0,
                                  "presence_penalty": lambda v: v == 0, "frequency_penalty": lambda v: v == 0,
                                  "logit_bias": lambda v: v == {}})
    if "prompt" not in body or body["prompt"] is None:
        raise bad("prompt", "is required: a string, or a list of token ids", "missing_required_parameter")
    prompt = body["prompt"]
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]                   # a batch of one prompt
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise bad("prompt", f"got a batch of {len(prompt)} prompts; this server takes one prompt per request",
                  "unsupported")
    if isinstance(prompt, str):
        if not prompt:
            raise bad("prompt", "is empty: give at least one character (or token id)")
    elif isinstance(prompt, list):
        if not prompt:
            raise bad("prompt", "is an empty list: give at least one token id")
        if not all(_is_int(t) for t in prompt):
            raise bad("prompt", "a token-id prompt must be a list of integers", "invalid_type")
    else:
        raise bad("prompt", "must be a string or a list of token ids", "invalid_type")
    return _common(body, "completion", prompt, ("max_tokens",))


def _message_text(i: int, m) -> tuple[str, str]:
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise bad(where, "must be an object with 'role' and 'content'", "invalid_type")
    role = m.get("role")
    if role not in CHAT_ROLES:
        raise bad(f"{where}.role", f"{json.dumps(role)} is not supported (use one of {', '.join(CHAT_ROLES)})")
    content = m.get("content")
    if isinstance(content, list):            # content parts: text only
        texts = []
        for j, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise bad(f"{where}.content[{j}]", f"only text parts are supported, got {json.dumps(kind)}",
                          "unsupported")
            texts.append(part["text"])
        content = "".join(texts)
    if not isinstance(content, str):
        raise bad(f"{where}.content", "must be a string or a list of text parts", "invalid_type")
    extra = set(m) - {"role", "content", "name"}
    if extra:
        raise bad(f"{where}.{sorted(extra)[0]}", "is not supported (tool calls and refusals are not)", "unsupported")
    return role, content


def render_chat(messages: list[tuple[str, str]]) -> str:
    """The plain chat template: ``Role: content`` lines, then ``Assistant:``."""
    lines = [f"{CHAT_ROLES[role]}: {content}" for role, content in messages]
    return "\n".join(lines + ["Assistant:"])


def parse_chat(body) -> CompletionRequest:
    """Validate a ``POST /v1/chat/completions`` body; the prompt is the rendered template."""
    body = _need_object(body)
    _check_known(body, _CHAT, "/v1/chat/completions")
    _refuse_unless_neutral(body, {"logprobs": lambda v: v is False, "top_logprobs": lambda v: v == 0,
                                  "presence_penalty": lambda v: v == 0, "frequency_penalty": lambda v: v == 0,
                                  "logit_bias": lambda v: v == {}, "tools": lambda v: v == [],
                                  "functions": lambda v: v == [], "tool_choice": lambda v: v == "none",
                                  "function_call": lambda v: v == "none",
                                  "response_format": lambda v: v == {"type": "text"}})
    msgs = body.get("messages")
    if msgs is None:
        raise bad("messages", "is required: a list of {\"role\", \"content\"} objects", "missing_required_parameter")
    if not isinstance(msgs, list) or not msgs:
        raise bad("messages", "must be a non-empty list of {\"role\", \"content\"} objects", "invalid_type")
    prompt = render_chat([_message_text(i, m) for i, m in enumerate(msgs)])
    return _common(body, "chat", prompt, ("max_completion_tokens", "max_tokens"))


# ---- responses -----------------------------------------------------------------------------------
def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _head(req: CompletionRequest, rid: str, created: int, model: str, chunk: bool) -> dict:
    obj = ("chat.completion.chunk" if chunk else "chat.completion") if req.kind == "chat" else "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": model}


def response(req: CompletionRequest, rid: str, created: int, model: str, text: str, finish: str,
             prompt_tokens: int, completion_tokens: int) -> dict:
    """A whole (non-streamed) completion."""
    if req.kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish,
                  "logprobs": None}
    else:
        choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
    return {**_head(req, rid, created, model, False), "choices": [choice],
            "usage": usage(prompt_tokens, completion_tokens)}


def chunk(req: CompletionRequest, rid: str, created: int, model: str, text: str | None, finish: str | None = None,
          role: bool = False) -> dict:
    """One stream chunk: a token's text (possibly ""), or the last one (text None, finish set)."""
    if req.kind == "chat":
        delta = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
        choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
    else:
        choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
    obj = {**_head(req, rid, created, model, True), "choices": [choice]}
    if req.include_usage:
        obj["usage"] = None                 # as OpenAI: null on every chunk but the usage one
    return obj


def usage_chunk(req: CompletionRequest, rid: str, created: int, model: str, prompt_tokens: int,
                completion_tokens: int) -> dict:
    return {**_head(req, rid, created, model, True), "choices": [], "usage": usage(prompt_tokens, completion_tokens)}


def sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def now_s() -> int:
    return int(time.time())
