"""Notebook 01's per-op toggles (section 8): decode latency and max logit error per choice of ops
on Triton, as a figure (:func:`toggle_figure`) and as a live widget that measures a new choice when
asked (:class:`KernelToggleView`; the measuring is the notebook's function, from
:mod:`workbench.bench.kernels`)."""

from __future__ import annotations

import html
import math
import time
import traceback

from workbench.bench.kernel_timing import compare_timing
from workbench.lab.formats import fmt_err, fmt_ms

INTERPRETER_TIMING = "triton-interpreter"     # workbench.bench.kernel_timing.INTERPRETER_NOTE (a row's "timing")


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
    fig.add_trace(go.Bar(y=names, x=med, orientation="h", name="latency", marker_color="#0072B2",
                         marker_pattern_shape=["/" if i else "" for i in interp],
                         error_x={"type": "data", "symmetric": False, "array": hi - med, "arrayminus": med - lo},
                         hovertemplate="%{y}: median %{x:.4g} ms<extra></extra>"), row=1, col=1)
    fig.add_trace(go.Bar(y=names, x=err, orientation="h", name="max error", marker_color="#D55E00",
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
        t0 = time.monotonic()
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
            self.message = self.describe(name, time.monotonic() - t0, again)
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
        head = ["choice (triton ops)", "median ms", "min..max ms", "vs eager", "max |logit err|", "launches",
                "top token"]
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
        over = (f" ({repeats:.0f} timed steps per row)"
                if isinstance(repeats, (int, float)) and math.isfinite(repeats) else "")
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
