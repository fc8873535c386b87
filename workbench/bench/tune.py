"""Tuning on a user's own trace: the SLO as text, the capacity at the SLO, and the serve options of
a measured configuration.

::

    slo = parse_slo("ttft_p95<=500ms,ppl<=+2%")                 # SLO(ttft_p95_ms=500, max_rel_ppl=0.02)
    screen = screen_capacity(ab, ["baseline", "stack: paged", ...], slo)   # each config at 2x, 4x, ... (1 round)
    name = pick_by_capacity(screen, rec["table"])                 # the most headroom; ties: fewer layers, less memory
    cap = capacity_search(ab, name, slo)                          # the highest arrival-rate multiple within the SLO
    cap["multiple"], cap["table"]                                 # 2.8, every point measured
    opts = serve_options(ab, "stack: paged + ...", model="runs/smollm2")
    serve_command(opts)                                          # workbench serve --model runs/smollm2 ...

The capacity search replays the ablation's trace on the chosen configuration's engine with every
arrival time divided by a multiple ``m`` (``m`` = 2: twice the recorded rate): doubling ``m`` from 1
while every round meets the SLO's P95 TTFT, then halving the gap between the last multiple that
met it and the first that did not (geometric midpoints), ``refine`` times.  A multiple *meets*
the SLO when every one of its ``rounds`` replays does, the recommendation rule's own test.
Quality does not depend on the rate: the configuration's measured perplexity stands.

Which configuration: at the trace's recorded rate every configuration that keeps up serves the
same tokens per second, so the recommendation rule (highest throughput, ties to the fewest
layers) picks the simplest one that meets the SLO.  A tuner wants the one with the most headroom:
:func:`screen_capacity` replays every configuration that met the SLO at 2x, 4x, 8x and 16x the
rate (one round each, stopping at its first miss), and :func:`pick_by_capacity` takes the highest
multiple met, ties broken as the recommendation rule breaks them (fewest layers, then least
memory).  The search then measures that configuration's capacity precisely.
"""

from __future__ import annotations

import math
import re

from workbench.bench.e2e_recommend import SLO
from workbench.engine.traces import Trace, TraceRequest
from workbench.errors import ConfigError

_TERM = re.compile(r"^\s*(ttft_p95|ppl|agreement)\s*(<=|>=)\s*([+-]?[0-9]*\.?[0-9]+)\s*(ms|s|%)?\s*$")


def parse_slo(text: str) -> SLO:
    """``"ttft_p95<=500ms,ppl<=+2%"`` -> ``SLO(ttft_p95_ms=500, max_rel_ppl=0.02)``.

    Terms, comma-separated: ``ttft_p95<=N`` with ``ms`` or ``s`` (required), ``ppl<=+N%`` (a
    relative perplexity increase; default +2 %), ``agreement>=N%`` (greedy tokens equal to the
    unchanged model's; default: not checked)."""
    if not isinstance(text, str) or not text.strip():
        raise ConfigError("--slo: empty; write e.g. \"ttft_p95<=500ms,ppl<=+2%\"")
    got: dict = {}
    for part in text.split(","):
        m = _TERM.match(part)
        if not m:
            raise ConfigError(f"--slo term {part.strip()!r}: expected ttft_p95<=N(ms|s), ppl<=+N% or agreement>=N%, "
                              f"e.g. \"ttft_p95<=500ms,ppl<=+2%\"")
        name, op, num, unit = m.groups()
        value = float(num)
        want = {"ttft_p95": ("<=", ("ms", "s")), "ppl": ("<=", ("%",)), "agreement": (">=", ("%",))}[name]
        if op != want[0] or unit not in want[1]:
            raise ConfigError(f"--slo term {part.strip()!r}: write {name}{want[0]}N{want[1][0]}"
                              + (f" (or {want[1][1]})" if len(want[1]) > 1 else ""))
        if name in got:
            raise ConfigError(f"--slo: {name} is given twice")
        got[name] = value * (1e3 if unit == "s" else 1.0) if name == "ttft_p95" else value / 100
    if "ttft_p95" not in got:
        raise ConfigError("--slo: a P95 TTFT bound is required, e.g. ttft_p95<=500ms")
    return SLO(ttft_p95_ms=got["ttft_p95"], max_rel_ppl=got.get("ppl", 0.02), min_agreement=got.get("agreement"))


def scale_trace(trace: Trace, multiple: float) -> Trace:
    """``trace`` at ``multiple`` times its rate: every arrival time divided by ``multiple``."""
    if not multiple > 0:
        raise ConfigError(f"scale_trace: the rate multiple must be > 0, got {multiple!r}")
    return Trace([TraceRequest(r.at / multiple, r.prompt, r.params, r.priority) for r in trace.requests])


def _meets(rows: list[dict], slo: SLO) -> bool:
    return all(r["ttft_ms_p95"] is not None and r["ttft_ms_p95"] <= slo.ttft_p95_ms for r in rows)


def capacity_search(ab, name: str, slo: SLO, rounds: int = 2, max_multiple: float = 16.0, refine: int = 3,
                    progress=None) -> dict:
    """The highest arrival-rate multiple of ``ab``'s trace at which configuration ``name`` meets
    ``slo`` in every round (see the module docstring).  ``ab``: an :class:`~workbench.bench.end_to_end.Ablation`
    that has run (its engines still open).  When the recorded rate is already more than it serves,
    the search goes down instead (0.5x, 0.25x, ... to ``1 / max_multiple``, then the same halving of
    the gap).  Returns ``multiple`` (the capacity; below 1 when the trace offers more than it serves
    within the SLO; None when not even ``1 / max_multiple`` is), ``time_scale`` (1 / multiple),
    ``bounded`` (False when ``max_multiple`` still met the SLO), ``table`` (one row per multiple:
    each round's P95 TTFT and throughput) and ``reason``.  ``progress(text)``: called before each point."""
    if rounds < 1 or not max_multiple > 1 or refine < 0:
        raise ConfigError("capacity_search: rounds >= 1, max_multiple > 1 and refine >= 0")
    table: list[dict] = []

    def point(m: float) -> bool:
        if progress is not None:
            progress(f"capacity: {name} at {m:.2f}x the trace's rate")
        rows = [ab.replay_at(name, m) for _ in range(rounds)]
        ok = _meets(rows, slo)
        table.append({"multiple": round(m, 4), "time_scale": round(1 / m, 4),
                      "ttft_ms_p95": [r["ttft_ms_p95"] for r in rows],
                      "ttft_ms_p95_worst": max(r["ttft_ms_p95"] for r in rows),
                      "tokens_per_s": [r["tokens_per_s"] for r in rows], "finished": min(r["finished"] for r in rows),
                      "meets": ok})
        return ok

    measured = ab.samples(name, "ttft_ms_p95")                 # the ablation's rounds at 1x
    at1 = bool(measured) and all(v <= slo.ttft_p95_ms for v in measured)
    table.append({"multiple": 1.0, "time_scale": 1.0, "ttft_ms_p95": measured,
                  "ttft_ms_p95_worst": max(measured) if measured else None,
                  "tokens_per_s": ab.samples(name, "tokens_per_s"), "finished": None, "meets": at1,
                  "source": "the ablation's rounds"})
    if at1:                             # up: double while it meets
        lo, hi, m = 1.0, None, 2.0
        while m <= max_multiple:
            if point(m):
                lo, m = m, m * 2
            else:
                hi = m
                break
    else:                               # the trace is more than it serves: down, halving until it meets
        lo, hi, m = None, 1.0, 0.5
        while m >= 1 / max_multiple:
            if point(m):
                lo = m
                break
            hi, m = m, m / 2
        if lo is None:
            return {"config": name, "multiple": None, "time_scale": None, "bounded": True, "table": table,
                    "slo": slo.describe(),
                    "reason": f"{name} does not meet the SLO even at 1/{max_multiple:g} of the trace's rate "
                              f"(P95 TTFT {max(measured or [math.nan]):.0f} ms at the recorded rate)"}
    for _ in range(refine if hi is not None else 0):
        mid = math.sqrt(lo * hi)
        if point(mid):
            lo = mid
        else:
            hi = mid
    bounded, lo = hi is not None, round(lo, 4)           # as the table has it
    reason = (f"{name} meets the SLO ({slo.describe()}) up to {lo:.2f}x the trace's recorded rate"
              + (" - less than the trace offers" if lo < 1 else "")
              + (f" and not at {hi:.2f}x" if bounded else f", the largest multiple tried ({max_multiple:g}x)")
              + f" ({len(table) - 1} multiples measured, {rounds} rounds each)")
    return {"config": name, "multiple": lo, "time_scale": 1 / lo, "bounded": bounded, "table": table,
            "slo": slo.describe(), "reason": reason}


def screen_capacity(ab, names, slo: SLO, multiples=(2.0, 4.0, 8.0, 16.0), rounds: int = 1, progress=None) -> list[dict]:
    """Each configuration in ``names`` (they met ``slo`` at the recorded rate) replayed at each
    multiple of the rate in turn, ``rounds`` rounds, until its first miss: ``config``, ``met`` (the
    highest multiple met, 1.0 when none), ``missed`` (the first multiple missed, None), the points'
    worst P95 TTFTs, and ``estimate``: where the P95 TTFT crosses the bound, interpolated between
    the last point met and the first missed on log-log axes (one noisy round at the bound's edge
    does not decide alone; without a miss, the highest multiple met)."""
    out = []
    for name in names:
        row = {"config": name, "met": 1.0, "missed": None, "points": {}}
        for m in multiples:
            if progress is not None:
                progress(f"screen: {name} at {m:g}x the trace's rate")
            rows = [ab.replay_at(name, m) for _ in range(rounds)]
            row["points"][m] = max(r["ttft_ms_p95"] for r in rows)
            if not _meets(rows, slo):
                row["missed"] = m
                break
            row["met"] = m
        row["estimate"] = _crossing(row, ab.samples(name, "ttft_ms_p95"), slo.ttft_p95_ms)
        out.append(row)
    return out


def _crossing(row: dict, at1: list, bound: float) -> float:
    """The multiple where the worst P95 TTFT reaches ``bound``, interpolated on log-log axes
    between the last multiple met and the first missed (see :func:`screen_capacity`)."""
    if row["missed"] is None:
        return row["met"]
    lo = row["met"]
    y0 = row["points"][lo] if lo in row["points"] else max(at1)
    y1 = row["points"][row["missed"]]
    if not (y0 > 0 and y1 > y0):
        return lo
    f = (math.log(bound) - math.log(y0)) / (math.log(y1) - math.log(y0))
    return lo * (row["missed"] / lo) ** min(1.0, max(0.0, f))


def pick_by_capacity(screen: list[dict], table: list[dict], tie: float = 0.1) -> str | None:
    """The screened configuration with the highest estimated capacity; every one within ``tie``
    (10 %) of it ties, and of the tied the fewest layers, then the least memory, wins (``table``:
    :func:`~workbench.bench.e2e_recommend.recommend`'s, for both)."""
    if not screen:
        return None
    best = max(r["estimate"] for r in screen)
    tied = [r for r in screen if r["estimate"] >= best * (1 - tie)]
    facts = {t["config"]: t for t in table}
    key = lambda r: (facts.get(r["config"], {}).get("layers", 0), facts.get(r["config"], {}).get("memory_bytes") or 0,
                     -r["estimate"])
    return min(tied, key=key)["config"]


def closest_config(table: list[dict]) -> str | None:
    """When no configuration meets the SLO: the one within its quality bounds (perplexity, agreement)
    whose slowest round came nearest the P95 TTFT bound (the reference, which is no server, left out)."""
    ok = [t for t in table if t["config"] != "reference LLM()"
          and "perplexity" not in t["why"] and "agreement" not in t["why"]]
    return min(ok, key=lambda t: t["ttft_ms_p95_worst"])["config"] if ok else None


def serve_options(ab, name: str, model=None, device=None, dtype=None) -> tuple[dict, list[str]]:
    """The ``workbench serve`` options (argparse names) that start configuration ``name`` of
    ``ab`` as the ablation built it, and notes on what a server cannot mirror.  ``model``: the
    model's folder (None: the bundled model)."""
    c = ab.config(name)
    s, cfg, llm = c.spec, ab.cfg, ab.llm
    if s.reference:
        raise ConfigError(f"{name} is LLM()'s one-request-at-a-time reference, not a serving configuration")
    notes: list[str] = []
    o: dict = {"model": None if model is None else str(model), "device": device, "dtype": dtype,
               "max_model_len": llm.max_model_len if llm.max_model_len != llm.model.config.max_position_embeddings
               else None,
               "max_num_seqs": cfg.max_num_seqs, "max_batched_tokens": cfg.max_num_batched_tokens}
    if s.window_s:
        o["window_ms"] = round(s.window_s * 1e3, 3)
    if s.tiers is not None:
        raise ConfigError(f"{name}: the tiered cache's serve flags are not written by tune yet; pick another "
                          "configuration")
    if s.kv is None:
        o["kv"] = "contiguous"
    else:
        kv = s.kv
        if kv.block_size != 16:
            o["block_size"] = kv.block_size
        if kv.num_blocks is not None:
            o["num_blocks"] = kv.num_blocks
        if not kv.enable_prefix_caching:
            o["no_prefix_caching"] = True
        if kv.offload is not None:
            o["offload"] = kv.offload
            if kv.offload_blocks is not None:
                o["offload_blocks"] = kv.offload_blocks
            o["lookahead"] = kv.lookahead
    if s.compile:
        o["compile"] = True
    elif s.static_decode:
        notes.append("the static decode step uncompiled (tiny mode) has no serve flag: the server runs it eagerly")
    if s.cuda_graphs:
        o["cuda_graphs"] = True
    if s.quant:
        o["quant"] = s.quant
    if s.backends:
        o["backend"] = ",".join(f"{op}={b}" for op, b in s.backends)
    if s.stream_weights is not None:
        o["resident_layers"] = s.stream_weights.resident_layers
        o["prefetch_distance"] = s.stream_weights.distance
    if s.priorities:
        o["trust_priority_header"] = True
        notes.append("priorities come from each request's x-priority header (the trace's priorities, sent by "
                     "workbench load --trace); --trust-priority-header honours it without an API key")
    threads = getattr(llm, "threads", None)
    if isinstance(threads, int) and str(llm.device) == "cpu":
        o["threads"] = threads
    return {k: v for k, v in o.items() if v is not None}, notes
