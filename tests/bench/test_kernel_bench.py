"""The kernel benchmark at its smallest CPU size: complete rows, fractions from the ceilings
measured in the same run, errors recorded (never dropped), the CSV appended.

Under the Triton interpreter the timings are not speed claims, so nothing here asserts a speed;
the benchmark is run in a subprocess because the interpreter must be switched on before any
kernel module is imported (another test in this process may have imported them compiled).
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# The smallest sizes: the benchmark's "small" preset cut down further (seconds under the interpreter).
TINY = dict(rows=16, hidden=64, inter=96, rope_tokens=8, rope_heads=(4, 2, 16), attn_heads=(4, 2, 16),
            prefill=(2, 17), decode=(2, 21), page=16, copy_mib=8, matmul=128, context=12)


def _run(code: str, tmp_path: Path, timeout: int = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    env.pop("TRITON_INTERPRET", None)                  # the benchmark must switch it on itself
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
    """One run of all sections through the command line (``scripts/bench_kernels.py``'s ``bench_main``;
    CSV appended twice: an existing file is extended)."""
    tmp = tmp_path_factory.mktemp("kbench")
    out_csv, out_json = tmp / "runs" / "kernel_bench.csv", tmp / "kb.json"
    proc = _run(f"""
        import sys
        from workbench.bench import kernels as kb
        from workbench.cli.kernels import bench_main
        kb.SIZES["small"].update({TINY!r})
        args = ["--device", "cpu", "--size", "small", "--repeats", "2", "--warmup", "1", "--quiet",
                "--csv", {str(out_csv)!r}]
        assert bench_main(args + ["--sections", "ceilings", "--ops", "rmsnorm"]) == 0
        sys.exit(bench_main(args + ["--json", {str(out_json)!r}]))
        """, tmp)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc, json.loads(out_json.read_text())["rows"], out_csv


def test_every_section_op_and_provider_has_a_complete_row(bench_run):
    from workbench.bench.kernels import OPS, ROW_FIELDS

    _, rows, _ = bench_run
    assert all(list(r) == ROW_FIELDS for r in rows)
    got = {(r["section"], r["op"], r["provider"]) for r in rows}
    want = {("ceilings", "copy", "torch"), ("ceilings", "matmul", "torch")}
    want |= {("kernels", op, p) for op in OPS for p in ("eager", "compile", "triton")}
    want |= {("decode", "decode_step", p) for p in ("eager", "fused", "fused+graphs")}
    assert got == want
    for r in rows:
        for f in ("time", "device", "device_name", "dtype", "torch", "triton", "status"):
            assert r[f] not in (None, ""), (f, r)
        if r["section"] == "kernels":
            assert r["backends"].endswith("=" + r["provider"]), r     # the op's backend, in backends' names
        if r["status"] == "skipped":
            assert r["note"], r                         # a skipped provider says why
            continue
        assert r["status"] == "ok", r                   # nothing fails at these sizes on a CPU
        assert r["sizes"] and r["metric"] and r["formula"] and r["backends"], r
        assert r["repeats"] == (5 if r["section"] == "ceilings" else 2)
        assert 0 < r["ms_min"] <= r["ms_median"] <= r["ms_max"], r
        assert r["achieved"] > 0, r
        if r["section"] != "ceilings":
            assert r["max_err"] is not None and r["err_vs"], r
            assert r["max_err"] < 1e-4, r               # fp32 on a CPU: a few ulp of the reference
    skipped = {(r["op"], r["provider"]) for r in rows if r["status"] == "skipped"}
    assert skipped == {(op, "compile") for op in OPS} | {("decode_step", "fused+graphs")}


def test_triton_rows_are_labelled_interpreter_timings(bench_run):
    proc, rows, _ = bench_run
    for r in rows:
        triton = r["provider"] == "triton" or (r["provider"] == "fused" and r["status"] == "ok")
        assert (r["timing"] == "triton-interpreter") == triton, r
        assert r["interpreter"] is True
    assert "not speed claims" in proc.stdout
    assert proc.stdout.rstrip().splitlines()[-1].startswith("achieved:")   # the table is printed last


def test_fractions_come_from_the_ceilings_measured_in_the_run(bench_run):
    _, rows, _ = bench_run
    ceil = {r["metric"]: r["achieved"] for r in rows if r["section"] == "ceilings"}
    measured = [r for r in rows if r["section"] != "ceilings" and r["status"] == "ok"]
    assert measured
    for r in measured:
        assert r["ceiling"] == ceil[r["metric"]], r
        amount = r["bytes"] if r["metric"] == "GB/s" else r["flops"]
        scale = 1e9 if r["metric"] == "GB/s" else 1e12
        assert r["achieved"] == pytest.approx(amount / (r["ms_median"] / 1e3) / scale)
        assert r["frac_of_ceiling"] == pytest.approx(r["achieved"] / ceil[r["metric"]])
    eager = {r["op"]: r["ms_median"] for r in measured if r["provider"] == "eager"}
    for r in measured:
        assert r["vs_eager"] == pytest.approx(eager[r["op"]] / r["ms_median"])


def test_decode_rows_state_the_model_bytes_and_launches(bench_run):
    _, rows, _ = bench_run
    dec = {r["provider"]: r for r in rows if r["section"] == "decode"}
    assert "preset:tiny" in dec["eager"]["model"] and "CPU size" in dec["eager"]["model"]
    assert "rmsnorm=triton" in dec["fused"]["backends"] and "attention_decode=triton" in dec["fused"]["backends"]
    assert "triton" not in dec["eager"]["backends"]
    for p in ("eager", "fused"):
        assert dec[p]["launches_per_step"] > 0 and dec[p]["launch_counter"]
        assert dec[p]["bytes"] > 0 and "weights" in dec[p]["formula"]
    # fusing removes dispatched ops: norms, SwiGLU, RoPE + cache write become one launch each
    assert dec["fused"]["launches_per_step"] < dec["eager"]["launches_per_step"]
    assert dec["fused"]["max_err"] < 1e-3
    assert "CUDA" in dec["fused+graphs"]["note"]


def test_csv_is_appended_with_one_header(bench_run):
    from workbench.bench.kernels import ROW_FIELDS, check_csv

    _, rows, path = bench_run
    with open(path, newline="") as f:
        lines = list(csv.reader(f))
    assert lines[0] == ROW_FIELDS
    assert sum(line == ROW_FIELDS for line in lines) == 1
    assert len(lines) == 1 + 2 + len(rows)          # the first run (ceilings only), then the full run
    assert [dict(zip(ROW_FIELDS, line))["op"] for line in lines[1:3]] == ["copy", "matmul"]
    assert [dict(zip(ROW_FIELDS, line))["op"] for line in lines[3:]] == [r["op"] for r in rows]
    bad = path.with_name("other.csv")
    bad.write_text("a,b\n1,2\n")
    with pytest.raises(Exception, match="columns differ"):
        check_csv(bad)


def test_a_failing_provider_is_recorded_and_the_run_goes_on(tmp_path):
    proc = _run(f"""
        import json
        from workbench.bench import kernels as kb
        kb.SIZES["small"].update({TINY!r})
        real = kb.make_case

        def broken(op, *a, **k):
            case = real(op, *a, **k)
            if op == "swiglu":
                def boom(*args, **kwargs):
                    raise RuntimeError("injected kernel failure")
                case.triton = (boom, (), {{}})
            if op == "rope":
                raise ValueError("injected input failure")
            return case

        kb.make_case = broken
        cfg = kb.KernelBenchConfig(device="cpu", size="small", sections=("ceilings", "kernels"),
                                   ops=("rope", "swiglu", "rmsnorm"), repeats=1, warmup=0)
        rows = kb.run_kernel_bench(cfg)
        print(json.dumps(rows))
        """, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    by = {(r["op"], r["provider"]): r for r in rows}
    assert by[("swiglu", "triton")]["status"] == "error"
    assert "injected kernel failure" in by[("swiglu", "triton")]["error"]
    assert by[("swiglu", "eager")]["status"] == "ok"
    assert all(by[("rope", p)]["status"] == "error" and "injected input failure" in by[("rope", p)]["error"]
               for p in ("eager", "compile", "triton"))
    assert by[("rmsnorm", "triton")]["status"] == "ok"        # the ops after the failures still ran


def test_config_rejects_bad_values():
    from workbench.errors import ConfigError
    from workbench.bench.kernels import KernelBenchConfig

    for bad in (dict(size="huge"), dict(ops=("gelu",)), dict(sections=("warp",)), dict(repeats=0),
                dict(compile="maybe"), dict(overrides={"nope": 1})):
        with pytest.raises(ConfigError):
            KernelBenchConfig(**bad)
