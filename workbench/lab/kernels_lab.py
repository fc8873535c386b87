"""Notebook 01's views (fused kernels): one op's measurement as a table, the roofline, the
launches per step and the per-op toggle figures.

The numbers come from :mod:`workbench.bench.kernels` (measurements) and
:mod:`workbench.bench.kernel_models` (predictions, FLOP and byte counts); this module shows them.
"""

from __future__ import annotations

import inspect

import torch

# How the notebook formats kernel-bench rows, and the columns it shows.
FORMATS = {"ms_median": "{:.4f}", "ms_min": "{:.4f}", "ms_max": "{:.4f}", "achieved": "{:.3g}", "frac_of_ceiling": "{:.2%}",
           "vs_eager": "{:.3g}", "max_err": "{:.2e}"}
SHOW = ["timing", "ms_median", "ms_min", "ms_max", "achieved", "metric", "frac_of_ceiling", "vs_eager", "max_err", "status", "note"]
PROVIDER_COLORS = (("eager", "#1f77b4"), ("compile", "#2ca02c"), ("triton", "#d62728"))


def kernel_source(fn) -> str:
    """The Python source of a function or of a Triton kernel (a ``@triton.jit`` object wraps the
    function in ``.fn``, an autotuner wraps the jitted kernel again: unwrapped to the end)."""
    while hasattr(fn, "fn"):
        fn = fn.fn
    return inspect.getsource(fn)


def measure_op(op: str, sizes: dict, dev: torch.device, dtype: torch.dtype, providers: dict, env: dict,
               ceilings: dict, warmup: int, repeats: int, show: bool = True) -> "pandas.DataFrame":  # noqa: F821
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


def roofline_figure(kdf, ceilings: dict, title: str):
    """The measured roofline (``min(matmul rate, intensity x copy bandwidth)`` from this run's
    ``ceilings``) with one marker per row of ``kdf`` (:func:`workbench.bench.kernel_models.roofline_frame`),
    coloured by provider; interpreter timings are drawn as open symbols (not speeds)."""
    import plotly.graph_objects as go

    from workbench.bench.kernels import INTERPRETER_NOTE

    peak, bw = ceilings["TFLOP/s"] * 1e12, ceilings["GB/s"] * 1e9
    ai = [10 ** (i / 20) for i in range(-60, 81)]
    fig = go.Figure(go.Scatter(x=ai, y=[min(peak, a * bw) for a in ai], mode="lines", name="measured roofline",
                               line=dict(color="black")))
    for provider, color in PROVIDER_COLORS:
        part = kdf[kdf["provider"] == provider]
        interp = part["timing"] == INTERPRETER_NOTE
        for sub, label, symbol in ((part[~interp], provider, "circle"),
                                   (part[interp], f"{provider} (interpreter: not a speed)", "circle-open")):
            if len(sub):
                fig.add_trace(go.Scatter(x=sub["intensity"], y=sub["flop_per_s"], mode="markers+text", name=label,
                                         text=sub["op"], textposition="top center",
                                         marker=dict(color=color, size=10, symbol=symbol)))
    fig.update_layout(title=title, xaxis_title="arithmetic intensity (FLOP / byte)", yaxis_title="FLOP/s",
                      xaxis_type="log", yaxis_type="log", height=450)
    return fig


def launch_figure(launches: dict, title: str, labels=("eager", "fused", "fused+graphs")):
    """Bars of kernel launches per decode step for ``labels``; a label missing from ``launches``
    (the CUDA-graph replay on a CPU) gets an empty bar saying it was not measured."""
    import plotly.graph_objects as go

    vals = [launches.get(p) for p in labels]
    fig = go.Figure(go.Bar(x=list(labels), y=[v or 0 for v in vals],
                           text=[f"{v:.0f}" if v is not None else "CUDA only:<br>not measured here" for v in vals],
                           textposition="outside", marker_color=["#1f77b4", "#d62728", "#9467bd"][:len(labels)]))
    fig.update_layout(title=title, yaxis_title="launches per step", height=380)
    return fig


def toggle_figure(df, interpreter: bool = False):
    """Per-op backends side by side: decode-step latency (median, with min..max as error bars)
    and the max logit error against the eager step, one bar per row of ``df`` (rows of
    ``workbench.bench.kernels.decode_rows`` indexed by variant).  ``interpreter`` says in the
    title that the triton timings are the interpreter's."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=1, cols=2, subplot_titles=("decode step (ms, median)", "max |logit error| vs eager"))
    fig.add_trace(go.Bar(x=list(df.index), y=df["ms_median"], name="latency",
                         error_y=dict(type="data", symmetric=False, array=df["ms_max"] - df["ms_median"],
                                      arrayminus=df["ms_median"] - df["ms_min"])), row=1, col=1)
    fig.add_trace(go.Bar(x=list(df.index), y=df["max_err"], name="max error", marker_color="#d62728"), row=1, col=2)
    fig.update_layout(height=380, showlegend=False,
                      title="Per-op backends" + (" (triton: interpreter timings, not speeds)" if interpreter else ""))
    return fig
