"""``workbench exercises``: list what each notebook asks, grade filled notebooks, show a hint
(:mod:`workbench.exercises`)."""

from __future__ import annotations

import json
import sys


def add_exercises_parser(sub) -> None:
    p = sub.add_parser("exercises", help="the notebooks' exercises: list them, grade filled notebooks, show a hint",
                       description="The exercises a learner writes in the notebooks (statement, stub, hints), "
                                   "checked against the package's own implementation.")
    es = p.add_subparsers(dest="exercises_command", required=True, metavar="ACTION")
    ls = es.add_parser("list", help="what each notebook asks: id, title, what it teaches, where it plugs in")
    ls.add_argument("notebooks", nargs="*", help="notebook names, numbers or paths (default: all)")
    ls.set_defaults(func=cmd_list)
    ck = es.add_parser("check", help="grade filled notebooks: a table of passed / failed with the failing case",
                       description="Grades the answer cells of filled notebooks (their stub cells, by metadata) "
                                   "against the reference, each notebook in its own process. It runs the "
                                   "learner's code with your rights, as nbgrader does. Exit status 1 when "
                                   "any exercise is not passed.")
    ck.add_argument("notebooks", nargs="+", help="filled notebooks (.ipynb)")
    ck.add_argument("--timeout", type=float, default=300.0, help="seconds per notebook (default 300)")
    ck.add_argument("--examples", type=int, default=None,
                    help="property-based inputs per exercise (default: each exercise's own, ~150)")
    ck.add_argument("--json", action="store_true", help="print the results as JSON")
    ck.add_argument("--details", action="store_true", help="print each failure in full after the table")
    ck.set_defaults(func=cmd_check)
    h = es.add_parser("hint", help="an exercise's hint (the ladder, one at a time)")
    h.add_argument("exercise", help="its id, e.g. 02.slot_mapping")
    h.add_argument("k", nargs="?", type=int, default=1, help="which hint (1 = the gentlest)")
    h.set_defaults(func=cmd_hint)


def cmd_list(args) -> int:
    from workbench.exercises import all_exercises, for_notebook

    exs = [e for nb in args.notebooks for e in for_notebook(nb)] if args.notebooks else all_exercises()
    if args.notebooks and not exs:
        from workbench.errors import WorkbenchError
        raise WorkbenchError(f"no exercises in {', '.join(args.notebooks)}")
    count: dict[str, int] = {}
    for e in exs:
        count[e.notebook] = count.get(e.notebook, 0) + 1
        k = count[e.notebook]
        print(f"{e.number}.{k}  {e.id:<28} {e.title}")
        print(f"      teaches: {e.teaches}")
        if e.plugs_into:
            print(f"      plugs into: {e.plugs_into}")
    print(f"\n{len(exs)} exercises in {len(count)} notebooks")
    return 0


def cmd_check(args) -> int:
    from pathlib import Path

    from workbench.exercises.grade import format_table, grade_notebook

    rows = []
    for nb in args.notebooks:
        for r in grade_notebook(nb, timeout=args.timeout, examples=args.examples):
            rows.append((Path(nb).name, r))
    if args.json:
        import dataclasses
        print(json.dumps([{"notebook": nb, **dataclasses.asdict(r)} for nb, r in rows], indent=1))
    else:
        print(format_table(rows))
        passed = sum(r.passed for _, r in rows)
        print(f"\n{passed} of {len(rows)} passed")
        failed = [r for _, r in rows if r.status == "failed"]
        if args.details and failed:
            print()
            for r in failed:
                print(r, end="\n\n")
    sys.stdout.flush()
    return 0 if all(r.passed for _, r in rows) else 1


def cmd_hint(args) -> int:
    from workbench.exercises import get, hint

    ex = get(args.exercise)
    text = hint(args.exercise, args.k)          # a hint that is not there is an error before anything prints
    print(f"{ex.id} · {ex.title}: hint {args.k} of {len(ex.hints)}\n")
    print(text)
    return 0
