"""Replays of a run's recorded frames, at human speed, with or without a kernel.

A live view redraws as fast as the run (notebook 02's block map: 4 redraws in 37 ms on a CPU), so
a learner sees only its end.  Every live view therefore also *records* what it drew - one
:class:`Frame` per change, stamped with the run's clock - and :func:`replay_figure` turns the
recording into one plotly figure with frames and plotly's own controls:

* **play / pause** and **speed** buttons (0.25x to 4x of the recorded pace, and a fixed pace of a
  few frames a second, since a CPU run can pass a whole replay in 40 ms);
* a **scrubber**: one slider step per frame, labelled with the frame's time in ms and what it
  shows; dragging or clicking a step shows that frame, so a learner steps through the states one
  by one, forward and back.

Being plain plotly (no widget), the replay works the same in a live notebook, in a saved notebook
reopened without a kernel, and in the batch run's HTML report; nothing is lost on reload.

The recording is cheap - a frame holds what the view already computed for its redraw - and
:class:`Recorder` measures it: ``seconds`` (time spent recording), ``per_frame_us``.  Long runs
keep at most ``max_frames`` frames (evenly spaced, the first and the last always kept), so a
replay's size is bounded (a block map of 256 blocks: ~10 KB a frame).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

SPEEDS = (0.25, 0.5, 1.0, 2.0, 4.0)   # x the recorded pace
STEADY_FPS = 4                         # the "steady" button: this many frames a second, whatever the pace
MIN_FRAME_MS = 30                      # plotly cannot draw much faster; shorter gaps are played at this
MAX_FRAME_MS = 2000                    # a long idle gap is played at this
MAX_FRAMES = 120
LABELLED_STEPS = 10                    # more frames than this: the slider names only the current one


@dataclass
class Frame:
    """One recorded state: ``t_ms`` on the run's clock, ``data`` (the traces' new values, as
    plotly trace dicts in the order of the figure's traces), ``label`` (what the slider says
    beside the time, e.g. "step 12: 3 running"), ``layout`` (layout changes, e.g. the title)."""
    t_ms: float
    data: list
    label: str = ""
    layout: dict = field(default_factory=dict)


class Recorder:
    """Frames as a view draws them.  ``add(data, label, layout)`` stamps the frame with the time
    since the first one (or ``t_ms``: the run's own clock); a frame equal to the last one is
    dropped (nothing changed).  ``seconds`` is what recording cost (the view's own drawing not
    counted)."""

    def __init__(self, max_frames: int = MAX_FRAMES, clock=time.monotonic) -> None:
        if max_frames < 2:
            raise ValueError(f"Recorder: max_frames must be >= 2, got {max_frames}")
        self.max_frames, self.clock = max_frames, clock
        self.frames: list[Frame] = []
        self.seconds = 0.0
        self.dropped = 0          # unchanged frames not kept
        self._t0: float | None = None

    def add(self, data: list, label: str = "", layout: dict | None = None, t_ms: float | None = None) -> bool:
        t = time.monotonic()
        now = self.clock()
        if self._t0 is None:
            self._t0 = now
        if t_ms is None:
            t_ms = (now - self._t0) * 1e3
        last = self.frames[-1] if self.frames else None
        kept = not (last is not None and last.data == data and last.layout == (layout or {}))
        if kept:
            self.frames.append(Frame(float(t_ms), data, label, dict(layout or {})))
        else:
            self.dropped += 1
        self.seconds += time.monotonic() - t
        return kept

    @property
    def per_frame_us(self) -> float:
        n = len(self.frames) + self.dropped
        return self.seconds / n * 1e6 if n else 0.0

    def cost_text(self) -> str:
        """One line: frames kept, and what recording them cost."""
        return (f"recorded {len(self.frames)} frames ({self.dropped} unchanged, not kept) "
                f"in {self.seconds * 1e3:.2f} ms, {self.per_frame_us:.0f} µs a frame")


def thin(frames: list[Frame], max_frames: int = MAX_FRAMES) -> list[Frame]:
    """At most ``max_frames`` of ``frames``, evenly spaced in order, the first and last kept."""
    n = len(frames)
    if n <= max_frames:
        return list(frames)
    idx = sorted({round(i * (n - 1) / (max_frames - 1)) for i in range(max_frames)})
    return [frames[i] for i in idx]


def _durations(frames: list[Frame]) -> list[float]:
    """Each frame's time on screen at 1x: the recorded gap to the next one, clamped."""
    gaps = [b.t_ms - a.t_ms for a, b in zip(frames, frames[1:])] + [MIN_FRAME_MS]
    return [min(MAX_FRAME_MS, max(MIN_FRAME_MS, g)) for g in gaps]


def _play_args(duration_ms: float, redraw: bool) -> dict:
    return {"frame": {"duration": duration_ms, "redraw": redraw}, "fromcurrent": True,
            "transition": {"duration": 0}, "mode": "immediate"}


def replay_figure(fig, frames: list[Frame], *, max_frames: int = MAX_FRAMES, redraw: bool = True,
                  time_label: str = "t", note: str | None = None):
    """``fig`` (its traces drawn as the first frame shows them) with ``frames`` as plotly frames,
    play / pause / speed buttons and a scrubber labelled in ms.  Returns ``fig``.

    ``redraw``: heatmaps need a full redraw per frame (True); scatter traces animate without.
    ``note``: a line under the controls (e.g. what the recording cost)."""
    import plotly.graph_objects as go

    frames = thin(frames, max_frames)
    if not frames:
        return fig
    first = frames[0]
    for trace, data in zip(fig.data, first.data):
        trace.update(data)
    if first.layout:
        fig.update_layout(first.layout)
    fig.frames = [go.Frame(data=f.data, name=str(i), layout=f.layout or None) for i, f in enumerate(frames)]
    gaps = _durations(frames)
    pace = sorted(gaps)[len(gaps) // 2]           # the median gap stands for "the recorded pace"
    steady = 1000 / STEADY_FPS

    def step(i: int, f: Frame) -> dict:
        text = f"{f.t_ms:,.1f} ms" + (f" · {f.label}" if f.label else "")
        return {"method": "animate", "label": text,
                "args": [[str(i)], {"mode": "immediate", "frame": {"duration": 0, "redraw": redraw},
                                    "transition": {"duration": 0}}]}

    buttons = [{"label": "▶ play", "method": "animate", "args": [None, _play_args(steady, redraw)]},
               {"label": "❚❚ pause", "method": "animate",
                "args": [[None], {"mode": "immediate", "frame": {"duration": 0, "redraw": False},
                                  "transition": {"duration": 0}}]}]
    speeds = [{"label": f"{s:g}x", "method": "animate",
               "args": [None, _play_args(min(MAX_FRAME_MS, max(MIN_FRAME_MS, pace / s)), redraw)]} for s in SPEEDS]
    n = len(frames)
    span = frames[-1].t_ms - frames[0].t_ms
    # controls placed in pixels around the plot area, whatever its height: the buttons in a row above
    # it (under the title), the scrubber below the x axis's title, the caption under the scrubber
    above, below = 44, 190 if note else 175
    margin = fig.layout.margin.to_plotly_json() if fig.layout.margin else {}
    top, bottom = (margin.get("t") or 80), (margin.get("b") or 40)
    row = {"type": "buttons", "direction": "left", "y": 1, "yanchor": "bottom", "pad": {"b": 8, "r": 4}}
    fig.update_layout(
        updatemenus=[{**row, "showactive": False, "x": 0.0, "xanchor": "left", "buttons": buttons},
                     {**row, "showactive": True, "active": -1, "x": 1.0, "xanchor": "right", "buttons": speeds}],
        sliders=[{"active": 0, "x": 0.0, "len": 1.0, "y": 0, "yanchor": "top", "pad": {"t": 58, "b": 0},
                  "currentvalue": {"prefix": f"{time_label} = ", "visible": True, "xanchor": "left",
                                   "font": {"size": 13, "color": "#222"}},
                  "transition": {"duration": 0}, "steps": [step(i, f) for i, f in enumerate(frames)]}],
        margin={**margin, "t": top + above, "b": max(bottom, below)},
        height=(fig.layout.height or 450) + above + max(0, below - bottom))
    if n > LABELLED_STEPS:              # step labels would overlap: the current one is named above the slider
        fig.layout.sliders[0].font = {"size": 1, "color": "rgba(0,0,0,0)"}
    caption = (f"replay: {n} frames over {span:,.1f} ms of the run. ▶ play shows {STEADY_FPS} frames a second, "
               "0.25x-4x the recorded pace;<br>drag or click the slider to step frame by frame")
    if note:
        caption += f"<br>{note}"
    fig.add_annotation(text=caption, xref="paper", yref="paper", x=0, y=0, yshift=-(below - 30), xanchor="left",
                       yanchor="top", showarrow=False, align="left", font={"size": 11, "color": "#555"})
    return fig


def has_replay(fig_json: dict) -> bool:
    """Does a plotly figure (as JSON) carry a replay: frames and a slider over them?"""
    layout = fig_json.get("layout") or {}
    return bool(fig_json.get("frames")) and bool(layout.get("sliders"))
