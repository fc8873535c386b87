"""Recorded traffic in: the public trace formats, read as a stream of rows.

::

    from workbench.load.traces import read_trace, detect_format
    for row in read_trace("azure_code_2023.csv", window=(0, 600), limit=500):
        row.at, row.prompt_tokens, row.max_tokens        # seconds from the window's start, lengths
    wl = build_trace_workload("trace.jsonl", tokenizer, max_model_len=1024)   # workbench.load.trace_workload

Five formats (``format=`` or detected from the file's name and first bytes, :func:`detect_format`):

* ``workbench`` - our own JSONL, one request a line: ``at`` (seconds; required), ``prompt`` (text)
  or ``prompt_tokens`` (a length), ``max_tokens`` (or ``output_tokens``; required), and optionally
  ``conversation`` (turns of one conversation share their history), ``prefix`` with
  ``prefix_tokens`` (requests naming one prefix share that many leading tokens) and ``priority``;
* ``sharegpt`` - ShareGPT conversations (a JSON list, or JSONL, of ``{"id", "conversations":
  [{"from": "human" | "gpt" | "system", "value"}...]}``), as vLLM's and SGLang's serving benchmarks
  use them.  Each human turn is a request that re-sends the conversation so far; the reply that
  follows it gives its ``max_tokens``.  ShareGPT has no times: conversations start as a Poisson
  process (``rate``), a conversation's next turn follows ``reply_s`` plus an exponential think
  time (mean ``think_s``) after the previous one;
* ``azure`` - the Azure LLM inference traces (CSV ``TIMESTAMP,ContextTokens,GeneratedTokens``);
* ``burstgpt`` - BurstGPT (CSV ``Timestamp,Model,Request tokens,Response tokens,Total tokens,Log
  Type``; a row with 0 response tokens is a failed request in the recording, left out and counted);
* ``mooncake`` - Mooncake's traces (JSONL ``timestamp`` in ms, ``input_length``, ``output_length``,
  ``hash_ids``: one id per 512-token block, equal ids for equal prefixes).

The reader streams: a file of any size is read a line (or, for a ShareGPT JSON list, an element)
at a time, and only the rows kept are returned.  ``window=(start, end)`` keeps the rows recorded
from ``start`` to ``end`` seconds after the trace's first row and times them from ``start``;
``limit`` stops after that many requests.  Every malformed row is a :class:`TraceError`: one line
naming the file, the line and the field.
"""

from __future__ import annotations

import csv
import json
import math
import random
import re
from dataclasses import dataclass, field
from datetime import datetime, UTC
from pathlib import Path
from collections.abc import Iterator

from workbench.errors import DataError

FORMATS = ("workbench", "sharegpt", "azure", "burstgpt", "mooncake")
MOONCAKE_BLOCK = 512                  # tokens per Mooncake hash id
AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
BURSTGPT_COLUMNS = ("Timestamp", "Request tokens", "Response tokens")
_READ = 1 << 16
_TIME_FIELD = {"workbench": "at", "azure": "TIMESTAMP", "burstgpt": "Timestamp", "mooncake": "timestamp"}


class TraceError(DataError):
    """A trace file that cannot be read: ``file:line: field: what is wrong`` on one line."""

    def __init__(self, path, line: int | None, field_name: str | None, why: str) -> None:
        where = f"{path}" + (f":{line}" if line is not None else "")
        super().__init__(f"{where}: {field_name + ': ' if field_name else ''}{why}")
        self.path, self.line, self.field = str(path), line, field_name


@dataclass
class TraceRow:
    """One recorded request.  ``at``: seconds from the trace's start (the window's, with one);
    a prompt is ``prompt`` (text), ``turns`` (ShareGPT: the conversation's messages up to this
    request, ``(role, text)``) or ``prompt_tokens`` (a length only, for synthetic content)."""

    line: int                           # where it is in the file (1-based)
    at: float
    max_tokens: int | None = None       # None: the length of ``reply`` (ShareGPT)
    prompt: str | None = None
    prompt_tokens: int | None = None
    turns: list | None = None           # ShareGPT: [(role, text), ...] ending with the user's message
    reply: str | None = None            # ShareGPT: the recorded answer (its length is max_tokens)
    conversation: str | None = None
    turn: int | None = None
    prefix: str | None = None           # own JSONL: a shared prefix's id ...
    prefix_tokens: int | None = None    # ... and its length
    hash_ids: tuple | None = None       # Mooncake: the prompt's block ids
    priority: int = 0


@dataclass
class ReadStats:
    """What reading a trace found besides the rows kept."""

    format: str = ""
    path: str = ""
    rows_read: int = 0                  # requests in the file up to where reading stopped
    kept: int = 0
    outside_window: int = 0
    left_out: dict = field(default_factory=dict)     # reason -> rows (e.g. failed requests in BurstGPT)
    stopped_at_limit: bool = False
    first_time: float | None = None     # the recorded time of the trace's first row (s; absolute where it was)


# ---- detection ----------------------------------------------------------------------------------
def detect_format(path) -> str:
    """The format of ``path`` from its suffix and first bytes (see the module docstring)."""
    p = Path(path)
    if not p.is_file():
        raise TraceError(p, None, None, "no such file")
    with open(p, "rb") as f:
        head = f.read(4096).decode("utf-8", errors="replace").lstrip("\ufeff")
    first = next((ln for ln in head.splitlines() if ln.strip()), "")
    if not first:
        raise TraceError(p, None, None, "empty file: no rows")
    if p.suffix.lower() == ".csv" or ("," in first and not first.lstrip().startswith(("{", "["))):
        cols = {c.strip() for c in next(csv.reader([first]), [])}
        if {"ContextTokens", "GeneratedTokens"} <= cols:
            return "azure"
        if {"Request tokens", "Response tokens"} <= cols:
            return "burstgpt"
        raise TraceError(p, 1, None, "a CSV trace must have the Azure header (TIMESTAMP,ContextTokens,GeneratedTokens) "
                                     "or BurstGPT's (Timestamp,Model,Request tokens,Response tokens,...); got "
                                     f"{first[:120]!r}")
    s = first.lstrip()
    if s.startswith("["):
        return "sharegpt"
    if s.startswith("{"):
        try:                                # the first row's keys; a row longer than 4 KiB: its text
            keys = {f'"{k}"' for k in json.loads(s)}
        except ValueError:
            keys = s
        if '"conversations"' in keys:
            return "sharegpt"
        if '"hash_ids"' in keys or '"input_length"' in keys:
            return "mooncake"
        return "workbench"
    raise TraceError(p, 1, None, f"not a trace this reader knows ({', '.join(FORMATS)}): it starts with {first[:80]!r}")


# ---- helpers ------------------------------------------------------------------------------------
def _number(path, line, name, value, integer=False, minimum=0.0):
    if isinstance(value, bool) or value is None:
        raise TraceError(path, line, name, f"expected a number, got {json.dumps(value)}")
    if isinstance(value, str):
        try:
            value = float(value.strip())
        except ValueError:
            raise TraceError(path, line, name, f"expected a number, got {value.strip()[:40]!r}") from None
    if not isinstance(value, (int, float)) or not math.isfinite(value):
        raise TraceError(path, line, name, f"expected a finite number, got {value!r}")
    if integer:
        if value != int(value):
            raise TraceError(path, line, name, f"expected a whole number of tokens, got {value!r}")
        value = int(value)
    if value < minimum:
        raise TraceError(path, line, name, f"must be >= {minimum:g}, got {value!r}")
    return value


def _json_line(path, n, line):
    try:
        obj = json.loads(line)
    except ValueError as e:
        raise TraceError(path, n, None, f"not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(obj, dict):
        raise TraceError(path, n, None, f"expected a JSON object, got {type(obj).__name__}")
    return obj


def _lines(path) -> Iterator[tuple[int, str]]:
    empty = True
    with open(path, encoding="utf-8-sig", errors="replace") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                empty = False
                yield n, line
    if empty:
        raise TraceError(path, None, None, "empty file: no rows")


def _json_elements(path) -> Iterator[tuple[int, object]]:
    """The elements of a JSON list, one at a time (the file is read in 64 KiB pieces, more only
    while an element is longer), with the line each starts on."""
    dec = json.JSONDecoder()
    buf, line, pos = "", 1, 0
    with open(path, encoding="utf-8-sig", errors="replace") as f:
        def more(size: int = _READ) -> bool:
            nonlocal buf, pos
            chunk = f.read(size)
            if not chunk:
                return False
            buf = buf[pos:] + chunk
            pos = 0
            return True

        def skip(chars: str) -> None:
            nonlocal pos, line
            while True:
                while pos < len(buf) and buf[pos] in chars:
                    line += buf[pos] == "\n"
                    pos += 1
                if pos < len(buf) or not more():
                    return

        skip(" \t\r\n")
        if pos >= len(buf):
            raise TraceError(path, None, None, "empty file: no rows")
        if buf[pos] != "[":
            raise TraceError(path, line, None, "a ShareGPT .json trace must be a JSON list of conversations")
        pos += 1
        expect_item = True
        while True:
            skip(" \t\r\n")
            if pos >= len(buf):
                raise TraceError(path, line, None, "the JSON list ends without ']' (a truncated file?)")
            if buf[pos] == "]":
                return
            if buf[pos] == ",":
                if expect_item:
                    raise TraceError(path, line, None, "not valid JSON (a ',' where an element should be)")
                pos += 1
                expect_item = True
                continue
            if not expect_item:
                raise TraceError(path, line, None, "not valid JSON (expected ',' or ']' after an element)")
            while True:
                try:
                    obj, end = dec.raw_decode(buf, pos)
                    break
                except ValueError as e:
                    # An element cut by the end of what was read: read more (as much again, so a long
                    # element costs linear time); an error inside what was read is the file's.
                    cut = e.msg.startswith("Unterminated string") or e.pos >= len(buf) - 8
                    if not (cut and more(max(_READ, len(buf) - pos))):
                        at = line + buf.count("\n", pos, e.pos)
                        raise TraceError(path, at, None, f"not valid JSON ({e.msg})") from None
            start_line = line
            line += buf.count("\n", pos, end)
            pos = end
            expect_item = False
            yield start_line, obj


def _azure_time(path, n, text: str) -> float:
    """Seconds, or a time stamp such as ``2023-11-16 18:15:46.6805900`` (seven digits of fraction,
    cut to six; no zone: UTC, so a trace across a daylight-saving change keeps its spacing)."""
    t = text.strip()
    try:
        return float(t)
    except ValueError:
        pass
    t = re.sub(r"\.(\d+)", lambda m: "." + m[1][:6].ljust(6, "0"), t, count=1)
    try:
        when = datetime.fromisoformat(t)
    except ValueError:
        raise TraceError(path, n, "TIMESTAMP", f"expected a time like 2023-11-16 18:15:46.680590 or seconds, "
                                               f"got {text.strip()[:40]!r}") from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return when.timestamp()


def _csv_rows(path, required: tuple) -> Iterator[tuple[int, dict]]:
    with open(path, encoding="utf-8-sig", errors="replace", newline="") as f:
        reader = csv.reader(f)
        header: list = []
        while not any(h.strip() for h in header):
            try:
                header = next(reader)
            except StopIteration:
                raise TraceError(path, None, None, "empty file: no header") from None
        header = [h.strip() for h in header]
        missing = [c for c in required if c not in header]
        if missing:
            raise TraceError(path, reader.line_num, missing[0], f"column missing from the header {','.join(header)}")
        for row in reader:
            n = reader.line_num
            if not row or all(not c.strip() for c in row):
                continue
            if len(row) != len(header):
                raise TraceError(path, n, None, f"the row has {len(row)} fields, the header {len(header)}")
            yield n, dict(zip(header, row))


# ---- the readers: (line, recorded time or None, row fields) -------------------------------------
def _workbench_rows(path, stats):
    known = {"at", "prompt", "prompt_tokens", "max_tokens", "output_tokens", "conversation", "prefix",
             "prefix_tokens", "priority"}
    turns: dict[str, int] = {}                  # conversation -> its rows so far (a row's turn number)
    for n, line in _lines(path):
        o = _json_line(path, n, line)
        unknown = sorted(set(o) - known)
        if unknown:
            raise TraceError(path, n, unknown[0], f"unknown field (known: {', '.join(sorted(known))})")
        if "at" not in o:
            raise TraceError(path, n, "at", "missing: the request's arrival in seconds")
        at = _number(path, n, "at", o["at"])
        if ("prompt" in o) == ("prompt_tokens" in o):
            raise TraceError(path, n, "prompt", "give exactly one of prompt (text) and prompt_tokens (a length)")
        row = TraceRow(n, at)
        if "prompt" in o:
            if not isinstance(o["prompt"], str) or not o["prompt"]:
                raise TraceError(path, n, "prompt", "expected non-empty text")
            row.prompt = o["prompt"]
        else:
            row.prompt_tokens = _number(path, n, "prompt_tokens", o["prompt_tokens"], integer=True, minimum=1)
        out = "max_tokens" if "max_tokens" in o else "output_tokens" if "output_tokens" in o else None
        if out is None:
            raise TraceError(path, n, "max_tokens", "missing: the tokens the request generates")
        row.max_tokens = _number(path, n, out, o[out], integer=True, minimum=1)
        for name in ("conversation", "prefix"):
            v = o.get(name)
            if v is not None and not isinstance(v, (str, int)) or isinstance(v, bool):
                raise TraceError(path, n, name, f"expected a string or an integer id, got {json.dumps(v)}")
            setattr(row, name, None if v is None else str(v))
        if row.conversation is not None:
            row.turn = turns.get(row.conversation, 0)
            turns[row.conversation] = row.turn + 1
        if (row.prefix is None) != ("prefix_tokens" not in o):
            raise TraceError(path, n, "prefix_tokens", "prefix and prefix_tokens go together")
        if row.prefix is not None:
            if row.prompt is not None:
                raise TraceError(path, n, "prefix", "a text prompt carries its own prefix; prefix / prefix_tokens "
                                                    "are for prompt_tokens")
            row.prefix_tokens = _number(path, n, "prefix_tokens", o["prefix_tokens"], integer=True, minimum=1)
            if row.prefix_tokens > row.prompt_tokens:
                raise TraceError(path, n, "prefix_tokens", f"{row.prefix_tokens} > prompt_tokens {row.prompt_tokens}")
        if "priority" in o:
            row.priority = _number(path, n, "priority", o["priority"], integer=True, minimum=-1e9)
        yield row


def _mooncake_rows(path, stats):
    for n, line in _lines(path):
        o = _json_line(path, n, line)
        for name in ("timestamp", "input_length", "output_length"):
            if name not in o:
                raise TraceError(path, n, name, "missing")
        at = _number(path, n, "timestamp", o["timestamp"]) / 1e3
        row = TraceRow(n, at, max_tokens=_number(path, n, "output_length", o["output_length"], integer=True, minimum=1),
                       prompt_tokens=_number(path, n, "input_length", o["input_length"], integer=True, minimum=1))
        ids = o.get("hash_ids", [])
        if not isinstance(ids, list) or not all(isinstance(h, int) and not isinstance(h, bool) for h in ids):
            raise TraceError(path, n, "hash_ids", "expected a list of integer block ids")
        if len(ids) > -(-row.prompt_tokens // MOONCAKE_BLOCK):
            raise TraceError(path, n, "hash_ids", f"{len(ids)} blocks of {MOONCAKE_BLOCK} tokens for an input of "
                                                  f"{row.prompt_tokens} tokens")
        row.hash_ids = tuple(ids)
        yield row


def _azure_rows(path, stats):
    for n, r in _csv_rows(path, AZURE_COLUMNS):
        at = _azure_time(path, n, r["TIMESTAMP"])
        prompt = _number(path, n, "ContextTokens", r["ContextTokens"], integer=True, minimum=0)
        gen = _number(path, n, "GeneratedTokens", r["GeneratedTokens"], integer=True, minimum=0)
        if prompt == 0 or gen == 0:
            why = "0 context tokens" if prompt == 0 else "0 generated tokens"
            stats.left_out[why] = stats.left_out.get(why, 0) + 1
            continue
        yield TraceRow(n, at, max_tokens=gen, prompt_tokens=prompt)


def _burstgpt_rows(path, stats):
    for n, r in _csv_rows(path, BURSTGPT_COLUMNS):
        at = _number(path, n, "Timestamp", r["Timestamp"])
        prompt = _number(path, n, "Request tokens", r["Request tokens"], integer=True, minimum=0)
        gen = _number(path, n, "Response tokens", r["Response tokens"], integer=True, minimum=0)
        if prompt == 0 or gen == 0:
            why = ("0 response tokens (a failed request in the recording)" if gen == 0 else "0 request tokens")
            stats.left_out[why] = stats.left_out.get(why, 0) + 1
            continue
        yield TraceRow(n, at, max_tokens=gen, prompt_tokens=prompt)


_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bard": "assistant",
          "bing": "assistant", "assistant": "assistant", "model": "assistant", "system": "system"}


def _sharegpt_rows(path, stats, rate: float, reply_s: float, think_s: float, seed: int):
    """One row per user turn that has a reply; arrivals made up (ShareGPT has no times)."""
    with open(path, "rb") as f:
        first = f.read(256).lstrip(b"\xef\xbb\xbf \t\r\n")
    items = _json_elements(path) if first.startswith(b"[") else ((n, _json_line(path, n, ln)) for n, ln in _lines(path))
    rng = random.Random(seed)
    t = 0.0
    for k, (n, conv) in enumerate(items):
        if not isinstance(conv, dict):
            raise TraceError(path, n, None, f"expected a conversation object, got {type(conv).__name__}")
        msgs = conv.get("conversations", conv.get("conversation"))
        if not isinstance(msgs, list):
            raise TraceError(path, n, "conversations", "missing or not a list of messages")
        cid = str(conv.get("id", k))
        history, at, turn = [], t, 0
        for j, m in enumerate(msgs):
            if not isinstance(m, dict) or not isinstance(m.get("value", m.get("content")), str):
                raise TraceError(path, n, f"conversations[{j}]", "expected {\"from\": ..., \"value\": \"text\"}")
            who = m.get("from", m.get("role"))
            role = _ROLES.get(str(who).lower())
            if role is None:
                raise TraceError(path, n, f"conversations[{j}].from", f"unknown speaker {who!r} "
                                                                      f"(known: {', '.join(sorted(_ROLES))})")
            text = m.get("value", m.get("content"))
            if role == "assistant" and history and history[-1][0] == "user" and text.strip():
                yield TraceRow(n, at, turns=list(history), reply=text, conversation=cid, turn=turn)
                turn += 1
                at += reply_s + (rng.expovariate(1 / think_s) if think_s else 0.0)
            history.append((role, text))
        if turn == 0:
            stats.left_out["a conversation with no user turn answered"] = \
                stats.left_out.get("a conversation with no user turn answered", 0) + 1
        t += rng.expovariate(rate)


def read_trace(path, format: str | None = None, window: tuple | None = None, limit: int | None = None,
               stats: ReadStats | None = None, rate: float = 1.0, reply_s: float = 2.0, think_s: float = 5.0,
               seed: int = 0) -> Iterator[TraceRow]:
    """The rows of ``path`` (see the module docstring), streamed; ``stats`` (a :class:`ReadStats`)
    is filled as it goes.  ``rate`` / ``reply_s`` / ``think_s`` / ``seed``: ShareGPT's arrivals."""
    p = Path(path)
    fmt = format or detect_format(p)
    if fmt not in FORMATS:
        raise DataError(f"trace format {fmt!r}: one of {', '.join(FORMATS)}")
    if not p.is_file():
        raise TraceError(p, None, None, "no such file")
    if window is not None:
        start, end = window
        if not (0 <= start < end):
            raise DataError(f"window {start}:{end}: expected 0 <= START < END (seconds of the recorded trace)")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise DataError(f"limit {limit!r}: expected a whole number of requests >= 1")
    if not rate > 0 or reply_s < 0 or think_s < 0:
        raise DataError(f"ShareGPT arrivals: rate must be > 0 and reply_s, think_s >= 0 (got {rate}, {reply_s}, "
                        f"{think_s})")
    st = stats if stats is not None else ReadStats()
    st.format, st.path = fmt, str(p)
    rows = {"workbench": _workbench_rows, "mooncake": _mooncake_rows, "azure": _azure_rows,
            "burstgpt": _burstgpt_rows}.get(fmt)
    it = rows(p, st) if rows else _sharegpt_rows(p, st, rate, reply_s, think_s, seed)
    t0 = None
    for row in it:
        st.rows_read += 1
        if t0 is None:
            t0 = st.first_time = row.at
        rel = row.at - t0
        if rel < -1e-9 and fmt != "sharegpt":
            raise TraceError(p, row.line, _TIME_FIELD[fmt], f"recorded {-rel:.3f} s before the trace's first row: "
                                                  "a trace's rows must be in arrival order")
        if window is not None:
            if not (window[0] <= rel < window[1]):
                st.outside_window += 1
                continue
            rel -= window[0]
        row.at = max(0.0, rel)
        st.kept += 1
        yield row
        if limit is not None and st.kept >= limit:
            st.stopped_at_limit = True
            return
