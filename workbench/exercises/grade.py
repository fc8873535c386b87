"""``workbench exercises check``: grade filled notebooks without running them.

Each notebook's stub cells (metadata ``workbench.exercise``, part ``stub``) are the learner's
answers.  They run in a separate Python process per notebook (``python -m
workbench.exercises.grade``), bounded by ``timeout`` seconds, so a learner's infinite loop or crash
ends that notebook's grading, never the instructor's session.  This is not a sandbox: like nbgrader,
grading runs the learner's code with the instructor's rights.

A stub cell must be self-contained (its imports at its top, as the stubs are written).
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

from workbench.errors import WorkbenchError
from workbench.exercises.cells import cell_tag
from workbench.exercises.core import Result


def answers(notebook: str | Path) -> dict[str, str]:
    """exercise id -> the learner's stub cell source, in notebook order."""
    import nbformat

    p = Path(notebook)
    if not p.is_file():
        raise WorkbenchError(f"{p}: no such notebook")
    try:
        nb = nbformat.read(str(p), as_version=4)
    except Exception as e:  # nbformat raises several types for a file that is not a notebook
        raise WorkbenchError(f"{p}: not a notebook ({type(e).__name__}: {e})") from None
    out: dict[str, str] = {}
    for cell in nb.cells:
        tag = cell_tag(cell)
        if tag and tag[1] == "stub":
            out[tag[0]] = cell.source
    return out


def grade_notebook(notebook: str | Path, *, timeout: float = 300.0, examples: int | None = None) -> list[Result]:
    """Every exercise of ``notebook``: one :class:`Result` each (a missing answer cell is failed)."""
    from workbench.exercises import for_notebook

    p = Path(notebook)
    found = answers(p)
    expected = for_notebook(p.stem)
    if not expected and not found:
        raise WorkbenchError(f"{p}: no exercises (its stem is not a notebook with exercises, and no cell is tagged "
                             f"workbench.exercise)")
    results: dict[str, Result] = {}
    todo = {}
    for ex in expected:
        if ex.id in found:
            todo[ex.id] = found[ex.id]
        else:
            results[ex.id] = Result(ex.id, "failed", case="the notebook", rule="its answer cell is missing "
                                    "(no cell with metadata workbench.exercise = this id)")
    for eid in found:
        if eid not in todo and eid not in results:
            todo[eid] = found[eid]
    if todo:
        payload = json.dumps({"answers": todo, "examples": examples, "notebook": p.name})
        try:
            done = subprocess.run([sys.executable, "-m", "workbench.exercises.grade"], input=payload,
                                  capture_output=True, text=True, timeout=timeout)
            rows = (json.loads(done.stdout.strip().splitlines()[-1])
                    if done.returncode == 0 and done.stdout.strip() else None)
            if rows is None:
                tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
                rows = [dataclasses.asdict(Result(eid, "failed", case="grading", rule=f"the grading process ended "
                                                  f"with status {done.returncode}: {tail[0]}")) for eid in todo]
        except subprocess.TimeoutExpired:
            rows = [dataclasses.asdict(Result(eid, "failed", case="grading",
                                              rule=f"grading this notebook took longer than {timeout:g} s "
                                                   f"(an answer that never returns?)")) for eid in todo]
        for r in rows:
            results[r["exercise"]] = Result(**r)
    order = [e.id for e in expected] + [e for e in found if e not in {x.id for x in expected}]
    return [results[e] for e in order if e in results]


def _grade_in_this_process(answers_: dict[str, str], notebook: str, examples: int | None) -> list[dict]:
    import linecache

    from workbench.exercises import check_fn, get

    out = []
    for eid, source in answers_.items():
        try:
            ex = get(eid)
        except WorkbenchError as e:
            out.append(dataclasses.asdict(Result(eid, "failed", case="the notebook", rule=str(e))))
            continue
        filename = f"<{notebook}: exercise {eid}>"
        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
        ns: dict = {"__name__": "__learner__"}
        try:
            exec(compile(source, filename, "exec"), ns)
        except Exception as e:
            line = getattr(e, "lineno", None) or _lineno(e, filename)
            out.append(dataclasses.asdict(Result(eid, "failed", case="the answer cell",
                                                 rule=f"the cell does not run: {type(e).__name__}: {e}"
                                                      + (f" (line {line})" if line else ""))))
            continue
        fn = ns.get(ex.function)
        if fn is None:
            out.append(dataclasses.asdict(Result(eid, "failed", case="the answer cell",
                                                 rule=f"the cell defines no function named {ex.function}")))
            continue
        out.append(dataclasses.asdict(check_fn(ex, fn, examples=examples)))
    return out


def _lineno(e: BaseException, filename: str) -> int | None:
    import traceback

    found = None
    for frame, lineno in traceback.walk_tb(e.__traceback__):
        if frame.f_code.co_filename == filename:
            found = lineno
    return found


def format_table(rows: list[tuple[str, Result]]) -> str:
    """The instructors' table: notebook, exercise, status, the failing case and its rule."""
    head = ("notebook", "exercise", "status", "failing case")
    body = [(nb, r.exercise, r.status, "" if r.passed or r.status == "not written" else
             f"{r.case}: {r.rule.splitlines()[0] if r.rule else ''}") for nb, r in rows]
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(head[:-1])]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head[:-1], widths)) + "  " + head[-1]]
    lines += ["  ".join(c.ljust(w) for c, w in zip(b[:-1], widths)) + "  " + b[-1] for b in body]
    return "\n".join(lines)


def main() -> int:
    import os

    if "TRITON_INTERPRET" not in os.environ and "triton" not in sys.modules:
        import torch      # Triton exercises (01) run under the interpreter where there is no GPU; the
        if not torch.cuda.is_available():   # variable is read when triton is first imported
            os.environ["TRITON_INTERPRET"] = "1"
    req = json.loads(sys.stdin.read())
    rows = _grade_in_this_process(req["answers"], req.get("notebook", "notebook"), req.get("examples"))
    sys.stdout.write("\n" + json.dumps(rows) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
