"""Notebook 04's replays and controls, checked as data (no browser): the load dashboard records a
frame per redraw with or without a view and replays them (frames grow, the first differs from the
last, the whole run drawn faintly behind); its light live view (``live="svg"``) is HTML replaced in
place and ends as the replay; the scheduler replay steps through an engine's steps (batch, queue,
preemptions); the window x rate picker switches which point's traces are visible; the tables
read as text with units; the ramp gives each run a view and a progress bar."""

from __future__ import annotations

import json
import math

import pandas as pd
import pytest

pytest.importorskip("plotly")

from workbench.bench import sched_experiments as sx  # noqa: E402
from workbench.errors import ConfigError  # noqa: E402
from workbench.lab import load_views as lv  # noqa: E402
from workbench.lab import sched_lab  # noqa: E402
from workbench.lab import sched_timeline as st  # noqa: E402
from workbench.lab.replay import has_replay  # noqa: E402
from workbench.load import RequestRecord  # noqa: E402


def _rec(i: int, t: float, ttft: float = 0.05) -> RequestRecord:
    return RequestRecord(id=i, stage=0, stage_name="s", priority=0, scheduled=t - ttft, sent=t - ttft,
                         token_times=[t - 0.02, t - 0.01, t], end=t, status="ok")


def _fed(live, n: int = 30, **kw) -> lv.LatencyDashboard:
    """A dashboard fed ``n`` samples 0.4 s apart (one finished request each), latency growing."""
    now = [0.0]
    dash = lv.LatencyDashboard(live=live, clock=lambda: now[0], title="ramp", **kw)
    for i in range(n):
        now[0] = t = 0.4 * (i + 1)
        dash.status = {"elapsed": t, "stage": "warm" if i < n // 2 else "peak", "target": 5.0, "mode": "poisson",
                       "sent": i + 1, "ok": i, "error": 0, "rejected": 0, "cancelled": 0, "in_flight": 1}
        dash.events += 1
        dash.update(t=t, record=_rec(i, t, ttft=0.01 * (i + 1)), in_flight=1 + i % 3, rejected=0,
                    metrics={"queue_len": i % 4, "running": 2, "kv_usage": 0.1 + 0.01 * i})
    return dash


def _frame_y(frame: dict, trace: int) -> list:
    return list(frame["data"][trace].get("y") or [])


# ---- the load dashboard: recording and replay ---------------------------------------------------------------
def test_dashboard_without_a_view_records_a_frame_per_sample_and_replays_them():
    dash = _fed(False, n=30)
    assert dash.fig is None and dash.widget is None                       # no widget in a batch run
    assert len(dash.recorder.frames) == 30 == len(dash.data["t"])
    fig = dash.replay()
    j = json.loads(fig.to_json())
    assert has_replay(j) and len(j["frames"]) == 30
    p95 = [k for k, *_ in lv.TRACES].index("ttft_p95")
    lens = [len(_frame_y(f, p95)) for f in j["frames"]]
    assert lens == sorted(lens) and lens[0] < lens[-1] == 30               # each frame draws the run so far
    assert _frame_y(j["frames"][0], p95) != _frame_y(j["frames"][-1], p95)
    # every trace's x is the whole run's: a frame sends y only
    assert all("x" not in d for d in j["frames"][5]["data"])
    # the status at each frame is its title, and its slider label says the stage
    titles = [f["layout"]["title"]["text"] for f in j["frames"]]
    assert "stage warm" in titles[0] and "stage peak" in titles[-1] and len(set(titles)) == 30
    steps = j["layout"]["sliders"][0]["steps"]
    assert "stage warm" in steps[0]["label"] and steps[-1]["label"].startswith("12,000.0 ms")
    # the whole run drawn faintly behind the played traces (not in the frames)
    ghosts = [t for t in j["data"] if str(t.get("name", "")).endswith("(whole run)")]
    assert ghosts and all(t["opacity"] == 0.25 and t.get("showlegend") is False for t in ghosts)
    assert len(j["frames"][0]["data"]) == len(lv.TRACES) < len(j["data"])
    # fixed axes: the scale does not jump while it plays
    assert j["layout"]["xaxis"]["range"][1] >= 12.0 and j["layout"]["yaxis"]["autorange"] is False


def test_a_series_that_has_no_value_yet_is_sent_empty_not_left_out():
    """An empty dict in a frame keeps whatever a later frame drew; scrubbing back must clear it."""
    dash = _fed(False, n=3)
    thr = [k for k, *_ in lv.TRACES].index("threshold")                   # no guard: never a threshold
    assert all(f.data[thr] == {"y": []} for f in dash.recorder.frames)


def test_replay_keeps_at_most_max_frames_first_and_last_kept():
    dash = _fed(False, n=50, max_frames=12)
    j = json.loads(dash.replay().to_json())
    assert len(j["frames"]) == 12
    assert j["layout"]["sliders"][0]["steps"][0]["label"].startswith("400.0 ms")
    assert j["layout"]["sliders"][0]["steps"][-1]["label"].startswith("20,000.0 ms")


def test_recording_cost_is_measured_and_said_per_frame_and_per_event():
    dash = _fed(False, n=10)
    assert dash.record_seconds > 0 and dash.events == 10
    text = dash.record_cost_text()
    assert "10 frames" in text and "µs a frame" in text and "per event observed (10 " in text


def test_redraws_send_at_most_max_points_the_newest_at_full_resolution():
    dash = _fed(False, n=40, max_points=10)
    idx = dash._shown_index()
    assert len(idx) == 10 and idx[0] == 0 and idx[-5:] == [35, 36, 37, 38, 39]
    assert idx == sorted(set(idx))
    with pytest.raises(ConfigError):
        lv.LatencyDashboard(live=False, max_points=1)
    with pytest.raises(ConfigError):
        lv.LatencyDashboard(live="widget")


def test_default_pace_is_a_few_redraws_a_second():
    now = [0.0]
    dash = lv.LatencyDashboard(live=False, clock=lambda: now[0])
    for i in range(1000):                        # 10 s of events, a hundred a second
        now[0] = i * 0.01
        dash.update(t=now[0])
    assert lv.MAX_HZ <= 4 and 10 * lv.MAX_HZ - 2 <= len(dash.data["t"]) <= 10 * lv.MAX_HZ + 2


# ---- the light live view --------------------------------------------------------------------------------------
class _Handle:
    def __init__(self):
        self.shown = []

    def update(self, obj, raw=False):
        self.shown.append((obj, raw) if raw else obj)


def test_svg_view_is_html_replaced_in_place_then_the_replay(monkeypatch):
    import IPython.display as ipd

    handle = _Handle()
    monkeypatch.setattr(ipd, "display", lambda obj, display_id=False: handle.shown.append(obj) or handle)
    now = [0.0]
    dash = lv.LatencyDashboard(live="svg", clock=lambda: now[0], name="load-dashboard", title="ramp").display()
    assert dash.widget is None and dash._handle is handle
    first = handle.shown[0].data
    assert 'class="wb-live wb-live-load-dashboard wb-live-svg"' in first and "<svg" in first
    for i in range(6):
        now[0] = t = 0.5 * (i + 1)
        dash.status = {"elapsed": t, "stage": "peak", "target": 9.0, "mode": "poisson", "sent": i, "ok": i,
                       "error": 0, "rejected": 0, "cancelled": 0, "in_flight": 2}
        dash.update(t=t, record=_rec(i, t), in_flight=2, rejected=0)
    html = [h.data for h in handle.shown]
    assert len(html) == 7 and dash.redraws == 6 and len(set(html)) == 7     # each redraw a new picture
    assert html[-1].count("<polyline") >= 6 and "3.0 s" in html[-1]          # the status line says the time
    fig = dash.finish(show=True)
    bundle, raw = handle.shown[-1]                     # the live view's output became the replay, in place
    assert raw and has_replay(bundle["application/vnd.plotly.v1+json"]) and has_replay(json.loads(fig.to_json()))


def test_svg_of_an_empty_dashboard_draws_axes_only():
    html = lv.svg_dashboard_html({k: [] for k in lv.SERIES}, 10.0, "t", ["waiting", ""])
    assert "<svg" in html and "<polyline" not in html and "seconds since the start" in html
    assert lv._nice_step(7.3, 4) == 2 and lv._nice_step(0, 4) == 1.0 and lv._nice_step(230, 3) == 100


# ---- the scheduler replay ---------------------------------------------------------------------------------------
def _steps(n_requests: int = 6, preempt_at: int | None = 4) -> pd.DataFrame:
    """Request i arrives at step i (an 8-token prefill), then decodes two steps; idle steps between."""
    rows, step = [], 0
    for s in range(n_requests + 2):
        ids = [i for i in range(max(0, s - 2), min(s + 1, n_requests))]
        prefill = [i == s for i in ids]
        rows.append(dict(step=step, start=0.01 * step, schedule_s=1e-4, model_s=0.01, post_s=1e-4,
                         num_seqs=len(ids), prefill_tokens=8 * sum(prefill), decode_tokens=len(ids) - sum(prefill),
                         running=len(ids), waiting=max(0, 2 - s % 3), swapped=0, kv_used_blocks=len(ids),
                         preempted=1 if s == preempt_at else 0, request_ids=tuple(f"req-{i}" for i in ids),
                         request_tokens=tuple(8 if p else 1 for p in prefill), request_prefill=tuple(prefill)))
        step += 1
        for _ in range(3):                       # idle steps: the queue unchanged, then changed once
            rows.append(dict(rows[-1], step=step, num_seqs=0, prefill_tokens=0, decode_tokens=0, preempted=0,
                             request_ids=(), request_tokens=(), request_prefill=()))
            step += 1
        rows[-1]["waiting"] = 7
    return pd.DataFrame(rows)


def test_busy_steps_keep_work_and_queue_changes_only():
    f = _steps()
    busy = sx.busy_steps(f)
    assert (busy["num_seqs"] > 0).sum() == (f["num_seqs"] > 0).sum()
    idle = busy[busy["num_seqs"] == 0]
    assert len(idle) == (f["num_seqs"] > 0).sum()        # per busy step, the one idle step that changed the queue
    assert (idle["waiting"] == 7).all() and list(busy.index) == list(range(len(busy)))
    assert len(sx.busy_steps(f.iloc[:0])) == 0


def test_scheduler_replay_steps_through_batch_queue_and_preemptions():
    fig = st.scheduler_replay(_steps(), "t")
    j = json.loads(fig.to_json())
    assert has_replay(j)
    frames = j["frames"]
    names = [t.get("name") for t in j["data"]]
    pre, dec = names.index("prefilling"), names.index("decoding")       # the played batch (the key comes later)
    assert names.index("preempted") < pre
    first, last = frames[0]["data"], frames[-1]["data"]
    assert first[pre]["y"] == ["req-0"] and first[pre]["customdata"] == [8]   # step 0: req-0 prefills 8 tokens
    assert first[dec] != last[dec] or first[pre] != last[pre]                 # scrubbing changes the batch shown
    assert first[0]["type"] == "bar" and len(first[0]["y"]) < len(last[0]["y"])   # tokens drawn up to the step
    # the preemption shows from its step on, with the count so far in the label
    preempted = names.index("preempted")
    assert frames[0]["data"][preempted]["x"] == [] and last[preempted]["x"] != []
    labels = [s["label"] for s in j["layout"]["sliders"][0]["steps"]]
    assert "1 preempted so far" in labels[-1] and "1 preempted" not in labels[0]
    assert labels[0].startswith("0.0 ms · step 0: 1 in the batch (1 prefilling, 0 decoding)")
    # a cursor at the step shown, and the title says the step
    assert frames[3]["layout"]["shapes"][0]["x0"] != frames[0]["layout"]["shapes"][0]["x0"]
    assert "step" in frames[-1]["layout"]["title"]["text"]
    # a colour key that stays: legend entries that are never empty
    keys = [t for t in j["data"] if t.get("legend") == "legend3"]
    assert {t["name"] for t in keys} == {"prefilling", "decoding"}


def test_scheduler_replay_rejects_frames_without_steps():
    with pytest.raises(ConfigError, match="missing"):
        st.scheduler_replay(pd.DataFrame({"step": [0]}))
    with pytest.raises(ConfigError, match="no steps"):
        st.scheduler_replay(_steps().iloc[:0])


# ---- the window x rate picker -----------------------------------------------------------------------------------
def _points():
    return [dict(window_ms=w, rate=r, ttft_ms_p95=100 + w + r, queue_ms_p95=50 + w, mean_batch=2.0 + w / 100,
                 steps=8, steps_frame=_steps(4 + k % 2, preempt_at=None))
            for k, (w, r) in enumerate([(0.0, 5.0), (20.0, 5.0), (0.0, 10.0), (20.0, 10.0)])]


def test_sweep_picker_shows_one_point_at_a_time_and_every_point_is_in_the_figure():
    pts = _points()
    fig = sched_lab.sweep_picker_figure(pts)
    j = json.loads(fig.to_json())
    menu = j["layout"]["updatemenus"][0]
    assert menu["type"] == "dropdown" and len(menu["buttons"]) == 4
    assert [b["label"] for b in menu["buttons"]][1] == "window 20 ms at 5 req/s"
    n = len(j["data"])
    vis = [b["args"][0]["visible"] for b in menu["buttons"]]
    assert all(len(v) == n for v in vis)
    always = [all(v[i] for v in vis) for i in range(n)]
    own = [[i for i in range(n) if v[i] and not always[i]] for v in vis]
    assert all(len(o) == len(own[0]) > 0 for o in own)                      # each point: the same number of traces
    assert len({tuple(o) for o in own}) == 4 and not set(own[0]) & set(own[1])   # and its own
    # the figure as it opens shows the first point's traces only
    assert [j["data"][i].get("visible", True) is not False for i in range(n)] == vis[0]
    titles = [b["args"][1]["title.text"] for b in menu["buttons"]]
    assert len(set(titles)) == 4 and "TTFT P95 125.0 ms" in titles[1]
    # the picked point is ringed on the sweep row
    ring = [i for i in own[1] if j["data"][i].get("x") == [20.0]]
    assert ring and j["data"][ring[0]]["y"] == [125.0]
    with pytest.raises(ConfigError):
        sched_lab.sweep_picker_figure([])


# ---- tables ---------------------------------------------------------------------------------------------------
def test_tables_have_units_rounding_and_no_nan():
    df = pd.DataFrame({"ttft_ms_p95": [4691.855592, math.nan], "steps": [74.0, 81.0], "mean_batch": [3.8912, 2.0],
                       "other": [1, 2]}, index=pd.Index([True, False], name="chunked_prefill"))
    t = sched_lab.readable(df, sched_lab.TRACE_COLUMNS, index={"chunked_prefill": "chunked prefill"})
    assert list(t.columns) == ["TTFT P95 (ms)", "mean batch (sequences)", "steps"] or \
        list(t.columns) == ["TTFT P95 (ms)", "steps", "mean batch (sequences)"]
    assert t["TTFT P95 (ms)"].tolist() == ["4,691.9", "—"] and t["steps"].tolist() == ["74", "81"]
    assert t["mean batch (sequences)"].tolist() == ["3.89", "2.00"]
    assert list(t.index) == ["yes", "no"] and t.index.name == "chunked prefill"
    m = sched_lab.metrics_table({"ratio": 2.243731, "tok_s": 257.349746, "ok": True, "n": 3, "nan": math.nan})
    assert m["value"].tolist() == ["2.244", "257.3", "yes", "3", "—"]


# ---- the ramp: a view per run, progress -------------------------------------------------------------------------
class _Bar:
    def __init__(self):
        self.said = []

    def start(self, name):
        self.said.append(("start", name))

    def note(self, text):
        pass

    def advance(self, n=1):
        self.said.append(("advance", n))


def test_each_ramp_gets_a_view_finished_when_its_run_ends(random_llm):
    seen = []

    class View:
        def __init__(self, guard):
            self.guard, self.finished = guard, False

        def finish(self):
            self.finished = True

    def watch(run, target, guard):
        seen.append(run.config.name)
        return View(guard)

    bar = _Bar()
    warm, _, stages = sx.ramp_stages(8.0, durations=(0.3, 0.1, 0.3, 0.1))
    ramp = sx.load_ramp(random_llm, stages, warm, max_tokens=2, guard_config={"min_samples": 4, "window": 8},
                        watch=watch, progress=bar)
    assert seen == ["no guard", "SLO guard"]
    views = ramp["views"]
    assert views["no guard"].guard is None and views["SLO guard"].guard is ramp["guard"]
    assert all(v.finished for v in views.values()) and ramp["dashboard"] is views["SLO guard"]
    assert bar.said == [("start", "no guard"), ("advance", 1), ("start", "SLO guard"), ("advance", 1)]


def test_load_ramp_in_a_batch_run_replays_both_runs(random_llm):
    warm, _, stages = sx.ramp_stages(8.0, durations=(0.3, 0.1, 0.3, 0.1))
    ramp = sched_lab.load_ramp(random_llm, stages, warm, max_tokens=2, live=False, progress=False,
                               guard_config={"min_samples": 4, "window": 8})
    assert set(ramp["replays"]) == {"no guard", "SLO guard"}
    for name, fig in ramp["replays"].items():
        j = json.loads(fig.to_json())
        assert has_replay(j) and sched_lab.RAMP_TITLES[name] in j["layout"]["title"]["text"]
        assert "µs a frame" in ramp["record_cost"][name]
    assert ramp["views"]["no guard"].widget is None                       # live=False: no widget made


def test_window_rate_sweep_names_each_point_and_keeps_busy_steps(random_llm):
    from workbench.bench.sched import SchedBenchConfig

    cfg = SchedBenchConfig(streams=1, prompt_tokens=8, max_tokens=2, rounds=1, rate=200.0, trace_requests=2,
                           long_prompt_tokens=16, long_every=2, token_budget=32, windows_ms=(0.0,))
    bar = _Bar()
    rows = sx.window_rate_sweep(random_llm, cfg, (5.0,), (200.0, 400.0), progress=bar)
    assert [(r["window_ms"], r["rate"]) for r in rows] == [(5.0, 200.0), (5.0, 400.0)]
    assert bar.said == [("start", "window 5 ms at 200 req/s"), ("advance", 1), ("start", "window 5 ms at 400 req/s"),
                        ("advance", 1)]
    for r in rows:
        f = r["steps_frame"]
        assert len(f) and ((f["num_seqs"] > 0) | f["waiting"].ne(f["waiting"].shift())).all()
    fig = sched_lab.sweep_picker_figure(rows)
    assert len(fig.layout.updatemenus[0].buttons) == 2
