"""Notebook 01's views (``workbench.lab.kernels_view``): the figures, the roofline's label placement,
the number formats, and the per-op toggle widget (busy state, a fixed reference row, failures
shown in the widget), driven with a fake measurement instead of a model."""

from __future__ import annotations

import itertools

import pandas as pd
import pytest
import torch

from workbench.lab import kernels_view as kl

pytest.importorskip("plotly")

OPS = ("rmsnorm", "rope", "swiglu")


def _row(ms: float, spread: float = 0.1, err: float = 0.0, launches: int = 100, timing: str = "host") -> dict:
    return {"ms_median": ms, "ms_min": ms * (1 - spread), "ms_max": ms * (1 + spread), "max_err": err, "repeats": 5,
            "launches_per_step": launches, "timing": timing, "note": "argmax == first variant's", "status": "ok"}


def _table() -> pd.DataFrame:
    rows = {"eager": _row(10.0), "rmsnorm": _row(300.0, err=3e-6, timing=kl.INTERPRETER_TIMING),
            "all": _row(3000.0, err=2e-6, launches=40, timing=kl.INTERPRETER_TIMING)}
    return pd.DataFrame(list(rows.values()), index=list(rows))


# ---- formats ------------------------------------------------------------------------------------

def test_max_errors_are_never_rounded_to_zero():
    assert kl.fmt_err(4.77e-7) == "4.77e-07" and kl.fmt_err(0.0) == "0" and kl.fmt_err(float("nan")) == "-"
    frame = kl.results_frame({"max_err_rope": 4.8e-7, "decode_max_logit_err_fused": 2.1e-6, "copy_gbps": 2.756983,
                              "cuda_graph_error": None, "launches": 252, "interpreter": True,
                              "decode_ms_graphed": float("nan")})
    v = frame["value"]
    assert v["max_err_rope"] == "4.80e-07" and v["decode_max_logit_err_fused"] == "2.10e-06"
    assert v["copy_gbps"] == "2.757" and v["cuda_graph_error"] == "—" and v["launches"] == "252"
    assert v["interpreter"] == "yes" and v["decode_ms_graphed"] == "—"


def test_fmt_ms_has_no_exponent():
    assert [kl.fmt_ms(v) for v in (3569.3, 16.15, 0.12345, float("nan"))] == ["3,569", "16.1", "0.123", "-"]


# ---- the roofline's labels ---------------------------------------------------------------------

def _boxes(points, labels, positions, x_range, y_range, size=(640, 320)):
    sx, sy = size[0] / (x_range[1] - x_range[0]), size[1] / (y_range[1] - y_range[0])
    return [kl.label_box((x - x_range[0]) * sx, (y - y_range[0]) * sy, p, 6.6 * len(t), 14.0, 6.0)
            for (x, y), t, p in zip(points, labels, positions)]


def test_label_positions_isolated_point_goes_on_top():
    assert kl.label_positions([(0.0, 0.0)], ["rmsnorm"], (-2, 2), (-2, 2)) == ["top center"]


def _markers(points, x_range, y_range, size=(640, 320)):
    sx, sy = size[0] / (x_range[1] - x_range[0]), size[1] / (y_range[1] - y_range[0])
    return [((x - x_range[0]) * sx - 6, (y - y_range[0]) * sy - 6, (x - x_range[0]) * sx + 6,
             (y - y_range[0]) * sy + 6) for x, y in points]


def _total_overlap(points, labels, positions, x_range, y_range):
    boxes, markers = _boxes(points, labels, positions, x_range, y_range), _markers(points, x_range, y_range)
    return (sum(kl._overlap(a, b) for a, b in itertools.combinations(boxes, 2))
            + sum(kl._overlap(b, m) for i, b in enumerate(boxes) for j, m in enumerate(markers) if i != j))


def test_label_positions_separate_coincident_and_nearby_points():
    # the CPU roofline's crowded corner: swiglu eager and triton on one spot, two more points close by
    points = [(-0.3, 6.8), (-0.3, 6.8), (-0.3, 6.4), (-0.5, 6.4)]
    labels = ["swiglu", "swiglu", "rmsnorm", "add_rmsnorm"]
    pos = kl.label_positions(points, labels, (-1.2, 2.6), (4.7, 12.0))
    assert pos[0] != pos[1]
    assert _total_overlap(points, labels, pos, (-1.2, 2.6), (4.7, 12.0)) == 0, pos


def test_label_positions_are_the_least_overlap_when_none_is_free():
    # five labels in a 24 x 11 px blob cannot all be free: the rule finds the least overlap there is
    points = [(0.0, 0.0), (0.0, 0.0), (0.05, 0.1), (-0.05, -0.1), (0.1, 0.0)]
    labels = ["swiglu", "swiglu", "rmsnorm", "add_rmsnorm", "rope"]
    xr, yr, n, k = (-2, 2), (-3, 3), len(points), len(kl._POSITIONS)
    pos = kl.label_positions(points, labels, xr, yr)
    # every combination (8^5), by brute force over precomputed overlaps
    boxes = [_boxes([pt] * k, [t] * k, kl._POSITIONS, xr, yr) for pt, t in zip(points, labels)]
    markers = _markers(points, xr, yr)
    alone = [[sum(kl._overlap(b, m) for j, m in enumerate(markers) if j != i) for b in boxes[i]] for i in range(n)]
    pair = {(i, a, j, b): kl._overlap(boxes[i][a], boxes[j][b])
            for i, j in itertools.combinations(range(n), 2) for a in range(k) for b in range(k)}
    least = min(sum(alone[i][a] for i, a in enumerate(ks))
                + sum(pair[i, ks[i], j, ks[j]] for i, j in itertools.combinations(range(n), 2))
                for ks in itertools.product(range(k), repeat=n))
    assert _total_overlap(points, labels, pos, xr, yr) == pytest.approx(least)
    assert _total_overlap(points, labels, ["top center"] * n, xr, yr) > 10 * least


def test_label_positions_stay_inside_the_plot():
    # a point at the top-right corner: its label goes below and to the left
    pos = kl.label_positions([(2.0, 3.0)], ["paged_decode"], (-2, 2), (-3, 3))
    assert pos == ["bottom left"]


def test_label_positions_keep_off_a_line():
    # a horizontal line just above the point: its label goes below, not across the line
    line = [(x / 10, 0.25) for x in range(-20, 21)]
    assert kl.label_positions([(0.0, 0.0)], ["flash_prefill"], (-2, 2), (-3, 3)) == ["top center"]
    assert kl.label_positions([(0.0, 0.0)], ["flash_prefill"], (-2, 2), (-3, 3), obstacles=line) == ["bottom center"]


def test_label_leaders_share_a_label_within_an_op_column():
    # rmsnorm's three providers close together (a GPU): one label, on the top one; a CPU's interpreter
    # point far below gets its own; another op is never merged in
    ops = ["rmsnorm", "rmsnorm", "rmsnorm", "rmsnorm", "swiglu"]
    ys = [9.0, 9.2, 8.9, 6.0, 9.1]
    assert kl.label_leaders(ops, ys, merge=0.5) == [1, 1, 1, 3, 4]
    assert kl.label_leaders(ops, ys, merge=0.05) == [0, 1, 2, 3, 4]


def test_si_tick_labels():
    assert [kl._si(10.0 ** k) for k in (0, 5, 6, 9, 12, 15)] == ["1", "100k", "1M", "1G", "1T", "1P"]


def test_roofline_figure():
    kdf = pd.DataFrame({"op": ["rmsnorm", "swiglu", "rmsnorm"], "provider": ["eager", "eager", "triton"],
                        "intensity": [0.5, 0.5, 0.5], "flop_per_s": [1e9, 1e9, 1e6],
                        "timing": ["perf_counter", "perf_counter", "triton-interpreter"],
                        "ms_median": [0.1, 0.1, 50.0]})
    roof = kl.roofline_figure(kdf, {"GB/s": 10.0, "TFLOP/s": 0.1}, title="r")
    line = roof.data[0]
    assert all(y == pytest.approx(min(0.1e12, x * 10e9)) for x, y in zip(line.x, line.y))
    assert 0.1e12 / 10e9 in line.x                                   # the ridge point is on the line
    symbols = {t.name: t.marker.symbol for t in roof.data[1:]}
    assert symbols == {"eager": "circle", "triton (interpreter: not a speed)": "circle-open"}
    eager, triton = roof.data[1:]
    # two ops on one spot: both labelled, apart, in the provider's colour; the far interpreter point: its own label
    assert list(eager.text) == ["rmsnorm", "swiglu"] and eager.textposition[0] != eager.textposition[1]
    assert list(eager.textfont.color) == ["#0072B2"] * 2 and list(triton.text) == ["rmsnorm"]
    assert all("customdata" in t.hovertemplate for t in roof.data[1:])
    lo, hi = roof.layout.xaxis.range                                 # log10 units: the points and the ridge inside
    assert lo < -0.3 < 1.0 < hi
    assert "1G" in roof.layout.yaxis.ticktext
    # the same op's providers close together (a GPU) share one grey label
    gpu = kdf.assign(flop_per_s=[1e9, 1e9, 1.1e9], timing="device")
    text = [t for tr in kl.roofline_figure(gpu, {"GB/s": 10.0, "TFLOP/s": 0.1}, title="r").data[1:] for t in tr.text]
    assert sorted(text) == ["", "rmsnorm", "swiglu"]


def test_launch_figure_leaves_room_for_its_labels():
    launches = kl.launch_figure({"eager": 120, "fused": 40}, title="t")
    assert list(launches.data[0].y) == [120, 40, 0] and "CUDA only" in launches.data[0].text[2]
    assert launches.layout.yaxis.range[1] >= 120 * 1.15 and launches.data[0].cliponaxis is False


# ---- the toggle figure ---------------------------------------------------------------------------

def test_toggle_figure():
    df = pd.DataFrame({"ms_median": [2.0, 1.0], "ms_min": [1.5, 0.5], "ms_max": [3.0, 1.25], "max_err": [0.0, 1e-6]},
                      index=["eager", "rmsnorm"])
    fig = kl.toggle_figure(df, interpreter=True)
    assert [list(t.y) for t in fig.data] == [["eager", "rmsnorm"]] * 2 and [len(t.x) for t in fig.data] == [2, 2]
    assert list(fig.data[0].error_x.array) == [1.0, 0.25] and list(fig.data[0].error_x.arrayminus) == [0.5, 0.5]
    assert "interpreter" in fig.layout.title.text and "interpreter" not in kl.toggle_figure(df).layout.title.text
    assert list(fig.data[1].text) == ["0", "1.00e-06"] and fig.data[1].cliponaxis is False
    assert fig.layout.xaxis2.range[1] >= 1.4e-6                       # room for the outside labels
    assert fig.layout.xaxis.type != "log" and fig.layout.yaxis.autorange == "reversed"
    assert list(fig.layout.yaxis.ticktext) == ["eager: 2 ms", "rmsnorm: 1 ms"]      # the medians, where they fit


def test_toggle_figure_log_axis_and_hatching_for_interpreter_rows():
    fig = kl.toggle_figure(_table())
    assert fig.layout.xaxis.type == "log" and "log axis" in fig.layout.annotations[0].text
    assert list(fig.data[0].marker.pattern.shape) == ["", "/", "/"] and "hatched" in fig.layout.title.text
    assert fig.layout.height > kl.toggle_figure(_table().iloc[:1]).layout.height


# ---- the toggle widget ---------------------------------------------------------------------------

class FakeMeasure:
    """Records each call and what the widget showed during it."""

    def __init__(self, view_ref: list, fail: bool = False):
        self.calls, self.seen, self.view_ref, self.fail = [], [], view_ref, fail

    def __call__(self, chosen):
        self.calls.append(list(chosen))
        view = self.view_ref[0]
        if view._ui is not None:
            ui = view._ui
            self.seen.append((ui["button"].disabled, ui["button"].description, ui["status"].value,
                              [b.disabled for b in ui["boxes"].values()]))
        if self.fail:
            raise RuntimeError("triton exploded")
        return _row(50.0 * len(chosen), err=1e-6, timing=kl.INTERPRETER_TIMING)


def _view(fail: bool = False):
    ref: list = []
    fake = FakeMeasure(ref, fail)
    view = kl.KernelToggleView(OPS, _table(), fake, default=("rmsnorm", "swiglu"), interpreter=True)
    ref.append(view)
    return view, fake


def test_choice_names():
    view, _ = _view()
    assert view.choice_name([]) == "eager" and view.choice_name(["swiglu", "rmsnorm"]) == "rmsnorm+swiglu"
    assert view.choice_name(list(OPS)) == "all" and view.choice_name(["rope"]) == "rope"


def test_toggle_view_without_widgets_measures_and_keeps_the_reference():
    view, fake = _view()
    eager = view.rows["eager"].copy()
    row = view.measure()                                              # the default ticks
    assert fake.calls == [["rmsnorm", "swiglu"]] and row["ms_median"] == 100.0
    assert list(view.frame.index) == ["eager", "rmsnorm", "all", "rmsnorm+swiglu"]
    assert "vs eager 10 ms" in view.message and "slower" in view.message and "interpreter" in view.message
    # nothing ticked is the reference row: no measurement, no second eager row, its numbers unchanged
    assert view.measure([]) is view.rows["eager"] and len(fake.calls) == 1
    assert "reference" in view.message and view.rows["eager"].equals(eager)
    assert view.latest == "eager"                                      # shown in bold: the row this press stands for
    assert list(view.frame.index).count("eager") == 1
    # a choice measured again replaces its row
    view.measure(["rmsnorm", "swiglu"])
    assert len(view.frame) == 4 and "replaces the earlier row" in view.message


def test_toggle_view_widget_busy_state_and_classes():
    pytest.importorskip("ipywidgets")
    view, fake = _view()
    box = view.widget
    assert {"wb-live", "wb-live-kernel-toggle"} <= set(box._dom_classes)
    ui = view._ui
    assert "wb-live-kernel-toggle-button" in ui["button"]._dom_classes
    ui["boxes"]["rope"].value = True
    ui["button"].click()                                             # as a press in the browser
    assert fake.calls == [["rmsnorm", "rope", "swiglu"]]
    assert view.choice_name(fake.calls[0]) == "all"
    disabled, description, status, boxes_disabled = fake.seen[0]
    assert disabled and description == "measuring ..." and "Measuring all" in status and all(boxes_disabled)
    assert not ui["button"].disabled and ui["button"].description == "measure"
    assert not any(b.disabled for b in ui["boxes"].values())
    assert "all" in ui["status"].value and "3,000" not in ui["status"].value   # the new row, not the table's
    table = ui["table"].value
    assert "overflow-x:auto" in table and "1.00e-06" in table and "3e-06" not in table   # scientific, 3 digits
    assert "&dagger;" in table and "ranges (5 timed steps per row) overlap" in table


def test_toggle_view_shows_a_failure_and_keeps_working():
    pytest.importorskip("ipywidgets")
    view, fake = _view(fail=True)
    assert view.widget is not None
    assert view.measure(["rope"]) is None
    assert view.error == "RuntimeError: triton exploded" and "triton exploded" in view._ui["status"].value
    assert "traceback" in view._ui["status"].value and not view._ui["button"].disabled
    assert list(view.frame.index) == ["eager", "rmsnorm", "all"]
    fake.fail = False
    assert view.measure(["rope"]) is not None and view.error is None and "rope" in view.frame.index


def test_toggle_view_live_figure_follows_the_rows():
    pytest.importorskip("ipywidgets")
    pytest.importorskip("anywidget")
    view, _ = _view()
    children = view.widget.children
    fig = view._ui["fig"]
    assert fig is not None, view.figure_error
    assert fig in children
    assert list(fig.data[0].y) == ["eager", "rmsnorm", "all"]
    view.measure(["rope", "swiglu"])
    assert list(fig.data[0].y) == ["eager", "rmsnorm", "all", "rope+swiglu"]
    assert fig.layout.yaxis.ticktext[-1] == "rope+swiglu: 100 ms"
    if hasattr(fig, "_widget_data"):                                  # the whole state stored, not only the delta
        assert list(fig._widget_data[0]["y"]) == ["eager", "rmsnorm", "all", "rope+swiglu"]
    assert fig.layout.height == view.static_figure().layout.height


def test_unknown_reference_is_refused():
    with pytest.raises(ValueError, match="reference"):
        kl.KernelToggleView(OPS, _table().drop(index="eager"), lambda chosen: {})


# ---- measure_op and kernel_source (moved here from test_notebook_logic.py) ------------------------

def test_measure_op_eager_rows_and_kernel_source():
    import workbench_kernels.rmsnorm as kr

    from workbench.bench import kernels as kb

    dev = torch.device("cpu")
    sizes = kb.resolve_sizes(kb.KernelBenchConfig(size="small"), dev)
    df = kl.measure_op("rmsnorm", sizes, dev, torch.float32, {"eager": None, "triton": "skipped here"},
                       kb.environment(dev), {"GB/s": 10.0, "TFLOP/s": 0.1}, 0, 1, show=False)
    assert list(df["provider"]) == ["eager", "triton"] and list(df["status"]) == ["ok", "skipped"]
    assert df.loc[0, "max_err"] < 1e-5 and df.loc[0, "ms_median"] > 0
    src = kl.kernel_source(kr._rmsnorm_fwd_kernel)
    assert src.lstrip().startswith(("def _rmsnorm_fwd_kernel", "@")) and "_rmsnorm_fwd_kernel" in src


def test_decode_rows_sampling_alone_is_not_an_interpreter_timing(random_llm):
    # sampling runs in the engine after the logits: a step with only sampling on triton runs no Triton code
    from workbench.bench import kernels as kb

    env = kb.environment(torch.device("cpu"))
    if not env["interpreter"] or kb.fused_backends().get("sampling") != "triton":
        pytest.skip("needs the Triton interpreter and a triton sampling backend")
    eager = {op: "eager" for op in kb.fused_backends()}
    rows = kb.decode_rows(random_llm.model, {"eager": eager, "sampling": {**eager, "sampling": "triton"},
                                             "rmsnorm": {**eager, "rmsnorm": "triton"}}, 8, env, {"GB/s": 10.0}, 0, 1,
                          graphs=False)
    assert [r["status"] for r in rows] == ["ok"] * 3, [r.get("error") for r in rows]
    assert [r["timing"] for r in rows] == ["host", "host", kl.INTERPRETER_TIMING]


def test_with_progress_moves_the_bar_between_items():
    calls = []

    class Bar:
        def start(self, name):
            calls.append(("start", name))

        def advance(self):
            calls.append(("advance",))

    seen = []
    for name, _ in kl.with_progress({"eager": {}, "rope": {"rope": "triton"}}, Bar()).items():
        seen.append(name)
        calls.append(("run", name))
    assert seen == ["eager", "rope"]
    assert calls == [("start", "eager"), ("run", "eager"), ("advance",),
                     ("start", "rope"), ("run", "rope"), ("advance",)]
