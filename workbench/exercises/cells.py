"""An exercise as notebook cells: the statement with its hint ladder, the stub, the check.

The registry is the one source: ``scripts/exercise_cells.py`` writes these cells into the notebooks
(``--check`` fails when a notebook's cells differ), and ``workbench exercises check`` finds a
learner's answer by the stub cell's metadata ``{"workbench": {"exercise": id, "part": "stub"}}``.
"""

from __future__ import annotations

from workbench.exercises.core import Exercise

PARTS = ("statement", "stub", "check")


def heading(ex: Exercise, k: int) -> str:
    return f"### Exercise {ex.number}.{k} · {ex.title}"


def statement_source(ex: Exercise, k: int) -> str:
    """Markdown: heading, statement, what it teaches / plugs into, then the hints, each inside the
    one before (a learner opens them one at a time)."""
    lines = [heading(ex, k), "", ex.statement.strip(), ""]
    meta = f"*Teaches:* {ex.teaches}"
    if ex.plugs_into:
        meta += f"  \n*Plugs into:* {ex.plugs_into}"
    lines += [meta, ""]
    for i, h in enumerate(ex.hints, 1):
        lines += [f"<details><summary>Hint {i} of {len(ex.hints)}</summary>", "", h.strip(), ""]
    lines += ["</details>"] * len(ex.hints)
    return "\n".join(lines).rstrip() + "\n"


def check_source(ex: Exercise) -> str:
    return ("from workbench.lab.exercise_view import check\n\n"
            f"# exercises = \"yours\" checks your {ex.function}; \"solutions\" (batch runs) uses notebooks/solutions\n"
            f"{ex.function} = check({ex.id!r}, {ex.function}, mode=exercises)")


def sources(ex: Exercise, k: int) -> dict[str, tuple[str, str]]:
    """part -> (cell type, source)."""
    return {"statement": ("markdown", statement_source(ex, k)),
            "stub": ("code", ex.stub.strip("\n")),
            "check": ("code", check_source(ex))}


def cell_tag(cell) -> tuple[str, str] | None:
    """(exercise id, part) of a cell written by this module, else None."""
    wb = cell.get("metadata", {}).get("workbench", {})
    if isinstance(wb, dict) and "exercise" in wb and wb.get("part") in PARTS:
        return wb["exercise"], wb["part"]
    return None
