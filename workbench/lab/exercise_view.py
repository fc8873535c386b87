"""An exercise's check in a notebook: runs :func:`workbench.exercises.resolve`, shows the verdict
as a box (green passed, red failed with the case, grey not written yet) that a saved notebook
keeps as plain HTML, and returns the function that drives the rest of the notebook."""

from __future__ import annotations

import html
from typing import Any

from workbench.exercises import Result, get, resolve

#: exercise id -> (status of its last check in this kernel, mode): what :func:`who` names
_LAST: dict[str, tuple[str, str]] = {}

_COLOURS = {"passed": ("#1b7f3b", "#eaf6ee"), "failed": ("#b42318", "#fdeceb"), "not written": ("#667085", "#f2f4f7")}


class CheckView:
    """What :func:`check` displays: HTML in a notebook, text in a terminal and in papermill's log."""

    def __init__(self, exercise_id: str, result: Result, note: str) -> None:
        self.ex, self.result, self.note = get(exercise_id), result, note

    def text(self) -> str:
        return str(self.result) + (f"\n{self.note}" if self.note else "")

    def __repr__(self) -> str:
        return self.text()

    def _repr_html_(self) -> str:
        r = self.result
        fg, bg = _COLOURS.get(r.status, _COLOURS["failed"])
        mark = {"passed": "✓ passed", "failed": "✗ failed", "not written": "… not written yet"}[r.status]
        head = (f"<b>{html.escape(self.ex.id)} · {html.escape(self.ex.title)}</b>: "
                f"<span style='color:{fg}'>{mark}</span>")
        if r.passed:
            body = (f"<div>{r.cases_run} edge cases and {r.examples_run} property-based inputs agree with the "
                    f"reference.</div>")
        elif r.status == "not written":
            body = ("<div>The stub still raises NotImplementedError. Write it above and run the stub and this cell "
                    "again.</div>")
        else:
            body = f"<pre style='white-space:pre-wrap;margin:4px 0'>{html.escape(str(r))}</pre>"
        note = f"<div><i>{html.escape(self.note)}</i></div>" if self.note else ""
        return (f"<div class='wb-exercise' data-status='{html.escape(r.status)}' style='border-left:4px solid {fg};"
                f"background:{bg};padding:6px 10px;margin:4px 0;font-family:sans-serif;font-size:13px'>"
                f"{head}{body}{note}</div>")


def check(exercise_id: str, fn: Any, mode: str = "yours", *, examples: int | None = None, display=None) -> Any:
    """Check ``fn`` (exercise ``exercise_id``) and show the verdict; returns the function that
    drives what follows (yours when it passes, else the reference; the solution in batch runs)."""
    use, result, note = resolve(exercise_id, fn, mode, examples=examples)
    _LAST[exercise_id] = (result.status, mode)
    view = CheckView(exercise_id, result, note)
    if display is None:
        try:
            from IPython import get_ipython
            from IPython.display import display as ipy_display
            display = ipy_display if get_ipython() is not None else print
        except ImportError:  # pragma: no cover - IPython is a dependency
            display = print
    display(view)
    return use


def who(exercise_id: str) -> str:
    """Whose function an exercise's check handed on, for labels in the cells that use it: "your
    slot_mapping", "the solution's slot_mapping" (batch runs) or "the package's slot_mapping (yours
    is not written yet)" / "(yours does not pass yet)"."""
    ex = get(exercise_id)
    status, mode = _LAST.get(exercise_id, ("unchecked", "yours"))
    if mode == "solutions":
        return f"the solution's {ex.function}"
    if status == "passed":
        return f"your {ex.function}"
    why = {"not written": "yours is not written yet",
           "failed": "yours does not pass yet"}.get(status, "yours is not checked yet")
    return f"the package's {ex.function} ({why})"
