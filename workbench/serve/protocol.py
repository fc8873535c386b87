"""The OpenAI wire format's edges: errors in OpenAI's shape and the raw request body.

The server answers every error in OpenAI's shape ``{"error": {"message", "type", "param",
"code"}}`` (:class:`APIError`; :func:`bad` for a 400 naming the field).  Before a body is
validated (:mod:`workbench.serve.requests`), :func:`check_content_type` (JSON, or no
Content-Type: else 415) and :func:`load_json` (strict UTF-8, at most :data:`MAX_JSON_DEPTH`
levels of nesting, no lone surrogates in any string, valid JSON: else 400) turn the raw bytes
into JSON.  Successful answers are shaped by :mod:`workbench.serve.responses`.  No web
framework in here.
"""

from __future__ import annotations

import json
import re

# OpenAI's error "type" per HTTP status (the client maps on the status; the type is for people)
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                413: "invalid_request_error", 429: "rate_limit_error", 500: "server_error",
                503: "service_unavailable"}


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
