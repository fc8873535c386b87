"""Notebook 06's controls, live view and progress, from hand-made results (headless, no engine):
the SLO slider's precomputed recommendations and the metric dropdown (plotly's own controls, so
they work without a kernel), the live view's recording and replay of the rounds, readable tables,
and the progress callbacks of the ablation's steps."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("plotly")

import pandas as pd

from workbench.bench.e2e_configs import Config, E2EConfig, Spec
from workbench.bench.e2e_recommend import SLO, recommend
from workbench.bench.e2e_results import AblationResults
from workbench.lab.e2e_view import (
    MEETS,
    MISSES,
    PICK,
    QUALITY,
    RECOMMENDATION_PREFIX,
    SLO_META,
    AblationLive,
    fmt_bytes,
    follow,
    waterfall_html,
    readable,
    short_name,
    slo_choices,
    slo_explorer_figure,
)
from workbench.lab.progress import Progress
from workbench.lab.replay import has_replay

# three measured configurations: per-run P95 TTFT (ms) and throughput (tokens/s), quality, memory
CANDIDATES = [
    {"name": "baseline", "layers": [], "ttft_ms_p95": [900.0, 1000.0, 950.0], "tokens_per_s": [100.0, 101.0, 99.0],
     "rel_ppl": None, "agreement": 1.0, "memory_bytes": 40 * 2**20},
    {"name": "+paged +prefix_cache", "layers": ["paged", "prefix_cache"], "ttft_ms_p95": [400.0, 420.0, 410.0],
     "tokens_per_s": [150.0, 152.0, 149.0], "rel_ppl": None, "agreement": 1.0, "memory_bytes": 60 * 2**20},
    {"name": "stack: paged + prefix_cache + quant", "layers": ["paged", "prefix_cache", "quant"],
     "ttft_ms_p95": [300.0, 310.0, 305.0], "tokens_per_s": [200.0, 205.0, 198.0], "rel_ppl": 0.05,
     "agreement": 0.9, "memory_bytes": 30 * 2**20},
]


def _steps(values: list[float]) -> list[dict]:
    """A waterfall of the baseline and two stack steps (the shape of Ablation.waterfall)."""
    base, paged, quant = values
    return [
        {"kind": "start", "layer": "baseline", "label": "baseline", "config": "baseline", "value": base,
         "lo": base * 0.9, "hi": base * 1.1},
        {"kind": "step", "layer": "prefix_cache", "label": "prefix cache", "config": "+paged +prefix_cache",
         "value": paged, "lo": paged * 0.9, "hi": paged * 1.1, "prev": base, "delta": paged - base,
         "rel": paged / base - 1, "verdict": "lower", "winner": "+paged +prefix_cache", "within_noise": False,
         "noise": 0.05},
        {"kind": "step", "layer": "quant", "label": "quant w8a8", "config": "stack: paged + prefix_cache + quant",
         "value": quant, "lo": quant * 0.9, "hi": quant * 1.1, "prev": paged, "delta": quant - paged,
         "rel": quant / paged - 1, "verdict": "within noise", "winner": None, "within_noise": True, "noise": 0.05},
        {"kind": "total", "layer": "stack", "label": "the stack", "config": "stack: paged + prefix_cache + quant",
         "value": quant, "prev": base, "delta": quant - base, "rel": quant / base - 1, "verdict": "lower",
         "winner": "stack: paged + prefix_cache + quant", "within_noise": False, "noise": 0.05},
    ]


WATERFALLS = {"ttft_ms_p95": _steps([950.0, 410.0, 305.0]), "tokens_per_s": _steps([100.0, 150.0, 200.0])}


def test_slo_choices_are_the_rule_at_every_bound_where_its_answer_changes():
    choices = slo_choices(CANDIDATES, max_rel_ppl=0.02, noise=0.05, default=1000.0)
    bounds = [c["bound"] for c in choices]
    assert bounds == sorted(bounds)
    # one bound under every configuration's slowest round, then each slowest round (rounded up), the stated one
    assert bounds == [279.0, 310.0, 420.0, 1000.0]
    assert [c["default"] for c in choices] == [False, False, False, True]
    for c in choices:              # the same answer as the rule itself
        assert c["pick"] == recommend(CANDIDATES, SLO(c["bound"], 0.02), noise=0.05)["pick"]
    assert choices[0]["pick"] is None                                  # nothing meets 279 ms
    # at 310 ms only the stack is fast enough, and its perplexity (+5 %) is over the bound: still none
    assert choices[1]["pick"] is None and choices[1]["quality_ok"]["stack: paged + prefix_cache + quant"] is False
    assert choices[2]["pick"] == "+paged +prefix_cache" and choices[3]["pick"] == "+paged +prefix_cache"
    assert choices[3]["meets"] == {"baseline": True, "+paged +prefix_cache": True,
                                   "stack: paged + prefix_cache + quant": False}
    # with a looser quality bound the stack wins at 310 ms
    loose = slo_choices(CANDIDATES, max_rel_ppl=0.10, noise=0.05)
    assert next(c for c in loose if c["bound"] == 310.0)["pick"] == "stack: paged + prefix_cache + quant"
    # a stated SLO within 0.1 ms of a computed bound replaces it
    assert ([c["bound"] for c in slo_choices(CANDIDATES, 0.02, noise=0.05, default=419.95)]
            == [279.0, 310.0, 419.95, 1000.0])


def test_slo_explorer_slider_moves_the_recommendation_and_dropdown_swaps_the_waterfall():
    choices = slo_choices(CANDIDATES, max_rel_ppl=0.02, noise=0.05, default=1000.0)
    fig = slo_explorer_figure(WATERFALLS, choices, CANDIDATES, metric="ttft_ms_p95", max_rel_ppl=0.02)
    doc = json.loads(fig.to_json())                # offline: everything the controls do is in the figure
    layout = doc["layout"]
    assert layout["meta"] == SLO_META
    ann = layout["annotations"][0]["text"]
    assert ann.startswith(f"<b>{RECOMMENDATION_PREFIX} +paged +prefix_cache")          # the stated SLO's pick
    slider = layout["sliders"][0]
    assert slider["active"] == 3 and len(slider["steps"]) == len(choices)
    texts = [s["args"][1]["annotations[0].text"] for s in slider["steps"]]
    assert all(t.startswith(f"<b>{RECOMMENDATION_PREFIX}") for t in texts)
    assert "none meets this SLO" in texts[0] and "+paged +prefix_cache" in texts[3] and texts[0] != texts[3]
    # each step recolours and outlines the waterfall bars (the pick's step) and the SLO panel, and moves the bound
    for s, c in zip(slider["steps"], choices):
        data, lay, idx = s["args"]
        assert set(data) == {"marker.color", "marker.line.width"} and all(len(v) == len(idx) for v in data.values())
        panel = doc["data"][idx[-1]]
        assert panel["orientation"] == "h"
        for name, color, width in zip(panel["customdata"], data["marker.color"][-1], data["marker.line.width"][-1]):
            want = (PICK if name == c["pick"] else MEETS if c["meets"][name]
                    else QUALITY if not c["quality_ok"][name] else MISSES)
            assert color == want and (width > 0) == (name == c["pick"])
        assert lay["shapes[0].x0"] == lay["shapes[0].x1"] == c["bound"]                 # the dotted bound
        outline = data["marker.line.width"][0]                                       # TTFT waterfall bars
        assert (3 in outline) == (c["pick"] == "+paged +prefix_cache")
    assert layout["shapes"][0]["x0"] == 1000.0 and layout["shapes"][0]["xref"] == "x2"
    # the dropdown: one button per metric, each showing that metric's traces (bars, noise bands, ranges) only
    buttons = layout["updatemenus"][0]["buttons"]
    assert [b["label"] for b in buttons] == ["TTFT p95 (ms)", "throughput (tokens/s)"]
    vis_ttft, vis_tps = buttons[0]["args"][0]["visible"], buttons[1]["args"][0]["visible"]
    n = len(doc["data"])
    assert len(vis_ttft) == n and len(vis_tps) == n and "shapes" not in buttons[1]["args"][1]
    wf = [i for i, t in enumerate(doc["data"]) if t.get("name") in ("TTFT p95", "throughput")]
    assert len(wf) == 2 and vis_ttft[wf[0]] and not vis_ttft[wf[1]] and vis_tps[wf[1]] and not vis_tps[wf[0]]
    assert idx[:2] == wf
    assert [t.get("visible", True) for t in (doc["data"][wf[0]], doc["data"][wf[1]])] == [True, False]
    assert buttons[1]["args"][1]["yaxis.title.text"] == "throughput (tokens/s)"
    bands = doc["data"][wf[1] - 1]                                              # the noise floor, behind the bars
    assert bands["name"] == "noise floor" and [round(b, 3) for b in bands["base"]] == [95.0, 142.5]
    assert vis_tps[wf[1] - 1] and not vis_ttft[wf[1] - 1]
    assert layout["xaxis"]["categoryarray"][0] == "baseline"                     # the steps in order


def test_short_names_keep_stack_steps_apart():
    assert short_name("stack: paged + prefix_cache + quant") == "stack step 3: +quant"
    assert short_name("+paged") == "+paged"


class _Results(AblationResults):
    """An ablation's results, filled in by hand as runs finish."""

    def __init__(self, names):
        self.cfg = E2EConfig.preset("tiny")
        self.noise = 0.05
        self.configs = [Config(n, "baseline" if n == "baseline" else "one at a time", (), None, Spec()) for n in names]
        self.stack = [{"step": 0, "layer": "baseline", "config": "baseline", "reason": None},
                      {"step": 1, "layer": "prefix_cache", "config": "+prefix", "reason": None}]
        self.skipped = []


def test_live_view_records_every_run_and_replays_the_rounds():
    ab = _Results(["baseline", "+prefix", "+quant"])
    shown = []
    bar = Progress(1, "runs", display=shown.append)
    live = AblationLive(ab, metric="ttft_ms_p95", repeats=2, show=False)
    live.bar = bar
    bar.total = live.total
    assert live.total == 6
    base = {"baseline": 100.0, "+prefix": 200.0, "+quant": 300.0}
    for r in range(2):
        order = ab.configs if r % 2 == 0 else ab.configs[::-1]
        for i, c in enumerate(order):
            live.started(r, i, c)
            row = {"ttft_ms_p95": base[c.name] + r, "tpot_ms_p50": 10.0, "e2e_ms_p95": 200.0, "tokens_per_s": 50.0}
            c.runs.append(row)
            live.finished(r, c, row)
    assert "round 2/2 · configuration 3/3: baseline" in shown[-2]           # what ran, on the bar
    assert bar.done == 6
    frames = live.recorder.frames
    assert len(frames) == 6 and frames[0].label.startswith("round 1/2 · baseline")
    first, last = frames[0].data, frames[-1].data
    assert first[0]["x"] == [100.0, None, None]                              # only the baseline measured
    assert last[0]["x"] == [100.5, 200.5, 300.5]                               # medians of 2 runs each
    assert last[1]["x"] == [100.0, 101.0, 200.0, 201.0, 300.0, 301.0]          # every run, as dots
    assert last[2] == {"type": "scatter", "x": [101.0], "y": ["baseline"]}    # the run just finished
    # (a frame's trace without a type is a scatter)
    assert [d["type"] for d in last] == ["bar", "scatter", "scatter"]
    assert [f.t_ms for f in frames] == sorted(f.t_ms for f in frames)
    assert "µs a run" in live.cost_text() and "never inside a timed replay" in live.cost_text()
    fig = live.replay()
    assert has_replay(json.loads(fig.to_json())) and len(fig.frames) == 6
    # the table so far and the waterfall so far (a stack step with no run is pending, not "not in the stack")
    table = live.table()
    assert list(table.index) == ["baseline", "+prefix", "+quant"] and table.loc["+quant", "runs"] == "2"
    empty = _Results(["baseline", "+prefix"])
    empty.configs[0].runs.append({"ttft_ms_p95": 100.0})
    pending = AblationLive(empty, show=False)
    assert [s["kind"] for s in pending.waterfall_steps()] == ["start", "pending"]
    page = pending.html()                     # what the live view shows: plain HTML, redrawn in place
    assert "not measured yet" in page and "<script" not in page and "1 of 6 runs" in page


def test_the_live_waterfall_is_plain_html_on_one_scale():
    steps = WATERFALLS["ttft_ms_p95"]
    page = waterfall_html(steps, unit="ms", width_px=480)
    assert page.count("<tr>") == 4 and "<script" not in page
    # 950 ms is 1/1.05 of the width: the baseline's bar; the prefix cache spans 410..950 ms
    assert "left:0px;top:2px;height:14px;width:457px" in page
    assert f"left:{410 / (1.05 * 950) * 480:.0f}px" in page and "410.0 ms (-57 %)" in page
    assert "repeating-linear-gradient" in page.split("+quant w8a8")[1]          # within noise: hatched
    assert "(-26 %, within noise)" in page


def test_readable_tables_have_units_and_no_raw_floats():
    df = pd.DataFrame({"config": ["a", "b"], "ttft_ms_p95": [4691.855592, float("nan")],
                       "kv_bytes": [19709952.0, 2048.0], "rel_ppl": [0.0123, None], "agreement": [0.92083, 1.0],
                       "tokens_per_s": [129.6, 260.2], "meets": [True, False], "runs": [3, 3]}).set_index("config")
    out = readable(df)
    assert list(out.columns) == ["TTFT p95 (ms)", "KV held", "perplexity change", "greedy agreement", "tokens/s",
                                 "meets", "runs"]
    assert out.loc["a"].tolist() == ["4,691.9", "18.8 MiB", "+1.23 %", "92.1 %", "130", "yes", "3"]
    assert out.loc["b"].tolist() == ["—", "2.00 KiB", "—", "100.0 %", "260", "no", "3"]
    assert fmt_bytes(3 * 2**30) == "3.00 GiB" and fmt_bytes(None) == "—" and fmt_bytes(512) == "512 B"
    steps = readable(pd.DataFrame({"value": [800.04], "delta": [-120.0], "rel": [-0.15]}), unit="ms")
    assert steps.iloc[0].tolist() == ["800.0", "-120.0", "-15.00 %"] and "median (ms)" in steps.columns


def test_follow_drives_a_progress_bar():
    shown = []
    bar = Progress(1, "configurations built", display=shown.append)
    step = follow(bar)
    step(0, 4, "baseline")
    step(2, 4, "+paged")
    assert bar.total == 4 and bar.done == 2 and "configurations built 3/4: +paged" in bar.text()
    step(4, 4, "")
    assert bar.done == 4 and "4/4 done" in bar.text()


def test_run_calls_started_before_each_run_and_progress_after_it(monkeypatch):
    from workbench.bench.end_to_end import Ablation

    ab = Ablation.__new__(Ablation)
    ab.cfg = E2EConfig.preset("tiny")
    ab.configs = [Config(n, "one at a time", (), None, Spec()) for n in ("baseline", "+a", "+b")]
    ab.skipped = []

    class _Workload:
        def trace(self, priorities):
            return priorities

    ab.workload = _Workload()
    monkeypatch.setattr(ab, "_run_once", lambda c, trace: ({"ttft_ms_p95": 1.0}, []), raising=False)
    calls = []
    ab.run(repeats=2, progress=lambda r, c, row: calls.append(("done", r, c.name)),
           started=lambda r, i, c: calls.append(("start", r, i, c.name)))
    assert calls[:2] == [("start", 0, 0, "baseline"), ("done", 0, "baseline")]
    assert [x[3] for x in calls if x[0] == "start" and x[1] == 1] == ["+b", "+a", "baseline"]   # reversed
    assert [x[2] for x in calls if x[0] == "start" and x[1] == 1] == [0, 1, 2]
    assert all(len(c.runs) == 2 for c in ab.configs)


def test_run_claims_reports_each_claim_to_a_callable(monkeypatch):
    from workbench.bench.claims import core

    class _Ctx:
        closed = False

        def close(self):
            self.closed = True

    monkeypatch.setattr(core, "measure_claim", lambda claim, ctx: claim.id)
    ids = [c.id for c in core.all_claims()[:2]]
    seen = []
    ctx = _Ctx()
    out = core.run_claims(ids, ctx=ctx, progress=lambda k, n, cid: seen.append((k, n, cid)))
    assert out == ids and ctx.closed
    assert seen == [(0, 2, ids[0]), (1, 2, ids[1]), (2, 2, "")]


def test_the_breakdown_reports_each_profiled_replay(monkeypatch):
    from workbench.bench import e2e_breakdown, e2e_measure

    ab = _Results(["baseline", "+prefix"])

    class _Workload:
        def trace(self, priorities):
            return priorities

    class _Front:
        engine = object()
        model = None

    ab.workload = _Workload()
    for c in ab.configs:
        c.front = _Front()
    ab._llm = lambda spec, net=None: _Front()
    monkeypatch.setattr(e2e_breakdown, "timer_cost_ms", lambda: 0.0)
    monkeypatch.setattr(e2e_breakdown, "profiled_replay", lambda engine, trace, per_op: {"wall_ms": 1.0})
    monkeypatch.setattr(e2e_measure, "close_engine", lambda engine: None)
    seen = []
    df = e2e_breakdown.breakdown(ab, ["baseline", "+prefix"], progress=lambda k, n, name: seen.append((k, n, name)))
    assert list(df.index) == ["baseline", "+prefix"] and (df["wall_ms"] == 1.0).all()
    assert seen == [(0, 2, "baseline"), (1, 2, "+prefix"), (2, 2, "")]
