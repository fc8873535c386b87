"""Points on a Ray cluster, the driver's side: :class:`RayExecutor` connects (or starts a local
cluster), checks that some node can hold one point, submits one Ray task per point with the
resources it asks for and writes what each sends back into the run folder (see
:mod:`workbench.lab.executors`).  The task itself is :func:`~workbench.lab.executors.ray_task.ray_point`.
Ray is imported only when a Ray run starts."""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import time
from pathlib import Path

from workbench.errors import ConfigError
from workbench.lab.executors.common import (
    RAY_HINT,
    WORKER_FIELDS,
    Done,
    Executor,
    Task,
    failed_record,
)
from workbench.lab.executors.ray_task import _notebook_dir, ray_point
from workbench.lab.run_folder import atomic_write

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
                refs[ref] = (task, time.monotonic())
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
            return failed_record(task, _ray_error(e), time.monotonic() - t0, {**dict.fromkeys(WORKER_FIELDS),
                                                                                "executor": "ray"})
        rec = out["record"]
        try:
            if out.get("results") is not None:         # each lands whole (the run's summary names it after)
                atomic_write(task.results, out["results"])
            if out.get("notebook") is not None:
                atomic_write(task.output, _retarget(out["notebook"], task))
        except OSError as e:          # the point ran, but its files did not land in the run folder
            with contextlib.suppress(OSError):
                Path(task.results).unlink(missing_ok=True)
            return failed_record(task, f"could not write what the worker sent: {type(e).__name__}: {e}"
                                 + (f" (the point itself: {rec.get('status')})" if rec.get("status") else ""),
                                 rec.get("seconds") or time.monotonic() - t0, rec.get("worker"))
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

