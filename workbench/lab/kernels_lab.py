"""Notebook 01's views (fused kernels): one op's measurement as a table, the roofline (its text
labels placed so that they do not overlap: :func:`label_positions`), the launches per step, the
per-op toggle figure and its live widget (:class:`KernelToggleView`).

The numbers come from :mod:`workbench.bench.kernels` (measurements) and
:mod:`workbench.bench.kernel_models` (predictions, FLOP and byte counts); this module shows them.
"""

from __future__ import annotations

import html
import inspect
import itertools
import math
import time
import traceback

import torch

# How the notebook formats kernel-bench rows, and the columns it shows.
FORMATS = {"ms_median": "{:.4f}", "ms_min": "{:.4f}", "ms_max": "{:.4f}", "achieved": "{:.3g}", "frac_of_ceiling": "{:.2%}",
           "vs_eager": "{:.3g}", "max_err": "{:.2e}"}
SHOW = ["timing", "ms_median", "ms_min", "ms_max", "achieved", "metric", "frac_of_ceiling", "vs_eager", "max_err", "status", "note"]
PROVIDER_COLORS = (("eager", "#1f77b4"), ("compile", "#2ca02c"), ("triton", "#d62728"))
INTERPRETER_TIMING = "triton-interpreter"     # workbench.bench.kernel_timing.INTERPRETER_NOTE (a row's "timing")


def fmt_ms(v: float) -> str:
    """A time in ms with three significant digits and no exponent: 3,570 / 16.2 / 0.123."""
    if v is None or not math.isfinite(v):
        return "-"
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}"


def fmt_err(v) -> str:
    """A max error in scientific notation (4.77e-07; "0" when exact): never rounded to 0.0."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if isinstance(v, str):
        return v
    return "0" if v == 0 else FORMATS["max_err"].format(v)


def results_frame(results: dict) -> pandas.DataFrame:  # noqa: F821
    """The notebook's results as a one-column table for display: errors (keys with ``err``) in
    scientific notation, other floats with four significant digits (the saved values are untouched)."""
    import pandas as pd

    def cell(key, v):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            return v
        if "err" in key:
            return fmt_err(v)
        return v if isinstance(v, int) else ("-" if math.isnan(v) else f"{v:.4g}")

    return pd.Series({k: cell(k, v) for k, v in results.items()}, name="value", dtype=object).to_frame()


def kernel_source(fn) -> str:
    """The Python source of a function or of a Triton kernel (a ``@triton.jit`` object wraps the
    function in ``.fn``, an autotuner wraps the jitted kernel again: unwrapped to the end)."""
    while hasattr(fn, "fn"):
        fn = fn.fn
    return inspect.getsource(fn)


def measure_op(op: str, sizes: dict, dev: torch.device, dtype: torch.dtype, providers: dict, env: dict,
               ceilings: dict, warmup: int, repeats: int, show: bool = True) -> pandas.DataFrame:  # noqa: F821
    """Every provider of one kernel-bench op at ``sizes`` (``workbench.bench.kernels``: the same
    code as the command-line benchmark), asserting that none failed.  With ``show``, prints the
    sizes and the FLOP / byte formula and displays the rows (columns :data:`SHOW`).  Returns the
    rows as a DataFrame (one per provider)."""
    import pandas as pd

    from workbench.bench import kernels as kb

    case = kb.make_case(op, sizes, dev, dtype)
    rows = kb.run_case(case, providers, dev, env, ceilings, warmup, repeats, dtype)
    failed = [f"{r['provider']}: {r['error']}" for r in rows if r["status"] == "error"]
    assert not failed, failed
    df = pd.DataFrame(rows)
    if show:
        from IPython.display import display

        print(f"{op}: {case.sizes}; {case.metric} from {case.formula}")
        display(df.set_index("provider")[SHOW].style.format(FORMATS, na_rep="-"))
    return df


# ---- text labels that do not overlap --------------------------------------------------------------
# plotly textpositions in order of preference; each is (vertical, horizontal) placement of the label box
_POSITIONS = ("top center", "bottom center", "middle right", "middle left", "top right", "top left",
              "bottom right", "bottom left")


def label_box(px: float, py: float, position: str, w: float, h: float, r: float) -> tuple:
    """The pixel box ``(x0, y0, x1, y1)`` (y up) of a ``w`` x ``h`` text label at ``position`` around a
    marker of radius ``r`` at ``(px, py)``, as plotly places it (approximately)."""
    vert, horiz = position.split()
    y0 = {"top": py + r, "bottom": py - r - h, "middle": py - h / 2}[vert]
    if horiz == "center":
        x0 = px - w / 2
    elif vert == "middle":
        x0 = px + r if horiz == "right" else px - r - w
    else:                                        # a corner: the label starts (ends) at the marker's centre
        x0 = px if horiz == "right" else px - w
    return (x0, y0, x0 + w, y0 + h)


def _overlap(a: tuple, b: tuple) -> float:
    return max(0.0, min(a[2], b[2]) - max(a[0], b[0])) * max(0.0, min(a[3], b[3]) - max(a[1], b[1]))


def label_positions(points, labels, x_range, y_range, size=(640, 320), char_px: float = 6.6,
                    line_px: float = 14.0, marker_px: float = 6.0, sweeps: int = 6, obstacles=()) -> list[str]:
    """A plotly ``textposition`` per point such that no two text labels overlap each other, any
    marker, a line drawn through ``obstacles`` (points along it, in axis units, each a 4 px
    square), or the plot's edge, where that is possible.  Greedy in the order of ``points`` (the
    first position of :data:`_POSITIONS` that is free, else the one that overlaps least), then
    ``sweeps`` passes that move each label to its least-overlapping position given the others.

    ``points`` are ``(x, y)`` in axis units (log10 of the value on a log axis), ``x_range`` /
    ``y_range`` the axes' ranges in the same units, ``size`` the plot area in pixels: an estimate
    (the figure is as wide as the page), and a smaller one than the real plot only spreads labels
    further apart.  Example: two points on top of each other get ``top center`` and ``bottom center``."""
    W, H = size
    sx, sy = W / (x_range[1] - x_range[0]), H / (y_range[1] - y_range[0])
    pix = [((x - x_range[0]) * sx, (y - y_range[0]) * sy) for x, y in points]
    markers = [(px - marker_px, py - marker_px, px + marker_px, py + marker_px) for px, py in pix]
    lines = [((x - x_range[0]) * sx - 2, (y - y_range[0]) * sy - 2, (x - x_range[0]) * sx + 2, (y - y_range[0]) * sy + 2)
             for x, y in obstacles]
    widths = [char_px * len(str(label)) for label in labels]
    boxes = [{pos: label_box(px, py, pos, w, line_px, marker_px) for pos in _POSITIONS}
             for (px, py), w in zip(pix, widths)]

    def cost(i: int, pos: str, chosen: dict) -> float:
        box = boxes[i][pos]
        return (widths[i] * line_px - _overlap(box, (0, 0, W, H))               # outside the plot
                + sum(_overlap(box, boxes[j][p]) for j, p in chosen.items() if j != i)
                + sum(_overlap(box, m) for j, m in enumerate(markers) if j != i)
                + sum(_overlap(box, o) for o in lines))

    def best(i: int, chosen: dict) -> str:
        costs = [(cost(i, pos, chosen), k, pos) for k, pos in enumerate(_POSITIONS)]
        return min(costs)[2]                      # ties: the earlier position of _POSITIONS

    chosen: dict[int, str] = {}
    for i in range(len(pix)):
        chosen[i] = best(i, chosen)
    for _ in range(sweeps):
        moved = False
        for i in range(len(pix)):
            pos = best(i, chosen)
            if cost(i, pos, chosen) < cost(i, chosen[i], chosen):
                chosen[i], moved = pos, True
        if not moved:
            break
    return [chosen[i] for i in range(len(pix))]


def label_leaders(ops, ys, merge: float) -> list[int]:
    """For each point, the point that carries its op's label (itself when it is labelled): the
    points of one op closer than ``merge`` to the next in ``y`` share one label, on the top one;
    points of the op farther apart get their own.  On a roofline an op's points stand in one
    column (its intensity is the same for every provider), so a GPU's eager, compile and triton
    points close together get one label, while a CPU's interpreter points far below get theirs."""
    leaders = list(range(len(ops)))
    by_op: dict = {}
    for i, op in enumerate(ops):
        by_op.setdefault(op, []).append(i)
    for idx in by_op.values():
        idx.sort(key=lambda i: -ys[i])
        for prev, i in itertools.pairwise(idx):
            if ys[prev] - ys[i] <= merge:
                leaders[i] = leaders[prev]
    return leaders


def _si(v: float) -> str:
    """1e5 -> 100k, 1e15 -> 1P: the tick labels of a FLOP/s axis."""
    for exp, prefix in ((18, "E"), (15, "P"), (12, "T"), (9, "G"), (6, "M"), (3, "k"), (0, "")):
        if v >= 10 ** exp:
            return f"{v / 10 ** exp:.3g}{prefix}"
    return f"{v:.3g}"


def roofline_figure(kdf, ceilings: dict, title: str, height: int = 480):
    """The measured roofline (``min(matmul rate, intensity x copy bandwidth)`` from this run's
    ``ceilings``) with one marker per row of ``kdf`` (:func:`workbench.bench.kernel_models.roofline_frame`),
    coloured by provider; interpreter timings are drawn as open symbols (not speeds).  Markers are
    labelled with their op: in the provider's colour, or once in grey for an op's points that stand
    close together (:func:`label_leaders`), at positions where the labels overlap neither each
    other, the markers nor the line (:func:`label_positions`); hovering shows the numbers."""
    import plotly.graph_objects as go

    from workbench.bench.kernels import INTERPRETER_NOTE

    peak, bw = ceilings["TFLOP/s"] * 1e12, ceilings["GB/s"] * 1e9
    ridge = math.log10(peak / bw)
    # the axes: the points and the ridge, with room around them for the labels
    xs = [math.log10(v) for v in kdf["intensity"]] if len(kdf) else []
    ys = [math.log10(v) for v in kdf["flop_per_s"]] if len(kdf) else []
    x_range = (min(xs + [ridge]) - 0.7, max(xs + [ridge]) + 0.7)
    y_range = (min(ys + [math.log10(peak)]) - 0.6, max(ys + [math.log10(peak)]) + 0.5)
    plot_px = (640, height - 170)            # the plot area assumed for placing labels (margins, title, legend)
    n_line = 120
    ai = sorted([10 ** (x_range[0] + (x_range[1] - x_range[0]) * i / n_line) for i in range(n_line + 1)] + [peak / bw])
    fig = go.Figure(go.Scatter(x=ai, y=[min(peak, a * bw) for a in ai], mode="lines", line={"color": "black"},
                               name=(f"roofline: min({ceilings['TFLOP/s']:,.4g} TFLOP/s, "
                                     f"intensity x {ceilings['GB/s']:,.4g} GB/s)"), hoverinfo="skip"))
    groups = []                      # (name, colour, symbol, rows) in trace order
    for provider, color in PROVIDER_COLORS:
        part = kdf[kdf["provider"] == provider]
        interp = part["timing"] == INTERPRETER_NOTE
        for sub, label, symbol in ((part[~interp], provider, "circle"),
                                   (part[interp], f"{provider} (interpreter: not a speed)", "circle-open")):
            if len(sub):
                groups.append((label, color, symbol, sub))
    order = [(g, k) for g, (_, _, _, sub) in enumerate(groups) for k in range(len(sub))]
    ops = [groups[g][3]["op"].iloc[k] for g, k in order]
    points = [(math.log10(groups[g][3]["intensity"].iloc[k]), math.log10(groups[g][3]["flop_per_s"].iloc[k]))
              for g, k in order]
    leaders = label_leaders(ops, [y for _, y in points], merge=30 * (y_range[1] - y_range[0]) / plot_px[1])
    shared = {i for i in leaders if leaders.count(i) > 1}
    labels = [op if leaders[i] == i else "" for i, op in enumerate(ops)]
    line = [(math.log10(a), math.log10(min(peak, a * bw))) for a in ai]          # labels keep off the roofline too
    positions = label_positions(points, labels, x_range, y_range, size=plot_px, obstacles=line)
    for g, (label, color, symbol, sub) in enumerate(groups):
        mine = [i for i, (gg, _) in enumerate(order) if gg == g]
        ms = sub["ms_median"] if "ms_median" in sub else [float("nan")] * len(sub)
        fig.add_trace(go.Scatter(
            x=sub["intensity"], y=sub["flop_per_s"], mode="markers+text", name=label,
            text=[labels[i] for i in mine], textposition=[positions[i] for i in mine],
            textfont={"color": ["#444" if i in shared else color for i in mine], "size": 11}, cliponaxis=False,
            marker={"color": color, "size": 10, "symbol": symbol, "line": {"width": 2, "color": color}},
            customdata=[[op, m] for op, m in zip(sub["op"], ms)],
            hovertemplate=(f"<b>%{{customdata[0]}}</b> ({label})<br>intensity %{{x:.3g}} FLOP/byte<br>"
                           "%{y:.3s}FLOP/s<br>median %{customdata[1]:.4g} ms<extra></extra>")))
    fig.update_layout(title=title, xaxis_title="arithmetic intensity (FLOP / byte)", yaxis_title="FLOP/s",
                      height=height, margin={"l": 70, "r": 30, "t": 110, "b": 60},
                      legend={"orientation": "h", "x": 0, "y": 1.01, "yanchor": "bottom"})
    fig.update_xaxes(type="log", range=list(x_range), dtick=1)
    ticks = [10.0 ** k for k in range(math.ceil(y_range[0]), math.floor(y_range[1]) + 1)]
    fig.update_yaxes(type="log", range=list(y_range), tickvals=ticks, ticktext=[_si(v) for v in ticks])
    return fig


def launch_figure(launches: dict, title: str, labels=("eager", "fused", "fused+graphs")):
    """Bars of kernel launches per decode step for ``labels``; a label missing from ``launches``
    (the CUDA-graph replay on a CPU) gets an empty bar saying it was not measured."""
    import plotly.graph_objects as go

    vals = [launches.get(p) for p in labels]
    top = max([v for v in vals if v is not None] or [1])
    fig = go.Figure(go.Bar(x=list(labels), y=[v or 0 for v in vals],
                           text=[f"{v:.0f}" if v is not None else "CUDA only:<br>not measured here" for v in vals],
                           textposition="outside", cliponaxis=False,
                           marker_color=["#1f77b4", "#d62728", "#9467bd"][:len(labels)]))
    fig.update_layout(title=title, yaxis_title="launches per step", height=380, yaxis_range=[0, top * 1.2])
    return fig


# ---- section 8: per-op toggles ---------------------------------------------------------------------
def toggle_figure(df, interpreter: bool = False):
    """Per-op backends side by side, one horizontal bar per row of ``df`` (rows of
    ``workbench.bench.kernels.decode_rows`` indexed by variant, top to bottom in the table's
    order): decode-step latency (median, with min..max as error bars; a log axis when the medians
    span more than 30x, as interpreter timings do) and the max logit error against the eager step.
    The medians are in the row labels (``eager: 16.2 ms``: a label inside a short bar would not
    fit, one outside would meet the error bar), the errors beside their bars.  Rows timed by the
    Triton interpreter are hatched; ``interpreter`` says so in the title."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    names = [str(n) for n in df.index]
    med, lo, hi = (df[c].astype(float) for c in ("ms_median", "ms_min", "ms_max"))
    err = df["max_err"].astype(float)
    log = bool(len(df)) and med.max() > 30 * max(med.min(), 1e-9)
    interp = list(df["timing"] == INTERPRETER_TIMING) if "timing" in df else [False] * len(df)
    fig = make_subplots(rows=1, cols=2, shared_yaxes=True, horizontal_spacing=0.05,
                        subplot_titles=("ms per decode step: median, min..max" + (" (log axis)" if log else ""),
                                        "max |logit error| vs eager"))
    fig.update_annotations(font_size=12)
    fig.add_trace(go.Bar(y=names, x=med, orientation="h", name="latency", marker_color="#1f77b4",
                         marker_pattern_shape=["/" if i else "" for i in interp],
                         error_x={"type": "data", "symmetric": False, "array": hi - med, "arrayminus": med - lo},
                         hovertemplate="%{y}: median %{x:.4g} ms<extra></extra>"), row=1, col=1)
    fig.add_trace(go.Bar(y=names, x=err, orientation="h", name="max error", marker_color="#d62728",
                         text=[fmt_err(v) for v in err], textposition="outside", cliponaxis=False,
                         hovertemplate="%{y}: %{x:.3e}<extra></extra>"), row=1, col=2)
    if log:
        span = (math.log10(max(lo.min(), 1e-9)) - 0.3, math.log10(hi.max()) + 0.1)
        fig.update_xaxes(type="log", range=list(span), dtick=1, row=1, col=1)
    else:
        fig.update_xaxes(type="linear", range=[0, float(hi.max()) * 1.05 if len(df) else 1], row=1, col=1)
    fig.update_xaxes(range=[0, float(err.max()) * 1.5 or 1e-6], exponentformat="e", row=1, col=2)
    fig.update_yaxes(autorange="reversed", automargin=True, tickvals=names,
                     ticktext=[f"{n}: {fmt_ms(v)} ms" for n, v in zip(names, med)])
    title = "Per-op backends" + (" (hatched: Triton interpreter timings, not speeds)" if interpreter or any(interp)
                                 else "")
    fig.update_layout(height=150 + 32 * len(df), showlegend=False, title=title, margin={"t": 80, "r": 70, "b": 40},
                      bargap=0.25)
    return fig


def compare_timing(row, ref) -> str:
    """A timing against the reference, with the noise stated: ``within noise`` when the two
    ``ms_min..ms_max`` ranges overlap, else the ratio of the medians (``25.3x slower``)."""
    if row["ms_min"] <= ref["ms_max"] and ref["ms_min"] <= row["ms_max"]:
        return "within noise (min..max ranges overlap)"
    ratio = row["ms_median"] / ref["ms_median"]
    return f"{ratio:.3g}x slower" if ratio > 1 else f"{1 / ratio:.3g}x faster"


class KernelToggleView:
    """Section 8's live per-op toggle: a checkbox per op, a "measure" button, a status line, a
    table and a live copy of :func:`toggle_figure`.

    ``rows`` are the rows measured already (the notebook's table, indexed by choice; ``reference``
    is the all-eager row): they are the starting point, and the reference is never measured
    again: a choice with nothing ticked *is* that row.  ``measure(chosen)`` measures one choice
    (the ``chosen`` ops on triton, every other op eager; its logits compared with the eager
    step's) and returns its decode row (a dict or Series with ``ms_median, ms_min, ms_max,
    max_err, launches_per_step, timing``).  A press disables the controls and says what it
    measures while it runs; a failure is shown in the widget, and the widget keeps working.

    The widget is built on first display (``ipywidgets`` and, for the figure, ``anywidget``);
    :meth:`measure` works without it (a batch run), and :attr:`message` says what it found."""

    name = "kernel-toggle"

    def __init__(self, ops, rows, measure, default=(), interpreter: bool = False, reference: str = "eager",
                 all_name: str | None = "all") -> None:
        import pandas as pd

        if reference not in rows.index:
            raise ValueError(f"KernelToggleView: no reference row {reference!r} in {list(rows.index)}")
        self.ops, self.measure_fn, self.default = tuple(ops), measure, tuple(default)
        self.interpreter, self.reference, self.all_name = interpreter, reference, all_name
        self.rows = {str(k): pd.Series(r) for k, r in rows.iterrows()}
        self.latest: str | None = None       # the choice measured last
        self.error: str | None = None        # the last failure, "Type: message"
        self.busy = False
        ref = self.rows[reference]
        self.message = (f"Tick ops and press measure. The eager reference ({fmt_ms(ref['ms_median'])} ms, "
                        f"min {fmt_ms(ref['ms_min'])}, max {fmt_ms(ref['ms_max'])}) was measured once, with the table.")
        self._details = ""
        self._ui: dict | None = None
        self.figure_error: str | None = None

    # ---- the measurement (no widgets needed) -------------------------------------------------
    def choice_name(self, chosen) -> str:
        """The row name of a choice: the reference for none, ``all_name`` for every op, else the ops
        joined by ``+`` in the order of ``ops``."""
        chosen = [op for op in self.ops if op in set(chosen)]
        if not chosen:
            return self.reference
        if self.all_name and len(chosen) == len(self.ops):
            return self.all_name
        return "+".join(chosen)

    @property
    def frame(self):
        """Every row: the table's, then the choices measured here (a re-measured one replaces its row)."""
        import pandas as pd

        return pd.DataFrame(list(self.rows.values()), index=list(self.rows))

    def ticked(self) -> list[str]:
        if self._ui is None:
            return list(self.default)
        return [op for op, box in self._ui["boxes"].items() if box.value]

    def measure(self, chosen=None):
        """Measure ``chosen`` (default: the ticked ops) and show it; returns its row, the reference
        row for an empty choice (not measured again), or None when it failed or a measurement was
        already running."""
        chosen = [op for op in self.ops if op in set(self.ticked() if chosen is None else chosen)]
        name = self.choice_name(chosen)
        if self.busy:
            return None
        if name == self.reference:
            self.error, self._details, self.latest = None, "", name
            self.message = (f"Nothing ticked: that is the eager reference row, measured once with the table "
                            f"({fmt_ms(self.rows[name]['ms_median'])} ms), not again.")
            self._refresh()
            return self.rows[name]
        self.busy = True
        self.message = f"Measuring {name} ({', '.join(chosen)} on triton, every other op eager) ..."
        self.error, self._details = None, ""
        self._set_busy(True)
        t0 = time.perf_counter()
        try:
            row = self.measure_fn(chosen)
        except Exception as err:  # noqa: BLE001 - shown in the widget, which keeps working
            self.error = f"{type(err).__name__}: {err}"
            self.message = f"Measuring {name} failed: {self.error}"
            self._details = traceback.format_exc()
            return None
        else:
            import pandas as pd

            again = name in self.rows
            self.rows[name] = pd.Series(dict(row))
            self.latest = name
            self.message = self.describe(name, time.perf_counter() - t0, again)
            return self.rows[name]
        finally:
            self.busy = False
            self._set_busy(False)
            self._refresh()

    def describe(self, name: str, seconds: float | None = None, again: bool = False) -> str:
        """One line on a measured choice against the reference, with both min..max ranges."""
        r, ref = self.rows[name], self.rows[self.reference]
        interp = r.get("timing") == INTERPRETER_TIMING
        line = (f"{name}: {fmt_ms(r['ms_median'])} ms (min {fmt_ms(r['ms_min'])}, max {fmt_ms(r['ms_max'])}) "
                f"vs eager {fmt_ms(ref['ms_median'])} ms (min {fmt_ms(ref['ms_min'])}, max {fmt_ms(ref['ms_max'])}): "
                f"{compare_timing(r, ref)}; max |logit error| {fmt_err(r['max_err'])}")
        if interp:
            line += "; Triton interpreter timing, not a speed"
        if seconds is not None:
            line += f" (measured in {seconds:.1f} s{'; replaces the earlier row' if again else ''})"
        return line + "."

    # ---- the table ---------------------------------------------------------------------------
    def table_html(self) -> str:
        """The rows as a compact HTML table that fits an output area: the choice (wrapping at ``+``),
        the median and its min..max range, the verdict against the reference, the max error in
        scientific notation, the launches and whether the top token agrees; a scroll container
        keeps it inside the widget if it still does not fit."""
        ref = self.rows[self.reference]
        head = ["choice (triton ops)", "median ms", "min..max ms", "vs eager", "max |logit err|", "launches", "top token"]
        cell = "padding:2px 8px;border-bottom:1px solid #ddd;"
        out = ["<div style='overflow-x:auto;max-width:100%'><table style='border-collapse:collapse;font-size:12px'>",
               "<tr>" + "".join(f"<th style='{cell}text-align:{'left' if i == 0 else 'right'}'>{h}</th>"
                                for i, h in enumerate(head)) + "</tr>"]
        any_interp = False
        for name, r in self.rows.items():
            interp = r.get("timing") == INTERPRETER_TIMING
            any_interp |= interp
            label = html.escape(name).replace("+", "+<wbr>") + (" &dagger;" if interp else "")
            if name == self.reference:
                label += " (reference)"
            vs = "-" if name == self.reference else compare_timing(r, ref).replace(" (min..max ranges overlap)", "")
            note = str(r.get("note", ""))
            top = "same" if "==" in note else ("differs" if "!=" in note else "-")
            launches = r.get("launches_per_step")
            vals = [label, fmt_ms(r["ms_median"]), f"{fmt_ms(r['ms_min'])}..{fmt_ms(r['ms_max'])}", vs,
                    fmt_err(r["max_err"]), "-" if launches is None else f"{launches:.0f}", top]
            weight = "font-weight:bold;" if name == self.latest else ""
            out.append("<tr>" + "".join(f"<td style='{cell}{weight}text-align:{'left' if i == 0 else 'right'}'>{v}</td>"
                                        for i, v in enumerate(vals)) + "</tr>")
        out.append("</table></div>")
        repeats = ref.get("repeats")
        over = f" ({repeats:.0f} timed steps per row)" if isinstance(repeats, (int, float)) and math.isfinite(repeats) else ""
        notes = [f"vs eager: <i>within noise</i> when the min..max ranges{over} overlap, else the ratio of the medians"]
        if any_interp:
            notes.append("&dagger; Triton interpreter timing (the kernel's Python run in NumPy): not a speed")
        return "".join(out) + "<div style='font-size:11px;color:#555'>" + "; ".join(notes) + ".</div>"

    # ---- the widget --------------------------------------------------------------------------
    def static_figure(self):
        """A plain ``go.Figure`` of every row (safe to save; a FigureWidget's state is not)."""
        return toggle_figure(self.frame, interpreter=self.interpreter)

    def _status_html(self) -> str:
        if self.error:
            return (f"<div style='color:#b00020'><b>{html.escape(self.message)}</b>"
                    f"<details><summary>traceback</summary><pre style='font-size:11px;white-space:pre-wrap'>"
                    f"{html.escape(self._details)}</pre></details></div>")
        text = html.escape(self.message)
        return f"<div style='white-space:normal'>{f'<b>{text}</b>' if self.busy else text}</div>"

    @property
    def widget(self):
        """The outermost ipywidget (a VBox with the CSS classes ``wb-live`` and ``wb-live-kernel-toggle``)."""
        if self._ui is None:
            self._build()
        return self._ui["box"]

    def _build(self) -> None:
        import ipywidgets as widgets

        boxes = {op: widgets.Checkbox(value=op in self.default, description=op, indent=False,
                                      layout=widgets.Layout(width="auto", margin="0 12px 0 0")) for op in self.ops}
        button = widgets.Button(description="measure", button_style="primary", icon="play",
                                tooltip="time one decode step with the ticked ops on triton")
        button.add_class("wb-live-kernel-toggle-button")
        button.on_click(lambda _: self.measure())
        status = widgets.HTML(layout=widgets.Layout(width="100%"))
        table = widgets.HTML(layout=widgets.Layout(width="100%", overflow="auto"))
        fig = None
        try:
            import plotly.graph_objects as go

            fig = go.FigureWidget(self.static_figure())          # needs anywidget
        except Exception as err:  # noqa: BLE001 - no widget frontend: the table alone
            self.figure_error = f"no live figure ({type(err).__name__}: {err}); the table holds the numbers"
        controls = widgets.HBox(list(boxes.values()) + [button],
                                layout=widgets.Layout(flex_flow="row wrap", align_items="center"))
        box = widgets.VBox([controls, status, table] + ([fig] if fig is not None else []),
                           layout=widgets.Layout(width="100%"))
        box.add_class("wb-live")
        box.add_class(f"wb-live-{self.name}")
        self._ui = {"boxes": boxes, "button": button, "status": status, "table": table, "fig": fig, "box": box}
        self._refresh(figure=False)        # the figure was just built from these rows

    def _set_busy(self, busy: bool) -> None:
        if self._ui is None:
            return
        self._ui["button"].disabled = busy
        self._ui["button"].description = "measuring ..." if busy else "measure"
        self._ui["button"].icon = "hourglass-half" if busy else "play"
        for box in self._ui["boxes"].values():
            box.disabled = busy
        self._ui["status"].value = self._status_html()

    def _refresh(self, figure: bool = True) -> None:
        if self._ui is None:
            return
        self._ui["status"].value = self._status_html() + (
            f"<div style='color:#555'>{html.escape(self.figure_error)}</div>" if self.figure_error else "")
        self._ui["table"].value = self.table_html()
        fig = self._ui["fig"]
        if fig is not None and figure:
            fresh = self.static_figure()
            layout = fresh.layout.to_plotly_json()
            layout.pop("template", None)
            with fig.batch_update():
                for trace, new in zip(fig.data, fresh.data):
                    trace.update(new.to_plotly_json())
                fig.update_layout(layout)
            from workbench.lab.viz import store_figure_state

            store_figure_state(fig, send=True)     # a view the browser draws late shows these rows too

    def display(self) -> KernelToggleView:
        from IPython.display import display

        try:
            display(self.widget)
        except ImportError as err:
            print(f"no toggle widget ({err}); the table above holds the same measurements")
        return self

    def _repr_mimebundle_(self, **kwargs):
        return self.widget._repr_mimebundle_(**kwargs)
