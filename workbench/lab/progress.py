"""Progress for long notebook cells: what is running (configuration k / n, round r / R), elapsed
time and an ETA, in a bar that survives saving the notebook.

A cell that runs for minutes with only ``[*]`` beside it looks hung.  tqdm's notebook bar is an
ipywidget: a saved notebook reopened without its kernel shows "Error displaying widget: model not
found" in its place.  :class:`Progress` draws plain HTML instead, replaced in place
(``display(..., display_id=True)`` then ``update``), at most ``max_hz`` times a second, so the
saved notebook keeps the last state as ordinary output; outside IPython it prints a line to
stderr at most every ``print_every_s`` seconds.  The bar carries the CSS class ``wb-progress``
(a browser test looks for it)::

    with Progress(len(configs), "configurations") as bar:
        for cfg in configs:
            bar.start(cfg.name)          # "configuration 3/8: paged+prefix" while it runs
            run(cfg)
            bar.advance()
"""

from __future__ import annotations

import html
import sys
import time

from workbench.lab.live_output import in_kernel


def _fmt_s(s: float) -> str:
    if s < 60:
        return f"{s:.0f} s"
    m, s = divmod(int(round(s)), 60)
    return f"{m} min {s:02d} s"


class Progress:
    """``total`` items of ``what`` (plural, e.g. "configurations"); ``start(name)`` names the one
    running, ``advance(n)`` counts finished ones, ``note(text)`` adds a second line (e.g. "round
    2/3").  The ETA is elapsed / done x left, shown once one item has finished."""

    def __init__(self, total: int, what: str, *, max_hz: float = 4.0, print_every_s: float = 10.0,
                 clock=time.monotonic, display=None) -> None:
        if total < 0:
            raise ValueError(f"Progress: total must be >= 0, got {total}")
        self.total, self.what, self.clock = total, what, clock
        self.min_interval, self.print_every_s = 1.0 / max_hz, print_every_s
        self.done, self.current, self.extra = 0, "", ""
        self.t0 = clock()
        self._shown = -1e9
        self._handle = None
        self._display = display            # tests: a callable(html) instead of IPython
        self._ipython = display is None and in_kernel()
        self.closed = False

    # ---- what it says
    @property
    def elapsed(self) -> float:
        return self.clock() - self.t0

    @property
    def eta(self) -> float | None:
        if not self.done or self.done >= self.total:
            return None
        return self.elapsed / self.done * (self.total - self.done)

    def text(self) -> str:
        k = min(self.done + (0 if self.closed or self.done >= self.total else 1), self.total)
        head = f"{self.what} {k}/{self.total}" + (f": {self.current}" if self.current and not self.closed else "")
        parts = [head, f"{_fmt_s(self.elapsed)} elapsed"]
        if self.closed or self.done >= self.total:
            parts[0] = f"{self.what}: {self.done}/{self.total} done"
        elif self.eta is not None:
            parts.append(f"about {_fmt_s(self.eta)} left")
        return " · ".join(parts) + (f" · {self.extra}" if self.extra else "")

    def html(self) -> str:
        frac = self.done / self.total if self.total else 1.0
        return (f'<div class="wb-progress" style="font: 13px sans-serif; margin: 4px 0">'
                f'<div style="background:#e6e6e6; width: 420px; height: 10px; border-radius: 5px">'
                f'<div style="background:#0072B2; width:{420 * frac:.0f}px; height: 10px; border-radius: 5px">'
                f'</div></div><div style="margin-top: 3px">{html.escape(self.text())}</div></div>')

    # ---- updates
    def start(self, name: str) -> None:
        self.current = str(name)
        self._show(force=True)

    def note(self, text: str) -> None:
        self.extra = str(text)
        self._show()

    def advance(self, n: int = 1) -> None:
        self.done = min(self.total, self.done + n)
        self._show(force=True)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._show(force=True)

    def __enter__(self) -> Progress:
        self._show(force=True)
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _show(self, force: bool = False) -> None:
        now = self.clock()
        if self._display is not None:
            if force or now - self._shown >= self.min_interval:
                self._shown = now
                self._display(self.html())
            return
        if self._ipython:
            if not force and now - self._shown < self.min_interval:
                return
            self._shown = now
            from IPython.display import HTML, display
            if self._handle is None:
                self._handle = display(HTML(self.html()), display_id=True)
            else:
                self._handle.update(HTML(self.html()))
            return
        if force and (self.closed or now - self._shown >= self.print_every_s):
            self._shown = now
            print(self.text(), file=sys.stderr, flush=True)


