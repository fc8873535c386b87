"""The package's architecture: one folder per layer, imports only downwards, a small public surface.

* ``lint-imports`` (import-linter, configured in ``.importlinter``) checks the layer order, that
  only ``lab`` and ``cli`` import plotly / ipywidgets / IPython, that the scheduler and the
  block bookkeeping import neither torch nor numpy, and that ``lab`` imports no timer, comparison
  or benchmark harness.  It reads imports statically, so
* a subprocess imports the pure modules (and ``workbench`` itself) and looks at ``sys.modules``:
  lazy exports must keep torch and plotly out until they are used.
* ``lab`` holds no measurement: a scan of its source finds no timer (:func:`lab_timers`).
* Every subpackage has an ``__all__`` whose names all resolve.
"""

from __future__ import annotations

import ast
import importlib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ["workbench", "workbench.model", "workbench.kv", "workbench.prefetch", "workbench.sched",
            "workbench.transforms", "workbench.quant", "workbench.engine", "workbench.load", "workbench.serve",
            "workbench.bench", "workbench.bench.claims", "workbench.lab", "workbench.lab.executors", "workbench.cli",
            "workbench.measure"]


def test_import_contracts_hold():
    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or shutil.which("lint-imports")
    if exe is None:
        pytest.fail("import-linter is not installed: it is in the dev extra (pip install -e '.[dev]')")
    r = subprocess.run([exe, "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert "0 broken" in r.stdout


def _modules_after(code: str) -> set[str]:
    r = subprocess.run([sys.executable, "-c", code + "\nimport sys; print(' '.join(sorted(sys.modules)))"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return set(r.stdout.split())


def test_scheduler_and_block_manager_import_without_torch():
    mods = _modules_after("import workbench.sched.scheduler, workbench.kv.block_manager, workbench.sched")
    assert "torch" not in mods and "numpy" not in mods
    assert "workbench.sched.scheduler" in mods and "workbench.kv.block_manager" in mods


def test_import_workbench_loads_neither_torch_nor_plotly():
    mods = _modules_after("import workbench, workbench.kv, workbench.engine, workbench.load, workbench.serve, "
                          "workbench.lab")
    assert not {"torch", "plotly", "ipywidgets", "starlette"} & mods
    mods = _modules_after("import workbench; workbench.SamplingParams")   # first use imports what it needs
    assert "workbench.engine.sampling" in mods and "torch" in mods


# ---- lab holds no measurement ---------------------------------------------------------------------
# lab shows measurements (views, the runner, the report); whatever *times* something lives in bench or
# measure, where it is tested as a measurement.  A timer read in lab would be a measurement taken where
# nothing checks it, so lab may not read a measuring clock, synchronize a device or time a call.  Its
# clock is time.monotonic (or time.time): deadlines and timeouts, redraw pacing, how long a run or a
# redraw took - bookkeeping, not results.  A view that plots the engine's timestamps reads the engine's
# own clock (``llm.engine.clock``).
LAB_TIMERS = {
    "perf_counter", "perf_counter_ns", "process_time", "process_time_ns", "thread_time", "thread_time_ns",
    "synchronize", "elapsed_time", "do_bench", "do_bench_cudagraph",        # torch.cuda / CUDA events / triton
    "time_call", "time_calls", "time_replays", "device_timer", "noise_probe",      # workbench's timers
}
LAB_TIMER_MODULES = ("timeit", "torch.utils.benchmark", "triton.testing", "workbench.measure.timing",
                     "workbench.measure.compare")


def lab_timers(root: Path = ROOT / "workbench" / "lab") -> list[str]:
    """``path:line: what`` for every timer in the Python files under ``root``: a name or attribute of
    :data:`LAB_TIMERS` (called or passed, ``time.perf_counter`` as a default argument too), a call with
    ``enable_timing=`` (``torch.cuda.Event``), or an import of :data:`LAB_TIMER_MODULES`."""
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            what = None
            if isinstance(node, ast.Attribute) and node.attr in LAB_TIMERS:
                what = f"{ast.unparse(node)}"
            elif isinstance(node, ast.Name) and node.id in LAB_TIMERS:
                what = node.id
            elif isinstance(node, ast.Call) and any(k.arg == "enable_timing" for k in node.keywords):
                what = f"{ast.unparse(node.func)}(enable_timing=...)"
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                mods = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                names = [a.name for a in node.names] if isinstance(node, ast.ImportFrom) else []
                bad = [m for m in mods if m.startswith(LAB_TIMER_MODULES)] + [n for n in names if n in LAB_TIMERS]
                what = f"import of {', '.join(bad)}" if bad else None
            if what:
                found.append(f"{rel}:{node.lineno}: {what}")
    return found


def test_lab_holds_no_measurement():
    found = lab_timers()
    assert not found, ("lab shows measurements and takes none: time the work in workbench.bench (or measure) and "
                       "show it from lab; lab's own clock for deadlines, pacing and how long something took is "
                       "time.monotonic:\n" + "\n".join(found))


def test_the_timer_scan_finds_what_it_forbids(tmp_path):
    (tmp_path / "view.py").write_text(
        "import time\nimport torch\nfrom time import perf_counter\nfrom workbench.measure.timing import sync\n"
        "def f(clock=time.perf_counter):\n"
        "    t0 = time.monotonic(); deadline = time.time() + 5     # bookkeeping: allowed\n"
        "    start = torch.cuda.Event(enable_timing=True)\n"
        "    torch.cuda.synchronize()\n"
        "    return perf_counter() - t0\n")
    found = [f.split(": ", 1)[1] for f in lab_timers(tmp_path)]
    assert found == ["import of perf_counter", "import of workbench.measure.timing", "time.perf_counter",
                     "torch.cuda.Event(enable_timing=...)", "torch.cuda.synchronize", "perf_counter"], found


@pytest.mark.parametrize("package", PACKAGES)
def test_every_package_has_a_public_surface_that_resolves(package):
    mod = importlib.import_module(package)
    assert isinstance(getattr(mod, "__all__", None), list), f"{package} has no __all__"
    for name in mod.__all__:
        if name in ("LatencyStreamView", "KVBlockMapView", "LatencyDashboard") and importlib.util.find_spec(
                "ipywidgets") is None:
            continue
        assert getattr(mod, name) is not None, f"{package}.{name}"


def test_the_top_level_exports_what_a_user_needs():
    import workbench

    for name in ("LLM", "LLMEngine", "AsyncEngine", "SamplingParams", "SchedulerConfig", "PagedKVConfig",
                 "TierConfig", "load_model", "summarize", "Tokenizer", "WorkbenchError"):
        assert name in workbench.__all__ and getattr(workbench, name) is not None
