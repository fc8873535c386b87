"""Fuzzing Ray sweeps (:class:`workbench.lab.executors.RayExecutor` through
:func:`workbench.lab.runner.run_notebooks`, on a real local head as tests/lab/test_sweep_executors.py
starts one): a sweep of 2 to 4 points, each drawn to finish, raise in a cell, kill the worker that
runs it (SIGKILL to the process running papermill: Ray reports WorkerCrashedError), end its kernel
(``os._exit``), or run past the point timeout.  Whatever the draw, the sweep completes and every
point keeps its row, in grid order, with its status and the reason it failed.

Each example is a whole sweep on Ray (some 10-30 s), so CI runs 2; a long run
(WORKBENCH_FUZZ_EXAMPLES) runs as many as it is given.  Skipped without Ray, as the lab's Ray tests.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fuzzkit import fuzz, note

nbformat = pytest.importorskip("nbformat")
pytest.importorskip("papermill")
pd = pytest.importorskip("pandas")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lab"))
from test_runner import write_notebook  # noqa: E402 - the lab tests' tiny notebooks
from test_sweep_executors import Head  # noqa: E402 - the lab tests' real Ray head

from workbench.lab import runner  # noqa: E402

POINT_TIMEOUT = 20
PARAMS = "results_path = None\ni = 0\nmodes = 'ok'"
SRC = """
import os, signal, time
from workbench.lab.results import save_results
mode = modes.split(",")[i]
if mode == "raise":
    raise ValueError(f"point {i} fails")
if mode == "crash":                              # the process running papermill (the Ray worker) dies
    os.kill(os.getppid(), signal.SIGKILL)
    time.sleep(60)
if mode == "kernel":                             # the kernel dies under papermill
    os._exit(3)
if mode == "hang":                               # past the point timeout
    time.sleep(600)
if results_path:
    save_results(results_path, {"product": 10 * i + 1})
"""
REASONS = {"raise": "ValueError: point {i} fails", "crash": "WorkerCrashedError", "kernel": "DeadKernelError",
           "hang": f"exceeded {POINT_TIMEOUT} s (point timeout"}


@pytest.fixture(scope="module")
def ray_address():
    if importlib.util.find_spec("ray") is None or not Path(sys.executable).with_name("ray").is_file():
        pytest.skip('Ray is not installed (pip install -e ".[ray]")')
    import ray

    head = Head()
    try:
        address = head.wait()
        ray.init(address=address, log_to_driver=False)   # one driver session for every sweep (warm workers)
        yield address
    finally:
        if ray.is_initialized():
            ray.shutdown()
        head.stop()


@pytest.fixture(scope="module")
def notebook(tmp_path_factory):
    return write_notebook(tmp_path_factory.mktemp("nbs") / "points.ipynb", SRC, parameters=PARAMS)


MODES = st.lists(st.sampled_from(["ok", "ok", "raise", "crash", "kernel", "hang"]), min_size=2, max_size=4)


def run_sweep(modes, address, notebook, out):
    res = runner.run_notebooks([notebook], out_dir=out, timeout=120, progress=False, executor="ray", address=address,
                               num_cpus=1, point_timeout=POINT_TIMEOUT,
                               parameters={"modes": ",".join(modes)}, sweep={"i": list(range(len(modes)))})
    table = pd.read_csv(res["sweep_csv"])
    assert list(table["i"]) == list(range(len(modes))), "one row a point, in grid order"
    for i, mode in enumerate(modes):
        row = table.loc[i]
        if mode == "ok":
            assert row["status"] == "ok" and row["product"] == 10 * i + 1, row.to_dict()
        else:
            assert row["status"] == "failed" and isinstance(row["error"], str) and row["error"].strip(), row.to_dict()
            assert REASONS[mode].format(i=i) in row["error"], (mode, row["error"])
            assert "\n" not in row["error"].strip(), row["error"]
        assert row["executor"] == "ray"
    assert [r["status"] for r in res["notebooks"]] == ["ok" if m == "ok" else "failed" for m in modes]
    return table


@pytest.mark.slow
@fuzz(ci=2, deadline_ms=600_000)
@given(modes=MODES)
def test_fuzz_ray_sweep_keeps_every_row(ray_address, notebook, tmp_path_factory, modes):
    run_sweep(modes, ray_address, notebook, tmp_path_factory.mktemp("sweep"))
    note(",".join(sorted(set(modes))))


@pytest.mark.slow
def test_every_way_to_fail_in_one_sweep(ray_address, notebook, tmp_path):
    run_sweep(["crash", "ok", "raise", "kernel", "hang"], ray_address, notebook, tmp_path)
