"""``workbench run-notebooks``: execute notebooks with papermill (parameters, sweeps) and write
an HTML report."""

from __future__ import annotations

import json


def _json_or_str(v: str):
    try:
        return json.loads(v)
    except json.JSONDecodeError:
        return v


def cmd_run_notebooks(args) -> int:
    from workbench.lab.runner import run_notebooks

    params = {}
    for item in args.param or []:
        if "=" not in item:
            from workbench.errors import ConfigError
            raise ConfigError(f"--param {item!r}: expected NAME=VALUE (VALUE parsed as JSON when possible)")
        k, v = item.split("=", 1)
        params[k] = _json_or_str(v)
    sweep = {}
    for item in args.sweep or []:
        if "=" not in item:
            from workbench.errors import ConfigError
            raise ConfigError(f"--sweep {item!r}: expected NAME=V1,V2,... (each value parsed as JSON when possible)")
        k, v = item.split("=", 1)
        sweep[k] = [_json_or_str(x) for x in v.split(",")]
    result = run_notebooks(args.notebooks or None, parameters=params, out_dir=args.out, timeout=args.timeout,
                           progress=not args.quiet, sweep=sweep or None)
    if args.json:
        print(json.dumps(result, indent=2, default=str))
    else:
        for nb in result["notebooks"]:
            status = "ok" if nb["status"] == "ok" else f"FAILED: {nb.get('error', '')}"
            print(f"{nb['name']:<28} {nb['seconds']:>7.1f} s  {status}")
        print(f"report: {result['report']}")
    return 0 if all(nb["status"] == "ok" for nb in result["notebooks"]) else 1


def add_run_notebooks_parser(sub) -> None:
    r = sub.add_parser("run-notebooks", help="execute notebooks with papermill and write an HTML report")
    r.add_argument("notebooks", nargs="*", help="notebook names or paths (default: all in notebooks/)")
    r.add_argument("-p", "--param", action="append", help="NAME=VALUE injected into every notebook (repeatable)")
    r.add_argument("--sweep", action="append", help="NAME=V1,V2,... run each notebook once per point of the grid "
                                                    "of all --sweep values (repeatable); writes sweep.csv")
    r.add_argument("--out", default=None, help="output folder (default: runs/<timestamp>)")
    r.add_argument("--timeout", type=int, default=900, help="per-cell timeout in seconds")
    r.add_argument("--json", action="store_true", help="print the run summary as JSON")
    r.add_argument("--quiet", action="store_true", help="no progress bar")
    r.set_defaults(func=cmd_run_notebooks)
