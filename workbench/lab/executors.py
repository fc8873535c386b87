"""Where the points of a notebook run execute: here (one after another, or in parallel
processes) or as Ray tasks on a cluster.

::

    run_notebooks(["04_scheduler"], sweep={"rate": [4, 8]}, jobs=2)            # 2 local processes
    run_notebooks(["04_scheduler"], sweep={"rate": [4, 8]}, executor="ray",
                  address="auto", num_gpus=1)                                  # one GPU per point

The runner (:mod:`workbench.lab.runner`) decides what runs and where its files go: it makes one
:class:`Task` per notebook and sweep point (grid order, file names in the run folder) and
collects the records into results.csv, sweep.csv and the report.  An executor only runs the
tasks and hands back one record per task (in any order: the runner puts them back in grid
order); it never raises for one point's failure: a notebook error, a dead worker process or a
failed Ray task becomes a record with ``status="failed"`` and the error, and the others go on.

* :class:`LocalExecutor` (``jobs``): ``jobs=1`` runs each notebook in this process, one after
  another (papermill starts one kernel per notebook); ``jobs=N`` runs up to N at once, each in a
  fresh process (forked from a fork server that has imported papermill once, or spawned where
  there is none: nothing of this process's threads or state is shared), which sends its record
  back; a process that dies (a kernel that kills its parent, the OOM killer) is recorded with
  its exit code.  Kernels that start together may race for ports: the runner retries a kernel
  that did not come up once.  With N jobs, N notebooks share the cores: each kernel gets
  ``WORKBENCH_THREADS`` = cores // N torch threads (unless that variable is set already), since a
  kernel that measured 2 threads fastest while the others were idle is many times slower once
  they compute (measured on 2 cores: notebook 06's ablation, 56 s with 1 thread, 286 s with 2).
* :class:`RayExecutor` (``address``, ``num_cpus``, ``num_gpus``, ``memory``, ``resources``):
  every point is one Ray task with those resources (default one CPU; ``num_gpus=1``: Ray sets
  ``CUDA_VISIBLE_DEVICES`` for the task and the notebook's kernel inherits it, as it inherits
  ``OMP_NUM_THREADS``, which Ray sets to the task's CPUs).  ``address=None`` lets ``ray.init()``
  choose (``RAY_ADDRESS``, else a cluster started by ``ray start`` on this machine, else a new
  local one); ``"auto"``, ``"host:6379"`` or ``"ray://host:10001"`` (Ray Client, needs
  ``ray[client]``) name a cluster.  A worker may be on another machine, so it does not touch
  the run folder: the driver sends the notebook's source, the task runs papermill in a temp
  folder on the worker, with the notebook's folder as working directory if that exists there
  (the same machine, a shared file system) or else the worker's own ``notebooks/``, and sends
  back the executed notebook and the results sidecar, which the driver writes into the run
  folder.  Every node needs the workbench installed (``pip install -e ".[ray]"``, same
  version) with a Jupyter kernel for its Python.  Before submitting, the executor checks that
  some live node can hold one point's resources (else a task would wait forever); pass
  ``check_resources=False`` on an autoscaling cluster whose nodes are not up yet.  A point
  runs at most once (``max_retries=0``: a benchmark is not silently repeated); a worker or
  node that dies fails its point.  ``RayExecutor(runtime_env=..., max_retries=...)`` passed as
  ``executor=`` gives what the command line does not.  It connects with ``ray.init()`` and
  disconnects at the end, unless this process was already connected (then it uses that); an
  address where nothing listens is an error at once (``ray.init()`` would retry for minutes).

A point timeout (``Task.point_timeout``, ``--point-timeout``) stops a point that runs longer:
locally the parent stops its worker process (each leads a session of its own) and the worker's
SIGTERM handler kills its kernel first; on Ray a watchdog in the task kills the kernel and the
task returns a failed record.  No kernel outlives its point: a worker that dies any other way
has its kernels found by ``JPY_PARENT_PID`` and killed (:func:`kill_kernels`).  An open Ray
session is reused only when ``address`` names its cluster (else a ConfigError), and then a
``runtime_env`` goes with each task.

Another way to run points is a subclass of :class:`Executor` passed as ``executor=``.

Each record's ``worker`` names what ran it: ``executor``, ``host``, ``pid`` (the process that
ran papermill), ``ip``, ``node_id``, ``worker_id`` and ``gpus`` (the last four from
``ray.get_runtime_context()`` on Ray; ``gpus`` is ``CUDA_VISIBLE_DEVICES`` locally).  Ray is
optional: this module imports it only when a Ray run starts.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from workbench.errors import ConfigError

THREADS_ENV = "WORKBENCH_THREADS"      # workbench.measure.threads.ENV (not imported here: it loads torch)

RAY_HINT = 'pip install -e ".[ray]"'
WORKER_FIELDS = ("executor", "host", "ip", "pid", "node_id", "worker_id", "gpus")


@dataclass(frozen=True)
class Task:
    """One notebook at one sweep point, as the runner decided it: ``index`` is its place in
    the grid, ``output`` / ``results`` are the executed notebook and the sidecar in the run
    folder, ``parameters`` are everything injected except ``results_path``."""

    index: int
    name: str
    notebook: Path
    parameters: dict
    output: Path
    results: Path
    timeout: int | None = None
    kernel: str | None = None
    point: dict = field(default_factory=dict)
    point_timeout: float | None = None      # wall-clock seconds for the whole point (None: no limit)


Done = Callable[[Task, dict], None]


class Executor:
    """What the runner asks of an executor, in this order: ``prepare()`` (check and connect,
    before the run folder exists: a ConfigError here stops the run), ``kernel(kernel_name)``
    (the kernel name the tasks carry), ``run(tasks, done)`` (call ``done(task, record)`` once
    per task, in any order, never raising for one task's failure), ``close()`` (always), and
    ``describe()`` for the report."""

    name = "executor"

    def prepare(self) -> None:
        """Nothing to check or start."""

    def kernel(self, kernel_name: str | None) -> str | None:
        return kernel_name

    def run(self, tasks: list[Task], done: Done) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Nothing to stop."""

    def describe(self) -> str:
        return self.name


def worker_info(executor: str) -> dict:
    """Who is running this: the host and pid here, plus the Ray node and worker in a Ray task."""
    info = dict.fromkeys(WORKER_FIELDS)
    info.update(executor=executor, host=socket.gethostname(), pid=os.getpid(),
                gpus=os.environ.get("CUDA_VISIBLE_DEVICES"))
    if executor == "ray":
        import ray

        ctx = ray.get_runtime_context()
        gpus = ctx.get_accelerator_ids().get("GPU", [])
        info.update(ip=ray.util.get_node_ip_address(), node_id=ctx.get_node_id(), worker_id=ctx.get_worker_id(),
                    gpus=",".join(str(g) for g in gpus) or None)
    return info


def failed_record(task: Task, error: str, seconds: float = 0.0, worker: dict | None = None) -> dict:
    """The record of a point that did not get as far as papermill's own record."""
    return {"name": task.name, "status": "failed", "seconds": seconds, "output": str(task.output),
            "error": error, "source": str(task.notebook), "attempts": 1,
            "worker": worker or {**dict.fromkeys(WORKER_FIELDS)}}


def _local_worker(pid: int | None) -> dict:
    return {**dict.fromkeys(WORKER_FIELDS), "executor": "local", "host": socket.gethostname(), "pid": pid}


def timeout_text(limit: float) -> str:
    return f"exceeded {limit:g} s (point timeout, --point-timeout)"


# ---- Jupyter kernels outliving the process that started them ---------------------------------------
def kill_kernels(parent_pid: int) -> list[int]:
    """SIGKILL every Jupyter kernel that process ``parent_pid`` started (and what those started)
    and remove their connection files; returns their pids.  jupyter_client starts a kernel in
    its own session with ``JPY_PARENT_PID`` set to the launcher's pid, so this finds them by that,
    also after the launcher died.  Linux (``/proc``); elsewhere nothing is found (ipykernel exits
    by itself about a second after its parent changes)."""
    import signal

    proc = Path("/proc")
    if not proc.is_dir():
        return []
    needle, killed = f"JPY_PARENT_PID={parent_pid}".encode(), []
    for d in proc.iterdir():
        if not d.name.isdigit() or int(d.name) in (os.getpid(), parent_pid):
            continue
        try:
            if needle not in (d / "environ").read_bytes().split(b"\0"):
                continue
            argv = (d / "cmdline").read_bytes().split(b"\0")
        except OSError:                                   # gone, or not ours to read
            continue
        pid = int(d.name)
        with contextlib.suppress(OSError):
            if os.getpgid(pid) == pid:                    # a session leader: its group goes too
                os.killpg(pid, signal.SIGKILL)
            else:
                os.kill(pid, signal.SIGKILL)
            killed.append(pid)
        if b"-f" in argv[:-1]:
            conn_file = Path(os.fsdecode(argv[argv.index(b"-f") + 1]))
            if conn_file.suffix == ".json":
                with contextlib.suppress(OSError):
                    conn_file.unlink()
    return killed


def _on_sigterm(signum, frame):
    """A worker told to stop: its kernels first (they are in sessions of their own: a signal to
    the worker's group misses them), then SystemExit, so that papermill's cleanup runs."""
    kill_kernels(os.getpid())
    raise SystemExit(128 + signum)


class _Watchdog:
    """In a worker: after ``limit`` seconds, kill this process's kernels (again every second,
    a kernel may still be starting) until the point's papermill returns."""

    def __init__(self, limit: float | None):
        import threading

        self.limit, self.fired, self._stop = limit, False, threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True) if limit else None

    def _watch(self):
        wait = self.limit
        while not self._stop.wait(wait):
            self.fired, wait = True, 1.0
            kill_kernels(os.getpid())

    def __enter__(self):
        if self._thread is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()


# ---- local: this process, or up to `jobs` processes at once ----------------------------------------
def run_task_here(task: Task, executor: str = "local") -> dict:
    """Run one task in this process, writing straight into the run folder."""
    from workbench.lab.runner import execute_one

    try:
        Path(task.results).unlink(missing_ok=True)            # never pick up an old sidecar
        rec = execute_one(Path(task.notebook), Path(task.output),
                          {**task.parameters, "results_path": str(task.results)}, task.timeout, task.kernel)
    except Exception as e:  # noqa: BLE001 - e.g. an OSError on the run folder: this point's failure
        rec = failed_record(task, f"{type(e).__name__}: {e}")
    rec["worker"] = worker_info(executor)
    return rec


def _child(task: Task, conn, env: dict) -> None:
    """A local worker process: run one task, send its record back.  ``env`` is the parent's
    environment when the task started (a fork server's own may be older).  It leads a session
    of its own (the parent stops it by its group; a Ctrl-C at the terminal goes to the parent,
    which stops its workers), and SIGTERM kills its kernel before it exits."""
    import signal

    with contextlib.suppress(OSError):
        os.setsid()
    signal.signal(signal.SIGTERM, _on_sigterm)
    os.environ.clear()
    os.environ.update(env)
    try:
        rec = run_task_here(task)
    except BaseException as e:  # noqa: BLE001 - anything here is this point's failure
        rec = failed_record(task, f"{type(e).__name__}: {e}", worker=worker_info("local"))
    try:
        conn.send(rec)
    except OSError:                                        # the parent gave up on this point
        pass
    finally:
        conn.close()


def _signal_group(pid: int | None, sig) -> None:
    """Signal a worker's process group (its session), or the worker alone before it made one."""
    if pid is None:
        return
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        with contextlib.suppress(OSError):
            os.kill(pid, sig)


def _stop_workers(procs: list, grace_s: float = 5.0) -> None:
    """SIGTERM each worker's group (it kills its kernel and exits), SIGKILL what is left after
    ``grace_s``, then kill any kernel a worker left behind."""
    import signal

    for proc in procs:
        if proc.is_alive():
            _signal_group(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            _signal_group(proc.pid, signal.SIGKILL)
            proc.join(5)
        if proc.pid is not None:
            kill_kernels(proc.pid)


def _exit_text(code: int | None) -> str:
    if code is None:
        return "did not exit"
    if code < 0:
        import signal

        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


# A fork server imports these once; each point's process is a fork of it (cheap, and nothing of
# the parent's threads or state).  Where there is none (Windows), spawn: a fresh interpreter each.
_PRELOAD = ["workbench.lab.executors", "workbench.lab.runner", "papermill", "nbformat", "nbclient", "jupyter_client"]


def _context(mp):
    if "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(_PRELOAD)
        return ctx
    return mp.get_context("spawn")


class LocalExecutor(Executor):
    """Points on this machine: ``jobs=1`` one after another in this process (the default),
    ``jobs=N`` up to N at once, one fresh process per point.  With a point timeout every point
    runs in a fresh process (also with ``jobs=1``), which is stopped, with its kernel, when the
    point has run that long.  In this process (``jobs=1``, no point timeout) a kernel that kills
    its parent ends the whole run; in worker processes it fails only its point."""

    EXIT_GRACE_S = 30.0      # a worker that sent its record but does not exit is stopped after this

    name = "local"

    def __init__(self, jobs: int | None = None):
        jobs = 1 if jobs is None else jobs
        if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
            raise ConfigError(f"jobs (--jobs) = {jobs!r}: expected a whole number >= 1 (points run at once)")
        self.jobs = jobs

    def describe(self) -> str:
        if self.jobs == 1:
            return "local, one point after another"
        threads = self.worker_env()[THREADS_ENV]
        return f"local, up to {self.jobs} points at once (one process each, {THREADS_ENV}={threads})"

    def kernel(self, kernel_name: str | None) -> str:
        from workbench.lab.runner import resolve_kernel

        return resolve_kernel(kernel_name)   # may put a kernelspec on JUPYTER_PATH: the children inherit it

    def run(self, tasks: list[Task], done: Done) -> None:
        if self.jobs == 1 and not any(t.point_timeout for t in tasks):
            for task in tasks:
                done(task, run_task_here(task))
            return
        self._run_processes(tasks, done)

    def worker_env(self) -> dict:
        """A worker's environment: this process', plus ``WORKBENCH_THREADS`` = cores // jobs when
        several points run at once and the variable is not set (see the module docstring)."""
        from workbench.measure.probe import available_cores

        env = dict(os.environ)
        if self.jobs > 1 and not env.get(THREADS_ENV, "").strip():
            env[THREADS_ENV] = str(max(1, available_cores() // self.jobs))
        return env

    def _start(self, ctx, task: Task):
        """A worker process for the task, as (reader, process), or the failed record if it did not start."""
        recv = send = proc = None
        try:
            recv, send = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_child, args=(task, send, self.worker_env()), name=f"workbench-point-{task.index}")
            proc.start()
            return recv, proc
        except Exception as e:  # noqa: BLE001 - no fork, no fork server, no pipes: this point fails
            if recv is not None:
                recv.close()
            return failed_record(task, f"could not start a worker process: {type(e).__name__}: {e}",
                                 worker=_local_worker(getattr(proc, "pid", None)))
        finally:
            if send is not None:
                send.close()                          # the child holds the only writer: EOF when it dies

    def _run_processes(self, tasks: list[Task], done: Done) -> None:
        import multiprocessing as mp
        from multiprocessing.connection import wait

        ctx = _context(mp)
        pending, running, exiting = list(tasks), {}, {}     # exiting: worker -> when it must be gone
        try:
            while pending or running:
                while pending and len(running) < self.jobs:
                    task = pending.pop(0)
                    started = self._start(ctx, task)
                    if isinstance(started, dict):
                        done(task, started)
                        continue
                    running[started[0]] = (started[1], task, time.perf_counter())
                if not running:
                    continue
                now = time.perf_counter()
                left = [t0 + task.point_timeout - now for _p, task, t0 in running.values() if task.point_timeout]
                for recv in wait(list(running), timeout=max(0.0, min(left)) if left else None):
                    proc, task, t0 = running.pop(recv)
                    try:
                        rec = recv.recv()
                    except (EOFError, OSError):
                        rec = None
                    recv.close()
                    if rec is None:                               # it died: wait for its exit code
                        _stop_workers([proc])
                        rec = failed_record(task, f"the worker process (pid {proc.pid}) {_exit_text(proc.exitcode)} "
                                            "before it sent its record", time.perf_counter() - t0,
                                            _local_worker(proc.pid))
                    else:
                        exiting[proc] = time.perf_counter() + self.EXIT_GRACE_S
                    done(task, rec)
                now = time.perf_counter()
                for recv, (proc, task, t0) in list(running.items()):
                    if task.point_timeout and now - t0 >= task.point_timeout:
                        del running[recv]
                        recv.close()
                        _stop_workers([proc])
                        done(task, failed_record(task, f"{timeout_text(task.point_timeout)}: its worker process "
                                                 f"(pid {proc.pid}) and kernel were stopped", now - t0,
                                                 _local_worker(proc.pid)))
                for proc, deadline in list(exiting.items()):      # reap without waiting for them
                    if not proc.is_alive() or now > deadline:
                        del exiting[proc]
                        _stop_workers([proc])
        finally:
            for recv in running:
                recv.close()
            procs = [p for p, _t, _t0 in running.values()]    # interrupted: stop what still runs
            deadline = time.perf_counter() + self.EXIT_GRACE_S
            for proc, by in exiting.items():                  # done: give them their time to exit
                proc.join(max(0.0, min(by, deadline) - time.perf_counter()))
            _stop_workers(procs + list(exiting))


# ---- Ray: one task per point on a cluster --------------------------------------------------------
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?)?b?\s*$", re.IGNORECASE)


def parse_memory(value) -> int | None:
    """Bytes from ``8GiB``, ``512MB``, ``2e9`` or a number (None stays None)."""
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        n = float(value)
    else:
        m = _SIZE.match(str(value))
        if m is None:
            try:
                n = float(str(value))
            except ValueError:
                raise ConfigError(f"memory (--memory) = {value!r}: expected bytes, e.g. 8GiB, 512MB or 2000000000") \
                    from None
        else:
            unit = (m.group(2) or "").lower()
            scale = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12,
                     "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}[unit]
            n = float(m.group(1)) * scale
    if n < 0:
        raise ConfigError(f"memory (--memory) = {value!r}: must not be negative")
    return int(n)


def _number(name: str, flag: str, value) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise ConfigError(f"{name} ({flag}) = {value!r}: expected a number >= 0")
    return value


def _notebook_dir(nb: Path) -> dict:
    """Where the notebook's working directory is, said so that another machine can find its own."""
    from workbench.lab.runner import NOTEBOOKS

    try:
        return {"notebooks": str(nb.parent.resolve().relative_to(NOTEBOOKS.resolve())), "path": str(nb.parent)}
    except ValueError:
        return {"notebooks": None, "path": str(nb.parent)}


def _worker_cwd(where: dict) -> Path:
    from workbench.lab.runner import NOTEBOOKS

    if where.get("notebooks") is not None and (NOTEBOOKS / where["notebooks"]).is_dir():
        return NOTEBOOKS / where["notebooks"]
    if where.get("path") and Path(where["path"]).is_dir():
        return Path(where["path"])
    return NOTEBOOKS


def ray_point(source: bytes, job: dict) -> dict:
    """The Ray task: run one notebook in a temp folder of the worker and return the executed
    notebook and the sidecar as bytes (the driver writes them into its run folder)."""
    import tempfile

    from workbench.lab.runner import execute_one, resolve_kernel

    worker = worker_info("ray")
    limit = job.get("point_timeout")
    with tempfile.TemporaryDirectory(prefix="workbench-point-") as tmp, _sigterm_kills_kernels(), \
            _Watchdog(limit) as watchdog:
        src, out = Path(tmp) / "source.ipynb", Path(tmp) / f"{job['name']}.ipynb"
        sidecar = Path(tmp) / f"{job['name']}.results.json"
        src.write_bytes(source)
        cwd = _worker_cwd(job["where"])
        try:
            rec = execute_one(src, out, {**job["parameters"], "results_path": str(sidecar)}, job["timeout"],
                              resolve_kernel(job["kernel"]), cwd=cwd)
        finally:
            kill_kernels(os.getpid())                     # none should be left; if one is, it goes now
        if watchdog.fired:
            rec.update(status="failed", error=f"{timeout_text(limit)}: its kernel was stopped ({rec.get('error')})")
        rec["worker"] = worker
        rec["cwd"] = f"{worker['host']}:{cwd}"
        return {"record": rec, "notebook": out.read_bytes() if out.is_file() else None,
                "results": sidecar.read_bytes() if sidecar.is_file() else None}


@contextlib.contextmanager
def _sigterm_kills_kernels():
    """While a Ray task runs: a SIGTERM to its worker (ray.cancel, the raylet stopping) kills the
    point's kernel first, then does what the worker would have done.  Only where a handler can be
    set (the main thread); a SIGKILL leaves the kernel to ipykernel's own parent check."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.getsignal(signal.SIGTERM)

    def handler(signum, frame):
        kill_kernels(os.getpid())
        if callable(old):
            old(signum, frame)
        else:
            raise SystemExit(128 + signum)

    try:
        signal.signal(signal.SIGTERM, handler)
    except (ValueError, OSError):
        yield
        return
    try:
        yield
    finally:
        with contextlib.suppress(ValueError, OSError, TypeError):
            signal.signal(signal.SIGTERM, old)


def _probe(address: str | None, timeout_s: float = 5.0) -> None:
    """A HOST:PORT (or ray://HOST:PORT) that nothing listens on is an error now: ray.init()
    would retry it for minutes.  Other addresses (None, "auto", "local") are Ray's to resolve."""
    if not address or address in ("auto", "local"):
        return
    hostport = address.split("://", 1)[-1]
    host, sep, port = hostport.rpartition(":")
    if not sep or not port.isdigit():
        raise ConfigError(f"address (--address) = {address!r}: expected HOST:PORT (the head's GCS port, "
                          "6379 unless `ray start --head --port` said otherwise), 'auto' or ray://HOST:10001")
    try:
        socket.create_connection((host.strip("[]") or "127.0.0.1", int(port)), timeout=timeout_s).close()
    except OSError as e:
        raise ConfigError(f"no Ray cluster answers at {address!r} ({e.strerror or e}): is its head up "
                          "(`ray start --head` prints the address to pass), and is the port open from here?") from None


def _import_ray():
    try:
        import ray
    except ImportError as e:
        raise ConfigError(f"the Ray executor needs Ray, which is not installed ({e}): {RAY_HINT}") from None
    return ray


def _ray_error(e: BaseException) -> str:
    cause = getattr(e, "cause", None)
    if cause is not None and not isinstance(cause, type(e)):
        text = f"{type(cause).__name__}: {cause}"
    else:
        text = f"{type(e).__name__}: {e}"
    lines = [ln for ln in str(text).strip().splitlines() if ln.strip()]
    text = lines[0] if len(lines) <= 3 else f"{lines[0]} ... {lines[-1]}"
    if "workbench" in str(e) and ("No module named" in str(e) or "ModuleNotFoundError" in str(e)):
        text += f" (is the workbench installed on every Ray node? {RAY_HINT} there)"
    return f"Ray task failed: {text}"


class RayExecutor(Executor):
    """Every point is one Ray task with the given resources (see the module docstring)."""

    name = "ray"

    def __init__(self, address: str | None = None, num_cpus: float | None = None, num_gpus: float | None = None,
                 memory=None, resources: dict | None = None, runtime_env: dict | None = None,
                 max_retries: int = 0, check_resources: bool = True):
        self.address = address
        self.num_cpus = _number("num_cpus", "--num-cpus", num_cpus)
        self.num_gpus = _number("num_gpus", "--num-gpus", num_gpus)
        self.memory = parse_memory(memory)
        resources = dict(resources or {})
        if not isinstance(resources, dict):
            raise ConfigError(f"resources (--resources) = {resources!r}: expected a JSON object {{name: amount}}")
        for k, v in resources.items():
            if k in ("CPU", "GPU", "memory"):
                flag = {"CPU": "num_cpus (--num-cpus)", "GPU": "num_gpus (--num-gpus)", "memory": "memory (--memory)"}
                raise ConfigError(f"resources (--resources): give {k} with {flag[k]}, not as a custom resource")
            _number(f"resources[{k!r}]", "--resources", v)
        self.resources = resources
        self.runtime_env = runtime_env
        self.max_retries = int(max_retries)
        self.check_resources = check_resources
        self.cluster = None
        self._ray, self._mine = None, False

    def request(self) -> dict:
        """One point's resources, in Ray's names (CPU, GPU, memory, custom)."""
        req = {"CPU": 1 if self.num_cpus is None else self.num_cpus}
        if self.num_gpus:
            req["GPU"] = self.num_gpus
        if self.memory:
            req["memory"] = self.memory
        return {**req, **{k: v for k, v in self.resources.items() if v}}

    def describe(self) -> str:
        req = ", ".join(f"{k}={_fmt_amount(k, v)}" for k, v in self.request().items())
        where = self.cluster or f"address {self.address or 'from ray.init()'}"
        return f"ray ({where}); each point asks for {req}"

    def prepare(self) -> None:
        """Import Ray, connect to the cluster (or start a local one) and check that some node can
        run one point; each problem is a ConfigError, before the run folder is made."""
        ray = _import_ray()
        self._ray, self._mine = ray, self._connect(ray)
        try:
            self._check(ray)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Disconnect, if this executor connected (a session the caller opened stays open)."""
        ray, self._ray = getattr(self, "_ray", None), None
        if ray is not None and self._mine:
            ray.shutdown()
        self._mine = False

    def kernel(self, kernel_name: str | None) -> str | None:
        return kernel_name                # None: each worker picks the kernel of its own Python

    def _options(self) -> dict:
        opts = {"num_cpus": 1 if self.num_cpus is None else self.num_cpus, "max_retries": self.max_retries}
        if self.runtime_env and not self._mine:
            opts["runtime_env"] = dict(self.runtime_env)   # a session we did not open: per task, not dropped
        if self.num_gpus is not None:
            opts["num_gpus"] = self.num_gpus
        if self.memory:
            opts["memory"] = self.memory
        if self.resources:
            opts["resources"] = dict(self.resources)
        return opts

    def _connect(self, ray) -> bool:
        if ray.is_initialized():
            self._check_session(ray)
            return False                  # the caller's session: use it, leave it open
        _probe(self.address or os.environ.get("RAY_ADDRESS"))
        kw = {"log_to_driver": False}
        if self.runtime_env:
            kw["runtime_env"] = self.runtime_env
        try:
            ray.init(address=self.address, **kw)
        except Exception as e:  # noqa: BLE001 - ConnectionError, ValueError, RuntimeError ... all mean: no cluster
            raise ConfigError(f"could not start or reach a Ray cluster (address {self.address!r}): "
                              f"{type(e).__name__}: {e}; start one with `ray start --head` and pass its address "
                              "(--address HOST:PORT, or 'auto' on a cluster node)") from None
        return True

    def _check_session(self, ray) -> None:
        """An open session is reused only when ``address`` names its cluster (or names none)."""
        address = self.address
        if not address or address in ("auto", "local"):
            return
        try:
            have = ray.get_runtime_context().gcs_address
        except Exception:  # noqa: BLE001 - e.g. Ray Client: nothing to compare with
            have = None
        if address.startswith("ray://") or not have:
            if not address.startswith("ray://") or not _client_connected(ray):
                raise ConfigError(f"address (--address) = {address!r}: this process is already connected to a Ray "
                                  "cluster that cannot be compared with it; call ray.shutdown() first, or pass no "
                                  "address to use the open session")
            return
        here = _local_ips(ray)
        if _hostport(address, here) != _hostport(have, here):
            raise ConfigError(f"address (--address) = {address!r}: this process is already connected to the Ray "
                              f"cluster at {have!r}; call ray.shutdown() first to use another one, or pass "
                              "address=None to use the open session")

    def _check(self, ray) -> None:
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        totals: dict = {}
        for n in nodes:
            for k, v in n.get("Resources", {}).items():
                totals[k] = totals.get(k, 0) + v
        shown = {k: v for k, v in totals.items() if not k.startswith("node:") and k != "object_store_memory"}
        self.cluster = (f"{len(nodes)} node{'s' if len(nodes) != 1 else ''}: "
                        + ", ".join(f"{k}={_fmt_amount(k, v)}" for k, v in sorted(shown.items())))
        if not self.check_resources:
            return
        need = self.request()
        if any(all(n.get("Resources", {}).get(k, 0) >= v for k, v in need.items()) for n in nodes):
            return
        have = "; ".join(f"{n.get('NodeManagerAddress')}: " + ", ".join(
            f"{k}={_fmt_amount(k, v)}" for k, v in sorted(n.get("Resources", {}).items())
            if not k.startswith("node:") and k != "object_store_memory") for n in nodes)
        raise ConfigError("no live node of the Ray cluster can run one point, which asks for "
                          + ", ".join(f"{k}={_fmt_amount(k, v)}" for k, v in need.items())
                          + f" (nodes: {have or 'none'}); lower --num-cpus / --num-gpus / --memory / --resources, "
                          "add a node that has them (ray start --address HEAD:PORT --num-gpus N ...), or on an "
                          "autoscaling cluster pass check_resources=False (--no-resource-check)")

    def run(self, tasks: list[Task], done: Done) -> None:
        if getattr(self, "_ray", None) is None:
            self.prepare()
        ray = self._ray
        remote, opts = ray.remote(ray_point), self._options()
        sources, refs = {}, {}
        try:
            for task in tasks:
                key = str(task.notebook)
                if key not in sources:
                    sources[key] = ray.put(Path(task.notebook).read_bytes())   # sent once per notebook
                job = {"name": task.name, "parameters": task.parameters, "timeout": task.timeout,
                       "kernel": task.kernel, "where": _notebook_dir(Path(task.notebook)),
                       "point_timeout": task.point_timeout}
                ref = remote.options(**opts, name=f"workbench:{task.name}").remote(sources[key], job)
                refs[ref] = (task, time.perf_counter())
            while refs:
                ready, _ = ray.wait(list(refs), num_returns=1)
                for ref in ready:
                    task, t0 = refs.pop(ref)
                    done(task, self._receive(ray, ref, task, t0))
        finally:
            for ref in refs:                                          # interrupted: cancel what is left
                with contextlib.suppress(Exception):                  # best effort
                    ray.cancel(ref, force=True)

    @staticmethod
    def _receive(ray, ref, task: Task, t0: float) -> dict:
        try:
            out = ray.get(ref)
        except Exception as e:  # noqa: BLE001 - RayTaskError, WorkerCrashedError, NodeDiedError, ...
            return failed_record(task, _ray_error(e), time.perf_counter() - t0, {**dict.fromkeys(WORKER_FIELDS),
                                                                                "executor": "ray"})
        rec = out["record"]
        try:
            if out.get("notebook") is not None:
                Path(task.output).write_bytes(_retarget(out["notebook"], task))
            if out.get("results") is not None:
                Path(task.results).write_bytes(out["results"])
        except OSError as e:          # the point ran, but its files did not land in the run folder
            with contextlib.suppress(OSError):
                Path(task.results).unlink(missing_ok=True)
            return failed_record(task, f"could not write what the worker sent: {type(e).__name__}: {e}"
                                 + (f" (the point itself: {rec.get('status')})" if rec.get("status") else ""),
                                 rec.get("seconds") or time.perf_counter() - t0, rec.get("worker"))
        return rec


def _local_ips(ray) -> set:
    """This machine's addresses as far as cheaply known: loopback, its host name's, Ray's node IP."""
    ips = {"127.0.0.1", "::1", "localhost"}
    with contextlib.suppress(OSError):
        ips.update(socket.gethostbyname_ex(socket.gethostname())[2])
    with contextlib.suppress(Exception):
        ips.add(ray.util.get_node_ip_address())
    return ips


def _hostport(address: str, local: set) -> tuple:
    """``(host, port)`` of HOST:PORT, the host resolved, and any address of this machine one
    ("this machine": a head here answers on loopback and on its own IP)."""
    host, _, port = address.split("://", 1)[-1].rpartition(":")
    host = host.strip("[]")
    with contextlib.suppress(OSError):
        host = socket.gethostbyname(host)
    return ("this machine" if host in local or host.startswith("127.") else host), port


def _client_connected(ray) -> bool:
    try:
        return bool(ray.util.client.ray.is_connected())
    except Exception:  # noqa: BLE001
        return False


def _retarget(nb_bytes: bytes, task: Task) -> bytes:
    """The executed notebook's papermill metadata names the driver's files, not the worker's temp ones."""
    try:
        nb = json.loads(nb_bytes)
        pm = nb.get("metadata", {}).get("papermill")
        if isinstance(pm, dict):
            pm["input_path"], pm["output_path"] = str(task.notebook), str(task.output)
        return (json.dumps(nb, indent=1, ensure_ascii=False) + "\n").encode()
    except (ValueError, AttributeError):
        return nb_bytes


def _fmt_amount(name: str, v) -> str:
    if name == "memory" or name.endswith("memory"):
        return f"{v / 2**30:.3g}GiB"
    return f"{v:g}" if isinstance(v, float) else str(v)


# ---- choosing one ----------------------------------------------------------------------------------
EXECUTORS = ("local", "ray")


def make_executor(executor="local", jobs: int | None = None, address: str | None = None,
                  num_cpus: float | None = None, num_gpus: float | None = None, memory=None,
                  resources: dict | None = None, check_resources: bool = True):
    """An executor from its name and options; options that do not belong to it are a ConfigError
    (``jobs`` is local-only, the rest Ray-only).  An executor object passes through unchanged."""
    ray_opts = {"address (--address)": address, "num_cpus (--num-cpus)": num_cpus,
                "num_gpus (--num-gpus)": num_gpus, "memory (--memory)": memory,
                "resources (--resources)": resources or None}
    if not isinstance(executor, str):
        given = [k for k, v in ray_opts.items() if v is not None] + (["jobs (--jobs)"] if jobs is not None else [])
        if given:
            raise ConfigError(f"executor is an executor object: set {', '.join(given)} on it, not on the run")
        if not isinstance(executor, Executor):
            raise ConfigError(f"executor = {executor!r}: expected 'local', 'ray' or an Executor "
                              "(workbench.lab.executors)")
        return executor
    if executor == "local":
        given = [k for k, v in ray_opts.items() if v is not None]
        if given:
            raise ConfigError(f"{', '.join(given)}: only for the Ray executor (executor='ray', --executor ray)")
        if not check_resources:
            raise ConfigError("check_resources (--no-resource-check): only for the Ray executor")
        return LocalExecutor(jobs)
    if executor == "ray":
        if jobs is not None:
            raise ConfigError("jobs (--jobs) is for the local executor; Ray runs as many points at once as the "
                              "cluster's resources allow: set what one point needs with --num-cpus / --num-gpus")
        return RayExecutor(address=address, num_cpus=num_cpus, num_gpus=num_gpus, memory=memory,
                           resources=resources, check_resources=check_resources)
    raise ConfigError(f"executor (--executor) = {executor!r}: expected one of {', '.join(EXECUTORS)}")


__all__ = ["EXECUTORS", "Executor", "LocalExecutor", "RayExecutor", "Task", "make_executor", "parse_memory", "worker_info"]
