"""The GPU table of the low-bit Triton kernels (``workbench.bench.quant_kernels``).

Without CUDA the table must refuse (a ConfigError that says it needs a GPU), never print
numbers.  The row logic and the formatter are checked on rows measured for real: on a CPU, one
tiny layer through the Triton interpreter with host timers (the row's ``timing`` says so; no
speed is asserted, these are Python timings); on a GPU, the real function at a tiny size.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"        # before the kernel modules create their jit functions
pytest.importorskip("triton", reason="triton is not installed")

from workbench.bench.kernel_timing import environment  # noqa: E402
from workbench.bench.quant_kernels import (KERNEL_PROVIDERS, PROVIDERS, format_table, host_timer,  # noqa: E402
                                           quant_kernel_rows, shape_rows, summarize, weight_bytes)
from workbench.errors import ConfigError  # noqa: E402


def test_refuses_without_a_gpu():
    with pytest.raises(ConfigError, match="needs a GPU"):
        quant_kernel_rows(device="cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="no CUDA device is available"):
            quant_kernel_rows()


def test_bad_group_is_refused_before_any_work():
    if not torch.cuda.is_available():
        pytest.skip("the argument checks come after the GPU check")
    with pytest.raises(ConfigError, match="group"):
        quant_kernel_rows(shapes=((64, 96),), group=64)


def _check_rows(rows, ms, N, K):
    assert [r["m"] for r in rows] == list(ms)
    for r in rows:
        assert (r["N"], r["K"]) == (N, K)
        for p in PROVIDERS:
            assert not r.get(f"{p}_error"), r.get(f"{p}_error")
            assert r[f"{p}_ms_min"] <= r[f"{p}_ms"] <= r[f"{p}_ms_max"]
            assert r[f"{p}_weight_bytes"] == weight_bytes(p, N, K, r["group"], getattr(torch, r["dtype"]))
            assert r[f"{p}_gbps"] == pytest.approx(r[f"{p}_weight_bytes"] / (r[f"{p}_ms"] / 1e3) / 1e9)
        for p in KERNEL_PROVIDERS:
            assert r[f"{p}_speedup"] == pytest.approx(r["dense_ms"] / r[f"{p}_ms"])
        assert r["path"].startswith("gemv" if r["m"] <= 4 else "gemm") and "split_k=" in r["path"]
    text = format_table(rows)
    lines = text.splitlines()
    assert lines[0].split()[:4] == ["N", "x", "K", "m"]
    for r in rows:
        line = next(ln for ln in lines[2:] if ln.startswith(f"{N}x{K}  ") and ln.split()[1] == str(r["m"]))
        assert f"{r['w4a16_ms']:.4f}" in line and f"{r['w4a16_speedup']:.2f}x" in line
    assert rows[0]["timing"] in text
    return text


def test_rows_and_table_from_a_tiny_real_run():
    """On a CPU: one 48 x 64 layer, m = 1 and 5, every provider really run (the kernels under
    the interpreter) and timed by perf_counter; errors against the references are real too."""
    if torch.cuda.is_available():
        rows = quant_kernel_rows(ms=(1, 5), shapes=((256, 512),), group=128, reps=4, repeats=3, warmup=1)
        text = _check_rows(rows, (1, 5), 256, 512)
        assert "cuda" in rows[0]["timing"]
        for r in rows:
            assert r["w4a16_max_rel_err"] < 2e-2 and r["w4a8_max_rel_err"] < 2e-2      # bf16 outputs
        return
    dev = torch.device("cpu")
    rows = shape_rows(48, 64, (1, 5), 32, torch.float32, dev, host_timer, environment(dev), reps=2, repeats=3,
                      warmup=1, l2_bytes=0)
    text = _check_rows(rows, (1, 5), 48, 64)
    assert "host perf_counter" in rows[0]["timing"] and "host perf_counter" in text
    for r in rows:
        assert r["interpreter"] is True
        assert r["copies"] == "dense=1,w4a16=1,w8a16=1,w4a8=1"
        for p in KERNEL_PROVIDERS:          # fp32: the kernels against the same quantized weights
            assert r[f"{p}_max_rel_err"] < 1e-5, (p, r[f"{p}_max_rel_err"])


def test_summarize_and_format_record_errors():
    """A provider that failed keeps its error text in the row and the table (no timing made up)."""
    row = {"N": 8, "K": 16, "m": 1, "group": 16, "dtype": "float32", "path": "gemv split_k=1 BLOCK 1x16x32",
           "dense_weight_bytes": 512, "w4a16_weight_bytes": 96, "w4a16_error": "RuntimeError: boom",
           "timing": "host perf_counter, 1 calls", "repeats": 2, "copies": "dense=1"}
    times = {"dense": [0.002, 0.001, 0.003]}
    r = summarize(row, times)
    assert r["dense_ms"] == pytest.approx(2.0) and r["dense_spread_pct"] == pytest.approx(100.0)
    assert "w4a16_ms" not in r and "w4a16_speedup" not in r
    text = format_table([r])
    assert "error: 8x16 m=1 w4a16: RuntimeError: boom" in text
    assert format_table([]) == "(no rows)"
