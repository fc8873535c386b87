"""What a load run records: one :class:`RequestRecord` per request, and their summary.

Times in a record are seconds from the start of the run (``perf_counter`` based).  Latency
definitions follow :mod:`workbench.engine.metrics`, seen from the client:

* **TTFT** = first token - send (queueing in the server counts; the generator's own lateness
  in sending is reported separately as ``send_lag_ms``, so coordinated omission is visible);
* **ITL** = gaps between consecutive tokens; **TPOT** = mean ITL of a request;
* **E2E** = end - send (for a rejection: how long the refusal took).

Status: ``ok`` (finished), ``error`` (failed, with the reason), ``rejected`` (refused by the
target: HTTP 429/503, an admission controller or the SLO guard, with the reason), or
``cancelled`` (still in flight when the run's time ran out).  Latency percentiles in
:meth:`LoadResult.summary` are over ``ok`` requests.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from workbench.engine.metrics import jitter

if TYPE_CHECKING:
    import pandas

STATUSES = ("ok", "error", "rejected", "cancelled")


@dataclass
class RequestRecord:
    id: int
    stage: int
    stage_name: str
    priority: int
    scheduled: float                 # when the arrival process meant to send it
    sent: float                      # when it was sent
    user: int | None = None          # closed loop: the virtual user
    prompt_len: int = 0              # characters (text) or tokens (id list)
    token_times: list[float] = field(default_factory=list)
    end: float | None = None
    status: str = "pending"
    reason: str | None = None        # error / rejection / cancellation reason
    finish_reason: str | None = None

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.sent if self.token_times else None

    @property
    def itl(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def tpot(self) -> float | None:
        n = len(self.token_times)
        return (self.token_times[-1] - self.token_times[0]) / (n - 1) if n > 1 else None

    @property
    def e2e(self) -> float | None:
        return None if self.end is None else self.end - self.sent

    @property
    def output_tokens(self) -> int:
        return len(self.token_times)

    def row(self) -> dict:
        ms = lambda v: None if v is None else v * 1e3  # noqa: E731
        return {"id": self.id, "stage": self.stage, "stage_name": self.stage_name, "user": self.user,
                "priority": self.priority, "status": self.status, "reason": self.reason,
                "finish_reason": self.finish_reason, "scheduled_s": self.scheduled, "sent_s": self.sent,
                "send_lag_ms": (self.sent - self.scheduled) * 1e3, "ttft_ms": ms(self.ttft),
                "tpot_ms": ms(self.tpot), "e2e_ms": ms(self.e2e), "output_tokens": self.output_tokens,
                "prompt_len": self.prompt_len, "itl_ms": [g * 1e3 for g in self.itl]}


def _pct(values, prefix: str) -> dict:
    a = np.asarray([v for v in values if v is not None], dtype=float) * 1e3
    if a.size == 0:
        return {f"{prefix}_p50_ms": math.nan, f"{prefix}_p95_ms": math.nan, f"{prefix}_p99_ms": math.nan,
                f"{prefix}_jitter_ms": math.nan}
    p50, p95, p99 = np.percentile(a, [50, 95, 99])
    return {f"{prefix}_p50_ms": p50, f"{prefix}_p95_ms": p95, f"{prefix}_p99_ms": p99,
            f"{prefix}_jitter_ms": jitter(a)}


def summarize_records(records, t0: float, t1: float, target=math.nan, token_records=None) -> dict:
    """Counts, rates and latency percentiles of ``records`` (all sent in [t0, t1)).

    ``tokens_per_s`` counts the tokens streamed in [t0, t1) by ``token_records`` (default
    ``records``): pass every record of the run so that a request sent earlier but still
    streaming in the window counts there."""
    counts = {s: 0 for s in STATUSES}
    for r in records:
        counts[r.status] = counts.get(r.status, 0) + 1
    ok = [r for r in records if r.status == "ok"]
    span = t1 - t0
    rate = (lambda n: n / span) if span > 0 else (lambda n: math.nan)
    tokens = sum(1 for r in (records if token_records is None else token_records)
                 for t in r.token_times if t0 <= t < t1)
    row = {"requests": len(records), "ok": counts["ok"], "errors": counts["error"],
           "rejected": counts["rejected"], "cancelled": counts["cancelled"], "target": target,
           "duration_s": span, "offered_qps": rate(len(records)), "goodput_qps": rate(len(ok))}
    row.update(_pct([r.ttft for r in ok], "ttft"))
    row.update(_pct([g for r in ok for g in r.itl], "itl"))
    row.update(_pct([r.tpot for r in ok], "tpot"))
    row.update(_pct([r.e2e for r in ok], "e2e"))
    row["tokens_per_s"] = rate(tokens)
    row["output_tokens"] = sum(r.output_tokens for r in records)
    return row


@dataclass
class LoadResult:
    """The records of one run, with ``frame()``, ``summary()``, ``reasons()`` and JSON export.

    ``stages``: (index, name, t0, t1, target) per stage, clipped to the run; ``config``: a
    JSON-able description of the LoadConfig; ``duration_s``: from start to the last request's end.
    """
    records: list[RequestRecord]
    duration_s: float
    stages: list[tuple[int, str, float, float, float]]
    config: dict = field(default_factory=dict)
    started_at: str = ""

    def frame(self) -> pandas.DataFrame:  # noqa: F821
        """One row per request (times in s from the start, latencies in ms, ``itl_ms`` a list)."""
        import pandas as pd

        cols = list(RequestRecord(0, 0, "", 0, 0.0, 0.0).row())
        return pd.DataFrame([r.row() for r in self.records], columns=cols)

    def summary(self) -> pandas.DataFrame:  # noqa: F821
        """One row per stage and an ``all`` row: requests, ok, errors, rejected, cancelled,
        target (rate or users), offered_qps (sent/s), goodput_qps (ok/s), TTFT / ITL / TPOT /
        E2E P50/P95/P99 and jitter (:func:`workbench.engine.metrics.jitter`) in ms over ok requests,
        tokens_per_s (tokens streamed in the window / its length, whenever the request was sent).
        A stage is credited with the requests *sent* in it (counts, rates, percentiles,
        output_tokens); its tokens_per_s counts every token streamed in its window, so under
        sustained load the stages add up to ``all``."""
        import pandas as pd

        rows, index = [], []
        for k, name, t0, t1, target in self.stages:
            t1c = min(t1, self.duration_s)
            rows.append({"stage": k, **summarize_records([r for r in self.records if r.stage == k],
                                                           t0, max(t0, t1c), target, token_records=self.records)})
            index.append(name)
        rows.append({"stage": -1, **summarize_records(self.records, 0.0, self.duration_s)})
        index.append("all")
        df = pd.DataFrame(rows, index=pd.Index(index, name="stage_name"))
        return df

    def reasons(self) -> pandas.DataFrame:  # noqa: F821
        """How many requests ended with each (status, reason) - rejections and errors explained."""
        import pandas as pd

        df = self.frame()
        df = df[df["status"] != "ok"]
        if df.empty:
            return pd.DataFrame(columns=["status", "reason", "count"])
        return (df.groupby(["status", "reason"], dropna=False).size().rename("count").reset_index()
                .sort_values("count", ascending=False, ignore_index=True))

    # ---- JSON ----------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {"format": "workbench-load/1", "started_at": self.started_at, "duration_s": self.duration_s,
                "config": self.config, "stages": [list(s) for s in self.stages],
                "records": [asdict(r) for r in self.records]}

    def to_json(self, path: str | Path | None = None) -> str:
        """The run as JSON (records with their token times, config, stages); written to
        ``path`` when given.  ``LoadResult.from_json`` reads it back."""
        text = json.dumps(self.to_dict(), default=_json_default)
        if path is not None:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text(text)
        return text

    @classmethod
    def from_json(cls, text_or_path: str | Path) -> LoadResult:
        from workbench.errors import WorkbenchError

        src = str(text_or_path)
        text = Path(src).read_text() if not src.lstrip().startswith("{") else src
        d = json.loads(text)
        if d.get("format") != "workbench-load/1":
            raise WorkbenchError(f"{src[:80]}: not a load-run JSON (expected \"format\": \"workbench-load/1\")")
        return cls(records=[RequestRecord(**r) for r in d["records"]], duration_s=d["duration_s"],
                   stages=[tuple(s) for s in d["stages"]], config=d["config"], started_at=d["started_at"])


def _json_default(o):
    if isinstance(o, (np.integer, np.floating)):
        return o.item()
    return repr(o)
