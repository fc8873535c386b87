"""A live widget's output, replaced when its run ends, so that a saved notebook reopens intact.

A widget's output holds only a reference to a model that lives in the kernel: a notebook saved
and reopened without that kernel shows "Error displaying widget: model not found" in its place.
A live view is worth watching only while its run goes on; afterwards its replay (or static
figure) carries the content.  :class:`LiveOutput` shows the widget under a display id and, at the
end, replaces that very output - in the notebook's file too - with plain output: a figure, or a
line saying where the replay is.  The widget's models are closed then.

Two details make "in place" work in JupyterLab (both seen in a probe: a FigureWidget shown with
``display(fig, display_id=True)`` and updated with a figure left the widget *and* appended the
figure): a FigureWidget's own display ignores the display id, so the widget goes out as its raw
mime bundle; and a plotly figure displayed through IPython makes a new output, so the
replacement goes out as the figure's raw plotly mime bundle too.
"""

from __future__ import annotations

import html
import uuid


def figure_bundle(fig) -> dict:
    """A plotly figure as the raw mime bundle JupyterLab's plotly renderer draws."""
    import plotly.io as pio

    return pio.renderers["plotly_mimetype"].to_mimebundle(fig.to_dict())


def note_bundle(text: str) -> dict:
    """A one-line note (HTML, with a plain-text fallback)."""
    return {"text/html": f'<div class="wb-live-ended" style="font: 13px sans-serif; color: #555">'
                         f"{html.escape(text)}</div>", "text/plain": text}


class LiveOutput:
    """``show(widget)`` once; ``end(figure=None, note=None)`` when the run is over (a figure,
    else the note, takes the widget's place).  Outside IPython both do nothing."""

    def __init__(self) -> None:
        self.display_id = uuid.uuid4().hex
        self.shown = False
        self.widgets: list = []

    def show(self, widget, *also) -> None:
        """Display ``widget`` (an ipywidget or a FigureWidget); ``also``: models to close with it."""
        try:
            from IPython.display import display
        except ImportError:
            return
        display(widget._repr_mimebundle_(), raw=True, display_id=self.display_id)
        self.shown = True
        self.widgets = [widget, *also]

    def end(self, figure=None, note: str | None = None) -> None:
        if not self.shown:
            return
        from IPython.display import update_display

        bundle = figure_bundle(figure) if figure is not None else note_bundle(note or "the live view has ended")
        update_display(bundle, raw=True, display_id=self.display_id)
        for w in self.widgets:
            close = getattr(w, "close", None)
            if close is not None:
                close()
        self.shown, self.widgets = False, []


def in_kernel() -> bool:
    """Is this a kernel (a notebook, or papermill's), where ``display`` draws rather than prints?"""
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None
