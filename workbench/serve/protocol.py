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
list), ``ignore_eos`` (vLLM's extension), ``n`` (1 to :data:`MAX_N` samples of each prompt; they
share the prompt's KV blocks), ``stream`` + ``stream_options`` (``include_usage``, and vLLM's
``continuous_usage_stats``, which with ``include_usage`` puts usage on every chunk).  Completions: ``prompt`` as text, token ids, or
a batch of either (choices are numbered prompt by prompt, ``n`` per prompt), ``echo`` (the prompt
before the completion; with ``max_tokens: 0``, the prompt alone), ``logprobs`` (0 to
:data:`MAX_LOGPROBS`: each token's log-probability and the top-k, for the echoed prompt tokens
too), ``best_of`` equal to ``n``.  Chat: ``messages``, ``logprobs`` + ``top_logprobs``.
``user``, ``metadata``, ``store`` and ``service_tier`` are accepted and ignored.  Features we do
not have (suffix, penalties, logit_bias, tools, JSON response formats) are refused with a 400
when set to anything but their neutral value - never silently ignored - and so is any field we
do not know.

With ``seed`` and ``n`` > 1, sample ``j`` of each prompt uses seed ``seed + j`` (the same seed
would give ``n`` equal samples).

Log-probabilities (completions, the legacy shape): ``{"tokens", "token_logprobs",
"top_logprobs", "text_offset"}``, one entry per token; a prompt's first token has ``null``
(nothing precedes it); each ``top_logprobs`` entry holds the top-k *and* the chosen token, as
vLLM does (so ``logprobs: 0`` still names the token).  Chat: ``{"content": [{"token",
"logprob", "bytes", "top_logprobs": [top-k]}]}`` as OpenAI.  Token strings are each token
decoded alone (a token that ends inside a UTF-8 character shows U+FFFD; ``bytes`` has its
real bytes).

Chat template.  A ``chat_template`` in the model folder (``tokenizer_config.json`` or
``chat_template.jinja``) is applied as transformers applies it (:mod:`.chat_template`).  The
bundled model was trained on plain prose and has none, so its messages are rendered with a
fixed, simple one (:func:`render_chat`)::

    System: You are terse.
    User: What is a list?
    Assistant:

one ``Role: content`` line per message (``developer`` is shown as ``System``), then
``Assistant:`` for the model to continue.
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


MAX_N = 16                 # samples per prompt
MAX_CHOICES = 256          # prompts x n in one request
MAX_LOGPROBS = 20          # top-k log-probabilities per token (the engine's limit)


@dataclass
class CompletionRequest:
    kind: str                      # "completion" or "chat"
    model: str | None              # None: the client did not name one (the served model answers)
    prompts: list                  # each text or token ids; chat: one, the rendered conversation
    max_tokens: int | None         # None: not given (the server picks a default); 0: echo only
    sampling: dict                 # SamplingParams keyword arguments other than max_tokens
    stream: bool = False
    include_usage: bool = False
    max_tokens_param: str = "max_tokens"   # the field that gave max_tokens (for error messages)
    n: int = 1                     # samples per prompt
    echo: bool = False             # completions: the prompt comes back before the completion
    logprobs: int | None = None    # top-k log-probabilities per token (None: none asked)
    continuous_usage: bool = False  # usage on every stream chunk
    messages: list | None = None   # chat: [{"role", "content"[, "name"]}] as validated
    add_special_tokens: bool = True   # False for a prompt rendered by the model's chat template

    @property
    def prompt(self):
        """The first (for chat: the only) prompt."""
        return self.prompts[0]

    def prompt_param(self, i: int = 0) -> str:
        if self.kind == "chat":
            return "messages"
        return f"prompt[{i}]" if len(self.prompts) > 1 else "prompt"

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * self.n


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


def _flag(body: dict, name: str) -> bool:
    v = body.get(name)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise bad(name, "must be true or false", "invalid_type")
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
        out["ignore_eos"] = _flag(body, "ignore_eos")
    return out


def sample_seed(seed: int | None, j: int) -> int | None:
    """The seed of sample ``j`` of a prompt: ``seed + j`` (kept in torch's seed range)."""
    if seed is None:
        return None
    s = seed + j
    return s - 2**64 if s > 2**64 - 1 else s


def _common(body: dict, kind: str, prompts: list, max_tokens_fields: tuple[str, ...],
            logprobs: int | None, echo: bool = False) -> CompletionRequest:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("model", "must be a string (a name from GET /v1/models)", "invalid_type")
    n = _number(body, "n", 1, MAX_N, integer=True) or 1
    if len(prompts) * n > MAX_CHOICES:
        raise bad("n", f"{len(prompts)} prompts x n={n} is {len(prompts) * n} choices; this server answers at most "
                       f"{MAX_CHOICES} in one request: send several requests", "unsupported")
    max_tokens, max_tokens_param = None, max_tokens_fields[0]
    for name in max_tokens_fields:           # chat: max_completion_tokens wins over the older max_tokens
        v = _number(body, name, 0 if echo else 1, 2**31 - 1, integer=True)
        if v is not None:
            max_tokens, max_tokens_param = v, name
            break
    stream = _flag(body, "stream")
    include_usage = continuous = False
    opts = body.get("stream_options")
    if opts is not None:
        if not stream:
            raise bad("stream_options", "is only allowed with \"stream\": true")
        if not isinstance(opts, dict) or set(opts) - {"include_usage", "continuous_usage_stats"}:
            raise bad("stream_options", "must be an object like {\"include_usage\": true} (keys: include_usage, "
                                        "continuous_usage_stats)", "invalid_type")
        for key in ("include_usage", "continuous_usage_stats"):
            if opts.get(key) is not None and not isinstance(opts[key], bool):
                raise bad(f"stream_options.{key}", "must be true or false", "invalid_type")
        include_usage = opts.get("include_usage") is True
        continuous = include_usage and opts.get("continuous_usage_stats") is True   # as vLLM: both
    return CompletionRequest(kind, model, prompts, max_tokens, _sampling(body), stream, include_usage,
                             max_tokens_param, n, echo, logprobs, continuous)


def _need_object(body) -> dict:
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object", None, "invalid_json")
    return body


def _one_prompt(prompt, param: str):
    if isinstance(prompt, str):
        if not prompt:
            raise bad(param, "is empty: give at least one character (or token id)")
    elif isinstance(prompt, list):
        if not prompt:
            raise bad(param, "is an empty list: give at least one token id")
        if not all(_is_int(t) for t in prompt):
            raise bad(param, "a token-id prompt must be a list of integers", "invalid_type")
    else:
        raise bad(param, "must be a string or a list of token ids", "invalid_type")
    return prompt


def _prompts(body: dict) -> list:
    """``prompt``: a string, token ids, or a batch (a list of strings / of token-id lists)."""
    if "prompt" not in body or body["prompt"] is None:
        raise bad("prompt", "is required: a string, a list of token ids, or a list of either (a batch)",
                  "missing_required_parameter")
    prompt = body["prompt"]
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) > MAX_CHOICES:
            raise bad("prompt", f"a batch of {len(prompt)} prompts; this server answers at most {MAX_CHOICES} "
                                "in one request", "unsupported")
        return [_one_prompt(p, f"prompt[{i}]") for i, p in enumerate(prompt)]
    return [_one_prompt(prompt, "prompt")]


def parse_completion(body) -> CompletionRequest:
    """Validate a ``POST /v1/completions`` body."""
    body = _need_object(body)
    _check_known(body, _COMPLETION, "/v1/completions")
    _refuse_unless_neutral(body, {"suffix": lambda v: v == "", "presence_penalty": lambda v: v == 0,
                                  "frequency_penalty": lambda v: v == 0, "logit_bias": lambda v: v == {}})
    prompts = _prompts(body)
    echo = _flag(body, "echo")
    lp = body.get("logprobs")
    if lp is False:                          # some clients send false for "none"
        lp = None
    logprobs = _number({"logprobs": lp}, "logprobs", 0, MAX_LOGPROBS, integer=True)
    req = _common(body, "completion", prompts, ("max_tokens",), logprobs, echo)
    best_of = body.get("best_of")
    if best_of is not None and best_of not in (1, req.n):
        raise bad("best_of", f"{json.dumps(best_of)} is not supported: best_of must equal n (this server returns "
                             "every sample it draws)", "unsupported")
    return req


def _message(i: int, m) -> dict:
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
    elif not isinstance(content, str):
        raise bad(f"{where}.content", "must be a string or a list of text parts", "invalid_type")
    extra = set(m) - {"role", "content", "name"}
    if extra:
        raise bad(f"{where}.{sorted(extra)[0]}", "is not supported (tool calls and refusals are not)", "unsupported")
    out = {"role": role, "content": content}     # text parts stay a list: a model's template may loop over them
    if m.get("name") is not None:
        if not isinstance(m["name"], str):
            raise bad(f"{where}.name", "must be a string", "invalid_type")
        out["name"] = m["name"]
    return out


def render_chat(messages: list) -> str:
    """The plain chat template: ``Role: content`` lines, then ``Assistant:``.  ``messages``:
    (role, content) pairs or ``{"role", "content"}`` objects."""
    pairs = [(m["role"], m["content"]) if isinstance(m, dict) else m for m in messages]
    lines = [f"{CHAT_ROLES[role]}: {content if isinstance(content, str) else ''.join(p['text'] for p in content)}"
             for role, content in pairs]
    return "\n".join(lines + ["Assistant:"])


def parse_chat(body) -> CompletionRequest:
    """Validate a ``POST /v1/chat/completions`` body; the prompt is the plain template's
    rendering (the server renders it again with the model's own template when it has one)."""
    body = _need_object(body)
    _check_known(body, _CHAT, "/v1/chat/completions")
    _refuse_unless_neutral(body, {"presence_penalty": lambda v: v == 0, "frequency_penalty": lambda v: v == 0,
                                  "logit_bias": lambda v: v == {}, "tools": lambda v: v == [],
                                  "functions": lambda v: v == [], "tool_choice": lambda v: v == "none",
                                  "function_call": lambda v: v == "none",
                                  "response_format": lambda v: v == {"type": "text"}})
    msgs = body.get("messages")
    if msgs is None:
        raise bad("messages", "is required: a list of {\"role\", \"content\"} objects", "missing_required_parameter")
    if not isinstance(msgs, list) or not msgs:
        raise bad("messages", "must be a non-empty list of {\"role\", \"content\"} objects", "invalid_type")
    messages = [_message(i, m) for i, m in enumerate(msgs)]
    top = _number(body, "top_logprobs", 0, MAX_LOGPROBS, integer=True)
    want = _flag(body, "logprobs")
    if top is not None and not want:
        raise bad("top_logprobs", "needs \"logprobs\": true")
    req = _common(body, "chat", [render_chat(messages)], ("max_completion_tokens", "max_tokens"),
                  (top or 0) if want else None)
    req.messages = messages
    return req


# ---- responses -----------------------------------------------------------------------------------
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
