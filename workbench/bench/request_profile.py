"""Where one request's end-to-end time goes: the model's forward calls vs everything around them.

::

    with forward_timer(llm.model) as ft:               # hooks on the model itself: one interval per forward
        rows = [request_breakdown(engine, prompt_ids, params) for _ in range(3)]
    rows[0]["forward_share"]                          # forward seconds / E2E seconds

A request's E2E (arrival to its last token, :mod:`workbench.engine.metrics`) is split into

    forward    the model's ``forward`` calls (pre/post hooks on the top-level module; on CUDA the
               device is synchronised at both ends, so the interval is the work, not the launch)
    sampling   the rest of the engine's model phase (``StepRecord.model_s``): logits split, the
               sampler, the token id read back to the host
    schedule   ``StepRecord.schedule_s`` of the request's steps (the scheduler, pure Python)
    post       ``StepRecord.post_s`` (detokenization, stop checks, bookkeeping)
    outside    E2E minus the request's steps: admission before the first step and the gaps between
               steps (the caller's loop; over HTTP, the server and the client)

The forward interval is the upper bound of "pure compute" on a CPU: it includes the framework's
per-op dispatch inside the model (``workbench.bench.profile`` splits a decode step further).
:func:`http_request` times the same request from an HTTP client (the caller runs the server), so
the share of a request's client-side E2E spent in forward can be compared with the in-process one.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch


class ForwardTimer:
    """Intervals of a module's forward calls: ``(start, end)`` perf_counter pairs, in call order."""

    def __init__(self, sync) -> None:
        self.sync = sync
        self.intervals: list[tuple[float, float]] = []
        self._t0: float | None = None

    def pre(self, _module, _args) -> None:
        self.sync()
        self._t0 = time.perf_counter()

    def post(self, _module, _args, _out) -> None:
        self.sync()
        self.intervals.append((self._t0, time.perf_counter()))

    def seconds_between(self, t0: float, t1: float) -> float:
        """Forward seconds of the calls that started within [t0, t1]."""
        return sum(e - s for s, e in self.intervals if t0 <= s <= t1)

    def calls_between(self, t0: float, t1: float) -> int:
        return sum(1 for s, _ in self.intervals if t0 <= s <= t1)


@contextmanager
def forward_timer(model: torch.nn.Module):
    """Time every forward call of ``model`` while the block runs (hooks removed afterwards)."""
    sync = torch.cuda.synchronize if next(model.parameters()).device.type == "cuda" else (lambda: None)
    ft = ForwardTimer(sync)
    handles = [model.register_forward_pre_hook(ft.pre), model.register_forward_hook(ft.post)]
    try:
        yield ft
    finally:
        for h in handles:
            h.remove()


def request_breakdown(engine, prompt, params, timer: ForwardTimer) -> dict:
    """Run one request alone on ``engine`` (an idle :class:`~workbench.engine.core.LLMEngine`; add,
    step until it ends) and split its E2E (see the module docstring).  ``timer``: a
    :class:`ForwardTimer` on the engine's model."""
    rid = engine.add_request(prompt, params)
    seq = engine.seqs[rid]
    first = len(engine.step_records)
    while not seq.finished:
        engine.step()
    out = engine.release(rid)
    m = out.metrics
    recs = [r for r in list(engine.step_records)[first:] if rid in r.request_ids]
    e2e = m.e2e
    forward = timer.seconds_between(m.arrival_time, m.finished_time)
    model = sum(r.model_s for r in recs)
    sched, post = sum(r.schedule_s for r in recs), sum(r.post_s for r in recs)
    # the last step's post phase runs after the finish timestamp: count only what lies inside E2E
    steps = sum(r.schedule_s + r.model_s for r in recs) + sum(r.post_s for r in recs[:-1])
    return {"prompt_tokens": m.prompt_tokens, "output_tokens": m.output_tokens, "e2e_s": e2e, "ttft_s": m.ttft,
            "forward_s": forward, "forward_calls": timer.calls_between(m.arrival_time, m.finished_time),
            "sampling_s": max(model - forward, 0.0), "schedule_s": sched, "post_s": post,
            "outside_s": max(e2e - steps, 0.0), "steps": len(recs), "forward_share": forward / e2e,
            "engine": m.engine, "threads": m.threads}


def http_request(base_url: str, model_name: str, prompt_ids: list[int], max_tokens: int, timer: ForwardTimer,
                 timeout: float = 60.0) -> dict:
    """One non-streaming ``/v1/completions`` request with a token-id prompt, timed at the client
    (send to the last byte of the response); the forward seconds the server's model spent in that
    window (``timer`` on the served model) over that E2E."""
    import httpx

    body = {"model": model_name, "prompt": list(prompt_ids), "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}
    with httpx.Client(timeout=timeout) as client:
        t0 = time.perf_counter()
        r = client.post(f"{base_url}/completions", json=body)
        t1 = time.perf_counter()
    r.raise_for_status()
    usage = r.json().get("usage") or {}
    forward = timer.seconds_between(t0, t1)
    return {"prompt_tokens": usage.get("prompt_tokens"), "output_tokens": usage.get("completion_tokens"),
            "e2e_s": t1 - t0, "forward_s": forward, "forward_calls": timer.calls_between(t0, t1),
            "forward_share": forward / (t1 - t0)}


__all__ = ["ForwardTimer", "forward_timer", "http_request", "request_breakdown"]
