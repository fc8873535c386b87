"""Models and checks behind notebook 01 (fused kernels): bytes moved, FLOPs counted, correctness.

The measurements themselves are in :mod:`workbench.bench.kernels`; this module holds what the
notebook *predicts* and *checks* around them, as plain functions with tests
(``tests/lab/test_notebook_logic.py``):

* :func:`add_rmsnorm_traffic`: the bytes every eager op of ``add_rmsnorm_ref`` reads and writes,
  next to :func:`fused_add_rmsnorm_bytes`, what the fused kernel moves; their ratio is the
  predicted speed-up of a memory-bound kernel (:func:`add_rmsnorm_prediction`);
* :data:`FLOPS_PER_ELEMENT`, :func:`kernel_flops`, :func:`kernel_bytes`, :func:`roofline_frame`:
  the roofline's coordinates (arithmetic intensity, achieved FLOP/s) of a kernel-bench row;
* :func:`scattered_block_table`: a paged-decode block table whose blocks are scattered;
* :func:`check_close`: a kernel's output against torch's, with the tolerance rule per dtype;
* :func:`greedy_tokens` and :func:`token_agreement`: the greedy-decoding check of a backend.

No plotting here (the views are in :mod:`workbench.lab.kernels_view`); pandas is imported when used.
"""

from __future__ import annotations

import torch

# FLOPs per element of the elementwise kernels, and how they are counted (the roofline's x axis).
FLOPS_PER_ELEMENT = {"rmsnorm": (4, "x², sum, ×rstd, ×w per element"), "add_rmsnorm": (5, "+ the residual add"),
                     "swiglu": (6, "exp, +1, ÷, ×g, ×u (+ neg)"), "rope": (3, "2 × and 1 + per element")}

STATS_BYTES = 4        # the statistics of RMSNorm are computed in float32


def add_rmsnorm_traffic(M: int, N: int, e: int) -> pandas.DataFrame:  # noqa: F821
    """Bytes read and written by each eager op of ``add_rmsnorm_ref`` on ``M`` rows of ``N``
    elements of ``e`` bytes (statistics in float32): one row per op, columns ``eager op``,
    ``bytes read``, ``bytes written``.  The casts to and from float32 are no-ops (and are not
    listed) when ``e`` is 4; ops on the ``[M, 1]`` statistics move negligible bytes but are listed
    for their launch."""
    import pandas as pd

    if M < 1 or N < 1 or e < 1:
        raise ValueError(f"add_rmsnorm_traffic: M, N and e must be positive, got {M}, {N}, {e}")
    f, MN = STATS_BYTES, M * N
    ops = [("h = residual + x", 2 * e * MN, e * MN)]
    if e != f:
        ops.append(("x.float()", e * MN, f * MN))      # a no-op in float32
    ops += [("xf.pow(2)", f * MN, f * MN), (".mean(-1)", f * MN, f * M), ("+ eps", f * M, f * M),
            ("torch.rsqrt", f * M, f * M), ("xf * rstd", f * MN + f * M, f * MN)]
    if e != f:
        ops.append((".to(dtype)", f * MN, e * MN))     # a no-op in float32
    ops.append(("weight * ...", e * MN + e * N, e * MN))
    return pd.DataFrame(ops, columns=["eager op", "bytes read", "bytes written"])


def fused_add_rmsnorm_bytes(M: int, N: int, e: int) -> int:
    """Bytes the fused add + RMSNorm kernel moves: read ``x`` and ``r``, write ``y`` and ``h``
    (``4·e·M·N``), plus the weight once (``e·N``)."""
    return 4 * e * M * N + e * N


def add_rmsnorm_prediction(M: int, N: int, e: int, bandwidth: float) -> tuple:
    """The predicted gain of fusing add + RMSNorm at ``bandwidth`` bytes / s.

    Returns ``(traffic, prediction, gain)``: the per-op table of :func:`add_rmsnorm_traffic`, a
    two-row table (``eager torch``, ``fused kernel``) of bytes, kernels and predicted ms (bytes /
    bandwidth: both versions are memory-bound), and the predicted speed-up (the ratio of bytes)."""
    import pandas as pd

    traffic = add_rmsnorm_traffic(M, N, e)
    eager_bytes = int(traffic[["bytes read", "bytes written"]].sum().sum())
    fused_bytes = fused_add_rmsnorm_bytes(M, N, e)
    prediction = pd.DataFrame({"bytes": [eager_bytes, fused_bytes], "kernels": [len(traffic), 1],
                               "predicted ms": [1e3 * eager_bytes / bandwidth, 1e3 * fused_bytes / bandwidth]},
                              index=["eager torch", "fused kernel"])
    return traffic, prediction, eager_bytes / fused_bytes


def kernel_flops(row, sizes: dict) -> float:
    """FLOPs of one kernel-bench row at the bench's ``sizes`` (``workbench.bench.kernels.SIZES``):
    the row's own count for compute-bound rows (metric ``TFLOP/s``), ``4·hd·nh·B·S`` for paged
    decode, and :data:`FLOPS_PER_ELEMENT` times the element count for the elementwise ops."""
    if row["metric"] == "TFLOP/s":
        return row["flops"]
    if row["op"] == "paged_decode":
        B, S = sizes["decode"]
        nh, _, hd = sizes["attn_heads"]
        return 4 * hd * nh * B * S
    elements = {"rmsnorm": sizes["rows"] * sizes["hidden"], "add_rmsnorm": sizes["rows"] * sizes["hidden"],
                "swiglu": sizes["rows"] * sizes["inter"],
                "rope": sizes["rope_tokens"] * sum(sizes["rope_heads"][:2]) * sizes["rope_heads"][2]}
    return FLOPS_PER_ELEMENT[row["op"]][0] * elements[row["op"]]


def kernel_bytes(row, sizes: dict, dtype: torch.dtype) -> float:
    """Bytes of one kernel-bench row: the row's own count for memory-bound rows (metric
    ``GB/s``), else (prefill attention) the minimum bytes of ``prefill_cost`` at the bench's
    ``[B, T]`` causal prefill."""
    if row["metric"] == "GB/s":
        return row["bytes"]
    from workbench_kernels.flash_prefill import prefill_cost

    B, T = sizes["prefill"]
    nh, nkv, hd = sizes["attn_heads"]
    return prefill_cost([T] * B, [T] * B, nh, nkv, hd, torch.finfo(dtype).bits // 8)[1]


def roofline_frame(kernel_rows: list[dict], sizes: dict, dtype: torch.dtype) -> pandas.DataFrame:  # noqa: F821
    """The ``ok`` rows of a kernel bench with their roofline coordinates: ``flops``, ``bytes``
    (:func:`kernel_flops`, :func:`kernel_bytes`), ``intensity`` (FLOP / byte) and
    ``flop_per_s`` (FLOPs over the median time)."""
    import pandas as pd

    kdf = pd.DataFrame(kernel_rows)
    kdf = kdf[kdf["status"] == "ok"].copy()
    kdf["flops"] = kdf.apply(kernel_flops, axis=1, sizes=sizes)
    kdf["bytes"] = kdf.apply(kernel_bytes, axis=1, sizes=sizes, dtype=dtype)
    kdf["intensity"] = kdf["flops"] / kdf["bytes"]
    kdf["flop_per_s"] = kdf["flops"] / (kdf["ms_median"] / 1e3)
    return kdf


def scattered_block_table(ctx_lens, page: int, generator: torch.Generator | None = None) -> tuple[torch.Tensor, int]:
    """A block table for sequences of ``ctx_lens`` tokens in blocks of ``page``, their blocks a
    random permutation of the pool (``generator``), so that no sequence's blocks are contiguous.

    Returns ``(table, num_blocks)``: ``table`` is ``int32 [len(ctx_lens), max blocks]``, row
    ``b`` holding sequence ``b``'s ``ceil(ctx_lens[b] / page)`` block ids followed by ``0``
    padding; ``num_blocks`` the pool size every id is below (each id is used exactly once)."""
    ctx = torch.as_tensor(ctx_lens, dtype=torch.int64)
    if page < 1 or (ctx < 1).any():
        raise ValueError(f"scattered_block_table: page must be >= 1 and every length >= 1, got {page}, {ctx.tolist()}")
    blocks = -(-ctx // page)
    num_blocks = int(blocks.sum())
    table = torch.zeros((len(blocks), int(blocks.max())), dtype=torch.int32)
    perm = torch.randperm(num_blocks, generator=generator).to(torch.int32)
    i = 0
    for b, n in enumerate(blocks.tolist()):
        table[b, :n] = perm[i:i + n]
        i += n
    return table, num_blocks


def check_close(ours: torch.Tensor, torch_out: torch.Tensor, ref32: torch.Tensor, name: str) -> float:
    """Assert a kernel's output matches torch's, and return the max abs error that was judged.

    float32: the same arithmetic up to summation order, so within a few ulp
    (``workbench_kernels._testing.TOLERANCES``); the error is ``ours`` vs ``torch_out``.
    bf16 / fp16: the kernel rounds once and torch several times, so both are judged against the
    float32 reference ``ref32`` and ours may be at most about 2x torch's error; the error returned
    is ours vs ``ref32``.  Raises ``AssertionError`` naming ``name`` when the check fails."""
    from workbench_kernels._testing import TOLERANCES, assert_close, assert_lowp_close, max_abs_error

    if ours.dtype == torch.float32:
        assert_close(ours, torch_out, *TOLERANCES[torch.float32], name=name)
        return max_abs_error(ours, torch_out)
    return assert_lowp_close(ours, torch_out, ref32, name=name)["ours_max"]


def greedy_tokens(model, ids: list[list[int]], n: int, tokenizer=None, **engine) -> list[list[int]]:
    """``n`` greedy tokens (EOS ignored) after each prompt of token ids ``ids`` from an engine on
    ``model`` (an ``LLM`` is built with ``max_model_len`` just large enough; ``engine`` options
    such as ``static_decode=True`` or ``cuda_graphs=True`` pass through to it)."""
    from workbench.engine.llm import LLM
    from workbench.engine.sampling import SamplingParams

    front = LLM(model, tokenizer=tokenizer, max_model_len=max(map(len, ids)) + n + 1, **engine)
    outs = front.generate(ids, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    return [o.token_ids for o in outs]


def token_agreement(reference: list[list[int]], other: list[list[int]]) -> float:
    """Fraction of positions where ``other`` has ``reference``'s token, over every token of the
    reference (sequences paired in order; a missing token counts as a disagreement)."""
    total = sum(map(len, reference))
    if total == 0:
        raise ValueError("token_agreement: the reference has no tokens")
    return sum(a == b for r, o in zip(reference, other) for a, b in zip(r, o)) / total
