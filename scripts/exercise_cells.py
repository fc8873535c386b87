"""Write the exercises' cells into the notebooks from the registry (workbench/exercises/exNN.py).

    .venv/bin/python scripts/exercise_cells.py --check            # exit 1 when a notebook's cells differ
    .venv/bin/python scripts/exercise_cells.py --write            # rewrite every tagged cell from the registry
    .venv/bin/python scripts/exercise_cells.py --insert 02.slot_mapping --after 14   # add its 3 cells after cell 14

Each exercise is three cells tagged ``{"workbench": {"exercise": ID, "part": ...}}``: the statement
with its hint ladder (markdown), the stub (code; what a learner fills in) and the check (code).
The registry is the one source of their text (``workbench exercises list`` reads it too); edit it
there, then ``--write``.  ``--insert`` places a new exercise's cells after cell N (0-based, as
``nbformat`` counts); ``--write`` keeps them where they are.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"


def _expected(notebook: Path) -> dict[tuple[str, str], tuple[str, str]]:
    from workbench.exercises import for_notebook
    from workbench.exercises.cells import sources

    out = {}
    for k, ex in enumerate(for_notebook(notebook.stem), 1):
        for part, (ctype, src) in sources(ex, k).items():
            out[(ex.id, part)] = (ctype, src)
    return out


def problems(notebook: Path) -> list[str]:
    """What differs between the notebook's exercise cells and the registry (empty when in sync)."""
    import nbformat

    from workbench.exercises.cells import cell_tag

    nb = nbformat.read(notebook, as_version=4)
    want = _expected(notebook)
    seen, out = {}, []
    for i, cell in enumerate(nb.cells):
        tag = cell_tag(cell)
        if tag is None:
            continue
        if tag in seen:
            out.append(f"{notebook.name}: cell {i} repeats {tag[0]} {tag[1]} (first at cell {seen[tag]})")
            continue
        seen[tag] = i
        if tag not in want:
            out.append(f"{notebook.name}: cell {i} is tagged {tag[0]} {tag[1]}, which the registry does not have")
        elif (cell.cell_type, cell.source) != want[tag]:
            out.append(f"{notebook.name}: cell {i} ({tag[0]} {tag[1]}) differs from the registry")
    for tag in want:
        if tag not in seen:
            out.append(f"{notebook.name}: no {tag[1]} cell for {tag[0]}")
    order = [seen[(eid, p)] for eid, p in want if (eid, p) in seen]
    if order != sorted(order):
        out.append(f"{notebook.name}: the exercise cells are out of the registry's order")
    return out


def _new_cell(ctype: str, src: str, eid: str, part: str):
    import nbformat

    cell = nbformat.v4.new_markdown_cell(src) if ctype == "markdown" else nbformat.v4.new_code_cell(src)
    cell.metadata["workbench"] = {"exercise": eid, "part": part}
    if part == "check":
        cell.metadata["tags"] = ["exercise-check"]
    return cell


def write(notebook: Path, insert: str | None = None, after: int | None = None) -> int:
    """Rewrite the tagged cells from the registry (and insert one exercise's cells); returns the
    number of cells changed."""
    import nbformat

    from workbench.exercises.cells import cell_tag

    nb = nbformat.read(notebook, as_version=4)
    want = _expected(notebook)
    changed = 0
    if insert:
        parts = [(tag[1], v) for tag, v in want.items() if tag[0] == insert]
        if not parts:
            raise SystemExit(f"{notebook.name}: the registry has no exercise {insert} for this notebook")
        if any(cell_tag(c) and cell_tag(c)[0] == insert for c in nb.cells):
            raise SystemExit(f"{notebook.name}: {insert} has cells already (use --write)")
        if after is None or not 0 <= after < len(nb.cells):
            raise SystemExit(f"--after must be a cell index 0..{len(nb.cells) - 1}")
        nb.cells[after + 1:after + 1] = [_new_cell(ct, src, insert, part) for part, (ct, src) in parts]
        changed += len(parts)
    for cell in nb.cells:
        tag = cell_tag(cell)
        if tag in want and (cell.cell_type, cell.source) != want[tag]:
            if cell.cell_type != want[tag][0]:
                raise SystemExit(f"{notebook.name}: {tag} is a {cell.cell_type} cell; "
                                 f"the registry makes it {want[tag][0]}")
            cell.source = want[tag][1]
            if cell.cell_type == "code":
                cell.outputs, cell.execution_count = [], None
            changed += 1
    if changed:
        nbformat.write(nb, notebook)
    return changed


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--check", action="store_true")
    g.add_argument("--write", action="store_true")
    g.add_argument("--insert", metavar="ID")
    ap.add_argument("--after", type=int, help="with --insert: the cell index to insert after")
    ap.add_argument("notebooks", nargs="*", type=Path)
    a = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    nbs = a.notebooks or sorted(NOTEBOOKS.glob("*.ipynb"))
    if a.check:
        found = [p for nb in nbs for p in problems(nb)]
        print("\n".join(found) or f"{len(nbs)} notebooks: exercise cells match the registry")
        return 1 if found else 0
    if a.insert:
        from workbench.exercises import get
        nb = NOTEBOOKS / f"{get(a.insert).notebook}.ipynb"
        print(f"{nb.name}: {write(nb, a.insert, a.after)} cells written")
        return 0
    for nb in nbs:
        n = write(nb)
        if n:
            print(f"{nb.name}: {n} cells rewritten")
    return 0


if __name__ == "__main__":
    sys.exit(main())
