"""Points on this machine: one after another in this process, or up to ``jobs`` at once, each in a
fresh process that sends its record back (see :mod:`workbench.lab.executors`)."""

from __future__ import annotations

import contextlib
import os
import socket
import time
from pathlib import Path

from workbench.errors import ConfigError
from workbench.lab.executors.common import (
    THREADS_ENV,
    WORKER_FIELDS,
    Done,
    Executor,
    Task,
    _on_sigterm,
    failed_record,
    kill_kernels,
    timeout_text,
    worker_info,
)


def _local_worker(pid: int | None) -> dict:
    return {**dict.fromkeys(WORKER_FIELDS), "executor": "local", "host": socket.gethostname(), "pid": pid}


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
    which stops its workers), SIGTERM kills its kernel before it exits, and it stops itself so
    when the parent is gone (:func:`_end_with_run`)."""
    import signal
    import threading

    with contextlib.suppress(OSError):
        os.setsid()
    signal.signal(signal.SIGTERM, _on_sigterm)
    os.environ.clear()
    os.environ.update(env)
    sent = threading.Event()
    _end_with_run(conn, sent)
    try:
        rec = run_task_here(task)
    except BaseException as e:  # noqa: BLE001 - anything here is this point's failure
        rec = failed_record(task, f"{type(e).__name__}: {e}", worker=worker_info("local"))
    try:
        sent.set()                                         # from here the parent may close its end
        conn.send(rec)
    except OSError:                                        # the parent gave up on this point
        pass
    finally:
        conn.close()


def _end_with_run(conn, sent) -> None:
    """Stop this worker (SIGTERM: its handler kills the kernel, then it exits) when the runner is
    gone before the record was sent: the runner holds the only reading end of the worker's pipe,
    so that end closing, also by the runner's SIGKILL, is a POLLERR on this one.  (The fork
    server is no parent to watch: it lives as long as any worker it forked.)  Without it a
    worker would go on running its notebook, and writing into a run folder nobody records any
    more.  POSIX ``poll`` only."""
    import select
    import signal
    import threading

    if not hasattr(select, "poll"):
        return

    def watch():
        poller = select.poll()
        poller.register(conn.fileno(), select.POLLERR)
        while True:
            try:
                if poller.poll():
                    break
            except InterruptedError:
                continue
        if not sent.is_set():
            os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="workbench-end-with-run", daemon=True).start()


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
_PRELOAD = ["workbench.lab.executors.local", "workbench.lab.runner", "papermill", "nbformat", "nbclient",
            "jupyter_client"]


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
            proc = ctx.Process(target=_child, args=(task, send, self.worker_env()),
                               name=f"workbench-point-{task.index}")
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
                    running[started[0]] = (started[1], task, time.monotonic())
                if not running:
                    continue
                now = time.monotonic()
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
                                            "before it sent its record", time.monotonic() - t0,
                                            _local_worker(proc.pid))
                    else:
                        exiting[proc] = time.monotonic() + self.EXIT_GRACE_S
                    done(task, rec)
                now = time.monotonic()
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
            deadline = time.monotonic() + self.EXIT_GRACE_S
            for proc, by in exiting.items():                  # done: give them their time to exit
                proc.join(max(0.0, min(by, deadline) - time.monotonic()))
            _stop_workers(procs + list(exiting))

