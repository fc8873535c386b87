"""The device check's helper command line, over :mod:`workbench.measure.gpu_results`::

    python -m workbench.cli.gpu_results start --probe JSON [--out DIR]   # prints: CUDA<TAB>DIR
    python -m workbench.cli.gpu_results write-tables OUT_DIR --work WORK_DIR
    python -m workbench.cli.gpu_results latest TABLE                      # print the latest table

``scripts/device_check.sh`` calls ``start`` and ``write-tables``; the work is done by the
module's plain functions (:func:`~workbench.measure.gpu_results.start`,
:func:`~workbench.measure.gpu_results.write_tables`, :func:`~workbench.measure.gpu_results.latest`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from workbench.measure import gpu_results
from workbench.measure.gpu_results import describe, latest, start, write_tables


def _print_latest(table: str, root: str | None) -> int:
    found = latest(table, root)
    print(describe(table, root))
    if found is None:
        return 1
    print(found.frame.to_string(index=False))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m workbench.cli.gpu_results",
                                description=gpu_results.__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("start", help="create the output folder and its meta.json; print 'CUDA<TAB>FOLDER'")
    s.add_argument("--probe", required=True, help="JSON: cuda_available, device_name, torch, triton, cuda, python")
    s.add_argument("--out", default="", help="write here instead (default: results/gpu/<device>-<date> on a GPU, "
                                              "runs/device_check without one)")
    s.add_argument("--root", default=None, help=argparse.SUPPRESS)
    w = sub.add_parser("write-tables", help="raw step outputs -> the CSV tables, summary.csv and device_check.log")
    w.add_argument("out_dir")
    w.add_argument("--work", required=True, help="folder of the raw outputs (<step>.out / .log, steps.tsv)")
    lt = sub.add_parser("latest", help="print the latest GPU table of a name and where it comes from")
    lt.add_argument("table")
    lt.add_argument("--root", default=None)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.cmd == "start":
        cuda, folder = start(json.loads(args.probe), out=args.out or None, root=args.root)
        try:                    # relative to the working directory when inside it (the repo root)
            folder = folder.resolve().relative_to(Path.cwd().resolve())
        except ValueError:
            pass
        print(f"{int(cuda)}\t{folder}")
        return 0
    if args.cmd == "write-tables":
        done = write_tables(args.out_dir, args.work)
        for table, how in done.items():
            print(f"{table + '.csv':<18} {how}")
        return 0
    return _print_latest(args.table, args.root)


if __name__ == "__main__":
    sys.exit(main())
