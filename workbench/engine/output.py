"""Turning sampled token ids into a request's output: text deltas, stop conditions, metrics.

One per request in the engine, whatever its configuration, so every mode stops, detokenizes and
times tokens the same way.  Per generated token, :meth:`OutputProcessor.push` decides whether the request is
finished (EOS, a stop string, max_tokens, the context limit), and which text can be released
now: text that might be the start of a stop string is held back until that is decided.
"""

from __future__ import annotations

from workbench.engine.types import RequestOutput, StreamEvent
from workbench.engine.sampling import SamplingParams
from workbench.model.tokenizer import IncrementalDetokenizer, Tokenizer


class OutputProcessor:
    def __init__(self, out: RequestOutput, params: SamplingParams, tokenizer: Tokenizer | None,
                 eos_token_ids: set[int], max_new: int) -> None:
        self.out, self.params, self.eos, self.max_new = out, params, eos_token_ids, max_new
        self.detok = IncrementalDetokenizer(tokenizer, out.prompt_token_ids) if tokenizer else None
        self.stops = params.stop
        self.hold = max((len(s) for s in params.stop), default=1) - 1
        self.emitted = 0  # characters of detok.text already released

    def push(self, token: int, now: float) -> StreamEvent:
        """Record one generated token (timestamped ``now``) and return its stream event."""
        out, m, p = self.out, self.out.metrics, self.params
        i = len(out.token_ids)
        if i == 0:
            m.first_token_time = now
        m.token_times.append(now)
        out.token_ids.append(token)
        finish = None
        if not p.ignore_eos and token in self.eos:
            finish, out.stop_reason = "stop", token
        d = self.detok
        if d is not None:
            d.push(token)
            if self.stops and finish is None:
                cut = find_stop(d.text, self.stops, self.emitted, p.include_stop_str_in_output)
                if cut is not None:
                    finish, out.stop_reason = "stop", cut[1]
                    d.text = d.text[:cut[0]]
        if finish is None and i + 1 >= self.max_new:
            finish = "length"
        text = ""
        if d is not None:
            release = len(d.text) if finish else max(self.emitted, len(d.text) - self.hold)
            text, self.emitted = d.text[self.emitted:release], release
        if finish:
            self.finish(finish, now)
        ev = StreamEvent(out.request_id, i, token, text, now, now - m.arrival_time, finish is not None, finish)
        if i == 0:
            ev.prompt_logprobs = out.prompt_logprobs
        return ev

    def finish(self, reason: str, now: float, error: str | None = None) -> None:
        out = self.out
        out.finish_reason = reason
        out.text = self.detok.text if self.detok is not None else None
        if error is not None:
            out.error = error
        out.metrics.finished_time = now

    @property
    def text(self) -> str | None:
        return self.detok.text if self.detok is not None else None


def find_stop(text: str, stops: list[str], emitted: int, include: bool) -> tuple[int, str] | None:
    """Earliest stop string in the not-yet-released text: (cut position, stop string)."""
    best = None
    for s in stops:
        j = text.find(s, max(0, emitted - len(s) + 1))
        if j >= 0 and (best is None or j < best[0]):
            best = (j + len(s) if include else j, s)
    return best
