"""Load generation, SLO guarding and live views, against any *target* that streams tokens.

One concept per file:

* ``target``    - the :class:`Target` protocol, :class:`TokenEvent`, :class:`HTTPTarget`
  (OpenAI-compatible SSE via httpx) and :class:`CallableTarget` (an in-process async generator);
* ``fake``      - :class:`FakeTarget`, an asyncio "model" with a fixed capacity, for tests and demos;
* ``engine``    - :class:`EngineTarget`, the batched engine in this process (no HTTP);
* ``arrivals``  - constant / Poisson arrival times and k6-style stages (pure functions of time);
* ``generator`` - :class:`LoadConfig`, :class:`LoadRun`, :func:`run_load` / :func:`run_load_sync`;
* ``result``    - :class:`RequestRecord`, :class:`LoadResult` (frame, summary, JSON);
* ``slo``       - :class:`SLOGuard` (a latency circuit breaker) and :class:`GuardedTarget`;
* ``views``     - :class:`LatencyDashboard`, :func:`scheduler_timeline` and
  :func:`latency_vs_load_figure` (plotly, lazy);
* ``cli``       - the ``workbench load`` subcommand (``add_parser(subparsers)``).

::

    from workbench.load import FakeTarget, LoadConfig, run_load_sync
    res = run_load_sync(FakeTarget(capacity=4), LoadConfig(mode="poisson", stages=[(2, 20), (2, 0)]))
    res.summary()

Against the real engine, in process: ``EngineTarget.from_model(None, device="cpu")``.
Nothing here imports the engine, torch, plotly or httpx at import time.
"""

from .arrivals import Schedule, Stage, arrival_offsets
from .engine import EngineTarget
from .fake import FakeTarget
from .generator import LoadConfig, LoadRun, run_load, run_load_sync
from .result import LoadResult, RequestRecord
from .slo import Decision, GuardedTarget, SLOConfig, SLOGuard
from .target import CallableTarget, HTTPTarget, Target, TokenEvent, parse_sse_chunk

__all__ = ["Schedule", "Stage", "arrival_offsets", "EngineTarget", "FakeTarget", "LoadConfig", "LoadRun", "run_load",
           "run_load_sync", "LoadResult", "RequestRecord", "Decision", "GuardedTarget", "SLOConfig", "SLOGuard",
           "CallableTarget", "HTTPTarget", "Target", "TokenEvent", "parse_sse_chunk", "LatencyDashboard",
           "latency_vs_load_figure", "scheduler_timeline"]


def __getattr__(name):   # the views need plotly: imported on first use only
    if name in ("LatencyDashboard", "latency_vs_load_figure", "scheduler_timeline"):
        from . import views
        return getattr(views, name)
    raise AttributeError(f"module 'workbench.load' has no attribute {name!r}")
