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
works offline: plotly.js is inlined once for all figures (and, by its hash in the page's
Content-Security-Policy, is with the figures' calls the only script that may run there).

Parameter and sweep names must be Python identifiers: papermill writes each parameter into the
notebook as ``NAME = VALUE``, so a name is code (:func:`check_name`).  The run folder is the
business of :mod:`workbench.lab.run_folder`: a new or empty folder (or ``resume`` /
``overwrite`` of a run there), never the notebooks' own; every file lands whole (papermill
writes ``.<name>.partial.ipynb``, renamed when the notebook ends); ``summary.json`` is written
first, after each notebook and last, and names only files that are there, whenever the run
is stopped (Ctrl-C, SIGTERM: the rest is written as for an early stop; SIGKILL: what had ended).

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
import keyword
import os
import re
import shutil
import signal
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

from workbench.errors import ConfigError
from workbench.lab.executors import Task, failed_record, make_executor
from workbench.lab.run_folder import atomic_csv, atomic_write, open_run_folder, partial_path
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


def check_name(name, where: str = "parameter") -> str:
    """``name`` if it is a Python identifier (not a keyword), else a ConfigError: papermill writes
    each parameter into the notebook as ``NAME = VALUE``, so a name is code that runs (``import
    os;os.system(...);x`` would)."""
    if not isinstance(name, str) or not name.isidentifier() or keyword.iskeyword(name):
        raise ConfigError(f"{where} name {name!r} is not a Python identifier (letters, digits and _, not "
                          "starting with a digit, not a keyword): the notebook's parameters cell assigns it")
    return name


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
    """``parameters`` plus, unless given, ``live=False`` for a notebook that declares ``live``: a
    batch run shows each figure once, as a static figure, and no live widget (papermill
    attaches a kernel too, so the notebook cannot tell a batch run from a person by itself); and
    ``exercises="solutions"`` for a notebook that declares ``exercises``: a batch run fills every
    exercise with its solution and runs its checker (:mod:`workbench.exercises`)."""
    declared = declared_parameters(nb)
    out = dict(parameters)
    if "live" not in parameters and "live" in declared:
        out["live"] = False
    if "exercises" not in parameters and "exercises" in declared:
        out["exercises"] = "solutions"
    return out


def _same_dir(a: str, b: str) -> bool:
    try:
        return os.path.samefile(os.path.dirname(a), os.path.dirname(b))
    except OSError:
        return False


# ---- one notebook ------------------------------------------------------------------------------
def _land_output(partial: Path, output: Path) -> None:
    """Move the executed notebook papermill wrote to ``partial`` to ``output`` in one rename (a
    notebook killed half-way never leaves a half-written ``output``), with no widget bundle (belt
    and braces for store_widget_state=False) and papermill's ``output_path`` naming ``output``."""
    import nbformat

    with contextlib.suppress(Exception):       # a notebook nbformat cannot read is still worth keeping
        nb = nbformat.read(str(partial), as_version=4)
        nb.metadata.pop("widgets", None)
        pm = nb.metadata.get("papermill")
        if isinstance(pm, dict) and pm.get("output_path") == str(partial):
            pm["output_path"] = str(output)
        nbformat.write(nb, str(partial))
    os.replace(partial, output)


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
    folder); never raises for a notebook's own failure.  papermill writes the executed copy
    beside ``output`` (``.<name>.partial.ipynb``), which becomes ``output`` in one rename when
    the notebook ends, failed or not: a notebook killed half-way leaves no half ``output``.  A
    notebook whose cell runs past ``timeout`` is recorded with where its threads were then
    (``stacks``: the kernel's last stack dump, next to the executed copy; the error names the
    innermost frames)."""
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
    partial = partial_path(output)
    t0 = time.monotonic()
    for attempt in range(1, attempts + 1):
        rec["attempts"] = attempt
        try:
            with _kernel_env(STACK_DUMP_ENV, spec):
                pm.execute_notebook(str(nb), str(partial), parameters=parameters, kernel_name=kernel_name,
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
    if partial.is_file():                          # also a failed notebook's copy: it shows where it failed
        _land_output(partial, Path(output))
    if spec is not None:
        dump = last_stack_dump(dumps) if rec["status"] != "ok" and "timed out" in (rec["error"] or "") else None
        if dump is not None:
            stacks = Path(output).with_suffix(".stacks.txt")
            atomic_write(stacks, dump)
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
        check_name(k, "sweep parameter")
        if not isinstance(values, (list, tuple)) or not values:
            raise ConfigError(f"sweep parameter {k!r}: expected a non-empty list of values, got {values!r}")
    keys = list(sweep)
    return [dict(zip(keys, combo)) for combo in itertools.product(*(sweep[k] for k in keys))]


def point_label(point: dict) -> str:
    """A file-name-safe label of a sweep point: ``window_ms-5_rate-4``."""
    return "_".join(f"{re.sub(r'[^A-Za-z0-9_]+', '', str(k)) or 'p'}-{re.sub(r'[^A-Za-z0-9.+-]+', '', str(v)) or 'x'}"
                    for k, v in point.items())


class RunStopped(SystemExit):
    """SIGTERM to a run: raised where the run is, so that it stops its points and writes what
    finished (as for Ctrl-C), then the process exits with 128 + the signal's number."""

    def __init__(self, signum: int):
        super().__init__(128 + signum)
        self.signal_name = signal.Signals(signum).name


@contextlib.contextmanager
def _signals_stop_the_run(state: dict):
    """While a run's points run: SIGINT is Ctrl-C (KeyboardInterrupt), SIGTERM raises
    :class:`RunStopped`; while ``state["defer"]`` (the run writing its files) either is only
    noted in ``state["pending"]`` and raised by the caller once the files are written.  Only
    where handlers can be set (the main thread)."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        if state.get("defer"):
            state["pending"] = signum
            return
        raise KeyboardInterrupt() if signum == signal.SIGINT else RunStopped(signum)

    old = {}
    try:
        for sig in (signal.SIGINT, signal.SIGTERM):
            old[sig] = signal.signal(sig, handler)
        yield
    finally:
        for sig, h in old.items():
            with contextlib.suppress(ValueError, OSError, TypeError):
                signal.signal(sig, h)


def _plan_entry(task: Task) -> dict:
    return {"name": task.name, "notebook": str(task.notebook), "point": dict(task.point),
            "parameters": dict(task.parameters), "output": task.output.name, "results": task.results.name}


def run_notebooks(notebooks=None, parameters: dict | None = None, out_dir=None, timeout: int | None = 900,
                  progress: bool = True, kernel_name: str | None = None, sweep: dict | None = None,
                  executor="local", jobs: int | None = None, address: str | None = None,
                  num_cpus: float | None = None, num_gpus: float | None = None, memory=None,
                  resources: dict | None = None, check_resources: bool = True,
                  point_timeout: float | None = None, resume: bool = False, overwrite: bool = False) -> dict:
    """Execute notebooks; returns {"run_dir", "report", "results_csv", "notebooks": [{"name",
    "status", "seconds", "output", "error", "point", "worker", ...}]} (+ "sweep_csv").

    ``parameters`` go to every notebook (plus its own ``results_path``); their names, and the
    sweep's, must be Python identifiers (papermill writes ``NAME = VALUE`` into the notebook).
    ``timeout`` is per cell, in seconds (None: no limit).  ``sweep`` (``{name: [values]}``) runs
    every notebook once per point of the grid, the point's values overriding ``parameters``; each
    point is its own record (a failed point is recorded and the sweep goes on), and ``sweep.csv``
    holds one row per point with its parameters, status, metrics and the worker that ran it.

    ``out_dir``: the run folder, new or empty (default ``runs/<UTC time>``); never the source
    notebooks' folder.  A folder that holds a run needs ``resume=True`` (keep its notebooks that
    finished ok, with their files, and run the rest: the same notebooks, parameters and sweep) or
    ``overwrite=True`` (delete that run's files, then run).  See :mod:`workbench.lab.run_folder`:
    every file lands whole, and ``summary.json`` names only files that are there ("status":
    "running" while the run goes on, updated as each notebook ends; "complete" or "interrupted",
    written last).

    ``executor``: ``"local"`` (``jobs`` points at once, default 1: one after another in this
    process), ``"ray"`` (one Ray task per point on the cluster at ``address``, each asking for
    ``num_cpus`` (default 1), ``num_gpus``, ``memory`` (bytes or "8GiB") and custom
    ``resources``; ``check_resources=False`` skips the check that some node can hold one point),
    or an executor object from :mod:`workbench.lab.executors`.

    ``point_timeout`` (seconds, default None: no limit) bounds one point's wall-clock time: a
    point that runs longer is stopped with its kernel and recorded as failed ("exceeded N s");
    locally every point then runs in a fresh process, also with ``jobs=1``.

    Nothing finished is lost: if the run stops early (Ctrl-C, SIGTERM, or an error escaping the
    executor), every point without a record gets a failed row saying why, and results.csv,
    sweep.csv, the report and summary.json ("interrupted") are still written; a
    KeyboardInterrupt (or SIGTERM's :class:`RunStopped`) is raised again after that, other
    errors end up in the rows.  A SIGKILL leaves the summary of the notebooks that had ended.
    """
    paths = resolve_notebooks(notebooks)
    parameters, points = _checked_arguments(parameters, sweep, point_timeout)
    ex = make_executor(executor, jobs=jobs, address=address, num_cpus=num_cpus, num_gpus=num_gpus, memory=memory,
                       resources=resources, check_resources=check_resources)
    folder = None
    try:
        # every refusal of the folder comes before the executor connects or starts anything
        folder = open_run_folder(out_dir, resume=resume, overwrite=overwrite, sources=paths,
                                 notebooks_dir=NOTEBOOKS, runs_dir=RUNS)
        ex.prepare()              # e.g. Ray missing, no cluster, no node fits a point
        run_dir = folder.path
        kernel = ex.kernel(kernel_name)
        tasks = _plan_tasks(paths, points, parameters, run_dir, timeout=timeout, kernel=kernel,
                            point_timeout=point_timeout)
    except BaseException:
        ex.close()
        if folder is not None:
            folder.close()
            if folder.created:
                _remove_if_empty(folder.path)
        raise
    started = datetime.now(UTC)
    return _run_tasks(folder, ex, tasks, progress=progress, parameters=parameters, sweep=sweep, kernel=kernel,
                      started=started)


def _checked_arguments(parameters: dict | None, sweep: dict | None, point_timeout) -> tuple[dict, list[dict]]:
    """The parameters (a copy) and the sweep's points, refused with a ConfigError when a name is not
    a Python identifier, ``results_path`` is passed or swept, or ``point_timeout`` is not seconds > 0."""
    parameters = dict(parameters or {})
    for k in parameters:
        check_name(k, "parameter")
    if "results_path" in parameters:
        raise ConfigError("run_notebooks: results_path is set by the runner for each notebook; do not pass it")
    points = sweep_points(sweep)
    if sweep and "results_path" in sweep:
        raise ConfigError("run_notebooks: results_path cannot be swept")
    if point_timeout is not None and (isinstance(point_timeout, bool) or not isinstance(point_timeout, (int, float))
                                      or point_timeout <= 0):
        raise ConfigError(f"point_timeout (--point-timeout) = {point_timeout!r}: expected seconds > 0 (or None)")
    return parameters, points


def _plan_tasks(paths: list[Path], points: list[dict], parameters: dict, run_dir: Path, *, timeout, kernel,
                point_timeout) -> list[Task]:
    """One task per notebook and sweep point, named after both (a repeated name gets a numbered suffix),
    its files in ``run_dir``."""
    tasks, seen = [], set()
    for nb in paths:
        for point in points:
            stem = nb.stem + (f"__{point_label(point)}" if point else "")
            stem = stem if stem not in seen else f"{stem}-{len(seen)}"
            seen.add(stem)
            tasks.append(Task(index=len(tasks), name=stem, notebook=nb,
                              parameters=batch_parameters(nb, {**parameters, **point}),
                              output=run_dir / f"{stem}.ipynb", results=run_dir / f"{stem}.results.json",
                              timeout=timeout, kernel=kernel, point=dict(point), point_timeout=point_timeout))
    return tasks


def _run_tasks(folder, ex, tasks: list[Task], *, progress: bool, parameters: dict, sweep: dict | None, kernel,
               started: datetime) -> dict:
    """Run the tasks a resumed folder has not kept on the executor, record each as it ends, then write
    the run's files (:func:`_write_run`) however the run stopped; Ctrl-C or SIGTERM is raised again
    after that.  Closes the executor and the folder."""
    from tqdm.auto import tqdm

    records: list = [None] * len(tasks)
    state: dict = {"defer": False, "pending": None}
    stopped: BaseException | None = None
    try:
        with _signals_stop_the_run(state):
            try:
                kept = folder.begin([_plan_entry(t) for t in tasks],
                                    {"parameters": parameters, "sweep": sweep, "kernel": kernel,
                                     "executor": _describe(ex), "mode": folder.mode or "new"})
            except BaseException:
                ex.close()
                raise
            for task in tasks:
                if task.name in kept:
                    records[task.index] = kept[task.name]
            todo = [t for t in tasks if records[t.index] is None]
            bar = tqdm(total=len(todo), desc="notebooks", unit="nb", disable=not progress, file=sys.stderr)

            def done(task: Task, rec: dict, write: bool = True) -> None:
                rec["name"], rec["notebook"], rec["point"] = task.name, task.notebook.stem, dict(task.point)
                rec["source"] = str(task.notebook)
                # what the summary names is on disk: a point that wrote no file names none
                rec["output"] = str(task.output) if task.output.is_file() else None
                rec["results"] = str(task.results) if task.results.is_file() else None
                records[task.index] = rec
                if write:
                    folder.update(records)
                with contextlib.suppress(Exception):          # a progress bar never costs a record
                    bar.set_postfix_str(task.name)
                    bar.update()

            try:
                try:
                    ex.run(todo, done)
                finally:
                    with contextlib.suppress(Exception):
                        bar.close()
                    ex.close()
            except BaseException as e:  # noqa: BLE001 - written down below; Ctrl-C, SIGTERM raised again after that
                stopped = e
            state["defer"] = True                            # a signal now waits until the files are written
            try:
                return _write_run(folder, tasks, records, done, ex, stopped, parameters=parameters,
                                  started=started, kernel=kernel, sweep=sweep)
            finally:
                state["defer"] = False
                folder.close()
                if stopped is not None and not isinstance(stopped, Exception):
                    raise stopped                    # KeyboardInterrupt, SystemExit: after the files are written
                if state["pending"] is not None:
                    sig = state["pending"]
                    raise KeyboardInterrupt() if sig == signal.SIGINT else RunStopped(sig)
    finally:
        folder.close()


def _describe(ex) -> str | None:
    try:
        return ex.describe()
    except Exception:  # noqa: BLE001 - a description never stops a run
        return None


def _remove_if_empty(d: Path) -> None:
    """A run refused after its folder was made leaves no empty folder behind (the lock aside)."""
    from workbench.lab.run_folder import LOCK

    with contextlib.suppress(OSError):
        if {p.name for p in d.iterdir()} <= {LOCK}:
            (d / LOCK).unlink(missing_ok=True)
            d.rmdir()


def _write_run(folder, tasks: list, records: list, done, ex, stopped, parameters: dict, started, kernel,
               sweep) -> dict:
    """Fill the rows of points without a record, then write results.csv, sweep.csv, the report
    and, last, summary.json ("complete", or "interrupted" when the run stopped early or a file
    could not be written)."""
    run_dir = folder.path
    if stopped is None:
        why = f"the {ex.name} executor returned no record for this point"
    elif isinstance(stopped, KeyboardInterrupt):
        why = "not run (or not finished): the run was interrupted (KeyboardInterrupt)"
    elif isinstance(stopped, RunStopped):
        why = f"not run (or not finished): the run was stopped ({stopped.signal_name})"
    else:
        text = _ANSI.sub("", str(stopped)).strip().splitlines()
        why = (f"not run (or not finished): the {ex.name} executor stopped: {type(stopped).__name__}"
               + (f": {text[0]}" if text else ""))
    for task in tasks:                               # an executor that lost a task: still one row for it
        if records[task.index] is None:
            done(task, failed_record(task, why), write=False)

    from workbench.lab.results import collect_results, write_report

    out = {"run_dir": str(run_dir), "notebooks": records}
    failure = None
    try:
        results = collect_results(records)
        out["results_csv"] = str(atomic_csv(results["metrics"], run_dir / "results.csv"))
        if sweep:
            out["sweep_csv"] = str(atomic_csv(results["sweep"], run_dir / "sweep.csv"))
        out["report"] = str(write_report(run_dir / "report.html", records, results, parameters=parameters,
                                         started=started, kernel=kernel or "each worker's own Python",
                                         sweep=sweep, executor=ex.describe()))
    except Exception as e:  # noqa: BLE001 - the summary still says what is there; then raised
        failure = e
    status = "complete" if stopped is None and failure is None else "interrupted"
    extra = {"files": {k: Path(v).name for k, v in out.items() if k in ("results_csv", "sweep_csv", "report")}}
    if failure is not None:
        extra["error"] = f"{type(failure).__name__}: {failure}"
    elif stopped is not None:
        extra["error"] = why
    folder.finish(records, status, **extra)
    if failure is not None:
        raise failure
    return out
