"""Per-request latency metrics and their summary.

Definitions (all times from ``time.perf_counter()``, in seconds; reported in ms):

* **TTFT** (time to first token) = first token's timestamp - arrival.  Arrival is when the
  request was submitted, so queueing behind other requests counts, as a user would see it.
* **ITL** (inter-token latency) = gaps between consecutive output tokens.
* **TPOT** (time per output token) = (E2E - TTFT) / (n - 1): the mean ITL.
* **E2E** = finish - arrival.
* **decode tokens/s** = (n - 1) / (E2E - TTFT): the decode rate, without prefill.
* **jitter** = the *sample* standard deviation (ddof=1) of one latency over its samples:
  across requests for TTFT/TPOT/E2E, across all inter-token gaps of all requests for ITL.
  Defined once, by :func:`jitter`: compute every jitter with it.

A token's timestamp is taken after its id is on the host, which on a GPU means after the
device finished computing it (``.item()`` synchronises), so no asynchronous work is hidden.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    finished_time: float | None = None
    prompt_tokens: int = 0
    threads: int | None = None   # torch intra-op threads the engine ran with (workbench.measure.threads)
    engine: str | None = None    # the engine configuration that served it (LLMEngine.describe())

    @property
    def time_in_queue(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def itl(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def e2e(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time

    @property
    def output_tokens(self) -> int:
        return len(self.token_times)

    @property
    def tpot(self) -> float | None:
        n = self.output_tokens
        return (self.token_times[-1] - self.token_times[0]) / (n - 1) if n > 1 else None

    @property
    def decode_tokens_per_s(self) -> float | None:
        tpot = self.tpot
        return 1.0 / tpot if tpot else None

    @property
    def tokens_per_s(self) -> float | None:
        """Output tokens over the whole request (prefill included)."""
        e2e = self.e2e
        return self.output_tokens / e2e if e2e else None

    def as_dict(self) -> dict:
        ms = lambda v: None if v is None else v * 1e3  # noqa: E731
        return {"prompt_tokens": self.prompt_tokens, "output_tokens": self.output_tokens,
                "queue_ms": ms(self.time_in_queue), "ttft_ms": ms(self.ttft), "tpot_ms": ms(self.tpot),
                "e2e_ms": ms(self.e2e), "tokens_per_s": self.tokens_per_s,
                "decode_tokens_per_s": self.decode_tokens_per_s, "threads": self.threads, "engine": self.engine}


def jitter(samples) -> float:
    """Jitter of a latency: the sample standard deviation (ddof=1, Bessel-corrected) of ``samples``.

    ``samples`` are the values of one latency, one per observation: per request for TTFT,
    TPOT or E2E, per inter-token gap (all gaps of all requests pooled) for ITL.  ``None`` values
    are dropped; fewer than two samples give 0.0 (no spread observed).  Same unit as the samples.
    """
    a = np.asarray([v for v in samples if v is not None], dtype=float)
    return float(a.std(ddof=1)) if a.size > 1 else 0.0


def _stats(values: list[float]) -> dict:
    a = np.asarray([v for v in values if v is not None], dtype=float)
    if a.size == 0:
        return {"n": 0}
    return {"n": int(a.size), "mean": a.mean(), "p50": np.percentile(a, 50), "p95": np.percentile(a, 95),
            "p99": np.percentile(a, 99), "min": a.min(), "max": a.max(),
            "jitter": jitter(a)}


def summarize(outputs) -> pandas.DataFrame:  # noqa: F821
    """One row per metric (TTFT, TPOT, ITL, E2E in ms; tokens/s) with n, mean, P50/P95/P99,
    min, max and jitter (std).  Accepts RequestOutputs or RequestMetrics."""
    import pandas as pd

    ms = [getattr(o, "metrics", o) for o in outputs]
    rows = {
        "ttft_ms": _stats([m.ttft * 1e3 for m in ms if m.ttft is not None]),
        "tpot_ms": _stats([m.tpot * 1e3 for m in ms if m.tpot is not None]),
        "itl_ms": _stats([g * 1e3 for m in ms for g in m.itl]),
        "e2e_ms": _stats([m.e2e * 1e3 for m in ms if m.e2e is not None]),
        "queue_ms": _stats([m.time_in_queue * 1e3 for m in ms if m.time_in_queue is not None]),
        "decode_tokens_per_s": _stats([m.decode_tokens_per_s for m in ms]),
        "tokens_per_s": _stats([m.tokens_per_s for m in ms]),
    }
    df = pd.DataFrame.from_dict(rows, orient="index")
    df.index.name = "metric"
    return df


def requests_frame(outputs) -> pandas.DataFrame:  # noqa: F821
    """One row per request with its metrics (ms) and finish reason."""
    import pandas as pd

    return pd.DataFrame([{"request_id": o.request_id, "finish_reason": o.finish_reason, **o.metrics.as_dict()}
                         for o in outputs])
