"""Prometheus text exposition (format 0.0.4) for ``GET /metrics``, written out by hand.

Two sources: what the server sees of each request (latency histograms and finish-reason
counters, updated on the event loop as the engine's events arrive) and the engine's own
snapshot (:meth:`workbench.sched.AsyncEngine.stats`: queue, batch, KV blocks, prefix hits,
preemptions, rejections), read at scrape time.  Latencies are in seconds, as Prometheus
expects; TTFT counts from arrival at the engine, so queueing is included.

::

    m = ServerMetrics()
    m.observe(event, prompt_tokens=12)      # each StreamEvent of a request
    text = m.render(aengine.stats(), engine_alive=True, guard=guard_snapshot_or_None)

With an SLO guard, its state is exported too: ``workbench_slo_guard_state{state=...}`` (1 for
the current state), its baseline / threshold / windowed P95 TTFT, its decision counts, and the
server's own count of requests it answered 503 for the guard.  With the guard's queue policy the
server holds deferred requests: ``workbench_slo_held_total{outcome=...}`` counts them by how the
hold ended, ``workbench_slo_hold_seconds`` is a histogram of their time held and
``workbench_slo_held_requests`` the number held now (the server calls ``m.hold_started()`` and
``m.hold_ended(outcome, seconds)`` around each hold).
"""

from __future__ import annotations

import bisect
import math
import threading
from collections import Counter

TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0,
                10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
               0.3, 0.5, 1.0, 2.5)
HOLD_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)


class Histogram:
    """Cumulative buckets as Prometheus wants them: ``le`` = upper bound, ``+Inf`` = count."""

    def __init__(self, buckets: tuple[float, ...]) -> None:
        assert list(buckets) == sorted(buckets), "bucket bounds must increase"
        self.bounds = tuple(buckets)
        self.counts = [0] * (len(buckets) + 1)    # per bucket, not cumulative; last = above every bound
        self.sum, self.count = 0.0, 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1   # value <= bound falls in that bucket
        self.sum += value
        self.count += 1

    def lines(self, name: str) -> list[str]:
        out, cum = [], 0
        for bound, n in zip(self.bounds + (math.inf,), self.counts):
            cum += n
            out.append(f'{name}_bucket{{le="{_label(_fmt(bound))}"}} {cum}')
        return out + [f"{name}_sum {_fmt(self.sum)}", f"{name}_count {self.count}"]


def _label(v) -> str:
    """A label value as the Prometheus text format wants it: backslash, double quote and newline escaped."""
    return str(v).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _fmt(v: float) -> str:
    if v == math.inf:
        return "+Inf"
    return repr(float(v)) if isinstance(v, float) else str(v)


def _num(v) -> str:
    """A sample value; None (not known yet) and non-numbers become NaN."""
    if isinstance(v, bool):
        return str(int(v))
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return "NaN" if math.isnan(v) else _fmt(v)
    return "NaN"


SLO_STATES = ("closed", "open", "half_open")

# finish reasons as the engine names them; all are exported (0 until seen) so rates work from the start
FINISH_REASONS = ("stop", "length", "abort", "rejected", "error")
# how a request held by the SLO guard's queue ended: admitted (then served), timed_out (503 after the
# guard's queue timeout), refused (the guard said no without "ask again"), disconnected (the client
# left), error (the guard raised, or the server stopped)
HOLD_OUTCOMES = ("admitted", "timed_out", "refused", "disconnected", "error")


class ServerMetrics:
    def __init__(self) -> None:
        self._lock = threading.Lock()     # observed on the event loop; a notebook may render from elsewhere
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)
        self.finished: Counter = Counter({r: 0 for r in FINISH_REASONS})
        self.http: Counter = Counter()          # (path, status) -> responses
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self._last: dict[str, float] = {}      # request id -> time of its previous token
        self.slo_shed = 0                      # requests answered 503 because the SLO guard shed them
        self.slo_guard_errors = 0              # calls into the guard that raised
        self.slo_guard_last_error: str | None = None
        self.slo_held: Counter = Counter({o: 0 for o in HOLD_OUTCOMES})   # held requests by how the hold ended
        self.slo_hold = Histogram(HOLD_BUCKETS)                           # seconds each was held
        self.slo_holding = 0                                               # held right now
        self.connections: dict = {}            # the server's edge (workbench.serve.connections): refused, timed_out

    def observe(self, ev, prompt_tokens: int = 0) -> None:
        """Record one :class:`~workbench.engine.types.StreamEvent` of a request."""
        with self._lock:
            if ev.token_id >= 0:
                self.generation_tokens += 1
                prev = self._last.get(ev.request_id)
                if prev is None:
                    self.ttft.observe(ev.since_arrival)
                else:
                    self.itl.observe(ev.time - prev)
                self._last[ev.request_id] = ev.time
            if ev.finished:
                self._end(ev.request_id, ev.finish_reason or "error", prompt_tokens, ev.since_arrival)

    def ended(self, request_id: str, reason: str, prompt_tokens: int = 0) -> None:
        """A request ended without its final event reaching us (the client went away and the
        server aborted it; the engine thread died)."""
        with self._lock:
            self._end(request_id, reason, prompt_tokens, None)

    def _end(self, request_id: str, reason: str, prompt_tokens: int, e2e: float | None) -> None:
        self.finished[reason] += 1
        self.prompt_tokens += prompt_tokens
        if e2e is not None and reason in ("stop", "length"):
            self.e2e.observe(e2e)
        self._last.pop(request_id, None)

    def shed(self) -> None:
        with self._lock:
            self.slo_shed += 1

    def hold_started(self) -> None:
        with self._lock:
            self.slo_holding += 1

    def hold_ended(self, outcome: str, seconds: float) -> None:
        """A request the guard's queue held: how it ended (one of HOLD_OUTCOMES) and for how long."""
        with self._lock:
            self.slo_holding -= 1
            self.slo_held[outcome] += 1
            self.slo_hold.observe(max(0.0, seconds))

    def guard_error(self, message: str) -> None:
        with self._lock:
            self.slo_guard_errors += 1
            self.slo_guard_last_error = message

    def http_response(self, path: str, status: int) -> None:
        with self._lock:
            self.http[(path, status)] += 1

    def render(self, stats: dict, engine_alive: bool, guard: dict | None = None) -> str:
        """The exposition text: our histograms and counters, gauges from the engine snapshot, and
        the SLO guard's state (``guard``: its snapshot dict; None when the server has no guard)."""
        lines: list[str] = []

        def metric(name: str, kind: str, help_: str, samples: list[str]) -> None:
            lines.extend([f"# HELP {name} {help_}", f"# TYPE {name} {kind}", *samples])

        with self._lock:
            metric("workbench_time_to_first_token_seconds", "histogram",
                   "Time from arrival at the engine to the first generated token (queueing included).",
                   self.ttft.lines("workbench_time_to_first_token_seconds"))
            metric("workbench_inter_token_latency_seconds", "histogram",
                   "Gap between consecutive generated tokens of a request.",
                   self.itl.lines("workbench_inter_token_latency_seconds"))
            metric("workbench_e2e_request_latency_seconds", "histogram",
                   "Arrival to last token, for requests that finished with stop or length.",
                   self.e2e.lines("workbench_e2e_request_latency_seconds"))
            metric("workbench_requests_finished_total", "counter", "Requests ended, by finish reason.",
                   [f'workbench_requests_finished_total{{finish_reason="{_label(r)}"}} {n}'
                    for r, n in sorted(self.finished.items())])
            metric("workbench_prompt_tokens_total", "counter", "Prompt tokens of finished requests.",
                   [f"workbench_prompt_tokens_total {self.prompt_tokens}"])
            metric("workbench_generation_tokens_total", "counter", "Tokens generated and sent to clients.",
                   [f"workbench_generation_tokens_total {self.generation_tokens}"])
            metric("workbench_http_responses_total", "counter", "HTTP responses by path and status code.",
                   [f'workbench_http_responses_total{{path="{_label(p)}",code="{_label(c)}"}} {n}'
                    for (p, c), n in sorted(self.http.items())])
            metric("workbench_http_connections_refused_total", "counter",
                   "Connections closed on arrival: --max-connections were open.",
                   [f"workbench_http_connections_refused_total {self.connections.get('refused', 0)}"])
            metric("workbench_http_connections_timed_out_total", "counter",
                   "Connections closed because a request did not arrive within --request-timeout.",
                   [f"workbench_http_connections_timed_out_total {self.connections.get('timed_out', 0)}"])

        s = stats
        gauges = [
            ("workbench_queue_length", "Requests waiting to be admitted.", s.get("waiting", 0)),
            ("workbench_running_requests", "Requests in the running batch.", s.get("running", 0)),
            ("workbench_swapped_requests", "Requests preempted to host memory.", s.get("swapped", 0)),
            ("workbench_kv_usage_ratio", "Fraction of KV blocks in use (cached-but-free blocks not counted).",
             s.get("kv_usage", 0.0)),
            ("workbench_kv_used_blocks", "KV blocks in use.", s.get("kv_used_blocks", 0)),
            ("workbench_kv_total_blocks", "KV blocks in the pool.", s.get("kv_total_blocks", 0)),
            ("workbench_prefix_cache_hit_rate", "Prompt tokens served from the prefix cache / prompt tokens looked up.",
             s.get("prefix_hit_rate", 0.0)),
            ("workbench_engine_alive", "1 while the engine thread runs.", int(engine_alive)),
        ]
        for name, help_, v in gauges:
            metric(name, "gauge", help_, [f"{name} {_fmt(v)}"])
        counters = [
            ("workbench_preemptions_total", "Sequences preempted by the scheduler.", s.get("preemptions", 0)),
            ("workbench_rejected_total", "Requests rejected by the engine (queue full, too big for the pool).",
             s.get("rejected", 0)),
            ("workbench_engine_steps_total", "Engine steps run.", s.get("steps", 0)),
        ]
        for name, help_, v in counters:
            metric(name, "counter", help_, [f"{name} {_fmt(v)}"])
        eng = s.get("engine")
        if isinstance(eng, dict):       # the configuration serving requests, as labels of a constant 1
            labels = ",".join(f'{k}="{_label(v)}"' for k, v in eng.items())
            metric("workbench_engine_info", "gauge",
                   "The engine configuration: KV layout, fast paths (static decode, compile, CUDA graphs), sampling.",
                   [f"workbench_engine_info{{{labels}}} 1"])
        self._render_prefetch(metric, s.get("prefetch"))
        self._render_kv_memory(metric, s.get("kv_memory"))
        self._render_guard(metric, guard)
        return "\n".join(lines) + "\n"

    @staticmethod
    def _render_prefetch(metric, prefetch) -> None:
        """The prefetch layer's counters, one series per kind ("weights": weight streaming, "kv":
        offloaded KV blocks and swapped sequences); kinds that are off are left out."""
        kinds = {k: v for k, v in (prefetch or {}).items() if isinstance(v, dict)}
        series = [
            ("workbench_prefetch_hit_rate", "gauge", "Uses whose bytes were already in place at the moment of use "
             "(not the prefix cache's hit rate).", "prefetch_hit_rate"),
            ("workbench_prefetch_stall_seconds_total", "counter", "Time compute waited for fetches.", "stall_s"),
            ("workbench_prefetch_bytes_total", "counter", "Bytes the prefetcher moved.", "bytes"),
            ("workbench_prefetch_copy_seconds_total", "counter", "Time the copy lane was busy.", "copy_s"),
            ("workbench_prefetch_achieved_gbps", "gauge", "Bytes moved / copy time, GB/s.", "achieved_gbps"),
            ("workbench_prefetch_efficiency", "gauge", "Share of copy time hidden behind compute.",
             "prefetch_efficiency"),
            ("workbench_prefetch_uses_total", "counter", "Fetched items used.", "uses"),
        ]
        for name, kind, help_, key in series:
            samples = [f'{name}{{kind="{_label(k)}"}} {_fmt(v[key])}' for k, v in sorted(kinds.items())
                       if v.get(key) is not None]
            metric(name, kind, help_, samples)

    @staticmethod
    def _render_kv_memory(metric, mem) -> None:
        """The physical tiered cache's resident bytes, measured (tensor storages, each once) and
        by formula, per zone, over the live sequences; absent for other KV layouts."""
        if not isinstance(mem, dict):
            return
        metric("workbench_kv_resident_bytes", "gauge",
               "Measured resident KV bytes of live sequences per zone (storage nbytes, deduplicated).",
               [f'workbench_kv_resident_bytes{{zone="{_label(z)}"}} {_fmt(v)}' for z, v in mem["measured"].items()])
        metric("workbench_kv_formula_bytes", "gauge", "The same zones by the tier formula.",
               [f'workbench_kv_formula_bytes{{zone="{_label(z)}"}} {_fmt(v)}' for z, v in mem["formula"].items()])
        metric("workbench_kv_full_cache_bytes", "gauge", "What a full cache would hold for the live sequences.",
               [f"workbench_kv_full_cache_bytes {_fmt(mem['full'])}"])
        metric("workbench_kv_offloaded_bytes", "gauge", "Bytes of live sequences in the offload tier.",
               [f"workbench_kv_offloaded_bytes {_fmt(mem['offloaded'])}"])

    def _render_guard(self, metric, guard: dict | None) -> None:
        metric("workbench_slo_guard_enabled", "gauge", "1 when an SLO guard decides admission.",
               [f"workbench_slo_guard_enabled {int(guard is not None)}"])
        with self._lock:
            shed, errors = self.slo_shed, self.slo_guard_errors
            held, holding = sorted(self.slo_held.items()), self.slo_holding
            hold_lines = self.slo_hold.lines("workbench_slo_hold_seconds")
        metric("workbench_slo_shed_total", "counter", "Requests answered 503 because the SLO guard shed them.",
               [f"workbench_slo_shed_total {shed}"])
        metric("workbench_slo_guard_errors_total", "counter", "Calls into the SLO guard that raised.",
               [f"workbench_slo_guard_errors_total {errors}"])
        metric("workbench_slo_held_total", "counter",
               "Requests held by the SLO guard's queue (policy=queue), by how the hold ended.",
               [f'workbench_slo_held_total{{outcome="{_label(o)}"}} {n}' for o, n in held])
        metric("workbench_slo_hold_seconds", "histogram",
               "Time requests spent held by the SLO guard's queue (not part of their TTFT).", hold_lines)
        metric("workbench_slo_held_requests", "gauge", "Requests held by the SLO guard's queue now.",
               [f"workbench_slo_held_requests {holding}"])
        if guard is None:
            return
        state = guard.get("state")
        if isinstance(state, str):
            states = list(SLO_STATES) + ([state] if state not in SLO_STATES else [])
            metric("workbench_slo_guard_state", "gauge", "The SLO guard's state (1 for the current one).",
                   [f'workbench_slo_guard_state{{state="{_label(s)}"}} {int(s == state)}' for s in states])
        for key, name, help_ in (("baseline_s", "workbench_slo_baseline_ttft_seconds",
                                  "The guard's learned baseline TTFT quantile (NaN while learning)."),
                                 ("threshold_s", "workbench_slo_threshold_ttft_seconds",
                                  "The TTFT quantile above which the guard opens (NaN while learning)."),
                                 ("p95_s", "workbench_slo_window_ttft_seconds",
                                  "The TTFT quantile over the guard's window (NaN when empty)."),
                                 ("window_samples", "workbench_slo_window_samples",
                                  "TTFT samples in the guard's window.")):
            if key in guard:
                metric(name, "gauge", help_, [f"{name} {_num(guard[key])}"])
        if "trips" in guard:
            metric("workbench_slo_trips_total", "counter", "Times the guard opened.",
                   [f"workbench_slo_trips_total {_num(guard['trips'])}"])
        decisions = [k for k in ("admitted", "rejected", "deferred", "bypassed", "probes") if k in guard]
        if decisions:
            metric("workbench_slo_decisions_total", "counter", "The guard's admission decisions, by kind.",
                   [f'workbench_slo_decisions_total{{decision="{_label(k)}"}} {_num(guard[k])}' for k in decisions])
        if "samples" in guard:
            metric("workbench_slo_samples_total", "counter", "TTFTs fed to the guard.",
                   [f"workbench_slo_samples_total {_num(guard['samples'])}"])
