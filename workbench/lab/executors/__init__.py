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
has its kernels found by ``JPY_PARENT_PID`` and killed (:func:`kill_kernels`), and a local
worker whose run is gone (killed, also by SIGKILL) stops itself and its kernel.  An open Ray
session is reused only when ``address`` names its cluster (else a ConfigError), and then a
``runtime_env`` goes with each task.

Another way to run points is a subclass of :class:`Executor` passed as ``executor=``.

The package, one executor a module: ``common`` (:class:`Task`, :class:`Executor`, the records, the
point timeout's watchdog, killing a point's kernels), ``local`` (:class:`LocalExecutor`) and ``ray``
(:class:`RayExecutor`, the driver) and ``ray_task`` (:func:`ray_point`, the Ray task on a worker);
here, :func:`make_executor`.

Each record's ``worker`` names what ran it: ``executor``, ``host``, ``pid`` (the process that
ran papermill), ``ip``, ``node_id``, ``worker_id`` and ``gpus`` (the last four from
``ray.get_runtime_context()`` on Ray; ``gpus`` is ``CUDA_VISIBLE_DEVICES`` locally).  Ray is
optional: this module imports it only when a Ray run starts.
"""

from __future__ import annotations

from workbench.errors import ConfigError
from workbench.lab.executors.common import (
    RAY_HINT,
    THREADS_ENV,
    WORKER_FIELDS,
    Done,
    Executor,
    Task,
    failed_record,
    kill_kernels,
    timeout_text,
    worker_info,
)
from workbench.lab.executors.local import LocalExecutor, run_task_here
from workbench.lab.executors.ray import RayExecutor, parse_memory
from workbench.lab.executors.ray_task import ray_point

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


__all__ = [
    "EXECUTORS",
    "RAY_HINT",
    "THREADS_ENV",
    "WORKER_FIELDS",
    "Done",
    "Executor",
    "LocalExecutor",
    "RayExecutor",
    "Task",
    "failed_record",
    "kill_kernels",
    "make_executor",
    "parse_memory",
    "ray_point",
    "run_task_here",
    "timeout_text",
    "worker_info",
]
