"""The device check's warm-up (workbench.bench.kernel_cases.warm_up) without a GPU: on a CPU every
benchmark launch case is recorded on meta tensors at its GPU sizes; the CUDA path's order (compile
workers, then each case once, then torch.compile), its rows and its deadline, with the cases and the
device calls faked."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from workbench.bench import kernel_cases as kc


REAL = kc.bench_launch_cases
ROOT = Path(__file__).resolve().parents[2]


def test_on_a_cpu_every_case_is_recorded_on_meta():
    """(In a process without the Triton interpreter: recording swaps the compiled kernel objects.)"""
    code = """
import json
from workbench.bench import kernel_cases as kc
real = kc.bench_launch_cases
kc.bench_launch_cases = lambda: real()[:6]
saved = []
res = kc.warm_up("cpu", on_rows=lambda rows: saved.append(len(rows)))
print(json.dumps({"res": res, "saved": saved}))
"""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    res = out["res"]
    assert res["device"] == "cpu" and res["cases"] == 6 and len(res["rows"]) == 6
    assert all(r["phase"].startswith("record") and r["status"] == "ok" and r["launches"] >= 1 for r in res["rows"]), \
        res["rows"]
    assert out["saved"] == [1, 2, 3, 4, 5, 6]             # saved after every case


@pytest.fixture()
def fake_cuda(monkeypatch):
    """warm_up's CUDA branch on a CPU: the device, the synchronize and the cases are fakes."""
    calls = []

    def case(i, fail=False):
        def call(dev, dtype):
            calls.append((i, dev.type, dtype))
            if fail:
                raise RuntimeError("injected")
        return kc.LaunchCase("rmsnorm", "test", f"case {i}", call)

    monkeypatch.setattr(kc, "bench_launch_cases", lambda: [case(0), case(1, fail=True), case(2)])
    import workbench.model.loader as loader

    monkeypatch.setattr(loader, "resolve_device", lambda d: torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda *a, **k: None)
    return calls


def test_the_cuda_path_runs_each_case_once_and_records_failures(fake_cuda):
    res = kc.warm_up("cuda", inductor=False)
    assert [c[0] for c in fake_cuda] == [0, 1, 2] and all(c[1] == "cuda" and c[2] == torch.bfloat16 for c in fake_cuda)
    assert [(r["phase"], r["status"]) for r in res["rows"]] == [("run", "ok"), ("run", "error"), ("run", "ok")]
    assert "injected" in res["rows"][1]["error"]


def test_past_the_deadline_the_rest_is_skipped(fake_cuda):
    res = kc.warm_up("cuda", inductor=True, deadline=time.time() - 1)
    assert fake_cuda == [] and [r["status"] for r in res["rows"]] == ["skipped"] * 3     # no inductor rows either


def test_compile_workers_report_their_rows(fake_cuda, monkeypatch):
    """Two worker processes (``gpu_results step warmup-compile``): without a GPU each real case
    fails to compile, and every case still comes back as a row of its shard."""
    monkeypatch.setattr(kc, "bench_launch_cases", REAL)
    n = len(REAL())
    res = kc.warm_up("cuda", workers=2, inductor=False, deadline=time.time() + 300)
    compiled = [r for r in res["rows"] if r["phase"] == "compile"]
    assert len(compiled) == n, [r for r in res["rows"] if r["phase"] == "compile"][:3]
    assert {r["status"] for r in compiled} <= {"ok", "error"}
    assert len([r for r in res["rows"] if r["phase"] == "run"]) == n
