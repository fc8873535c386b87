"""Launch plans of the low-bit matmuls (:mod:`workbench_kernels.quant_matmul`): which path
("gemv": CUDA-core sums for a few rows; "gemm": ``tl.dot``), block sizes and split-K a wrapper
launches for one shape -- a function of the shapes (and the SM count) only, so no host sync.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from . import interpreter_active

GEMV_MAX_M = 4          # rows up to which the auto plan takes the CUDA-core GEMV (a lead: tune on the GPU)
_REPRESENTATIVE_SMS = 132       # H100 / H200, for plans made without a CUDA device (meta tensors, AOT)
_MIN_K_PER_SPLIT = 256          # input columns a split reads at least (each split costs an fp32 partial)
_MAX_SPLIT_K = 32


# ---- plans ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class QuantMatmulPlan:
    """What a wrapper launches for one shape: ``path`` ("gemv": CUDA-core sums; "gemm":
    ``tl.dot``), block sizes, ``split_k`` (programs along K) and ``k_per_split`` (input columns
    each reads), ``group_aligned`` (each BLOCK_K step lies in one group: one scale per row)."""
    path: str
    block_m: int
    block_n: int
    block_k: int
    split_k: int
    k_per_split: int
    group_aligned: bool
    num_warps: int
    num_stages: int | None = None       # None: Triton's default

    def describe(self) -> str:
        return (f"{self.path} split_k={self.split_k} "
                f"BLOCK {self.block_m}x{self.block_n}x{self.block_k}")


_SM_COUNT: dict[int, int] = {}


def _num_sms(device) -> int:
    if device is not None and torch.device(device).type == "cuda":
        idx = torch.device(device).index
        idx = torch.cuda.current_device() if idx is None else idx
        if idx not in _SM_COUNT:
            _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
        return _SM_COUNT[idx]
    return _REPRESENTATIVE_SMS


def _pow2_divisor(n: int, cap: int) -> int:
    """The largest power of two <= cap dividing n."""
    b = 1
    while b * 2 <= cap and n % (b * 2) == 0:
        b *= 2
    return b


def _split(tiles: int, K: int, unit: int, sms: int, gemv: bool, split_k: int | None) -> tuple[int, int]:
    """(split_k, k_per_split).  Unless ``split_k`` is given: when the output tiles alone are fewer
    than 2 x SMs (gemv: memory-bound, wants many loads in flight) or SMs (gemm), enough splits
    for 4 x SMs (gemv) / 2 x SMs (gemm) programs, each split >= _MIN_K_PER_SPLIT input columns,
    at most _MAX_SPLIT_K.  Split boundaries on multiples of ``unit``; no empty split."""
    units = -(-K // unit)
    if split_k is None:
        floor, target = (2 * sms, 4 * sms) if gemv else (sms, 2 * sms)
        want = -(-target // max(tiles, 1)) if tiles < floor else 1
        split_k = max(1, min(want, K // _MIN_K_PER_SPLIT, _MAX_SPLIT_K))
    split_k = max(1, min(int(split_k), units))
    k_per_split = -(-units // split_k) * unit
    return -(-K // k_per_split), k_per_split


def _check_plan_args(op: str, m: int, N: int, K: int, group: int, path: str | None, split_k: int | None) -> None:
    if path not in (None, "gemv", "gemm"):
        raise ValueError(f"{op}: path must be None, 'gemv' or 'gemm', got {path!r}")
    if split_k is not None and int(split_k) < 1:
        raise ValueError(f"{op}: split_k must be >= 1, got {split_k}")
    if min(m, N, K, group) < 1:
        raise ValueError(f"{op}: m, N, K and group must be >= 1, got m={m}, N={N}, K={K}, group={group}")


def _gemm_tiles(m: int, interp: bool) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) of the tensor-core path on a GPU: 16 / 32 / 64 token rows
    against 64 weight rows (4 warps), 64 x 128 with 8 warps beyond 64 rows (measured with the
    ahead-of-time compiler for sm_90: <= 128 registers per thread at BLOCK_K = 64, no spills).
    Under the interpreter at most 32 x 64 (each program is a Python loop iteration)."""
    if interp:
        return (16 if m <= 16 else 32), 64, 4
    if m <= 64:
        return (16 if m <= 16 else 32 if m <= 32 else 64), 64, 4
    return 64, 128, 8


def w4a16_plan(m: int, N: int, K: int, group: int, *, split_k: int | None = None, path: str | None = None,
               bits: int = 4, device=None) -> QuantMatmulPlan:
    """The launch of :func:`w4a16_matmul` (``bits=8``: :func:`w8a16_matmul`) for x [m, K] and a
    weight [N, K] with ``group`` columns per scale.  On a GPU (``device`` a CUDA device: its SM
    count; otherwise an H100/H200's 132):

    * path: ``gemv`` for m <= GEMV_MAX_M (4), else ``gemm``.
    * gemv: BLOCK_M = next_pow2(m) (<= 16), BLOCK_K = 128 input columns per step (int4: 64 bytes
      of each weight row), BLOCK_N = 4096 / (BLOCK_M * BLOCK_K / 2) within [16, 64]: m = 1 -> 64
      weight rows, 2 -> 32, 3-4 -> 16 (the unrolled rows keep their loads live: <= ~110
      registers per thread on sm_90, Triton 3.6 and 3.9).
    * gemm: BLOCK_M x BLOCK_N = 16 / 32 / 64 x 64 (4 warps) for m <= 16 / 32 / 64, 64 x 128 with
      8 warps beyond; BLOCK_K = 128 for m <= 32, else 64.
    * BLOCK_K is lowered to the largest power of two dividing ``group`` when that is >= 32, so a
      step lies in one group (one scale per row: GROUP_ALIGNED); below 32 the scales are gathered
      per element.  One group per row (per-channel) is always aligned.  Never wider than K needs.
    * split_k: when the output tiles are fewer than 2 x SMs (gemv) / SMs (gemm), enough splits
      for 4 x SMs / 2 x SMs programs, each >= 256 input columns, at most 32, boundaries on
      BLOCK_K (:func:`_split`).

    Under the interpreter (a CPU): tiles of at most 32 x 64, one split unless ``split_k`` is
    given.  ``path`` / ``split_k`` force a choice."""
    op = "w4a16_plan" if bits == 4 else "w8a16_plan"
    _check_plan_args(op, m, N, K, group, path, split_k)
    interp = interpreter_active()
    path = path or ("gemv" if m <= GEMV_MAX_M else "gemm")
    p2 = triton.next_power_of_2
    if path == "gemv":
        bm, warps, bk = min(p2(m), 16), 4, 128
    else:
        bm, bn, warps = _gemm_tiles(m, interp)
        bk = 128 if (m <= 32 or interp) else 64
    if group < K and _pow2_divisor(group, bk) >= 32:
        bk = _pow2_divisor(group, bk)           # one group per step: one scale per row
    bk = max(32, min(bk, p2(K)))
    if path == "gemv":
        bn = max(16, min(64, 4096 // (bm * bk // 2)))
    if interp:
        bn = max(16, min(64, p2(N)))         # few programs: each is a Python loop iteration
    aligned = group >= K or group % bk == 0
    tiles = -(-N // bn) * -(-m // bm)
    sms = 0 if interp else _num_sms(device)          # interpreter: one split unless asked
    split_k, k_per_split = _split(tiles, K, bk, sms, path == "gemv", split_k)
    return QuantMatmulPlan(path, bm, bn, bk, split_k, k_per_split, aligned, warps)


def w8a16_plan(m: int, N: int, K: int, group: int, *, split_k: int | None = None, path: str | None = None,
               device=None) -> QuantMatmulPlan:
    """:func:`w4a16_plan` for int8 weights (the same rule)."""
    return w4a16_plan(m, N, K, group, split_k=split_k, path=path, bits=8, device=device)


def wxa8_plan(m: int, N: int, K: int, group: int, *, bits: int = 4, split_k: int | None = None,
              path: str | None = None, device=None) -> QuantMatmulPlan:
    """The launch of :func:`w4a8_matmul` (``bits=8``: :func:`w8a8_matmul`).

    * path: ``gemv`` (int32 ``tl.sum``) for m <= GEMV_MAX_M, else ``gemm`` (int8 ``tl.dot`` ->
      int32), tiles as :func:`w4a16_plan`.
    * BLOCK_K: the largest power of two dividing ``group``, at most 128 (gemv, and the int8 gemm)
      or 64 (the int4 gemm: its unpacking holds more registers); per-channel K = 704: 64.  The
      int8 dot needs BLOCK_K / 2 >= 32, so a smaller divisor becomes 64 and the last step of each
      group is masked at the group's end (int4 also needs an even group).
    * gemv: BLOCK_M = next_pow2(m), BLOCK_N = 4096 / (BLOCK_M * BLOCK_K / 2) within [16, 64].
    * split_k over whole groups, by the rule of :func:`w4a16_plan`."""
    op = f"w{bits}a8_plan"
    _check_plan_args(op, m, N, K, group, path, split_k)
    interp = interpreter_active()
    path = path or ("gemv" if m <= GEMV_MAX_M else "gemm")
    p2 = triton.next_power_of_2
    if path == "gemv":
        bk = max(2, _pow2_divisor(group, 128))
        bm, warps = min(p2(m), 16), 4
        bn = max(16, min(64, 4096 // (bm * max(bk // 2, 1))))
    else:
        bk = max(64, _pow2_divisor(group, 64 if bits == 4 else 128))
        bm, bn, warps = _gemm_tiles(m, interp)
    if interp:
        bn = max(16, min(64, p2(N)))         # few programs: each is a Python loop iteration
    tiles = -(-N // bn) * -(-m // bm)
    sms = 0 if interp else _num_sms(device)
    split_k, k_per_split = _split(tiles, K, group, sms, path == "gemv", split_k)
    return QuantMatmulPlan(path, bm, bn, bk, split_k, k_per_split, group % bk == 0 or group >= K, warps)


def w4a8_plan(m: int, N: int, K: int, group: int, **kw) -> QuantMatmulPlan:
    return wxa8_plan(m, N, K, group, bits=4, **kw)


def w8a8_plan(m: int, N: int, K: int, group: int, **kw) -> QuantMatmulPlan:
    return wxa8_plan(m, N, K, group, bits=8, **kw)



def _launch_opts(plan: QuantMatmulPlan) -> dict:
    opts = {"num_warps": plan.num_warps}
    if plan.num_stages is not None:
        opts["num_stages"] = plan.num_stages
    return opts
