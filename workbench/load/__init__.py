"""Load generation, SLO guarding and live views, against any *target* that streams tokens.

One concept per file:

* ``target``    - the :class:`Target` protocol, :class:`TokenEvent`, :class:`HTTPTarget`
  (OpenAI-compatible SSE via httpx) and :class:`CallableTarget` (an in-process async generator);
* ``fake``      - :class:`FakeTarget`, an asyncio "model" with a fixed capacity, for tests and demos;
* ``engine_target`` - :class:`EngineTarget`, the batched engine in this process (no HTTP);
* ``arrivals``  - constant / Poisson arrival times and k6-style stages (pure functions of time);
* ``generator`` - :class:`LoadConfig`, :class:`LoadRun`, :func:`run_load` / :func:`run_load_sync`;
* ``result``    - :class:`RequestRecord`, :class:`LoadResult` (frame, summary, JSON);
* ``traces``    - recorded traces in: our JSONL, ShareGPT, Azure, BurstGPT, Mooncake (:func:`read_trace`);
* ``trace_workload`` - a trace as token ids with its prefix structure, and its summary
  (:func:`build_trace_workload`, :class:`TraceOptions`, :class:`TraceWorkload`);
* ``trace_samples`` - small synthetic files in each format (:func:`write_sample`);

The SLO guard (a serving policy) is :mod:`workbench.serve.slo`; the live views are
:mod:`workbench.lab.load_views`; the ``workbench load`` command is :mod:`workbench.cli.load`.

::

    from workbench.load import FakeTarget, LoadConfig, run_load_sync
    res = run_load_sync(FakeTarget(capacity=4), LoadConfig(mode="poisson", stages=[(2, 20), (2, 0)]))
    res.summary()

Against the real engine, in process: ``EngineTarget.from_model(None, device="cpu")``.
Nothing here imports the engine, torch, plotly or httpx at import time.
"""

from workbench._exports import exports, lazy

_EXPORTS = exports({
    "workbench.load.arrivals": "Schedule Stage arrival_offsets",
    "workbench.load.engine_target": "EngineTarget",
    "workbench.load.fake": "FakeTarget",
    "workbench.load.generator": "LoadConfig LoadRun run_load run_load_sync",
    "workbench.load.result": "LoadResult RequestRecord",
    "workbench.load.target": "CallableTarget HTTPTarget Target TokenEvent parse_sse_chunk",
    "workbench.load.traces": "FORMATS TraceError TraceRow detect_format read_trace",
    "workbench.load.trace_workload": "TraceOptions TraceWorkload build_trace_workload parse_window",
    "workbench.load.trace_samples": "write_sample",
})
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy(__name__, _EXPORTS)
