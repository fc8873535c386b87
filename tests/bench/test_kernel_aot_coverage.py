"""``workbench kernels-aot`` covers every launch configuration the GPU benchmarks make.

The benchmark configurations are derived here from the benchmarks' own size tables
(``workbench.bench.kernels.SIZES``, ``decode_stack.DEFAULTS``, ``quant_kernels.SHAPES`` / ``MS``,
notebook 06's ``E2EConfig.preset("tiny")``, the device check's quant shapes) and matched against
:func:`workbench.bench.kernel_cases.bench_launch_cases`; then the ahead-of-time plan for sm_90
(recorded on meta tensors in a process without the Triton interpreter; nothing is compiled) must
launch something for every one of those cases.  The device check's warm-up runs the same cases."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from workbench.bench.kernel_cases import OPS, bench_launch_cases

ROOT = Path(__file__).resolve().parents[2]


def _buckets(n: int) -> set[int]:
    return {min(1 << i, n) for i in range(n.bit_length() + 1)}


def _cases(source: str) -> list:
    return [c for c in bench_launch_cases() if c.source == source]


def test_kernel_bench_full_sizes_are_cases():
    got = {c.config["op"] for c in _cases("kernels-bench") if c.config.get("size") == "full"}
    assert got == set(OPS)


def test_decode_roofline_is_a_case():
    from workbench.bench.kernels import SIZES
    from workbench.model.loader import model_config

    sz = SIZES["full"]
    cfg = model_config(sz["model"])
    cases = _cases("decode-roofline")
    assert {c.file for c in cases} >= {"rmsnorm", "rope", "swiglu", "paged_decode"}
    dec = [c.config for c in cases if c.config["phase"] == "decode"]
    assert dec and all(d["batch"] == 1 and d["model"] == sz["model"] and d["max_len"] > sz["context"]
                       and d["hidden"] == cfg.hidden_size and d["heads"] == (cfg.num_attention_heads,
                                                                          cfg.num_key_value_heads, cfg.head_dim)
                       for d in dec)
    assert any(c.config["phase"] == "prefill" and c.config["tokens"] == sz["context"] for c in cases)


def test_decode_stack_batches_and_both_caches_are_cases():
    from workbench.bench.decode_stack import DEFAULTS, DecodeStackConfig

    d = DEFAULTS["cuda"]
    cases = _cases("decode-stack")
    ctx = d["prompt_tokens"] + d["max_tokens"] + 1
    for kv in ("paged", "contiguous"):
        dec = {(c.file, c.config["batch"]) for c in cases if c.config["kv"] == kv and c.config["phase"] == "decode"}
        for b in _buckets(max(d["batches"])) | set(d["batches"]):
            for file in ("rmsnorm", "rope", "swiglu", "paged_decode", "sampling"):
                assert (file, b) in dec, (kv, file, b)
        pre = [c.config for c in cases if c.config["kv"] == kv and c.config["phase"] == "prefill"]
        assert pre and all(p["tokens"] == d["prompt_tokens"] and p["max_len"] == ctx for p in pre)
    assert all(c.config["block_size"] == DecodeStackConfig.block_size for c in cases if c.config["kv"] == "paged")
    assert {c.config["model"] for c in cases} == {d["model"]}


def test_every_quant_table_row_is_a_case_and_the_device_check_uses_table_rows():
    from workbench.bench.quant_kernels import GROUP, MS, SHAPES

    got = {(c.config["shape"], c.config["m"]) for c in _cases("quant-bench") if c.config["group"] == GROUP}
    assert got == {(tuple(s), m) for s in SHAPES for m in MS}
    script = (ROOT / "scripts" / "device_check.sh").read_text()
    line = re.search(r"^\s*QUANT=\((.*)\)", script, re.M).group(1)
    ms = [int(m) for m in re.search(r"--kernel-ms (\S+)", line).group(1).split(",")]
    shapes = [tuple(int(v) for v in s.split("x"))
              for s in re.search(r"--kernel-shapes (\S+)", line).group(1).split(",")]
    assert {(s, m) for s in shapes for m in ms} <= got


def test_the_end_to_end_ablation_is_a_case():
    from workbench.bench.e2e_configs import E2EConfig

    e = E2EConfig.preset("tiny")
    cases = _cases("e2e")
    assert {c.config["batch"] for c in cases if c.config["phase"] == "decode"} == _buckets(e.max_num_seqs)
    assert any(c.file == "flash_prefill" for c in cases)          # notebook 06's Triton layer runs prefill attention
    assert all(c.config["block_size"] == e.block_size for c in cases)


def test_kernels_aot_plans_every_benchmark_case_for_sm90():
    """Every benchmark case launches at least one kernel that ``workbench kernels-aot`` compiles
    for sm_90 (each planned binary lists the cases that launch it); bf16 only, as the GPU runs."""
    code = """
import json
from workbench.bench.kernel_cases import bench_launch_cases
from workbench.transforms.kernel_aot import plan
rows = plan(targets=(90,), dtypes=("bfloat16",), configs="first", bench_cases=bench_launch_cases())
print(json.dumps([{"kernel": ln.kernel if ln is not None else cfg, "covers": covers, "ok": ln is not None}
                  for ln, cfg, cap, dt, covers in rows]))
"""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("TRITON_INTERPRET", None)                  # recording needs the compiled kernel objects
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    assert all(r["ok"] for r in rows), [r for r in rows if not r["ok"]]
    covered = {c.split(" bf16")[0] for r in rows for c in r["covers"]}
    missing = [c.label() for c in bench_launch_cases() if c.label() not in covered]
    assert not missing, f"benchmark cases kernels-aot does not compile: {missing}"
    # and the representative cases are still there, one row each as before
    assert any(not any(":" in c for c in r["covers"]) for r in rows)
