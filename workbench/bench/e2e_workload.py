"""The end-to-end workload: chat with shared system prompts, long documents, one-off requests.

::

    wl = build_workload(llm.tokenizer, WorkloadConfig.preset("smoke"), max_model_len=llm.max_model_len)
    wl.trace()                   # a workbench.engine.Trace, in arrival order (priorities=False: all 0)
    wl.info[i]                   # kind, conversation, turn, system prompt, lengths, priority, arrival
    wl.describe(); wl.frame()

Deterministic given its seed.  Chat conversations each use one of a few *shared system prompts*;
turn ``k`` sends the system prompt, every earlier user message and reply, and the new message,
so a later turn's prompt is exactly the earlier turn's tokens plus more (what a prefix cache can
reuse).  The replies in the history are held-out text standing in for the model's answers: a
trace is fixed before it is replayed, a real client would send back what the model said.
Documents fill the model's context but for the tokens they ask for; one-off requests have mixed
lengths.  New conversations, documents and one-off requests arrive as a Poisson process; a
conversation's next turn is sent ``reply_s`` plus an exponential think time after the previous
one (a fixed trace, not a closed loop: a slow engine sees the next turn before it answered).
All text is the bundled held-out corpus (:mod:`workbench.data`), as token ids.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from workbench.engine.sampling import SamplingParams
from workbench.engine.traces import Trace, TraceRequest
from workbench.errors import ConfigError

KINDS = ("chat", "doc", "short")


# ---- the workload -------------------------------------------------------------------------------

@dataclass
class WorkloadConfig:
    conversations: int = 3               # chat conversations
    turns: int = 2                       # turns per conversation (each re-sends the history)
    system_prompts: int = 2              # shared system prompts (conversation i uses i % n)
    system_tokens: int = 192
    user_tokens: tuple[int, int] = (12, 40)    # a user message's length, uniform in [lo, hi]
    reply_tokens: int = 32               # a stand-in assistant reply in the history
    chat_max_tokens: int = 8
    documents: int = 2                   # long-document requests
    doc_tokens: int | None = None        # None: near the context (max_model_len - doc_max_tokens - 8)
    doc_max_tokens: int = 8
    short: int = 3                       # one-off requests of mixed lengths
    short_tokens: tuple[int, int] = (8, 128)
    short_max_tokens: int = 8
    rate: float = 10.0                   # Poisson arrivals / s of conversations, documents and one-off requests
    reply_s: float = 0.25                # a turn is sent at least this long after the previous one (its answer) ...
    think_s: float = 0.15                # ... plus a think time (exponential, this mean)
    chat_priority: int = 1               # chat turns are interactive; documents and one-off requests get 0
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("conversations", "turns", "system_prompts", "system_tokens", "reply_tokens", "chat_max_tokens",
                     "documents", "doc_max_tokens", "short", "short_max_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < (1 if name in ("turns", "system_prompts", "system_tokens") else 0):
                raise ConfigError(f"WorkloadConfig.{name} must be a non-negative integer (>= 1 for turns, "
                                  f"system_prompts, system_tokens), got {v!r}")
        for name in ("user_tokens", "short_tokens"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise ConfigError(f"WorkloadConfig.{name} must be (lo, hi) with 1 <= lo <= hi, got {(lo, hi)!r}")
        if not self.rate > 0 or self.think_s < 0 or self.reply_s < 0:
            raise ConfigError(f"WorkloadConfig: rate must be > 0, reply_s and think_s >= 0, got {self.rate!r}, "
                              f"{self.reply_s!r}, {self.think_s!r}")
        if self.conversations + self.documents + self.short == 0:
            raise ConfigError("WorkloadConfig: the workload has no request (conversations, documents and short are 0)")

    @classmethod
    def preset(cls, mode: str, **over) -> WorkloadConfig:
        sizes = {"tiny": {"conversations": 2, "turns": 2, "documents": 1, "short": 2, "chat_max_tokens": 6,
                          "doc_max_tokens": 6, "short_max_tokens": 6, "system_tokens": 128, "rate": 30.0,
                          "reply_s": 0.08, "think_s": 0.05},
                 # 40 requests (P95 between the 38th and 39th TTFT), offered faster than the baseline serves
                 # them on 2 cores: a configuration's capacity shows in its throughput, not only its latency
                 "smoke": {"conversations": 8, "turns": 3, "documents": 4, "short": 12, "chat_max_tokens": 6,
                           "doc_max_tokens": 6, "short_max_tokens": 6, "rate": 40.0, "reply_s": 0.1, "think_s": 0.05},
                 "full": {"conversations": 12, "turns": 4, "system_prompts": 3, "system_tokens": 320, "documents": 8,
                          "short": 24, "chat_max_tokens": 24, "doc_max_tokens": 16, "short_max_tokens": 16,
                          "rate": 16.0, "reply_s": 0.3, "think_s": 0.2}}
        if mode not in sizes:
            raise ConfigError(f"WorkloadConfig.preset: mode must be one of {', '.join(sizes)}, got {mode!r}")
        return cls(**{**sizes[mode], **over})


@dataclass
class Workload:
    """The requests (``info``: kind, conversation, turn, system prompt, lengths, priority, arrival)
    and the trace that replays them, in arrival order."""

    config: WorkloadConfig
    prompts: list[list[int]]
    params: list[SamplingParams]
    info: list[dict]

    def trace(self, priorities: bool = True) -> Trace:
        """The trace; ``priorities=False`` gives every request priority 0 (the baseline's)."""
        return Trace([TraceRequest(i["at"], p, sp, i["priority"] if priorities else 0)
                      for p, sp, i in zip(self.prompts, self.params, self.info)])

    @property
    def duration(self) -> float:
        return max(i["at"] for i in self.info)

    def frame(self):
        import pandas as pd

        return pd.DataFrame(self.info)

    def describe(self) -> str:
        n = {k: sum(i["kind"] == k for i in self.info) for k in KINDS}
        lens = {k: [i["prompt_tokens"] for i in self.info if i["kind"] == k] for k in KINDS}
        span = lambda v: f"{min(v)}..{max(v)}" if v else "-"
        c = self.config
        return (f"{len(self.info)} requests over {self.duration:.2f} s: {n['chat']} chat turns "
                f"({c.conversations} conversations x {c.turns} turns, {c.system_prompts} shared system prompts of "
                f"{c.system_tokens} tokens; prompts {span(lens['chat'])} tokens), {n['doc']} documents "
                f"({span(lens['doc'])} tokens), {n['short']} one-off requests ({span(lens['short'])} tokens); "
                f"{sum(i['max_tokens'] for i in self.info)} new tokens in all, greedy; Poisson {c.rate}/s; "
                f"next turn {c.reply_s} s + think time (mean {c.think_s} s) after the previous; "
                f"chat priority {c.chat_priority}")


_ENCODED: dict[int, tuple] = {}      # id(tokenizer) -> (tokenizer, every held-out document's ids): encoded once


def _documents(tokenizer) -> list[list[int]]:
    from workbench.data import heldout_documents

    hit = _ENCODED.get(id(tokenizer))
    if hit is None or hit[0] is not tokenizer:
        hit = _ENCODED[id(tokenizer)] = (tokenizer, [list(tokenizer.encode(d["text"])) for d in heldout_documents()])
    return hit[1]


def _windows(tokenizer, n: int, length: int, seed: int) -> list[list[int]]:
    """``n`` windows of ``length`` tokens of held-out documents (seeded: the document, then the
    start; never the document's leading BOS)."""
    if n == 0:
        return []
    docs = [ids for ids in _documents(tokenizer) if len(ids) > length + 1]
    if not docs:
        raise ConfigError(f"the held-out corpus has no document longer than {length} tokens for this tokenizer")
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        ids = rng.choice(docs)
        start = rng.randrange(1, len(ids) - length)
        out.append(ids[start:start + length])
    return out


def build_workload(tokenizer, cfg: WorkloadConfig | None = None, max_model_len: int = 1024) -> Workload:
    """The workload of ``cfg`` (see the module docstring) as token ids of ``tokenizer``."""
    cfg = cfg or WorkloadConfig()
    if tokenizer is None:
        raise ConfigError("build_workload needs a tokenizer (the workload is held-out text); a shape preset has none")
    rng = random.Random(cfg.seed)
    bos = list(tokenizer.encode(""))
    mark = lambda text: list(tokenizer.encode(text))[len(bos):]
    user_mark, reply_mark = mark("\n\nUser: "), mark("\n\nAssistant: ")
    doc_tokens = cfg.doc_tokens or (max_model_len - cfg.doc_max_tokens - 8 - len(bos))
    systems = [bos + w for w in _windows(tokenizer, cfg.system_prompts, cfg.system_tokens, cfg.seed + 1)]
    n_turns = cfg.conversations * cfg.turns
    users = _windows(tokenizer, n_turns, cfg.user_tokens[1], cfg.seed + 2)
    replies = _windows(tokenizer, n_turns, cfg.reply_tokens, cfg.seed + 3)
    docs = [bos + w for w in _windows(tokenizer, cfg.documents, doc_tokens, cfg.seed + 4)]
    shorts = _windows(tokenizer, cfg.short, cfg.short_tokens[1], cfg.seed + 5)
    # the arrivals: conversations (their first turn), documents and one-off requests in a seeded order
    starts = ["chat"] * cfg.conversations + ["doc"] * cfg.documents + ["short"] * cfg.short
    rng.shuffle(starts)
    reqs, t, seen = [], 0.0, {"chat": 0, "doc": 0, "short": 0}
    alone = {"conversation": None, "turn": None, "system": None}          # not part of a conversation
    for kind in starts:
        k = seen[kind]
        seen[kind] += 1
        if kind == "doc":
            reqs.append((t, docs[k], cfg.doc_max_tokens, {"kind": "doc", **alone}))
        elif kind == "short":
            ids = bos + shorts[k][:rng.randint(*cfg.short_tokens)]
            reqs.append((t, ids, cfg.short_max_tokens, {"kind": "short", **alone}))
        else:
            history, at = list(systems[k % cfg.system_prompts]), t
            for turn in range(cfg.turns):
                j = k * cfg.turns + turn
                history += user_mark + users[j][:rng.randint(*cfg.user_tokens)] + reply_mark
                reqs.append((at, list(history), cfg.chat_max_tokens,
                             {"kind": "chat", "conversation": k, "turn": turn, "system": k % cfg.system_prompts}))
                history += replies[j]                 # what "the assistant said", re-sent with the next turn
                at += cfg.reply_s + (rng.expovariate(1 / cfg.think_s) if cfg.think_s else 0.0)
        t += rng.expovariate(cfg.rate)
    reqs.sort(key=lambda r: r[0])
    prompts, params, info = [], [], []
    for at, ids, max_tokens, meta in reqs:
        if len(ids) + max_tokens > max_model_len:
            raise ConfigError(f"a {meta['kind']} prompt of {len(ids)} tokens + {max_tokens} new ones exceeds the "
                              f"context ({max_model_len}); use fewer turns or shorter documents")
        prompts.append(ids)
        params.append(SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
        info.append({**meta, "at": round(at, 6), "prompt_tokens": len(ids), "max_tokens": max_tokens,
                     "priority": cfg.chat_priority if meta["kind"] == "chat" else 0})
    return Workload(cfg, prompts, params, info)
