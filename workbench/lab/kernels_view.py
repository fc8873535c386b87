"""Notebook 01's views (fused kernels): one op's measurement as a table, the roofline (its text
labels placed so that they do not overlap: :mod:`workbench.lab.labels`), the launches per step,
and the per-op toggle figure and its live widget (:mod:`workbench.lab.kernel_toggle`).  The
notebook uses them as ``kl.<name>``.

The numbers come from :mod:`workbench.bench.kernels` (measurements: :func:`measure_op` shows
:func:`workbench.bench.kernels.measure_op`'s rows) and :mod:`workbench.bench.kernel_models`
(predictions, FLOP and byte counts); this module shows them.
"""

from __future__ import annotations

import inspect
import math

from workbench.bench.kernel_timing import compare_timing
from workbench.lab.formats import FORMATS, SHOW, fmt_err, fmt_ms, readable_table, results_frame
from workbench.lab.kernel_toggle import (
    INTERPRETER_TIMING,
    KernelToggleView,
    toggle_figure,
)
from workbench.lab.labels import (
    _POSITIONS,
    _overlap,
    label_box,
    label_leaders,
    label_positions,
)

# colour-blind-safe (workbench.lab.viz.PALETTE): eager blue, torch.compile green, our Triton kernels vermilion
PROVIDER_COLORS = (("eager", "#0072B2"), ("compile", "#009E73"), ("triton", "#D55E00"))


def kernel_source(fn) -> str:
    """The Python source of a function or of a Triton kernel (a ``@triton.jit`` object wraps the
    function in ``.fn``, an autotuner wraps the jitted kernel again: unwrapped to the end)."""
    while hasattr(fn, "fn"):
        fn = fn.fn
    return inspect.getsource(fn)


def measure_op(op: str, sizes: dict, dev, dtype, providers: dict, env: dict, ceilings: dict, warmup: int,
               repeats: int, show: bool = True):
    """Every provider of one kernel-bench op at ``sizes``, measured by
    :func:`workbench.bench.kernels.measure_op` (the same code as the command-line benchmark; it
    asserts that none failed).  With ``show``, prints the sizes and the FLOP / byte formula and
    displays the rows (columns :data:`SHOW`).  Returns the rows as a DataFrame (one per provider)."""
    from workbench.bench import kernels as kb

    df = kb.measure_op(op, sizes, dev, dtype, providers, env, ceilings, warmup, repeats)
    if show:
        from IPython.display import display

        print(f"{op}: {df.attrs['sizes']}; {df.attrs['metric']} from {df.attrs['formula']}")
        display(readable_table(df.set_index("provider")[SHOW]))     # ms, % of the ceiling, errors never 0.0
    return df


class with_progress(dict):  # noqa: N801 - reads as a function where it is used
    """``mapping`` (e.g. decode-step variants) that moves ``bar`` (a :class:`workbench.lab.progress.Progress`)
    as a function walks it with ``.items()``: ``bar.start(name)`` before each item, ``bar.advance()``
    after it, so a long call such as :func:`workbench.bench.kernels.decode_rows` says which of its
    variants runs (k / n, elapsed, ETA) without a callback of its own.  The bar moves between two
    items, never inside one: nothing timed pays for it."""

    def __init__(self, mapping, bar):
        super().__init__(mapping)
        self.bar = bar

    def items(self):
        for name, value in super().items():
            self.bar.start(str(name))
            yield name, value
            self.bar.advance()


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
                           marker_color=["#0072B2", "#D55E00", "#CC79A7"][:len(labels)],
                           hovertemplate="%{x}: %{y:.0f} launches per step<extra></extra>"))
    fig.update_layout(title=title, yaxis_title="launches per step", height=380, yaxis_range=[0, top * 1.2])
    return fig




__all__ = [
    "FORMATS",
    "INTERPRETER_TIMING",
    "PROVIDER_COLORS",
    "SHOW",
    "_POSITIONS",
    "KernelToggleView",
    "_overlap",
    "compare_timing",
    "fmt_err",
    "fmt_ms",
    "kernel_source",
    "label_box",
    "label_leaders",
    "label_positions",
    "launch_figure",
    "measure_op",
    "results_frame",
    "roofline_figure",
    "toggle_figure",
    "with_progress",
]
