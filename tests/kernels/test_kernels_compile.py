"""Every Triton kernel compiles for Hopper (sm_90) and Ampere (sm_80), checked without a GPU.

The other kernel tests run under the Triton interpreter, which accepts some code the real
compiler rejects; here ``workbench.transforms.kernel_aot`` runs the real pipeline (TTIR -> PTX -> ptxas ->
cubin) for both targets at the representative sizes, launching each kernel through its host
wrapper on meta tensors (see that module).  Compilation needs a process where
``TRITON_INTERPRET`` is not 1 (other test modules set it in this process), so it runs in
subprocesses, with a fresh ``TRITON_CACHE_DIR`` so that the kernels are really compiled.

Cost: ~60 compiles of ~1 s each on one core.  bf16 covers each autotuned kernel's first and
last config (its largest and smallest tile: on sm_90 the two lowerings of tl.dot, wgmma and
mma.sync); fp32 (no tensor cores: the kernels ask for IEEE products) covers the last, smallest
config (fp32's large tiles take 4-14 s each to compile) on sm_90 only (no tensor cores: sm_80 adds
nothing bf16's sm_80 rows do not show).  fp16 follows bf16's code paths.
``workbench kernels-aot --dtypes all --configs all`` compiles everything (~6 minutes).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

TARGETS = ("sm_90", "sm_80")
# kernel file -> its launchable kernels (a kernel added to a file without a case in
# workbench.transforms.kernel_launches shows up there as an error row, so this list is a floor, not the set)
KERNELS = {
    "rmsnorm": {"_rmsnorm_fwd_kernel"},
    "rope": {"_rope_fwd_kernel"},
    "swiglu": {"_swiglu_fwd_kernel"},
    "flash_prefill": {"_flash_prefill_kernel"},
    "paged_decode": {"_paged_decode_split_kernel", "_paged_decode_merge_kernel"},
    "sampling": {"_sampling_fwd_kernel"},
    "quant_matmul": {"_wxa16_gemv_kernel", "_wxa16_gemm_kernel", "_wxa8_matmul_fwd_kernel",
                     "_quantize_per_token_int8_fwd_kernel"},
}
ATTENTION_MMA = {"_flash_prefill_kernel", "_paged_decode_split_kernel"}   # the kernels that call tl.dot


def _aot(args: list[str], tmp: Path, interpret: bool = False) -> list[dict]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "TRITON_CACHE_DIR": str(tmp)}
    env.pop("TRITON_INTERPRET", None)
    if interpret:       # the module must notice and compile in a clean child process itself
        env["TRITON_INTERPRET"] = "1"
    proc = subprocess.run([sys.executable, "-m", "workbench.cli", "kernels-aot", "--json", *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode == 2 and "ptxas" in proc.stderr:
        pytest.skip(f"no ptxas in this triton install: {proc.stderr.strip().splitlines()[-1]}")
    assert proc.returncode in (0, 1) and proc.stdout.strip(), \
        f"kernel_aot {' '.join(args)} exited {proc.returncode}:\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout)["rows"]


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    bf16 = _aot(["--targets", "90,80", "--dtypes", "bfloat16", "--configs", "ends"],
                tmp_path_factory.mktemp("triton_cache_bf16"))
    # fp32 is run from a process with TRITON_INTERPRET=1: `workbench kernels-aot` must work there too
    fp32 = _aot(["--targets", "90", "--dtypes", "float32", "--configs", "last"],
                tmp_path_factory.mktemp("triton_cache_fp32"), interpret=True)
    return bf16 + fp32


def _kernel_label(r: dict) -> str:
    return f"{r['target']} {r['kernel']} [{r['case']}] {r['config']}"


def test_every_kernel_compiles_for_hopper_and_ampere(rows):
    failed = [f"{_kernel_label(r)}:\n{r['error']}" for r in rows if r["status"] != "ok"]
    assert not failed, "kernels that do not compile:\n\n" + "\n\n".join(failed)
    for dtype, targets in (("bf16", TARGETS), ("fp32", ("sm_90",))):
        for file, names in KERNELS.items():
            for target in targets:
                got = {r["kernel"] for r in rows if r["file"] == file and r["target"] == target
                       and r["dtype"] == dtype}
                assert names <= got, f"{file} {dtype} {target}: compiled {sorted(got)}, expected {sorted(names)}"


def test_compiled_kernels_fit_the_targets(rows):
    """Registers within the register file for every compiled config (a launch asking for more
    fails), and every launch has a config within the target's shared memory per block (the
    autotuner skips a config that needs more; a kernel without a fitting one cannot run)."""
    fits: dict[tuple, bool] = {}
    for r in rows:
        assert r["smem"] is not None and r["num_warps"] in (1, 2, 4, 8, 16), _kernel_label(r)
        assert "launch would fail" not in r["note"], f"{_kernel_label(r)}: {r['note']}"
        if r["regs"] is not None:          # from cuobjdump, bundled with triton
            assert 0 < r["regs"] <= 255, _kernel_label(r)
        key = (r["kernel"], r["case"], r["target"])
        fits[key] = fits.get(key, False) or "shared memory" not in r["note"]
    assert all(fits.values()), [k for k, ok in fits.items() if not ok]


def test_attention_uses_tensor_cores_in_bf16(rows):
    """What Triton 3.x emits for the attention kernels' tl.dot in bf16:

    * sm_80: ``mma.sync.aligned.m16n8k16`` (Ampere's warp-level MMA) for every tile.
    * sm_90: ``wgmma.mma_async`` (Hopper's warpgroup MMA: 4 warps, 64 rows per warpgroup) when
      the tile has >= 64 rows and the program 4 or 8 warps -- the flash-prefill tiles of 64 and
      128 query rows.  Smaller tiles fall back to ``mma.sync``: the 32-row prefill tile and the
      decode kernel, whose rows are the GQA group padded to 16 (one query token per sequence).
    So: every bf16 attention row has tensor-core instructions; on sm_80 only mma.sync; on sm_90
    the largest prefill tile uses wgmma.
    """
    att = [r for r in rows if r["kernel"] in ATTENTION_MMA and r["dtype"] == "bf16"]
    assert {r["target"] for r in att} == set(TARGETS)
    for r in att:
        assert r["mma"] + r["wgmma"] > 0, f"{_kernel_label(r)}: no tensor-core instruction in the PTX"
        if r["target"] == "sm_80":
            assert r["mma"] > 0 and r["wgmma"] == 0, _kernel_label(r)
    big = [r for r in att if r["target"] == "sm_90" and r["kernel"] == "_flash_prefill_kernel"
           and "BLOCK_M=128" in r["config"]]
    assert big and all(r["wgmma"] > 0 for r in big), [_kernel_label(r) for r in big]
    decode = [r for r in att if r["target"] == "sm_90" and r["kernel"] == "_paged_decode_split_kernel"]
    assert decode and all(r["mma"] > 0 and r["wgmma"] == 0 for r in decode)


def test_fp32_attention_uses_exact_products(rows):
    """fp32 inputs use ``input_precision="ieee"`` (FP32_IEEE): true fp32 FMAs, no tf32 tensor cores."""
    att = [r for r in rows if r["kernel"] in ATTENTION_MMA and r["dtype"] == "fp32"]
    assert att
    for r in att:
        assert r["mma"] == 0 and r["wgmma"] == 0, f"{_kernel_label(r)}: tensor cores used for fp32"


def test_pointwise_kernels_load_16_bytes_at_a_time(rows):
    """The bandwidth-bound kernels read whole rows with 16-byte vector loads (``ld.global.v4``:
    8 bf16 or 4 fp32 per load) -- Triton proves the alignment from the launch's specialisation
    (16-aligned pointers, row strides divisible by 16)."""
    for r in rows:
        if r["kernel"] in ("_rmsnorm_fwd_kernel", "_swiglu_fwd_kernel"):
            assert r["ld_v4"] > 0, f"{_kernel_label(r)}: no ld.global.v4 ({r})"
            # the bundled model's 256-wide rows batched (e2e's decode batches): a tile of several such rows
            # spreads the weight vector thinner than 8 elements a thread, one scalar load; measured, not a target
            if not ("x256 " in r["case"] and r["kernel"] == "_rmsnorm_fwd_kernel" and "BLOCK_M=1 " not in r["config"]):
                assert r["ld_scalar"] == 0, f"{_kernel_label(r)}: scalar global loads ({r})"


def test_format_and_cli_options():
    """The table and the argparse hook, without compiling anything."""
    import argparse

    from workbench.cli.kernels import add_kernels_aot_arguments
    from workbench.transforms.kernel_aot import format_aot

    args = add_kernels_aot_arguments(argparse.ArgumentParser()).parse_args([])
    assert (args.targets, args.dtypes, args.configs, args.json) == ("90,80", "bfloat16", "all", False)
    ok = {"file": "swiglu", "kernel": "_swiglu_fwd_kernel", "case": "swiglu 1x8192 bf16", "target": "sm_90",
          "config": "BLOCK_M=1 BLOCK_N=1024 w4", "status": "ok", "error": "", "seconds": 0.4, "smem": 0,
          "num_warps": 4, "regs": 40, "ld_v4": 8, "ld_v2": 0, "ld_scalar": 0, "cp_async": 0, "mma": 0, "wgmma": 0,
          "spill_bytes": 0, "note": ""}
    bad = {**ok, "target": "sm_80", "status": "error", "error": "CompilationError: at 3:4:\nbad thing",
           "smem": None, "regs": None}
    text = format_aot([ok, bad])
    assert "swiglu_fwd" in text and "1/2 compiled" in text
    assert "FAILED: sm_80 swiglu_fwd" in text and "bad thing" in text


def test_launch_knobs_are_feature_detected():
    """``JITFunction.run`` copies some compilation knobs into the options, a set that grows with
    Triton (``fpsan_homomorphic_casts`` since 3.9): a knob is passed only where this Triton has
    both the knob and the option (triton 3.6 - 3.8 lack it; ``_pack_args`` rejects unknown ones)."""
    from dataclasses import dataclass
    from types import SimpleNamespace

    from workbench.transforms.kernel_compile import _launch_knobs

    @dataclass
    class Old:                      # triton 3.6 - 3.8's options
        instrumentation_mode: str = ""

    @dataclass
    class New(Old):                 # triton 3.9's
        fpsan_homomorphic_casts: bool = False

    old_knobs = SimpleNamespace(compilation=SimpleNamespace(instrumentation_mode=""))
    new_knobs = SimpleNamespace(compilation=SimpleNamespace(instrumentation_mode="", fpsan_homomorphic_casts=True))
    backend = lambda cls: SimpleNamespace(parse_options=lambda opts: cls())  # noqa: E731
    assert _launch_knobs(old_knobs, backend(Old)) == {"instrumentation_mode": ""}
    assert _launch_knobs(new_knobs, backend(Old)) == {"instrumentation_mode": ""}
    assert _launch_knobs(old_knobs, backend(New)) == {"instrumentation_mode": ""}
    assert _launch_knobs(new_knobs, backend(New)) == {"instrumentation_mode": "", "fpsan_homomorphic_casts": True}
