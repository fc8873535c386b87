"""Live and static views built from a real short run of the batched engine (bundled model, CPU),
headless (no display, as under papermill): the scheduler timeline's traces carry the engine's
per-step numbers, and the latency dashboard updates while the load runs."""

from __future__ import annotations

import json
import threading

import pytest

pytest.importorskip("plotly")
pytest.importorskip("ipywidgets")

from workbench.errors import ConfigError  # noqa: E402
from workbench.lab.load_views import TRACES, LatencyDashboard  # noqa: E402
from workbench.lab.sched_timeline import scheduler_timeline  # noqa: E402
from workbench.load import EngineTarget, LoadConfig, LoadRun, RequestRecord  # noqa: E402


@pytest.fixture(scope="module")
def live_run():
    """One short constant-rate run with a dashboard attached; returns (target, result, dashboard,
    what the dashboard held at each tick while the run was going, what the engine hold saw).

    Whether a timer poll of the engine's metrics happens to fall on a step that holds KV blocks
    is chance (a small model on CPU finishes a 5-token request in a few ms).  So the engine
    thread is held, once, right after the first step that leaves requests running with KV blocks
    in use (its ``on_step`` hook), until the dashboard has drawn a sample with that KV usage: the
    dashboard's poller and redraws run on as usual, only the engine waits."""
    from workbench.sched import SchedulerConfig

    target = EngineTarget.from_model(None, device="cpu", scheduler=SchedulerConfig(max_num_seqs=4,
                                                                                    max_num_batched_tokens=64),
                                     temperature=0.0)
    cfg = LoadConfig(mode="constant", stages=[(0.6, 10), (0.6, 10)], max_tokens=5, num_prompts=8,
                     max_duration_s=30, tick_s=0.1)
    run = LoadRun(target, cfg)
    dash = LatencyDashboard(window_s=5.0, max_hz=10, metrics_hz=10).attach(run)
    seen = []
    drawn = threading.Event()          # the dashboard has drawn a sample with KV usage > 0

    def observe(r, rec):               # called after the dashboard's own observer
        seen.append((r.done, dash.redraws, len(dash.data["t"])))
        if (dash.data["kv_usage"][-1:] or [None])[0]:
            drawn.set()

    hold = {}

    def hold_one_busy_step(stats):     # the engine thread, after each step
        last = target.engine.step_records[-1]
        if not hold and stats["kv_usage"] > 0 and stats["running"] > 0 and last.num_seqs > 0:
            hold["stats"] = stats
            hold["drawn"] = drawn.wait(60)

    run.add_observer(observe)
    target.aengine.on_step = hold_one_busy_step
    try:
        res = run.run()
    finally:
        target.aengine.on_step = None
    yield target, res, dash, seen, hold
    target.close()


def test_scheduler_timeline_traces_carry_the_engine_steps(live_run):
    target, res, *_ = live_run
    frame = target.engine.steps_frame()
    frame = frame[frame["num_seqs"] > 0]
    assert len(frame) >= 5 and frame["prefill_tokens"].sum() > 0 and frame["decode_tokens"].sum() > 0
    fig = scheduler_timeline(frame)
    tr = {t.name: t for t in fig.data}
    assert list(tr) == ["prefill tokens", "decode tokens", "scheduler", "model", "after sampling", "prefilling",
                        "decoding"]
    assert sum(tr["prefill tokens"].y) == frame["prefill_tokens"].sum()
    assert sum(tr["decode tokens"].y) == frame["decode_tokens"].sum()
    assert list(tr["prefill tokens"].x) == frame["step"].tolist()
    for name, col in (("scheduler", "schedule_s"), ("model", "model_s"), ("after sampling", "post_s")):
        assert sum(tr[name].y) == pytest.approx(frame[col].sum() * 1e3)
    # which requests: one marker per (step, request), every request of the run appears
    cells = [t for t in fig.data if t.name in ("prefilling", "decoding")]
    assert sum(len(t.x) for t in cells) == frame["num_seqs"].sum()
    assert len({y for t in cells for y in t.y}) == len(res.records)
    assert fig.layout.barmode == "stack" and f"{len(frame)} steps" in fig.layout.title.subtitle.text
    json.loads(fig.to_json())                                  # builds and serialises without a display


def test_steps_frame_splits_each_step_per_request(live_run):
    """request_tokens: the tokens each request of the step computed; they add up to the step's
    prefill + decode tokens, and the timeline's per-request markers carry exactly them."""
    target, *_ = live_run
    frame = target.engine.steps_frame()
    assert {"request_ids", "request_tokens", "request_prefill"} <= set(frame.columns)
    for r in frame.itertuples():
        assert len(r.request_tokens) == len(r.request_ids) == len(r.request_prefill) == r.num_seqs
        assert sum(r.request_tokens) == r.prefill_tokens + r.decode_tokens
        assert sum(n for n, p in zip(r.request_tokens, r.request_prefill) if p) == r.prefill_tokens
        assert all(n >= 1 for n in r.request_tokens)
        if r.preempted == 0:
            assert all(n == 1 for n, p in zip(r.request_tokens, r.request_prefill) if not p)
    assert frame["prefill_tokens"].sum() > 0 and frame["decode_tokens"].sum() > 0
    expected = sorted((r.step, str(rid), n, p) for r in frame.itertuples()
                      for rid, n, p in zip(r.request_ids, r.request_tokens, r.request_prefill))
    fig = scheduler_timeline(frame)
    tr = {t.name: t for t in fig.data}
    got = sorted((int(x), y, int(n), name == "prefilling") for name in ("prefilling", "decoding")
                 for x, y, n in zip(tr[name].x, tr[name].y, tr[name].customdata))
    assert got == expected
    assert tr["prefilling"].marker.color == fig.data[0].marker.color       # coloured as the token bars
    assert tr["decoding"].marker.color == fig.data[1].marker.color
    assert "tokens" in tr["prefilling"].hovertemplate and "(P " in fig.data[0].hovertext[0]
    # without request_prefill, a request computing more than one token counts as prefilling
    only_tokens = scheduler_timeline(frame.drop(columns=["request_prefill"]))
    t2 = {t.name: t for t in only_tokens.data}
    assert all(n > 1 for n in t2["prefilling"].customdata) and all(n == 1 for n in t2["decoding"].customdata)
    assert len(t2["prefilling"].x) + len(t2["decoding"].x) == frame["num_seqs"].sum()
    # a frame from before the split: one "in batch" trace, as before
    old = scheduler_timeline(frame.drop(columns=["request_tokens", "request_prefill"]))
    names = [t.name for t in old.data]
    assert names[5:] == ["in batch"] and len(old.data[5].x) == frame["num_seqs"].sum()
    # rows without the split (concatenated with an older frame) fall back to "in batch" row by row
    mixed = frame.copy()
    row = mixed.index[mixed["num_seqs"] > 0][0]
    mixed.loc[row, "request_tokens"] = None
    t3 = {t.name: t for t in scheduler_timeline(mixed).data}
    assert len(t3["in batch"].x) == frame.loc[row, "num_seqs"]
    assert sum(len(t3[k].x) for k in ("prefilling", "decoding", "in batch")) == frame["num_seqs"].sum()
    json.loads(fig.to_json())


def test_scheduler_timeline_on_a_time_axis_and_truncated_requests(live_run):
    target, *_ = live_run
    frame = target.engine.steps_frame()
    fig = scheduler_timeline(frame, x="time", max_requests=2)
    bars = fig.data[0]
    dur = (frame["schedule_s"] + frame["model_s"] + frame["post_s"]).to_numpy()
    assert list(bars.width) == pytest.approx(list(dur))
    assert bars.x[0] == pytest.approx(dur[0] / 2) and all(b >= a for a, b in zip(bars.x, bars.x[1:]))
    shown = {y for t in fig.data[5:] for y in t.y}
    assert len(shown) == 2 and "more not shown" in fig.layout.annotations[2].text
    with pytest.raises(ConfigError, match="prefill_tokens"):
        scheduler_timeline(frame.drop(columns=["prefill_tokens"]))
    with pytest.raises(ConfigError, match="no steps"):
        scheduler_timeline(frame.iloc[:0])
    import pandas as pd
    with pytest.raises(ConfigError, match="no steps"):
        scheduler_timeline(pd.DataFrame([]))                  # steps_frame() of an engine that never stepped
    with pytest.raises(ConfigError, match="'step' or 'time'"):
        scheduler_timeline(frame, x="seconds")


def test_dashboard_updated_while_the_run_went_and_reads_engine_metrics(live_run):
    target, res, dash, seen, hold = live_run
    during = [(redraws, n) for done, redraws, n in seen if not done]
    assert len(during) >= 5
    assert during[-1][0] > during[0][0] >= 0                  # redrawn while requests were still coming
    assert during[-1][1] >= 3
    d = dash.data
    assert len(d["t"]) == dash.redraws and d["t"] == sorted(d["t"])
    assert max(v for v in d["ttft_p95"] if v is not None) > 0
    assert max(v for v in d["itl_p50"] if v is not None) > 0
    # engine metrics polled from EngineTarget.metrics (attach found them on the target)
    assert dash.metrics_fn == target.metrics and dash._poller is None
    assert any(v is not None for v in d["queue_len"]) and max(v or 0 for v in d["batch_size"]) >= 1
    # the engine was held at a step with KV blocks in use until a drawn sample showed them
    assert hold.get("drawn") is True, hold
    assert max(v or 0 for v in d["kv_usage"]) > 0
    assert hold["stats"]["kv_usage"] * 100 in d["kv_usage"]       # the engine's own number, as a percent
    assert f"ok {sum(r.status == 'ok' for r in res.records)}" in dash.label.value
    keys = [k for k, *_ in TRACES]                     # the dashboard's traces, in this order
    assert type(dash.fig).__name__ == "FigureWidget"
    assert list(dash.fig.data[keys.index("ttft_p95")].y) == d["ttft_p95"]
    static = dash.static_figure()
    assert type(static).__name__ == "Figure" and list(static.data[keys.index("itl_p99")].y) == d["itl_p99"]


def _rec(i: int, sent: float, token_times: list[float]) -> RequestRecord:
    r = RequestRecord(id=i, stage=0, stage_name="s", priority=0, scheduled=sent, sent=sent,
                      token_times=token_times, end=token_times[-1], status="ok")
    return r


def test_dashboard_percentiles_over_its_window_on_known_records():
    dash = LatencyDashboard(window_s=1.0, max_hz=10)
    # TTFTs 10, 20, 30, 40 ms; gaps 1 ms (x3) and 9 ms (x1)
    recs = [_rec(0, 0.0, [0.010, 0.011, 0.012]), _rec(1, 0.0, [0.020, 0.021]), _rec(2, 0.0, [0.030, 0.039]),
            _rec(3, 0.0, [0.040])]
    for r in recs:
        dash.update(t=0.05, record=r)
    dash.update(t=0.05, force=True)
    d = dash.data
    assert d["ttft_p50"][-1] == pytest.approx(25.0) and d["ttft_p99"][-1] == pytest.approx(39.7)
    assert d["itl_p50"][-1] == pytest.approx(1.0) and d["itl_p99"][-1] == pytest.approx(9.0 - 0.08 * 3, abs=1e-6)
    # two seconds later the window (1 s) holds one new request only
    dash.update(t=2.0, record=_rec(4, 1.9, [1.95, 1.96]), force=True)
    assert d["ttft_p50"][-1] == pytest.approx(50.0) and d["itl_p95"][-1] == pytest.approx(10.0)
    assert d["in_flight"][-1] is None and d["slo_state"][-1] is None
