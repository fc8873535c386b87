"""The device check's helper command line, over :mod:`workbench.measure.gpu_results`::

    python -m workbench.cli.gpu_results start --probe JSON [--out DIR]   # prints: CUDA<TAB>DIR
    python -m workbench.cli.gpu_results run [--triton] -- -m MODULE ARGS... | -c CODE ARGS...
    python -m workbench.cli.gpu_results step NAME [--device DEV] ...    # the check's own steps (below)
    python -m workbench.cli.gpu_results write-tables OUT_DIR --work WORK_DIR
    python -m workbench.cli.gpu_results latest TABLE                      # print the latest table

``scripts/device_check.sh`` calls ``start``, runs every step through ``run`` (the command as
``python -m`` / ``python -c`` would, with its JIT / autotune / inductor seconds written to
``$WORKBENCH_COMPILE_LOG`` at exit, also when the step's time cap stops it) and ends with
``write-tables``.  ``step`` holds the steps no ``workbench`` command expresses:

* ``warmup``: compile and autotune every benchmark's kernels once, first
  (:func:`workbench.bench.kernel_cases.warm_up`); ``warmup-compile`` is one of its worker processes;
* ``quant-kernels``: the W4A16 / W8A16 / W4A8 kernel table (:mod:`workbench.bench.quant_kernels`),
  saved row by row (the CPU dry run: its code path under the interpreter);
* ``prefetch-link``: the pinned host -> HBM link's GB/s per block size alone, early;
  ``prefetch-stream``: weight streaming, reusing the link measured by ``prefetch-link``.

Each prints its result as JSON (what ``write-tables`` reads) and saves what it has as it goes
(:func:`~workbench.measure.gpu_results.save_partial`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
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
    r = sub.add_parser("run", help="run '-m MODULE ARGS...' or '-c CODE ARGS...' as python would, writing its "
                                   "compile seconds to $WORKBENCH_COMPILE_LOG at exit")
    r.add_argument("--triton", action="store_true", help="also count Triton JIT and autotuning (imports triton "
                                                          "first: only where the interpreter is not wanted)")
    r.add_argument("argv", nargs=argparse.REMAINDER)
    st = sub.add_parser("step", help="one of the device check's own steps: warmup, warmup-compile, quant-kernels, "
                                     "prefetch-link, prefetch-stream")
    st.add_argument("name", choices=STEPS)
    st.add_argument("--device", default=None)
    st.add_argument("--workers", type=int, default=0, help="warmup: compile processes (0: none, compile on first run)")
    st.add_argument("--no-inductor", action="store_true", help="warmup: skip torch.compile of the kernel bench's ops")
    st.add_argument("--budget-s", type=float, default=None,
                    help="warmup / prefetch-stream: stop starting work past this")
    st.add_argument("--shard", type=int, default=0)
    st.add_argument("--shards", type=int, default=1)
    st.add_argument("--kernel-ms", default="1,4,16,64", help="quant-kernels: rows m")
    st.add_argument("--kernel-shapes", default="4096x4096,11008x4096", help="quant-kernels: OUTxIN layer shapes")
    st.add_argument("--link-json", default=None, help="prefetch-stream: the prefetch-link step's output")
    st.add_argument("--repeats", type=int, default=None, help="prefetch-stream: streaming runs per configuration")
    return p


STEPS = ("warmup", "warmup-compile", "quant-kernels", "prefetch-link", "prefetch-stream")


def _run(argv: list[str], triton: bool) -> int:
    """``argv`` as ``python -m MODULE ...`` / ``python -c CODE ...`` would run it, in this process,
    with a :class:`~workbench.measure.gpu_results.CompileLog` installed; its totals are written at
    exit, at a normal end, an exception, or SIGTERM (a step's time cap)."""
    import runpy
    import signal

    if argv and argv[0] == "--":
        argv = argv[1:]
    if len(argv) < 2 or argv[0] not in ("-m", "-c"):
        print("run: expected -m MODULE ARGS... or -c CODE ARGS...", file=sys.stderr)
        return 2
    log = gpu_results.CompileLog()
    if triton:
        log.install()

    def on_term(signum, frame):         # the cap: write the totals, then end as the signal would
        log.dump()
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    rc = 0
    try:
        if argv[:2] == ["-m", __name__] or argv[:2] == ["-m", "workbench.cli.gpu_results"]:
            rc = main(argv[2:])                      # this module: already imported, no second copy
        elif argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = ["-c", *argv[2:]]
            exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__"})
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, int) and e.code is not None:
            print(e.code, file=sys.stderr)
    finally:
        sys.stdout.flush()
        log.dump()
    return rc


def _partial_saver(key: str, extra: dict | None = None):
    return lambda rows: gpu_results.save_partial({**(extra or {}), key: list(rows)})


def _step(args) -> int:
    """The device check's own steps; each prints one JSON object last."""
    say = lambda msg: print(f"[{args.name}] {msg}", file=sys.stderr, flush=True)  # noqa: E731
    deadline = time.time() + args.budget_s if args.budget_s else None
    if args.name == "warmup-compile":
        from workbench.bench.kernel_cases import compile_shard

        print(json.dumps({"rows": compile_shard(args.shard, args.shards, args.device)}, default=str))
        return 0
    if args.name == "warmup":
        from workbench.bench.kernel_cases import warm_up

        res = warm_up(args.device, workers=args.workers, inductor=not args.no_inductor, deadline=deadline,
                      progress=say, on_rows=_partial_saver("rows"))
        print(json.dumps(res, default=str))
        bad = [r for r in res["rows"] if r["status"] == "error"]
        for r in bad:
            say(f"error: {r['source']} {r['case']}: {r['error']}")
        return 1 if bad else 0
    if args.name == "quant-kernels":
        import torch

        from workbench.bench import quant_kernels as qk
        from workbench.cli.quant import KERNEL_TOLERANCE

        cuda = (args.device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda")
        save = _partial_saver("kernels")
        rows: list = []

        def on_row(row):
            rows.append(row)
            save(rows)

        if cuda:
            ms = tuple(int(m) for m in args.kernel_ms.split(","))
            shapes = tuple(tuple(int(v) for v in s.lower().split("x")) for s in args.kernel_shapes.split(","))
            qk.quant_kernel_rows(ms=ms, shapes=shapes, device=args.device or "cuda", progress=say, on_row=on_row)
        else:
            qk.dry_run_rows(progress=say, on_row=on_row)
        bad = [f"{r['N']}x{r['K']} m={r['m']} {k}={r[k]:.2g}" for r in rows for k in r
               if k.endswith("_max_rel_err") and not k.startswith("dense") and r[k] is not None
               and not r[k] <= KERNEL_TOLERANCE]
        print(json.dumps({"kernels": rows, "kernels_table": qk.format_table(rows),
                          "kernel_errors_beyond_tolerance": bad, "dry_run": not cuda}, default=str))
        for b in bad:
            say(f"kernel error beyond {KERNEL_TOLERANCE:g}: {b}")
        return 1 if bad else 0
    if args.name == "prefetch-link":
        from workbench.bench.prefetch import link_step

        print(json.dumps(link_step(args.device, progress=say), default=str))
        return 0
    if args.name == "prefetch-stream":
        from workbench.bench.prefetch import prefetch_bench

        link = gpu_results.read_json_output(args.link_json) if args.link_json and Path(args.link_json).is_file() \
            else None
        res = prefetch_bench(smoke=True, device=args.device, options=("eager",), repeats=args.repeats, link=link,
                             deadline=deadline, progress=say, on_section=gpu_results.save_partial)
        print(json.dumps(res, default=str))
        return 0
    raise AssertionError(args.name)


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
    if args.cmd == "run":
        return _run(args.argv, args.triton)
    if args.cmd == "step":
        return _step(args)
    if args.cmd == "write-tables":
        done = write_tables(args.out_dir, args.work)
        for table, how in done.items():
            print(f"{table + '.csv':<18} {how}")
        return 0
    return _print_latest(args.table, args.root)


if __name__ == "__main__":
    sys.exit(main())
