"""Exercises: a piece of each layer for a learner to write, checked against the package's own.

Each notebook has 1-4 exercises (``ex00`` ... ``ex06``; ``workbench exercises list``).  In a
notebook an exercise is three cells, written from this registry by ``scripts/exercise_cells.py``:

* the statement, with its hint ladder (nested ``<details>``: each hint opens the next);
* the starter stub, which the learner fills in (cell metadata ``workbench.exercise``);
* the check: ``fn = check("02.slot_mapping", fn, mode=exercises)`` (:mod:`workbench.lab.exercise_view`).

``mode`` is the notebook parameter ``exercises``:

``"yours"``      (a notebook's default) the learner's function is checked; when it passes it drives
                 what follows (their eviction policy runs the pool, ...); when it fails or is not
                 written yet, the reference drives it and the check says so.
``"solutions"``  (the default of batch runs, ``workbench run-notebooks``) each exercise is filled from
                 ``notebooks/solutions/<notebook>.py``, checked, and a failing solution stops the run:
                 the Quick start and CI run every checker.

Solutions live outside the learner's notebook.  ``workbench exercises check NB...`` grades filled
notebooks (:mod:`workbench.exercises.grade`).
"""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path
from typing import Any

from workbench.errors import WorkbenchError
from workbench.exercises.core import Case, Exercise, Result, check_fn, compare_tensors, compare_values, show

__all__ = ["Case", "Exercise", "Result", "MODES", "SOLUTIONS", "all_exercises", "check_fn", "compare_tensors",
           "compare_values", "for_notebook", "get", "hint", "load_solution", "resolve", "show"]

MODES = ("yours", "solutions")
#: one module per notebook, in notebook order
MODULES = ("ex00", "ex01", "ex02", "ex03", "ex04", "ex05", "ex06")
SOLUTIONS = Path(__file__).resolve().parent.parent.parent / "notebooks" / "solutions"


def all_exercises() -> list[Exercise]:
    out: list[Exercise] = []
    for m in MODULES:
        out += importlib.import_module(f"workbench.exercises.{m}").EXERCISES
    return out


def get(exercise_id: str) -> Exercise:
    for ex in all_exercises():
        if ex.id == exercise_id:
            return ex
    have = ", ".join(e.id for e in all_exercises())
    raise WorkbenchError(f"no exercise {exercise_id!r} (there are: {have})")


def for_notebook(notebook: str) -> list[Exercise]:
    """The exercises of a notebook, by its stem (``02_kv_tiers``), its number (``02``) or a path."""
    stem = Path(notebook).stem
    return [e for e in all_exercises() if e.notebook == stem or e.number == stem]


def hint(exercise_id: str, k: int = 1) -> str:
    """Hint ``k`` (1-based) of an exercise: the ladder, for a learner outside a notebook."""
    ex = get(exercise_id)
    if not 1 <= k <= len(ex.hints):
        raise WorkbenchError(f"exercise {exercise_id} has hints 1 to {len(ex.hints)}, not {k}")
    return ex.hints[k - 1]


def load_solution(exercise_id: str, folder: Path | None = None) -> Any:
    """The solution's function, from ``notebooks/solutions/<notebook>.py``."""
    ex = get(exercise_id)
    path = Path(folder or SOLUTIONS) / f"{ex.notebook}.py"
    if not path.is_file():
        raise WorkbenchError(f"exercise {exercise_id}: no solutions file {path}")
    spec = importlib.util.spec_from_file_location(f"workbench_solutions_{ex.notebook}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    fn = getattr(module, ex.function, None)
    if fn is None:
        raise WorkbenchError(f"exercise {exercise_id}: {path} defines no {ex.function}")
    return fn


def resolve(exercise_id: str, fn: Any, mode: str = "yours", *, examples: int | None = None) -> tuple[Any, Result, str]:
    """Check an exercise and say which function drives what follows: ``(function, result, note)``.

    ``mode="solutions"``: the solution is checked and returned; a failing solution raises (a batch
    run must not go on with a wrong solution).  ``mode="yours"``: ``fn`` is checked; it is
    returned when it passes, the reference otherwise (the note says which)."""
    if mode not in MODES:
        raise WorkbenchError(f"exercises must be one of {', '.join(map(repr, MODES))}, got {mode!r}")
    ex = get(exercise_id)
    if mode == "solutions":
        sol = load_solution(exercise_id)
        res = check_fn(ex, sol, examples=examples)
        if not res.passed:
            raise WorkbenchError(f"the solution of exercise {exercise_id} ({SOLUTIONS / (ex.notebook + '.py')}) "
                                 f"fails its check:\n{res}")
        return sol, res, "the solution (notebooks/solutions) drives what follows"
    res = check_fn(ex, fn, examples=examples)
    if res.passed:
        note = f"your {ex.function} drives what follows: {ex.plugs_into}" if ex.plugs_into else ""
        return fn, res, note
    if res.status == "not written":
        return ex.reference, res, f"not written yet: the package's own {ex.function} drives what follows"
    return ex.reference, res, f"the package's own {ex.function} drives what follows until yours passes"
