"""OpenAI request bodies: :class:`CompletionRequest` and the validation of
``POST /v1/completions`` (:func:`parse_completion`) and ``POST /v1/chat/completions``
(:func:`parse_chat`) bodies (no web framework in here).

A parsed JSON body (:func:`workbench.serve.protocol.load_json`) becomes a
:class:`CompletionRequest`, or an :class:`~workbench.serve.protocol.APIError` naming the field
and what is wrong with it.

Supported: ``max_tokens`` (chat also ``max_completion_tokens``), ``temperature`` [0, 2],
``top_p`` (0, 1], ``top_k`` (extension; 0 or -1 = off), ``seed``, ``stop`` (a string or a
list), ``ignore_eos`` (vLLM's extension), ``n`` (1 to :data:`MAX_N` samples of each prompt; they
share the prompt's KV blocks), ``stream`` + ``stream_options`` (``include_usage``, and vLLM's
``continuous_usage_stats``, which with ``include_usage`` puts usage on every chunk).
Completions: ``prompt`` as text, token ids, or a batch of either (choices are numbered prompt by
prompt, ``n`` per prompt), ``echo`` (the prompt before the completion; with ``max_tokens: 0``,
the prompt alone), ``logprobs`` (0 to :data:`MAX_LOGPROBS`: each token's log-probability and the
top-k, for the echoed prompt tokens too), ``best_of`` equal to ``n``.  Chat: ``messages``,
``logprobs`` + ``top_logprobs``.
``user``, ``metadata``, ``store`` and ``service_tier`` are accepted and ignored.  Features we do
not have (suffix, penalties, logit_bias, tools, JSON response formats) are refused with a 400
when set to anything but their neutral value - never silently ignored - and so is any field we
do not know.

With ``seed`` and ``n`` > 1, sample ``j`` of each prompt uses seed ``seed + j`` (the same seed
would give ``n`` equal samples).

Chat template.  A ``chat_template`` in the model folder (``tokenizer_config.json`` or
``chat_template.jinja``) is applied as transformers applies it (:mod:`workbench.model.chat_template`).  The
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
from dataclasses import dataclass

from workbench.serve.protocol import APIError, bad

CHAT_TEMPLATE_NAME = "workbench-plain-v1"
CHAT_ROLES = {"system": "System", "developer": "System", "user": "User", "assistant": "Assistant"}

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
