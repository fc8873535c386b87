"""Run notebooks in batch with papermill, collect their results, write an HTML report.

::

    res = run_notebooks()                                  # every notebooks/*.ipynb, defaults
    res = run_notebooks(["00_tour"], parameters={"model": "/path/to/model", "mode": "full"})
    res["report"]                                          # runs/<UTC timestamp>/report.html
    res = run_notebooks(["04_scheduler"], sweep={"window_ms": [0, 5], "rate": [4, 8]}, jobs=2)
    res = run_notebooks(["04_scheduler"], sweep={"rate": [4, 8]}, executor="ray", address="auto", num_gpus=1)

Each notebook runs in a fresh kernel with its folder as the working directory; its executed
copy goes to the run folder, and the runner injects ``results_path`` (a JSON sidecar in the
run folder, see :mod:`workbench.lab.results`) next to the given parameters, and ``live=False``
where the notebook declares ``live`` (static figures, no live widgets: see :func:`batch_parameters`).  A notebook that
fails is recorded (status, error, seconds) and the run goes on; a kernel that fails to start
(a port race between kernels starting together) is retried once.  Then every sidecar is
collected into ``results.csv`` (one row per notebook and metric) and ``report.html``, which
works offline: plotly.js is inlined once for all figures.

Where the notebooks run is the executor's business (:mod:`workbench.lab.executors`): here one
after another (the default), up to ``jobs`` at once in local processes, or as Ray tasks on a
cluster with per-point resources.  This module alone decides what runs and where its files
go; records, results.csv and sweep.csv are in grid order whatever order the points finish in,
and each record names the worker that ran it (host, pid; Ray node, IP and worker id).  Ray is
imported only when a Ray run starts.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import shutil
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from workbench.errors import ConfigError
from workbench.lab.executors import Task, failed_record, make_executor
from workbench.lab.stacks import last_stack_dump, stack_dump_spec, stack_summary

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = ROOT / "notebooks"
RUNS = ROOT / "runs"
KERNEL_NAME = "python3"
FALLBACK_KERNEL = "workbench-python"

# Messages of a kernel that did not come up (nothing was executed): worth one retry.
_START_ERRORS = re.compile(r"address already in use|kernel died before replying|kinfo|didn't respond|"
                           r"did not respond|failed to start|startup|zmqerror", re.IGNORECASE)
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


# ---- what to run, where, with which kernel ----------------------------------------------------
def resolve_notebooks(notebooks=None) -> list[Path]:
    """Paths, or names under notebooks/ (with or without ``.ipynb``); default: all, sorted."""
    if not notebooks:
        found = sorted(NOTEBOOKS.glob("*.ipynb"))
        if not found:
            raise ConfigError(f"{NOTEBOOKS}: no notebooks (*.ipynb) to run")
        return found
    if isinstance(notebooks, (str, Path)):
        notebooks = [notebooks]
    out = []
    for nb in notebooks:
        p = Path(nb).expanduser()
        candidates = [p, NOTEBOOKS / p, NOTEBOOKS / f"{p}.ipynb"]
        hit = next((c for c in candidates if c.is_file() and c.suffix == ".ipynb"), None)
        if hit is None:
            have = ", ".join(x.stem for x in sorted(NOTEBOOKS.glob("*.ipynb"))) or "none"
            raise ConfigError(f"notebook {str(nb)!r} not found (give a path to a .ipynb file or a name in "
                              f"{NOTEBOOKS}: {have})")
        out.append(hit.resolve())
    return out


def new_run_dir(out_dir=None) -> Path:
    if out_dir is not None:
        d = Path(out_dir).expanduser().resolve()
        d.mkdir(parents=True, exist_ok=True)
        return d
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    d, k = RUNS / stamp, 1
    while d.exists():
        k += 1
        d = RUNS / f"{stamp}-{k}"
    d.mkdir(parents=True)
    return d


def resolve_kernel(kernel_name: str | None = None) -> str:
    """The kernel to run: ``kernel_name`` if given, else ``python3`` when that kernelspec runs
    this interpreter (jupyter_client maps a bare ``python`` to ``sys.executable``), else a
    kernelspec for ``sys.executable`` written under runs/.jupyter and put on JUPYTER_PATH, so
    the notebooks always see the same environment (and the same ``workbench``) as the runner."""
    if kernel_name:
        return kernel_name
    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel

    bare = {"python", f"python{sys.version_info[0]}", f"python{sys.version_info[0]}.{sys.version_info[1]}"}
    try:
        exe = KernelSpecManager().get_kernel_spec(KERNEL_NAME).argv[0]
        # Same bin/ folder = same environment (python and python3 are both links in a venv).
        if exe in bare or _same_dir(exe, sys.executable):
            return KERNEL_NAME
    except NoSuchKernel:
        pass
    base = RUNS / ".jupyter"
    spec_dir = base / "kernels" / FALLBACK_KERNEL
    spec_dir.mkdir(parents=True, exist_ok=True)
    (spec_dir / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": f"Python ({sys.executable})", "language": "python"}, indent=1))
    paths = os.environ.get("JUPYTER_PATH", "")
    if str(base) not in paths.split(os.pathsep):
        os.environ["JUPYTER_PATH"] = os.pathsep.join(p for p in (str(base), paths) if p)
    return FALLBACK_KERNEL


def declared_parameters(nb: Path) -> set[str]:
    """The names a notebook's ``parameters`` cell assigns (papermill's own reading of it)."""
    import papermill as pm

    return set(pm.inspect_notebook(str(nb)))


def batch_parameters(nb: Path, parameters: dict) -> dict:
    """``parameters`` plus ``live=False`` for a notebook that declares ``live`` (unless given): a
    batch run shows each figure once, as a static figure, and no live widget (papermill
    attaches a kernel too, so the notebook cannot tell a batch run from a person by itself)."""
    if "live" not in parameters and "live" in declared_parameters(nb):
        return {**parameters, "live": False}
    return dict(parameters)


def _same_dir(a: str, b: str) -> bool:
    try:
        return os.path.samefile(os.path.dirname(a), os.path.dirname(b))
    except OSError:
        return False


# ---- one notebook ------------------------------------------------------------------------------
def _strip_widget_state(path: Path) -> None:
    """Belt and braces for store_widget_state=False: no widget bundle in saved notebooks."""
    import nbformat

    nb = nbformat.read(str(path), as_version=4)
    if "widgets" in nb.metadata:
        del nb.metadata["widgets"]
        nbformat.write(nb, str(path))


@contextlib.contextmanager
def _kernel_env(name: str, value: str | None):
    """``name=value`` in this process' environment while a kernel starts (it inherits it)."""
    if value is None:
        yield
        return
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


def execute_one(nb: Path, output: Path, parameters: dict, timeout: int | None, kernel_name: str,
                attempts: int = 2, cwd: Path | None = None) -> dict:
    """Execute one notebook with papermill (working directory ``cwd``, default the notebook's
    folder); never raises for a notebook's own failure.  A notebook whose cell runs past
    ``timeout`` is recorded with where its threads were then (``stacks``: the kernel's last
    stack dump, next to the executed copy; the error names the innermost frames)."""
    import papermill as pm
    from papermill.exceptions import PapermillExecutionError

    from workbench import STACK_DUMP_ENV

    cwd = Path(nb).parent if cwd is None else Path(cwd)
    rec = {"name": nb.stem, "status": "ok", "seconds": 0.0, "output": str(output), "error": None,
           "source": str(nb), "attempts": 0, "cwd": str(cwd)}
    dumps = Path(output).parent / f".{Path(output).stem}.stacks"
    spec = stack_dump_spec(timeout, dumps)
    if spec is not None:
        shutil.rmtree(dumps, ignore_errors=True)
        dumps.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    for attempt in range(1, attempts + 1):
        rec["attempts"] = attempt
        try:
            with _kernel_env(STACK_DUMP_ENV, spec):
                pm.execute_notebook(str(nb), str(output), parameters=parameters, kernel_name=kernel_name,
                                    progress_bar=False, log_output=False, cwd=str(cwd),
                                    execution_timeout=timeout, store_widget_state=False)
            rec["status"], rec["error"] = "ok", None
            break
        except PapermillExecutionError as e:       # a cell raised: the notebook's own failure
            rec["status"] = "failed"
            rec["error"] = f"cell {e.exec_count}: {e.ename}: {_ANSI.sub('', str(e.evalue))}"
            break
        except Exception as e:  # noqa: BLE001 - a failed notebook must not stop the run
            rec["status"] = "failed"
            rec["error"] = f"{type(e).__name__}: {_ANSI.sub('', str(e))}".strip()
            if attempt < attempts and _START_ERRORS.search(f"{type(e).__name__} {e}"):
                time.sleep(1.0)
                continue
            break
    rec["seconds"] = time.monotonic() - t0
    if output.is_file():
        with contextlib.suppress(Exception):       # a half-written output is still worth keeping
            _strip_widget_state(output)
    if spec is not None:
        dump = last_stack_dump(dumps) if rec["status"] != "ok" and "timed out" in (rec["error"] or "") else None
        if dump is not None:
            stacks = Path(output).with_suffix(".stacks.txt")
            stacks.write_text(dump)
            rec["stacks"] = str(stacks)
            rec["error"] += f" | where its threads were: {stack_summary(dump)} (all stacks: {stacks})"
        shutil.rmtree(dumps, ignore_errors=True)
    return rec


# ---- the run -----------------------------------------------------------------------------------
def sweep_points(sweep: dict | None) -> list[dict]:
    """The grid of a sweep: ``{"window_ms": [0, 5], "rate": [4, 8]}`` -> 4 points, in order."""
    if not sweep:
        return [{}]
    for k, values in sweep.items():
        if not isinstance(values, (list, tuple)) or not values:
            raise ConfigError(f"sweep parameter {k!r}: expected a non-empty list of values, got {values!r}")
    keys = list(sweep)
    return [dict(zip(keys, combo)) for combo in itertools.product(*(sweep[k] for k in keys))]


def point_label(point: dict) -> str:
    """A file-name-safe label of a sweep point: ``window_ms-5_rate-4``."""
    return "_".join(f"{k}-{re.sub(r'[^A-Za-z0-9.+-]+', '', str(v)) or 'x'}" for k, v in point.items())


def run_notebooks(notebooks=None, parameters: dict | None = None, out_dir=None, timeout: int | None = 900,
                  progress: bool = True, kernel_name: str | None = None, sweep: dict | None = None,
                  executor="local", jobs: int | None = None, address: str | None = None,
                  num_cpus: float | None = None, num_gpus: float | None = None, memory=None,
                  resources: dict | None = None, check_resources: bool = True,
                  point_timeout: float | None = None) -> dict:
    """Execute notebooks; returns {"run_dir", "report", "results_csv", "notebooks": [{"name",
    "status", "seconds", "output", "error", "point", "worker", ...}]} (+ "sweep_csv").

    ``parameters`` go to every notebook (plus its own ``results_path``); ``timeout`` is per
    cell, in seconds (None: no limit).  ``sweep`` (``{name: [values]}``) runs every notebook
    once per point of the grid, the point's values overriding ``parameters``; each point is
    its own record (a failed point is recorded and the sweep goes on), and ``sweep.csv`` holds
    one row per point with its parameters, status, metrics and the worker that ran it.

    ``executor``: ``"local"`` (``jobs`` points at once, default 1: one after another in this
    process), ``"ray"`` (one Ray task per point on the cluster at ``address``, each asking for
    ``num_cpus`` (default 1), ``num_gpus``, ``memory`` (bytes or "8GiB") and custom
    ``resources``; ``check_resources=False`` skips the check that some node can hold one point),
    or an executor object from :mod:`workbench.lab.executors`.

    ``point_timeout`` (seconds, default None: no limit) bounds one point's wall-clock time: a
    point that runs longer is stopped with its kernel and recorded as failed ("exceeded N s");
    locally every point then runs in a fresh process, also with ``jobs=1``.

    Nothing finished is lost: if the run stops early (Ctrl-C, or an error escaping the
    executor), every point without a record gets a failed row saying why, and summary.json,
    results.csv, sweep.csv and the report are still written; a KeyboardInterrupt is raised
    again after that, other errors end up in the rows.
    """
    from tqdm.auto import tqdm

    paths = resolve_notebooks(notebooks)
    parameters = dict(parameters or {})
    if "results_path" in parameters:
        raise ConfigError("run_notebooks: results_path is set by the runner for each notebook; do not pass it")
    points = sweep_points(sweep)
    if sweep and "results_path" in sweep:
        raise ConfigError("run_notebooks: results_path cannot be swept")
    if point_timeout is not None and (isinstance(point_timeout, bool) or not isinstance(point_timeout, (int, float))
                                      or point_timeout <= 0):
        raise ConfigError(f"point_timeout (--point-timeout) = {point_timeout!r}: expected seconds > 0 (or None)")
    ex = make_executor(executor, jobs=jobs, address=address, num_cpus=num_cpus, num_gpus=num_gpus, memory=memory,
                       resources=resources, check_resources=check_resources)
    ex.prepare()                  # e.g. Ray missing, no cluster, no node fits a point: said before any run folder
    try:
        run_dir = new_run_dir(out_dir)
        kernel = ex.kernel(kernel_name)
    except BaseException:
        ex.close()
        raise
    started = datetime.now(timezone.utc)

    tasks, seen = [], set()
    for nb in paths:
        for point in points:
            stem = nb.stem + (f"__{point_label(point)}" if point else "")
            stem = stem if stem not in seen else f"{stem}-{len(seen)}"
            seen.add(stem)
            tasks.append(Task(index=len(tasks), name=stem, notebook=nb, parameters=batch_parameters(nb, {**parameters, **point}),
                              output=run_dir / f"{stem}.ipynb", results=run_dir / f"{stem}.results.json",
                              timeout=timeout, kernel=kernel, point=dict(point), point_timeout=point_timeout))

    records: list = [None] * len(tasks)
    bar = tqdm(total=len(tasks), desc="notebooks", unit="nb", disable=not progress, file=sys.stderr)

    def done(task: Task, rec: dict) -> None:
        rec["name"], rec["notebook"], rec["point"] = task.name, task.notebook.stem, dict(task.point)
        rec["output"], rec["source"] = str(task.output), str(task.notebook)
        rec["results"] = str(task.results) if task.results.is_file() else None
        records[task.index] = rec
        with contextlib.suppress(Exception):          # a progress bar never costs a record
            bar.set_postfix_str(task.name)
            bar.update()

    stopped: BaseException | None = None
    try:
        try:
            ex.run(tasks, done)
        finally:
            with contextlib.suppress(Exception):
                bar.close()
            ex.close()
    except BaseException as e:  # noqa: BLE001 - written down below; Ctrl-C is raised again after that
        stopped = e
    try:
        return _write_run(run_dir, tasks, records, done, ex, stopped, parameters=parameters, started=started,
                          kernel=kernel, sweep=sweep)
    finally:
        if stopped is not None and not isinstance(stopped, Exception):
            raise stopped                        # KeyboardInterrupt, SystemExit: after the files are written


def _write_run(run_dir: Path, tasks: list, records: list, done, ex, stopped, parameters: dict, started, kernel,
               sweep) -> dict:
    """Fill the rows of points without a record, then write summary.json, results.csv, sweep.csv
    and the report."""
    if stopped is None:
        why = f"the {ex.name} executor returned no record for this point"
    elif isinstance(stopped, KeyboardInterrupt):
        why = "not run (or not finished): the run was interrupted (KeyboardInterrupt)"
    else:
        text = _ANSI.sub("", str(stopped)).strip().splitlines()
        why = (f"not run (or not finished): the {ex.name} executor stopped: {type(stopped).__name__}"
               + (f": {text[0]}" if text else ""))
    for task in tasks:                               # an executor that lost a task: still one row for it
        if records[task.index] is None:
            done(task, failed_record(task, why))
    (run_dir / "summary.json").write_text(json.dumps(records, indent=2, default=str))     # first: the least to go wrong

    from workbench.lab.results import collect_results, write_report

    results = collect_results(records)
    csv = run_dir / "results.csv"
    results["metrics"].to_csv(csv, index=False)
    out = {"run_dir": str(run_dir), "results_csv": str(csv), "notebooks": records}
    if sweep:
        out["sweep_csv"] = str(run_dir / "sweep.csv")
        results["sweep"].to_csv(out["sweep_csv"], index=False)
    out["report"] = str(write_report(run_dir / "report.html", records, results, parameters=parameters,
                                     started=started, kernel=kernel or "each worker's own Python",
                                     sweep=sweep, executor=ex.describe()))
    return out
