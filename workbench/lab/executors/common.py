"""What every executor shares: a point as the runner decided it (:class:`Task`), the executor's
interface (:class:`Executor`), a point's record and who ran it, and the point timeout's parts:
killing the Jupyter kernels a worker started (:func:`kill_kernels`) and a watchdog that does it
when the point has run too long.  The executors: :mod:`~workbench.lab.executors.local`,
:mod:`~workbench.lab.executors.ray`."""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

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

