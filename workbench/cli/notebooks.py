"""``workbench run-notebooks``: execute notebooks with papermill (parameters, sweeps) and write
an HTML report; the points run here (``--jobs N`` at once) or as Ray tasks on a cluster
(``--executor ray --address ... --num-gpus 1``)."""

from __future__ import annotations

import json


def _json_or_str(v: str, where: str = "value"):
    """A value as JSON (number, true/false/null, "text", [list], {object}), else the text itself;
    text that starts like a JSON string, list or object must be one (no silent fallback to a
    string that merely looks like a list)."""
    from workbench.errors import ConfigError

    try:
        return json.loads(v)
    except json.JSONDecodeError as e:
        if v.lstrip()[:1] in ('"', "[", "{"):
            raise ConfigError(f"{where}: {v!r} starts like JSON but is not JSON ({e.msg} at character {e.pos}); write "
                              "it as JSON (e.g. [1, 2] or \"text\"), or as plain text that does not start with [, { or "
                              '"') from None
        return v


def split_values(text: str, where: str) -> list[str]:
    """``--sweep`` values: split at the commas outside brackets, braces and JSON strings, so
    ``[1,2],[3,4]`` is two values (two lists) and ``"a,b",c`` is two (a string with a comma, and c)."""
    from workbench.errors import ConfigError

    out, depth, start, quote, escaped = [], [], 0, False, False
    pairs = {"[": "]", "{": "}"}
    for i, ch in enumerate(text):
        if quote:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                quote = False
        elif ch == '"':
            quote = True
        elif ch in pairs:
            depth.append(pairs[ch])
        elif ch in "]}":
            if not depth or depth.pop() != ch:
                raise ConfigError(f"{where}: unbalanced {ch!r} at character {i} of {text!r}")
        elif ch == "," and not depth:
            out.append(text[start:i])
            start = i + 1
    if quote or depth:
        raise ConfigError(f"{where}: {text!r} ends inside a JSON {'string' if quote else 'list or object'} "
                          f"(missing {'a closing quote' if quote else repr(depth[-1])})")
    return out + [text[start:]]


def _resources(text: str | None) -> dict | None:
    from workbench.errors import ConfigError

    if text is None:
        return None
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"--resources {text!r}: not JSON ({e}); expected an object, e.g. "
                          "'{\"accelerator_type:H100\": 1}'") from None
    if not isinstance(d, dict):
        raise ConfigError(f"--resources {text!r}: expected a JSON object {{name: amount}}")
    return d


def cmd_run_notebooks(args) -> int:
    from workbench.errors import ConfigError
    from workbench.lab.runner import check_name, run_notebooks

    params = {}
    if args.model is not None:          # the same as -p model='"DIR"': every notebook on that checkpoint
        params["model"] = args.model
    for item in args.param or []:
        if "=" not in item:
            raise ConfigError(f"--param {item!r}: expected NAME=VALUE (VALUE parsed as JSON when possible)")
        k, v = item.split("=", 1)
        params[check_name(k, f"--param {item!r}: the")] = _json_or_str(v, f"--param {k}")
    sweep = {}
    for item in args.sweep or []:
        if "=" not in item:
            raise ConfigError(f"--sweep {item!r}: expected NAME=V1,V2,... (each value parsed as JSON when possible)")
        k, v = item.split("=", 1)
        check_name(k, f"--sweep {item!r}: the")
        if k in sweep:
            raise ConfigError(f"--sweep {k}: given twice; give all its values in one --sweep {k}=V1,V2,...")
        sweep[k] = [_json_or_str(x, f"--sweep {k}") for x in split_values(v, f"--sweep {k}")]
    result = run_notebooks(args.notebooks or None, parameters=params, out_dir=args.out, timeout=args.timeout,
                           progress=not args.quiet, sweep=sweep or None, executor=args.executor, jobs=args.jobs,
                           address=args.address, num_cpus=args.num_cpus, num_gpus=args.num_gpus,
                           memory=args.memory, resources=_resources(args.resources),
                           check_resources=not args.no_resource_check, point_timeout=args.point_timeout,
                           resume=args.resume, overwrite=args.overwrite)
    if args.json:
        print(json.dumps(result, indent=2, default=str))
    else:
        for nb in result["notebooks"]:
            status = "ok" if nb["status"] == "ok" else f"FAILED: {nb.get('error', '')}"
            w = nb.get("worker") or {}
            where = f"{w.get('ip') or w.get('host') or '?'}:{w.get('pid') or '?'}"
            print(f"{nb['name']:<28} {nb['seconds']:>7.1f} s  {where:<22} {status}")
        if "sweep_csv" in result:
            print(f"sweep: {result['sweep_csv']}")
        print(f"report: {result['report']}")
    return 0 if all(nb["status"] == "ok" for nb in result["notebooks"]) else 1


def add_run_notebooks_parser(sub) -> None:
    r = sub.add_parser("run-notebooks", help="execute notebooks with papermill and write an HTML report")
    r.add_argument("notebooks", nargs="*", help="notebook names or paths (default: all in notebooks/)")
    r.add_argument("-p", "--param", action="append", help="NAME=VALUE injected into every notebook (repeatable)")
    r.add_argument("--sweep", action="append", help="NAME=V1,V2,... run each notebook once per point of the grid "
                                                    "of all --sweep values (repeatable); writes sweep.csv. Each value "
                                                    "is read as JSON when possible; commas inside [..], {..} or \"..\" "
                                                    "do not split: sizes=[1,2],[3,4] is two lists")
    r.add_argument("--out", default=None, help="the run's folder, new or empty (default: runs/<UTC time>); never "
                                               "the notebooks' own folder")
    again = r.add_mutually_exclusive_group()
    again.add_argument("--resume", action="store_true",
                       help="--out holds a run of the same notebooks, parameters and sweep: keep the notebooks that "
                            "finished ok there (their files), run the rest, rewrite results.csv and the report")
    again.add_argument("--overwrite", action="store_true",
                       help="--out holds a run: delete the files it wrote (named in its summary.json), then run; "
                            "other files in the folder are left alone")
    r.add_argument("--model", default=None,
                   help="a Hugging Face-format folder every notebook runs on instead of the bundled model (the same "
                        "as -p model='\"DIR\"'; e.g. one written by workbench import-gguf)")
    r.add_argument("--timeout", type=int, default=900, help="per-cell timeout in seconds")
    r.add_argument("--point-timeout", type=float, default=None, metavar="SECONDS",
                   help="wall-clock limit for one notebook run / sweep point (default: none): a point that runs "
                        "longer is stopped with its kernel and recorded as failed ('exceeded N s'); locally each "
                        "point then runs in its own process, also with --jobs 1")
    r.add_argument("--json", action="store_true", help="print the run summary as JSON")
    r.add_argument("--quiet", action="store_true", help="no progress bar")
    x = r.add_argument_group("where the points run")
    x.add_argument("--executor", choices=["local", "ray"], default="local",
                   help="local: on this machine (see --jobs); ray: one Ray task per notebook and sweep point on "
                        "an existing Ray cluster (needs pip install -e \".[ray]\", and the workbench on every node)")
    x.add_argument("--jobs", type=int, default=None, metavar="N",
                   help="local: run up to N points at once, one process each (default 1: one after another in "
                        "this process, where a kernel that kills its parent ends the whole run; with N >= 2 or "
                        "--point-timeout it fails only its point); each kernel uses its own threads")
    x.add_argument("--address", default=None,
                   help="ray: the cluster, e.g. HOST:6379, 'auto' (on a cluster node) or ray://HOST:10001 (Ray "
                        "Client); default: RAY_ADDRESS, else a cluster started by `ray start` here, else a new "
                        "local one")
    x.add_argument("--num-cpus", type=float, default=None, metavar="N",
                   help="ray: CPUs one point asks for (default 1; Ray sets the kernel's OMP_NUM_THREADS to it)")
    x.add_argument("--num-gpus", type=float, default=None, metavar="N",
                   help="ray: GPUs one point asks for, e.g. 1 (Ray sets CUDA_VISIBLE_DEVICES for its kernel; "
                        "0.5 lets two points share one)")
    x.add_argument("--memory", default=None, metavar="SIZE",
                   help="ray: memory one point reserves, e.g. 8GiB or 512MB (a scheduling reservation, not a limit)")
    x.add_argument("--resources", default=None, metavar="JSON",
                   help="ray: custom resources one point asks for, e.g. '{\"accelerator_type:H100\": 1}'")
    x.add_argument("--no-resource-check", action="store_true",
                   help="ray: submit even when no live node has what one point asks for (an autoscaling cluster "
                        "whose nodes are not up yet); otherwise that is an error, not a wait forever")
    r.set_defaults(func=cmd_run_notebooks)
