"""A recorded trace as a workload: token ids for every request, the structure that matters kept.

::

    opts = TraceOptions(time_scale=0.5, limit=200)            # twice the recorded rate, 200 requests
    wl = build_trace_workload("mooncake.jsonl", tokenizer, max_model_len=1024, options=opts)
    print(wl.describe())          # the summary: requests, rate over time, lengths, prefix tokens that repeat
    wl.trace()                    # a workbench.engine.Trace, in arrival order
    wl.scaled(0.25).trace()       # the same requests at 4x the rate (the capacity search's step)

A row with text (our JSONL's ``prompt``, ShareGPT's messages) is tokenized.  A row with a length
only gets *synthetic content* from the bundled held-out corpus, built so the structure a cache
sees is the recorded one:

* Mooncake's ``hash_ids``: each id is one block of tokens (512, times ``length_scale``), the same
  tokens wherever the id occurs, so equal ids are equal prefixes;
* our JSONL's ``prefix`` / ``prefix_tokens``: requests naming one prefix start with the same tokens;
* one ``conversation``'s turns: each turn's prompt starts with the previous turn's whole prompt;
* anything else (the Azure and BurstGPT traces record no content): tokens no other request has.

ShareGPT turns are built piece by piece (each message tokenized alone, between fixed ``User:`` /
``Assistant:`` marks), so a later turn's ids start with the earlier turn's ids exactly.

Lengths: ``length_scale`` multiplies every recorded length (a long-context trace on a short
model keeps its shape): every output length, and the prompt lengths given as numbers (a text
prompt is tokenized as it is); then a prompt that does not fit the context with its new tokens is cut
to fit (counted: ``clipped``).  Every request is greedy with ``ignore_eos``: it generates exactly
its recorded number of tokens (x ``length_scale``, capped by ``max_tokens_cap`` and the context).
``time_scale`` multiplies every arrival time (0.5 replays the trace at twice its rate).
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass, field, replace
from pathlib import Path

from workbench.engine.sampling import SamplingParams
from workbench.engine.traces import Trace, TraceRequest
from workbench.errors import ConfigError
from workbench.load.traces import MOONCAKE_BLOCK, ReadStats, read_trace

KINDS = ("chat", "doc", "short")       # a conversation's turn; a prompt of half the context or more; the rest


@dataclass(frozen=True)
class TraceOptions:
    """How a trace file becomes a workload (see the module docstring)."""

    format: str | None = None          # None: detected
    time_scale: float = 1.0            # arrival times x this (0.5: twice the recorded rate)
    limit: int | None = None           # the first N requests (of the window)
    window: tuple[float, float] | None = None   # (start, end) s of the recorded trace (or "start:end")
    length_scale: float = 1.0          # recorded lengths x this (prompt and output tokens, Mooncake's block)
    max_tokens_cap: int | None = None  # new tokens per request at most
    rate: float = 1.0                  # ShareGPT: new conversations per second (Poisson)
    reply_s: float = 2.0               # ShareGPT: a turn follows the previous one after this ...
    think_s: float = 5.0               # ... plus an exponential think time of this mean
    seed: int = 0
    block_size: int = 16               # the summary's prefix blocks (the KV pool's block size)

    def __post_init__(self) -> None:
        if not self.time_scale > 0:
            raise ConfigError(f"time scale {self.time_scale!r}: expected a number > 0 (0.5 replays the trace at twice "
                              "its recorded rate)")
        if not self.length_scale > 0:
            raise ConfigError(f"length scale {self.length_scale!r}: expected a number > 0")
        if self.max_tokens_cap is not None and self.max_tokens_cap < 1:
            raise ConfigError(f"max tokens cap {self.max_tokens_cap!r}: expected an integer >= 1")
        if self.limit is not None and (isinstance(self.limit, bool) or not isinstance(self.limit, int)
                                       or self.limit < 1):
            raise ConfigError(f"limit {self.limit!r}: expected a whole number of requests >= 1")
        object.__setattr__(self, "window", parse_window(self.window))     # "60:660" or (60, 660) -> floats
        if not self.rate > 0 or not self.reply_s >= 0 or not self.think_s >= 0:
            raise ConfigError(f"ShareGPT arrivals: rate must be > 0 and reply_s, think_s >= 0 (got rate {self.rate!r}, "
                              f"reply_s {self.reply_s!r}, think_s {self.think_s!r})")
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or self.block_size < 1:
            raise ConfigError(f"block size {self.block_size!r}: expected an integer >= 1 (the KV pool's block size)")

    def describe(self) -> str:
        default = TraceOptions.__dataclass_fields__
        parts = [f"{k}={getattr(self, k)}" for k in ("time_scale", "limit", "window", "length_scale", "max_tokens_cap")
                 if getattr(self, k) != default[k].default]
        return ", ".join(parts) or "as recorded"


def parse_window(text: str | None) -> tuple[float, float] | None:
    """``"60:660"`` -> (60.0, 660.0) seconds of the recorded trace; ``":600"`` starts at 0."""
    if text is None or (isinstance(text, str) and not text.strip()):
        return None
    if isinstance(text, (tuple, list)):
        try:
            start, end = (float(v) for v in text)
        except (TypeError, ValueError):
            raise ConfigError(f"window {text!r}: expected (START, END) in seconds of the recorded trace") from None
        sep = ":"
    else:
        a, sep, b = str(text).strip().partition(":")
        try:
            start, end = float(a or 0), float(b)
        except ValueError:
            raise ConfigError(f"--window {text!r}: expected START:END in seconds of the recorded trace, e.g. 0:600") \
                from None
    if not sep or not 0 <= start < end:
        name = "--window" if isinstance(text, str) else "window"
        raise ConfigError(f"{name} {text!r}: expected START:END with 0 <= START < END (seconds), e.g. 0:600")
    return start, end


# ---- synthetic content ----------------------------------------------------------------------------
class _Content:
    """Deterministic token segments of the held-out corpus, one per key.  A segment starts with two
    tokens that number its key (the order keys are first asked for), so segments of different
    keys never share a leading token pair: no two made-up prompts share a prefix by chance, however
    many the trace has (up to the square of the corpus's distinct tokens)."""

    def __init__(self, tokenizer, seed: int) -> None:
        from workbench.data import heldout_documents

        self.bos = list(tokenizer.encode(""))
        pool: list[int] = []
        for d in heldout_documents():
            pool += list(tokenizer.encode(d["text"]))[len(self.bos):]
        if len(pool) < 64:
            raise ConfigError("the held-out corpus is too short for this tokenizer to make synthetic prompts")
        self.pool, self.seed = pool, seed
        self.alphabet = sorted(set(pool))
        random.Random(seed).shuffle(self.alphabet)
        self.keys: dict = {}

    def segment(self, key, n: int) -> list[int]:
        if n <= 0:
            return []
        k, a = self.keys.setdefault(key, len(self.keys)), len(self.alphabet)
        out = [self.alphabet[k % a], self.alphabet[k // a % a]][:n]
        h = int.from_bytes(hashlib.blake2b(repr((self.seed, key)).encode(), digest_size=8).digest(), "little")
        start = h % len(self.pool)
        while len(out) < n:
            out += self.pool[start:start + n - len(out)]
            start = 0
        return out


def _scaled(n: int, s: float) -> int:
    return max(1, round(n * s))


@dataclass
class TraceWorkload:
    """A trace's requests as token ids (``prompts``, ``params``, ``info``: kind, conversation, turn,
    lengths, priority, arrival, line in the file), and what reading it found (``stats``)."""

    config: TraceOptions
    prompts: list[list[int]]
    params: list[SamplingParams]
    info: list[dict]
    source: str = ""
    stats: ReadStats = field(default_factory=ReadStats)
    clipped: int = 0
    max_model_len: int = 0

    def trace(self, priorities: bool = True) -> Trace:
        """The trace in arrival order; ``priorities=False`` gives every request priority 0."""
        return Trace([TraceRequest(i["at"], p, sp, i["priority"] if priorities else 0)
                      for p, sp, i in zip(self.prompts, self.params, self.info)])

    def scaled(self, factor: float) -> TraceWorkload:
        """The same requests with every arrival time x ``factor`` (0.5: twice the rate)."""
        if not factor > 0:
            raise ConfigError(f"TraceWorkload.scaled: factor must be > 0, got {factor!r}")
        return replace(self, config=replace(self.config, time_scale=self.config.time_scale * factor),
                       info=[{**i, "at": round(i["at"] * factor, 6)} for i in self.info])

    @property
    def duration(self) -> float:
        return max((i["at"] for i in self.info), default=0.0)

    def frame(self):
        import pandas as pd

        return pd.DataFrame(self.info)

    def summary(self, bins: int = 10) -> dict:
        """Requests, rate over time (``bins`` equal spans), length percentiles, and the share of
        prompt tokens in blocks an earlier request already sent (what a prefix cache with room for
        everything could reuse; blocks of ``block_size`` tokens, whole blocks only)."""
        import numpy as np

        from workbench.kv.prefix_cache import block_hash

        n = len(self.info)
        at = np.array([i["at"] for i in self.info]) if n else np.zeros(0)
        dur = float(at.max()) if n else 0.0
        width = dur / bins if dur > 0 else 1.0
        counts = np.bincount(np.minimum((at / width).astype(int), bins - 1), minlength=bins) if n else np.zeros(bins)
        pl = np.array([i["prompt_tokens"] for i in self.info]) if n else np.zeros(1)
        ol = np.array([i["max_tokens"] for i in self.info]) if n else np.zeros(1)
        bs, seen, repeat = self.config.block_size, set(), 0
        for p in self.prompts:
            h = None
            for k in range(len(p) // bs):
                h = block_hash(h, p[k * bs:(k + 1) * bs])         # the prefix cache's own chain
                if h in seen:
                    repeat += bs
                else:
                    seen.add(h)
        pct = lambda v, q: int(np.percentile(v, q))
        kinds = {k: sum(i["kind"] == k for i in self.info) for k in KINDS}
        return {"source": self.source, "format": self.stats.format, "requests": n, "duration_s": dur,
                "rate_per_s": n / dur if dur > 0 else float("nan"), "bins_s": width,
                "rate_over_time": [float(c) / width for c in counts],
                "prompt_tokens_p50": pct(pl, 50), "prompt_tokens_p95": pct(pl, 95), "prompt_tokens_max": int(pl.max()),
                "max_tokens_p50": pct(ol, 50), "max_tokens_p95": pct(ol, 95), "max_tokens_max": int(ol.max()),
                "prompt_tokens": int(pl.sum()) if n else 0, "new_tokens": int(ol.sum()) if n else 0,
                "repeated_prefix_share": repeat / max(1, int(pl.sum())) if n else 0.0,
                "conversations": len({i["conversation"] for i in self.info if i["conversation"] is not None}),
                "kinds": kinds, "clipped": self.clipped, "rows_read": self.stats.rows_read,
                "outside_window": self.stats.outside_window, "left_out": dict(self.stats.left_out),
                "stopped_at_limit": self.stats.stopped_at_limit, "options": self.config.describe()}

    def describe(self) -> str:
        s = self.summary()
        rate = " ".join(f"{r:.1f}" for r in s["rate_over_time"])
        kinds = ", ".join(f"{v} {k}" for k, v in s["kinds"].items() if v)
        per_s = f"{s['rate_per_s']:.2f}/s" if s["duration_s"] > 0 else "all at once"
        lines = [f"{s['source']} ({s['format']}): {s['requests']} requests over {s['duration_s']:.1f} s "
                 f"({per_s}; {s['options']}); {kinds}"
                 + (f" in {s['conversations']} conversations" if s["conversations"] else ""),
                 f"  rate over time (requests/s in {len(s['rate_over_time'])} spans of {s['bins_s']:.1f} s): {rate}",
                 f"  prompt tokens p50 {s['prompt_tokens_p50']}, p95 {s['prompt_tokens_p95']}, max "
                 f"{s['prompt_tokens_max']}; new tokens p50 {s['max_tokens_p50']}, p95 {s['max_tokens_p95']}, max "
                 f"{s['max_tokens_max']}; {s['new_tokens']:,} new tokens in all, greedy",
                 f"  prompt tokens in blocks an earlier request sent: {100 * s['repeated_prefix_share']:.1f} % "
                 f"(blocks of {self.config.block_size})"]
        extra = []
        if s["clipped"]:
            extra.append(f"{s['clipped']} prompts cut to fit the context of {self.max_model_len}")
        if s["outside_window"]:
            extra.append(f"{s['outside_window']} rows outside the window")
        if s["stopped_at_limit"]:
            extra.append(f"reading stopped at the limit after {s['rows_read']} rows")
        extra += [f"{v} rows left out: {k}" for k, v in s["left_out"].items()]
        if extra:
            lines.append("  " + "; ".join(extra))
        return "\n".join(lines)


def build_trace_workload(path, tokenizer, max_model_len: int, options: TraceOptions | None = None) -> TraceWorkload:
    """The workload of the trace at ``path`` (see the module docstring) as ``tokenizer``'s ids."""
    o = options or TraceOptions()
    if tokenizer is None:
        raise ConfigError("a trace workload needs a tokenizer (prompts become token ids): give a model with one")
    stats = ReadStats()
    rows = list(read_trace(path, o.format, o.window, o.limit, stats, rate=o.rate, reply_s=o.reply_s,
                           think_s=o.think_s, seed=o.seed))
    if not rows:
        raise ConfigError(f"{path}: no request to replay ({stats.rows_read} rows read, {stats.outside_window} outside "
                          f"the window {o.window}, left out: {stats.left_out or 'none'})")
    content = _Content(tokenizer, o.seed) if any(r.prompt_tokens is not None for r in rows) else None
    bos = list(tokenizer.encode(""))
    enc = lambda text: list(tokenizer.encode(text))[len(bos):]
    marks = {"user": enc("\n\nUser: "), "assistant": enc("\n\nAssistant: "), "system": enc("System: ")}
    block = _scaled(MOONCAKE_BLOCK, o.length_scale)
    conv_last: dict[str, list[int]] = {}
    prompts, params, info, clipped = [], [], [], 0
    cap = max(1, max_model_len - len(bos) - 1)
    for r in rows:
        if r.turns is not None:                  # ShareGPT: piece by piece
            ids = list(bos)
            for role, text in r.turns:
                ids += marks[role] + enc(text)
            ids += marks["assistant"]
            new = _scaled(len(enc(r.reply)), o.length_scale)
        elif r.prompt is not None:
            ids, new = list(tokenizer.encode(r.prompt)), _scaled(r.max_tokens, o.length_scale)
        else:
            n = _scaled(r.prompt_tokens, o.length_scale)
            if r.hash_ids:
                ids = list(bos)
                for h in r.hash_ids:
                    ids += content.segment(("block", h), block)
                ids = ids[:n] if len(ids) >= n else ids + content.segment(("row", r.line), n - len(ids))
            elif r.conversation is not None and r.conversation in conv_last:
                prev = conv_last[r.conversation]
                ids = prev[:n] if n <= len(prev) else prev + content.segment(("row", r.line), n - len(prev))
            elif r.prefix is not None:
                ids = bos + content.segment(("prefix", r.prefix), _scaled(r.prefix_tokens, o.length_scale))
                ids = ids[:n] if len(ids) >= n else ids + content.segment(("row", r.line), n - len(ids))
            else:
                ids = bos + content.segment(("row", r.line), n - len(bos))
            new = _scaled(r.max_tokens, o.length_scale)
        new = max(1, min(new, o.max_tokens_cap or new, cap))
        if len(ids) + new > max_model_len:
            ids, clipped = ids[:max_model_len - new], clipped + 1
        if r.conversation is not None:
            conv_last[r.conversation] = ids
        kind = ("chat" if r.conversation is not None else "doc" if len(ids) >= max_model_len // 2 else "short")
        prompts.append(ids)
        params.append(SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True))
        info.append({"kind": kind, "conversation": r.conversation, "turn": r.turn, "system": None,
                     "at": round(r.at * o.time_scale, 6), "prompt_tokens": len(ids), "max_tokens": new,
                     "priority": r.priority, "line": r.line})
    order = sorted(range(len(info)), key=lambda i: (info[i]["at"], i))
    return TraceWorkload(o, [prompts[i] for i in order], [params[i] for i in order], [info[i] for i in order],
                         source=Path(path).name, stats=stats, clipped=clipped, max_model_len=max_model_len)
