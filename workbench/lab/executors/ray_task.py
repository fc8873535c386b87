"""Points on a Ray cluster, the worker's side: :func:`ray_point` is the Ray task that runs one
notebook in a temp folder of the worker (with the notebook's folder, or the worker's own
``notebooks/``, as working directory) and returns the executed notebook and its sidecar as bytes.
Ray pickles it by its module path (``workbench.lab.executors.ray_task.ray_point``), so every node
needs the workbench installed.  The point timeout's watchdog and a SIGTERM kill the point's kernel."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from workbench.lab.executors.common import (
    _Watchdog,
    kill_kernels,
    timeout_text,
    worker_info,
)


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
