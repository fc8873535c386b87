"""The progress bar of long notebook cells (workbench.lab.progress): what runs, k / n, elapsed, ETA,
as plain HTML replaced in place (no widget: a saved notebook keeps its last state)."""

from __future__ import annotations

from workbench.lab.progress import Progress


def test_progress_says_what_runs_elapsed_and_eta():
    t = [0.0]
    shown: list[str] = []
    bar = Progress(4, "configurations", clock=lambda: t[0], display=shown.append)
    with bar:
        bar.start("baseline")
        assert "configurations 1/4: baseline" in bar.text() and "0 s elapsed" in bar.text()
        assert "left" not in bar.text()                      # no ETA before one has finished
        t[0] = 30.0
        bar.advance()
        bar.start("paged+prefix")
        assert "configurations 2/4: paged+prefix" in bar.text() and "about 1 min 30 s left" in bar.text()
        bar.note("round 2/3")
        assert bar.text().endswith("round 2/3")
        t[0] = 100.0
        bar.advance(3)
    assert "4/4 done" in bar.text() and "1 min 40 s elapsed" in bar.text()
    assert all('class="wb-progress"' in h for h in shown) and len(shown) >= 5


def test_progress_escapes_names_and_throttles_notes():
    t = [0.0]
    shown: list[str] = []
    bar = Progress(2, "points", clock=lambda: t[0], display=shown.append, max_hz=2)
    bar.start("<b>x</b>")
    n = len(shown)
    bar.note("a")
    bar.note("b")                       # within 0.5 s of the last draw: not drawn
    assert len(shown) == n
    t[0] = 1.0
    bar.note("c")
    assert len(shown) == n + 1 and "&lt;b&gt;" in shown[-1] and "<b>x" not in shown[-1]
