"""Sweeps on more than one process or machine: ``--jobs N`` local processes and ``--executor ray``
on a real Ray head (``ray start --head --block`` with 2 CPUs on free ports, started when the
module's first test runs so that it boots while the local tests run, stopped and checked gone at
the end; the Ray tests skip when Ray is not installed).  Both give the serial run's rows in grid
order, each row names the worker that ran it, and a failed or crashed point keeps its row while
the sweep goes on.  The executor's own connection by address is tested once; the two Ray runs
then share one driver connection (one Ray job, so its workers import papermill once)."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
pytest.importorskip("papermill")
pd = pytest.importorskip("pandas")

from workbench.cli.main import main  # noqa: E402 - after the importorskip
from workbench.errors import ConfigError  # noqa: E402
from workbench.lab import executors, runner  # noqa: E402

from test_runner import write_notebook  # noqa: E402 - the same tiny notebooks as the runner's tests


GRID = {"a": [1, 2], "b": [3, 5]}
PARAMS = "results_path = None\na = 0\nb = 0\ncrash = False\nmode = ''\nhandshake = ''"
SRC = """
import os, signal, time
from workbench.lab.results import save_results
if handshake and (a, b) == (1, 3):             # the first point finishes only once this file exists
    deadline = time.monotonic() + 90
    while not os.path.exists(handshake):
        assert time.monotonic() < deadline, "no handshake"
        time.sleep(0.05)
if crash or mode == "crash":
    os.kill(os.getppid(), signal.SIGKILL)      # the process that runs papermill dies: a worker crash
if mode == "hang":                             # runs past any point timeout
    with open(os.path.join(os.path.dirname(results_path), "hang.kernel.pid"), "w") as f:
        f.write(str(os.getpid()))
    time.sleep(600)
if (a, b) == (2, 3):
    raise ValueError(f"point a={a} b={b} fails")
if results_path:
    save_results(results_path, {"product": a * b, "label": f"{a}x{b}", "cwd": os.path.basename(os.getcwd())})
"""
# What a point gives whoever runs it (seconds and the worker columns differ by design).
SAME = ["notebook", "a", "b", "status", "error", "product", "label", "cwd"]
WORKER = ["executor", "worker_host", "worker_ip", "worker_pid", "worker_node_id", "worker_id", "worker_gpus"]


@pytest.fixture(scope="module")
def grid_nb(tmp_path_factory):
    return write_notebook(tmp_path_factory.mktemp("nbs") / "grid.ipynb", SRC, parameters=PARAMS)


@pytest.fixture(scope="module")
def serial(grid_nb, tmp_path_factory):
    """The reference: today's executor, one point after another in this process."""
    res = runner.run_notebooks([grid_nb], out_dir=tmp_path_factory.mktemp("serial"), timeout=120,
                               progress=False, sweep=GRID)
    return res, pd.read_csv(res["sweep_csv"])


def check_rows(table, serial_table):
    assert list(table.columns[:6]) == ["notebook", "a", "b", "status", "seconds", "error"]
    assert list(table.columns[-len(WORKER):]) == WORKER
    pd.testing.assert_frame_equal(table[SAME], serial_table[SAME])
    assert list(table["status"]) == ["ok", "ok", "failed", "ok"]           # grid order, the failed point kept
    assert "ValueError: point a=2 b=3 fails" in table.loc[2, "error"]
    folder = table["cwd"].fillna("")[0]                                       # the notebook's folder (nbsN: the
    assert folder.startswith("nbs") and list(table["cwd"].fillna("")) == [folder, folder, "", folder]   # Nth made here)


def test_serial_rows_name_this_process(serial):
    table = serial[1]
    check_rows(table, table)
    assert set(table["executor"]) == {"local"} and set(table["worker_pid"]) == {os.getpid()}
    assert set(table["worker_host"]) == {socket.gethostname()}
    assert table["worker_node_id"].isna().all() and table["worker_id"].isna().all()


@pytest.mark.slow
def test_local_jobs_2_gives_the_serial_rows(grid_nb, serial, tmp_path, monkeypatch):
    finished, run, handshake = [], executors.LocalExecutor.run, tmp_path / "second-is-done"

    def noting(task, rec, done):
        finished.append(task.index)
        done(task, rec)
        if task.index == 1:
            handshake.touch()                  # only now may the first point finish: it ends after the second

    monkeypatch.setattr(executors.LocalExecutor, "run", lambda self, tasks, done: run(
        self, tasks, lambda task, rec: noting(task, rec, done)))
    res = runner.run_notebooks([grid_nb], out_dir=tmp_path, timeout=120, progress=False, sweep=GRID, jobs=2,
                               parameters={"handshake": str(handshake)})
    assert finished[0] == 1 and sorted(finished) == [0, 1, 2, 3]          # the first point finished later...
    table = pd.read_csv(res["sweep_csv"])
    check_rows(table, serial[1])                                           # ...and its row is still first
    pids = list(table["worker_pid"])
    assert len(set(pids)) == 4 and os.getpid() not in pids               # one fresh process per point
    assert [r["point"] for r in res["notebooks"]] == runner.sweep_points(GRID)
    pd.testing.assert_frame_equal(pd.read_csv(res["results_csv"]), pd.read_csv(serial[0]["results_csv"]))
    assert "up to 2 points at once" in Path(res["report"]).read_text()


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _kernels_with(marker: str) -> list[int]:
    """ipykernel processes whose environment carries ``marker`` (inherited from this test's run)."""
    found = []
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and marker.encode() in (d / "environ").read_bytes().split(b"\0") \
                    and b"ipykernel" in (d / "cmdline").read_bytes():
                found.append(int(d.name))
        except OSError:
            continue
    return found


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/environ").is_file(), reason="finds kernels through /proc")
def test_local_crash_and_point_timeout_keep_their_rows_and_leave_no_kernel(grid_nb, tmp_path, monkeypatch):
    """A worker its kernel kills, one that runs past --point-timeout (stopped, with its kernel) and
    a fine one: three rows, and no kernel of this run left running."""
    marker = f"WORKBENCH_TEST_RUN={os.getpid()}-{time.monotonic_ns()}"
    monkeypatch.setenv(*marker.split("=", 1))                                   # the workers and kernels inherit it
    res = runner.run_notebooks([grid_nb], out_dir=tmp_path, timeout=120, progress=False, point_timeout=15,
                               sweep={"mode": ["crash", "ok", "hang"]}, parameters={"a": 1, "b": 5}, jobs=2)
    table = pd.read_csv(res["sweep_csv"])
    assert list(table["status"]) == ["failed", "ok", "failed"] and table.loc[1, "product"] == 5
    assert "was killed by SIGKILL" in table.loc[0, "error"] and table.loc[0, "worker_pid"] > 0
    assert "exceeded 15 s (point timeout" in table.loc[2, "error"] and table.loc[2, "seconds"] >= 15
    kernel = int((tmp_path / "hang.kernel.pid").read_text())                 # the hanging point's kernel was up...
    assert not _alive(kernel)                                                # ...and is gone
    assert _kernels_with(marker) == []                                       # as is every other kernel of the run


def test_a_worker_that_cannot_start_fails_its_point_only(tmp_path, monkeypatch):
    import multiprocessing as mp

    class NoFork:
        def __init__(self, *a, **k):
            self.pid = None

        def start(self):
            raise OSError(11, "Resource temporarily unavailable")

    class Ctx:
        Pipe = staticmethod(mp.Pipe)
        Process = NoFork

    monkeypatch.setattr(executors.local, "_context", lambda mp: Ctx())
    tasks = [executors.Task(index=i, name=f"p{i}", notebook=tmp_path / "n.ipynb", parameters={},
                            output=tmp_path / f"p{i}.ipynb", results=tmp_path / f"p{i}.json") for i in range(3)]
    got = []
    executors.LocalExecutor(jobs=2).run(tasks, lambda task, rec: got.append((task.index, rec)))
    assert [i for i, _ in got] == [0, 1, 2]
    assert all(r["status"] == "failed" and "could not start a worker process: BlockingIOError" in r["error"]
               for _, r in got)


def test_ray_files_that_cannot_be_written_fail_the_point(tmp_path):
    class Ray:
        @staticmethod
        def get(ref):
            return {"record": {"status": "ok", "seconds": 1.5, "worker": {"executor": "ray"}},
                    "notebook": b"{}", "results": b"{}"}

    task = executors.Task(index=0, name="p", notebook=tmp_path / "n.ipynb", parameters={},
                          output=tmp_path / "gone" / "p.ipynb", results=tmp_path / "gone" / "p.json")
    rec = executors.RayExecutor._receive(Ray, None, task, time.monotonic())
    assert rec["status"] == "failed" and "could not write what the worker sent: FileNotFoundError" in rec["error"]
    assert rec["worker"] == {"executor": "ray"} and rec["seconds"] == 1.5


# ---- options and their errors (no kernels) --------------------------------------------------------
@pytest.mark.parametrize("kwargs, needle", [
    ({"executor": "ray", "jobs": 2}, "jobs (--jobs) is for the local executor"),
    ({"address": "auto"}, "address (--address): only for the Ray executor"),
    ({"num_gpus": 1}, "num_gpus (--num-gpus): only for the Ray executor"),
    ({"jobs": 0}, "expected a whole number >= 1"),
    ({"executor": "dask"}, "expected one of local, ray"),
    ({"executor": "ray", "num_gpus": -1}, "expected a number >= 0"),
    ({"executor": "ray", "resources": {"GPU": 1}}, "give GPU with num_gpus (--num-gpus)"),
    ({"executor": "ray", "memory": "lots"}, "expected bytes"),
])
def test_bad_executor_options_are_config_errors(kwargs, needle):
    with pytest.raises(ConfigError) as e:
        executors.make_executor(**kwargs)
    assert needle in str(e.value)


def test_an_executor_object_passes_through_alone():
    ex = executors.LocalExecutor(jobs=3)
    assert executors.make_executor(ex) is ex and "up to 3 points at once" in ex.describe()
    with pytest.raises(ConfigError, match="set jobs"):
        executors.make_executor(ex, jobs=2)


def test_parallel_points_split_the_cores_between_their_kernels(monkeypatch):
    from workbench.measure import probe

    monkeypatch.setattr(probe, "available_cores", lambda: 8)
    monkeypatch.delenv("WORKBENCH_THREADS", raising=False)
    assert executors.LocalExecutor(jobs=4).worker_env()["WORKBENCH_THREADS"] == "2"
    assert executors.LocalExecutor(jobs=16).worker_env()["WORKBENCH_THREADS"] == "1"
    assert "WORKBENCH_THREADS=2" in executors.LocalExecutor(jobs=4).describe()
    assert "WORKBENCH_THREADS" not in executors.LocalExecutor(jobs=1).worker_env()   # alone: measured at load
    monkeypatch.setenv("WORKBENCH_THREADS", "3")                                       # the user's choice stands
    assert executors.LocalExecutor(jobs=4).worker_env()["WORKBENCH_THREADS"] == "3"


def test_an_address_nobody_answers_is_an_error_at_once():
    with pytest.raises(ConfigError, match=r"no Ray cluster answers at '127.0.0.1:\d+'"):
        executors.ray._probe(f"127.0.0.1:{_free_port()}")                    # ray.init() would retry for minutes
    with pytest.raises(ConfigError, match="expected HOST:PORT"):
        executors.ray._probe("headnode")
    for fine in (None, "auto", "local"):
        executors.ray._probe(fine)                                             # Ray's own to resolve


def test_a_worker_works_in_the_notebook_folder_it_has(tmp_path):
    """The Ray task's working directory: the notebook's folder under the worker's own notebooks/,
    else the driver's folder where the worker has it (same machine, shared disk), else notebooks/."""
    nb = runner.NOTEBOOKS / "00_tour.ipynb"
    assert executors.ray_task._notebook_dir(nb)["notebooks"] == "."
    assert executors.ray_task._worker_cwd(executors.ray_task._notebook_dir(nb)) == runner.NOTEBOOKS
    assert executors.ray_task._worker_cwd(executors.ray_task._notebook_dir(tmp_path / "x.ipynb")) == tmp_path
    assert executors.ray_task._worker_cwd({"notebooks": None, "path": "/nowhere/on/this/worker"}) == runner.NOTEBOOKS


def test_memory_sizes_and_requests():
    assert [executors.parse_memory(v) for v in ("8GiB", "512MB", "2e9", 1024, None)] == [
        8 * 2**30, 512 * 10**6, 2 * 10**9, 1024, None]
    ex = executors.make_executor("ray", num_gpus=0.5, memory="1GiB", resources={"accel": 1})
    assert ex.request() == {"CPU": 1, "GPU": 0.5, "memory": 2**30, "accel": 1}


class FakeRay:
    """What RayExecutor asks a cluster before submitting: its live nodes and their resources."""

    def __init__(self, *nodes):
        self._nodes = [{"Alive": True, "NodeManagerAddress": f"10.0.0.{i}", "Resources": r}
                       for i, r in enumerate(nodes, 1)] + [{"Alive": False, "Resources": {"GPU": 8.0}}]

    def nodes(self):
        return self._nodes


def test_ray_resource_check_needs_one_node_that_fits():
    cpu_node = {"CPU": 2.0, "memory": 8.0 * 2**30, "object_store_memory": 1e9, "node:10.0.0.1": 1.0}
    gpu_node = {"CPU": 8.0, "GPU": 1.0, "memory": 64.0 * 2**30}
    executors.RayExecutor(num_gpus=1)._check(FakeRay(cpu_node, gpu_node))           # the GPU node fits
    with pytest.raises(ConfigError, match=r"can run one point, which asks for CPU=1, GPU=1 \(nodes: 10.0.0.1: "
                                          r"CPU=2, memory=8GiB\).*--no-resource-check"):
        executors.RayExecutor(num_gpus=1)._check(FakeRay(cpu_node))                # the dead 8-GPU node does not
    with pytest.raises(ConfigError, match="CPU=4, memory=16GiB"):                  # no single node has both
        executors.RayExecutor(num_cpus=4, memory="16GiB")._check(FakeRay(cpu_node, {"CPU": 8.0, "memory": 2**30}))
    ex = executors.RayExecutor(num_gpus=1, check_resources=False)
    ex._check(FakeRay(cpu_node))                                                    # told not to check
    assert ex.cluster == "1 node: CPU=2, memory=8GiB" and "each point asks for CPU=1, GPU=1" in ex.describe()


@pytest.mark.parametrize("flags, needle", [
    (["--executor", "ray", "--jobs", "2"], "--jobs"),
    (["--address", "auto"], "--executor ray"),
    (["--executor", "ray", "--resources", "{nope"], "--resources"),
])
def test_cli_bad_combinations_exit_2_with_one_line(grid_nb, tmp_path, capsys, flags, needle):
    assert main(["run-notebooks", str(grid_nb), "--out", str(tmp_path / "run"), "--quiet", *flags]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.strip().count("\n") == 0 and "Traceback" not in err
    assert not (tmp_path / "run").exists()                                # nothing run, no run folder


def test_no_ray_is_a_config_error_naming_the_extra(grid_nb, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)                          # `import ray` raises ImportError
    with pytest.raises(ConfigError, match=r'pip install -e "\.\[ray\]"'):
        runner.run_notebooks([grid_nb], out_dir=tmp_path / "run", executor="ray", progress=False)
    assert not (tmp_path / "run").exists()


def test_runner_and_cli_do_not_import_ray():
    code = "import sys, workbench.lab.runner, workbench.lab.executors, workbench.cli.main; print('ray' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False,
                       cwd=Path(__file__).resolve().parents[2])
    assert r.returncode == 0 and r.stdout.strip() == "False", r.stderr


# ---- a real Ray head, as a user starts one ----------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ours(sid: int, tag: str) -> list[int]:
    """The head's processes: its session (``start_new_session``; the raylet's workers, renamed
    ``ray::IDLE`` and the like, stay in it) or a command line naming its temp folder."""
    out = subprocess.run(["ps", "-eo", "pid=,sid=,args="], capture_output=True, text=True, check=True).stdout
    rows = [line.split(None, 2) + [""] for line in out.splitlines() if line.strip()]
    return [int(r[0]) for r in rows if (r[1] == str(sid) or tag in r[2]) and "ps -eo" not in r[2]]


class Head:
    """``ray start --head --block`` with 2 CPUs on free ports, as a user starts one.  Stopped by
    SIGTERM to that one process (it stops its raylet, GCS and workers), then checked gone."""

    def __init__(self):
        self.tmp = tempfile.mkdtemp(prefix="wbray", dir="/tmp")   # short: Ray's socket paths must fit in 107 bytes
        self.log_path = Path(self.tmp) / "head.log"
        port = _free_port()
        self.address = f"127.0.0.1:{port}"
        # Every port given: nothing collides with another cluster here, and the raylet does not wait
        # (15 s, then abort) for its agents to report ports they picked, which a busy machine can miss.
        ports = [f"--{name}={_free_port()}" for name in ("dashboard-port", "dashboard-agent-listen-port",
                                                         "dashboard-agent-grpc-port", "metrics-export-port",
                                                         "runtime-env-agent-port")]
        self.log = open(self.log_path, "w")                     # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [str(Path(sys.executable).with_name("ray")), "start", "--head", "--block", "--num-cpus=2",
             "--num-gpus=0", "--disable-usage-stats", "--include-dashboard=false", "--include-log-monitor=false",
             f"--port={port}", *ports, f"--temp-dir={self.tmp}", "--node-ip-address=127.0.0.1"],
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, "RAY_raylet_start_wait_time_s": "120"})

    def wait(self, limit_s: float = 120) -> str:
        deadline = time.monotonic() + limit_s
        while "Ray runtime started" not in self.log_path.read_text():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail("the Ray head did not start:\n" + self.log_path.read_text()[-3000:])
            time.sleep(0.3)
        return self.address

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        self.log.close()
        deadline = time.monotonic() + 20
        while _ours(self.proc.pid, self.tmp) and time.monotonic() < deadline:
            time.sleep(0.5)
        left = _ours(self.proc.pid, self.tmp)
        for pid in left:                                          # ours (they name our temp folder): end them
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(self.tmp, ignore_errors=True)
        assert not left, f"Ray processes left after the head stopped: {left}"


@pytest.fixture(scope="module")
def _head(request):
    """The head, started as soon as the module's first test runs when any selected test needs it
    (it takes a while to come up: the local tests run meanwhile); None without Ray."""
    wanted = any("ray_head" in getattr(item, "fixturenames", ()) for item in request.session.items)
    if not wanted or importlib.util.find_spec("ray") is None or not Path(sys.executable).with_name("ray").is_file():
        yield None
        return
    head = Head()
    try:
        yield head
    finally:
        head.stop()


@pytest.fixture(autouse=True)
def _start_head_early(_head):
    """Every test of this module asks for the head fixture, so it starts with the first one."""


@pytest.fixture(scope="module")
def ray_head(_head):
    if _head is None:
        pytest.skip('Ray is not installed (pip install -e ".[ray]")')
    return _head.wait()


def test_ray_connects_by_address_checks_the_nodes_and_disconnects(ray_head, grid_nb, tmp_path):
    """The executor's own connection to the head (ray.init(address)), the resource check against
    its real node list, and ray.shutdown(): a GPU point on a CPU-only head is refused up front."""
    import ray

    assert not ray.is_initialized()
    with pytest.raises(ConfigError, match=r"no live node of the Ray cluster can run one point, which asks for "
                                          r"CPU=1, GPU=1 \(nodes: [0-9.]+: CPU=2, memory="):
        runner.run_notebooks([grid_nb], out_dir=tmp_path / "gpu", executor="ray", address=ray_head, num_gpus=1,
                             progress=False)
    assert not (tmp_path / "gpu").exists() and not ray.is_initialized()


@pytest.fixture(scope="module")
def ray_session(ray_head):
    """One driver connection for the runs below: the executor uses a session it finds open (and
    leaves it open), so both runs share the Ray job and its warm workers; shut down at the end."""
    import ray

    ray.init(address=ray_head, log_to_driver=False)
    yield ray_head
    ray.shutdown()


def test_an_open_session_is_reused_only_for_its_own_cluster(ray_session):
    import ray

    port = ray_session.rsplit(":", 1)[1]
    for same in (ray_session, f"localhost:{port}", "auto", None):
        ex = executors.RayExecutor(address=same, runtime_env={"env_vars": {"X": "1"}})
        ex.prepare()
        assert not ex._mine and ex._options()["runtime_env"] == {"env_vars": {"X": "1"}}   # per task: not dropped
        ex.close()
    with pytest.raises(ConfigError, match=r"already connected to the Ray cluster at '[0-9.]+:\d+'.*ray.shutdown"):
        executors.RayExecutor(address=f"127.0.0.1:{_free_port()}").prepare()
    assert ray.is_initialized()                                            # the caller's session stays open


@pytest.mark.slow
def test_ray_sweep_gives_the_serial_rows_and_names_its_workers(ray_session, grid_nb, serial, tmp_path):
    res = runner.run_notebooks([grid_nb], out_dir=tmp_path, timeout=120, progress=False, sweep=GRID,
                               executor="ray", address=ray_session, num_cpus=1)
    table = pd.read_csv(res["sweep_csv"])
    check_rows(table, serial[1])
    assert set(table["executor"]) == {"ray"} and os.getpid() not in set(table["worker_pid"])
    for col in ("worker_host", "worker_ip", "worker_node_id", "worker_id"):
        assert table[col].notna().all() and (table[col].astype(str).str.len() > 0).all(), col
    assert table["worker_node_id"].nunique() == 1                       # one node: the head
    pd.testing.assert_frame_equal(pd.read_csv(res["results_csv"]), pd.read_csv(serial[0]["results_csv"]))
    for rec in res["notebooks"]:                                         # the driver wrote what the workers sent
        executed = nbformat.read(rec["output"], as_version=4)
        assert executed.metadata.papermill.input_path == str(grid_nb)
        assert (rec["results"] is not None) == (rec["status"] == "ok")
    report = Path(res["report"]).read_text()
    assert "each point asks for CPU=1" in report and "ray: " in report


@pytest.mark.slow
def test_ray_cli_crash_keeps_its_row(ray_session, grid_nb, tmp_path, capsys):
    out = tmp_path / "cli"
    rc = main(["run-notebooks", str(grid_nb), "-p", "a=1", "-p", "b=5", "--sweep", "crash=true,false",
               "--executor", "ray", "--address", ray_session, "--quiet", "--out", str(out)])
    assert rc == 1                                                       # one point failed
    table = pd.read_csv(out / "sweep.csv")
    assert list(table["status"]) == ["failed", "ok"] and table.loc[1, "product"] == 5
    assert "Ray task failed: WorkerCrashedError" in table.loc[0, "error"] and set(table["executor"]) == {"ray"}
    printed = capsys.readouterr().out
    assert "FAILED: Ray task failed" in printed and f"sweep: {out / 'sweep.csv'}" in printed
