"""Flash attention for prefill over ragged (variable-length) batches, in Triton.

Motivation.  Prefill attention is the one compute-bound part of a decoder step: for a sequence
of S tokens it does ``4 * S^2 * nh * hd`` FLOPs (halved by the causal mask) but needs only
``q, k, v, o`` in memory.  The textbook version materialises the ``[nh, S, S]`` score matrix
(``S^2`` bytes per head, read and written several times); FlashAttention never does: each
program keeps a ``BLOCK_M`` tile of queries in registers, streams ``BLOCK_N`` tiles of keys
and values past it and rescales a running softmax (the recurrence in the kernel's docstring).

Ragged batches.  A serving engine packs the prompts of a batch back to back, without padding:
``q [total_q, nh, hd]`` with ``cu_seqlens_q [B+1]`` (int32 offsets, ``cu[i]..cu[i+1]`` are
sequence i's rows), the layout of ``flash_attn_varlen_func`` and vLLM.

Chunked prefill and prefix hits.  When a sequence's queries are only the *last* T of its S
keys (a prompt split over several steps, or the tail of a prompt whose prefix came from the
prefix cache), query i sits at absolute position ``S - T + i`` and the causal mask is aligned
bottom-right.  Two entry points share one kernel:

* :func:`flash_prefill` -- keys and values packed like the queries (``cu_seqlens_k`` may differ
  from ``cu_seqlens_q``);
* :func:`flash_prefill_paged` -- keys and values read in place from the paged KV cache
  (``[num_blocks, block_size, nkv, hd]`` + a block table, see ``workbench.kv.paged``), after
  the new tokens' K/V were written to their slots.  This is what chunked prefill in a paged
  engine needs: the earlier chunks' K/V are already in the pool and are not copied out.

``attention_prefill`` and ``attention_prefill_paged`` are the entry points of
``workbench.transforms.backends`` (op ``attention_prefill``): model-shaped / no host sync.

Choice: one kernel with a ``PAGED`` compile-time switch rather than two kernels, because the
only difference is how a key's row address is computed; the tiling, masks and online softmax
are the same code.  Bytes/FLOPs for benchmarks: see :func:`prefill_cost`.

Over 400 lines because the kernel, its two entry points and its cost model are read together:
the tiling constants, the masks and the byte / FLOP formulas must agree.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from . import check_interpreter, count_launch, interpreter_active

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256

# Autotune on a GPU; a single small tile under the interpreter (each program is run in numpy).
if interpreter_active():
    _CONFIGS = [triton.Config({"BLOCK_M": 16, "BLOCK_N": 16}, num_warps=4, num_stages=1)]
else:
    _CONFIGS = [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s)
                for bm, bn, w, s in [(128, 64, 8, 3), (128, 32, 4, 3), (64, 64, 4, 3),
                                     (64, 32, 4, 2), (32, 32, 4, 2)]]


def _prune(configs, named_args, **kwargs):
    """Wide heads (hd > 128): the fp32 accumulator [BLOCK_M, hd] and the K/V stages double, so
    keep only the small tiles (a 128-row tile would spill registers)."""
    if named_args.get("BLOCK_D", kwargs.get("BLOCK_D", 128)) > 128:
        configs = [c for c in configs if c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] <= 64 * 32] or configs[-1:]
    return configs


@triton.jit
def _dot(a, b, FP32_IEEE: tl.constexpr):
    """a @ b with fp32 accumulation.  FP32_IEEE: true fp32 products (fp32 inputs, where Triton
    would otherwise use tf32; and bf16 under the interpreter, whose bf16 dot multiplies raw bit
    patterns -- triton-lang/triton#11584.  A bf16 x bf16 product is exact in fp32, so the
    upcast computes what a tensor core computes)."""
    if FP32_IEEE:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b)


# max_seqlen_bucket (the longest query run, as a power of two in [64, 4096]) is in the autotune
# key so that a 16-token test prompt does not choose the tiles of a 4096-token prefill; the kernel
# does not read it, and it is not specialized (the compiled configs are shared by every bucket:
# a new bucket costs a benchmark of them, not compiles)
@triton.autotune(configs=_CONFIGS, key=["HEAD_DIM", "CAUSAL", "WINDOWED", "PAGED", "max_seqlen_bucket"],
                 prune_configs_by={"early_config_prune": _prune})
@triton.jit(do_not_specialize=["max_seqlen_bucket"])
def _flash_prefill_kernel(
    Q,                      # [total_q, nh, hd] queries, packed sequence after sequence
    K, V,                   # packed: [total_k, nkv, hd]; paged: [num_blocks, PAGE_SIZE, nkv, hd]
    O,                      # [total_q, nh, hd] output, same dtype as Q
    CU_Q,                   # [B+1] int32: sequence b's queries are rows CU_Q[b] .. CU_Q[b+1]-1
    K_LENS,                 # packed: [B+1] int32 cu_seqlens_k; paged: [B] int32 keys per sequence
    BLOCK_TABLE,            # [B, max_blocks] int32 physical block ids (paged only; else unused)
    qk_scale,               # softmax scale * log2(e): the softmax runs in base 2
    window,                 # sliding window: key j is visible from position p iff j > p - window
    stride_qt, stride_qh, stride_qd,
    stride_kb, stride_kt, stride_kh, stride_kd,     # stride_kb: per block (paged only)
    stride_vb, stride_vt, stride_vh, stride_vd,
    stride_ot, stride_oh, stride_od,
    stride_bt,              # BLOCK_TABLE row stride
    max_seqlen_bucket,      # autotune key only (see above); unused by the kernel
    GROUP: tl.constexpr,    # nh // nkv query heads share one kv head (GQA; 1 = MHA, nh = MQA)
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,  # BLOCK_D = next power of two >= max(hd, 16)
    PAGE_SIZE: tl.constexpr, PAGED: tl.constexpr,
    CAUSAL: tl.constexpr, WINDOWED: tl.constexpr, FP32_IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """One program: BLOCK_M queries of one head of one sequence; grid (cdiv(max_q, BLOCK_M), nh, B).

    FlashAttention-2 (Dao, 2023, arXiv:2307.08691), forward pass.  For a query row q and key
    tiles K_j, V_j (scores in base 2: s = q.k * scale * log2 e, so exp2 replaces exp)::

        m_j   = max(m_{j-1}, max_n s_jn)                   running maximum
        alpha = 2^(m_{j-1} - m_j)                          rescales what was summed so far
        p_jn  = 2^(s_jn - m_j)
        l_j   = alpha * l_{j-1} + sum_n p_jn               running softmax denominator
        acc_j = alpha * acc_{j-1} + p_j @ V_j              running unnormalised output
        o     = acc_J / l_J                                one division at the end (FA-2)

    Query i of a sequence with T queries and S keys sits at position p = S - T + i; it sees key
    j when ``j <= p`` (causal) and ``j > p - window`` (sliding window).  Only key tiles that
    some row of this tile can see are visited.  m starts at -1e30 (not -inf) so that a row
    whose first visited tile is fully masked computes 2^(-inf) = 0, never -inf - -inf = NaN.
    """
    start_m, h, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q_start = tl.load(CU_Q + b)
    q_len = tl.load(CU_Q + b + 1) - q_start
    if start_m * BLOCK_M >= q_len:
        return
    if PAGED:
        k_start = 0
        k_len = tl.load(K_LENS + b)
    else:
        k_start = tl.load(K_LENS + b)
        k_len = tl.load(K_LENS + b + 1) - k_start
    kvh = h // GROUP
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pos_m = offs_m + (k_len - q_len)                       # absolute positions of the queries
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM

    q_rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(Q + q_rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :] * stride_qd,
                mask=(offs_m < q_len)[:, None] & d_ok[None, :], other=0.0)

    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    hi = k_len
    if CAUSAL:
        hi = tl.minimum(k_len, (start_m + 1) * BLOCK_M + (k_len - q_len))
    lo = 0
    if WINDOWED:
        lo = tl.maximum(0, start_m * BLOCK_M + (k_len - q_len) - window + 1)
        lo = (lo // BLOCK_N) * BLOCK_N
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_ok = offs_n < k_len
        if PAGED:   # position -> (block id from the table, offset in the block)
            blk = tl.load(BLOCK_TABLE + b * stride_bt + offs_n // PAGE_SIZE, mask=n_ok, other=0)
            k_row = blk.to(tl.int64) * stride_kb + (offs_n % PAGE_SIZE) * stride_kt
            v_row = blk.to(tl.int64) * stride_vb + (offs_n % PAGE_SIZE) * stride_vt
        else:
            k_row = (k_start + offs_n).to(tl.int64) * stride_kt
            v_row = (k_start + offs_n).to(tl.int64) * stride_vt
        kv_mask = n_ok[None, :] & d_ok[:, None]
        kT = tl.load(K + k_row[None, :] + kvh * stride_kh + offs_d[:, None] * stride_kd,
                     mask=kv_mask, other=0.0)                                   # [BLOCK_D, BLOCK_N]
        s = _dot(q, kT, FP32_IEEE) * qk_scale                                   # [BLOCK_M, BLOCK_N]
        visible = n_ok[None, :]
        if CAUSAL:
            visible = visible & (offs_n[None, :] <= pos_m[:, None])
        if WINDOWED:
            visible = visible & (offs_n[None, :] > pos_m[:, None] - window)
        s = tl.where(visible, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + v_row[:, None] + kvh * stride_vh + offs_d[None, :] * stride_vd,
                    mask=n_ok[:, None] & d_ok[None, :], other=0.0)              # [BLOCK_N, BLOCK_D]
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, FP32_IEEE)
        m_i = m_new

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(O + q_rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :] * stride_od,
             out.to(O.dtype.element_ty), mask=(offs_m < q_len)[:, None] & d_ok[None, :])


# ---- host side ------------------------------------------------------------------------------------

def _check_common(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_layout: str) -> None:
    if q.dim() != 3:
        raise ValueError(f"q must be [total_tokens, num_heads, head_dim], got shape {tuple(q.shape)}")
    if q.dtype not in _DTYPES:
        raise TypeError(f"q dtype {q.dtype} not supported; use float16, bfloat16 or float32")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have one shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    nh, hd, nkv = q.shape[1], q.shape[2], k.shape[-2]
    if k.shape[-1] != hd:
        raise ValueError(f"head_dim differs: q has {hd}, {kv_layout} has {k.shape[-1]}")
    if nkv < 1 or nh % nkv:
        raise ValueError(f"num_heads ({nh}) must be a multiple of num_kv_heads ({nkv}) for grouped-query attention")
    if hd > MAX_HEAD_DIM:
        raise ValueError(f"head_dim {hd} > {MAX_HEAD_DIM}: a query tile would not fit in registers")


def _batch_size(name: str, cu: torch.Tensor) -> int:
    if cu.dim() != 1 or cu.shape[0] < 1:
        raise ValueError(f"{name} must be 1-D [B+1] int32 offsets, got shape {tuple(cu.shape)}")
    return cu.shape[0] - 1


def _check_offsets(name: str, t: torch.Tensor, length: int, device: torch.device) -> None:
    if t.dtype != torch.int32 or t.dim() != 1 or t.shape[0] != length:
        raise ValueError(f"{name} must be a 1-D int32 tensor of length {length}, got {t.dtype} {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, q on {device}")


def _check_cu(name: str, cu: torch.Tensor, total: int) -> torch.Tensor:
    """Values of a cu_seqlens tensor (one small device->host copy); returns the lengths."""
    c = cu.cpu()
    if int(c[0]) != 0 or int(c[-1]) != total or bool((c[1:] < c[:-1]).any()):
        raise ValueError(f"{name} must rise from 0 to the packed length {total}, got {c.tolist()}")
    return c[1:] - c[:-1]


def seqlen_bucket(max_seqlen_q: int) -> int:
    """The autotune bucket of a launch: the longest query run rounded up to a power of two,
    clamped to [64, 4096] (at most 7 tunings per kernel variant)."""
    return min(4096, max(64, triton.next_power_of_2(max(1, int(max_seqlen_q)))))


def _launch(q, k, v, cu_q, k_lens, block_table, max_seqlen_q, scale, causal, sliding_window, paged):
    if sliding_window is not None and (not causal or sliding_window < 1):
        raise ValueError(f"sliding_window={sliding_window} needs causal=True and a window >= 1")
    B, nh, hd = cu_q.shape[0] - 1, q.shape[1], q.shape[2]
    # the kernel reads the offsets / lengths densely and block_table by row stride only: make them
    # so (a no-op returning the same tensor when already contiguous, as under CUDA-graph capture)
    cu_q, k_lens = cu_q.contiguous(), k_lens.contiguous()
    if block_table is not None:
        block_table = block_table.contiguous()
    o = torch.empty_like(q)
    if B == 0 or q.shape[0] == 0:
        return o
    scale = 1.0 / math.sqrt(hd) if scale is None else float(scale)
    if paged:
        skb, skt, skh, skd = k.stride()
        svb, svt, svh, svd = v.stride()
        page, bt, sbt = k.shape[1], block_table, block_table.stride(0)
    else:
        (skt, skh, skd), (svt, svh, svd) = k.stride(), v.stride()
        skb = svb = 0
        page, bt, sbt = 1, cu_q, 0      # BLOCK_TABLE unused: any int32 pointer will do
    grid = lambda meta: (triton.cdiv(max_seqlen_q, meta["BLOCK_M"]), nh, B)  # noqa: E731
    check_interpreter()
    _flash_prefill_kernel[grid](
        q, k, v, o, cu_q, k_lens, bt, scale * math.log2(math.e), sliding_window or 0,
        *q.stride(), skb, skt, skh, skd, svb, svt, svh, svd, *o.stride(), sbt, seqlen_bucket(max_seqlen_q),
        GROUP=nh // k.shape[-2], HEAD_DIM=hd, BLOCK_D=max(16, triton.next_power_of_2(hd)),
        PAGE_SIZE=page, PAGED=paged, CAUSAL=causal, WINDOWED=sliding_window is not None,
        FP32_IEEE=q.dtype == torch.float32 or (q.dtype == torch.bfloat16 and interpreter_active()))
    count_launch("flash_prefill")
    return o


def flash_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                  max_seqlen: int, scale: float | None = None, causal: bool = True,
                  sliding_window: int | None = None, *, cu_seqlens_k: torch.Tensor | None = None,
                  check: bool = True) -> torch.Tensor:
    """Attention over a packed ragged batch: q [total_q, nh, hd], k/v [total_k, nkv, hd] -> [total_q, nh, hd].

    ``cu_seqlens`` [B+1] int32 offsets of the queries (and of the keys unless ``cu_seqlens_k``
    is given); ``max_seqlen`` the longest query run (sizes the grid; the caller knows it, so no
    device sync).  With ``cu_seqlens_k``, sequence b's queries are the last ``q_len_b`` of its
    ``k_len_b`` keys (chunked prefill) and the causal mask is aligned bottom-right.
    ``check=True`` also validates the offsets' values (one small device->host copy); pass
    False in a hot loop or under CUDA-graph capture.  Any strides; fp16, bf16 or fp32.
    """
    _check_common(q, k, v, "k")
    if k.dim() != 3:
        raise ValueError(f"k/v must be [total_tokens, num_kv_heads, head_dim], got shape {tuple(k.shape)}")
    cu_k = cu_seqlens if cu_seqlens_k is None else cu_seqlens_k
    B = _batch_size("cu_seqlens", cu_seqlens)
    _check_offsets("cu_seqlens", cu_seqlens, B + 1, q.device)
    _check_offsets("cu_seqlens_k", cu_k, B + 1, q.device)
    if check:
        q_lens = _check_cu("cu_seqlens", cu_seqlens, q.shape[0])
        k_lens = _check_cu("cu_seqlens_k", cu_k, k.shape[0])
        _check_lens(q_lens, k_lens, max_seqlen)
    return _launch(q, k, v, cu_seqlens, cu_k, None, int(max_seqlen), scale, causal, sliding_window, paged=False)


def flash_prefill_paged(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor,
                        max_seqlen_q: int, scale: float | None = None, causal: bool = True,
                        sliding_window: int | None = None, *, check: bool = True) -> torch.Tensor:
    """Prefill (or a prefill chunk) reading keys/values in place from the paged cache.

    q [total_q, nh, hd] packed like :func:`flash_prefill`; k_cache/v_cache
    [num_blocks, block_size, nkv, hd]; block_tables [B, max_blocks] int32; seq_lens [B] int32
    keys per sequence *including* this chunk, whose K/V must already be in their slots.
    Sequence b's queries are the last ``q_len_b`` of its ``seq_lens[b]`` positions.
    """
    _check_common(q, k_cache, v_cache, "k_cache")
    if k_cache.dim() != 4:
        raise ValueError(f"k_cache/v_cache must be [num_blocks, block_size, num_kv_heads, head_dim], "
                         f"got shape {tuple(k_cache.shape)}")
    B = _batch_size("cu_seqlens_q", cu_seqlens_q)
    _check_offsets("cu_seqlens_q", cu_seqlens_q, B + 1, q.device)
    _check_offsets("seq_lens", seq_lens, B, q.device)
    if block_tables.dtype != torch.int32 or block_tables.dim() != 2 or block_tables.shape[0] != B:
        raise ValueError(f"block_tables must be int32 [B={B}, max_blocks], got {block_tables.dtype} "
                         f"{tuple(block_tables.shape)}")
    if block_tables.device != q.device:
        raise ValueError(f"block_tables is on {block_tables.device}, q on {q.device}")
    if check:
        q_lens = _check_cu("cu_seqlens_q", cu_seqlens_q, q.shape[0])
        _check_lens(q_lens, seq_lens.cpu(), max_seqlen_q)
        _check_block_table(block_tables, seq_lens, k_cache.shape[0], k_cache.shape[1])
    return _launch(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, int(max_seqlen_q), scale,
                   causal, sliding_window, paged=True)


def attention_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True) -> torch.Tensor:
    """The model-shaped entry point (``workbench.transforms.backends``, op ``attention_prefill``): a batch of
    B equal-length prompts, queries = keys.  q [B, nh, T, hd], k/v [B, nkv, T, hd] -> [B, nh, T, hd].

    Packs to the varlen layout (a view when the inputs are [B, T, heads, hd] transposed, as the
    model's projections give them; a copy otherwise) and calls :func:`flash_prefill` with
    offsets ``0, T, 2T, ..`` made here, so their values need no host check.
    """
    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape:
        raise ValueError(f"attention_prefill: q must be [B, nh, T, hd] and k, v one shape [B, nkv, T, hd]; got "
                         f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    B, nh, T, hd = q.shape
    if k.shape[0] != B or k.shape[2] != T:
        raise ValueError(f"attention_prefill: k {tuple(k.shape)} must have q's batch {B} and length {T} "
                         "(prefill from position 0: queries = keys)")
    qp, kp, vp = (x.transpose(1, 2).reshape(B * T, x.shape[1], hd) for x in (q, k, v))
    cu = torch.arange(0, (B + 1) * T, T, dtype=torch.int32, device=q.device)
    o = flash_prefill(qp, kp, vp, cu, T, causal=causal, check=False)
    return o.view(B, T, nh, hd).transpose(1, 2)


def attention_prefill_paged(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor,
                            max_seqlen_q: int, sliding_window: int | None = None) -> torch.Tensor:
    """The chunk-aware entry point of ``workbench.transforms.backends`` (op ``attention_prefill``): causal
    :func:`flash_prefill_paged` without any device->host copy (the offsets, lengths and block
    ids are not validated: the caller made them).  q [total_q, nh, hd] packed sequence after
    sequence (``cu_seqlens_q`` [B+1] int32), k_cache/v_cache [num_blocks, block_size, nkv, hd],
    block_tables [B, max_blocks] int32, seq_lens [B] int32 keys per sequence including this
    chunk (already written); sequence b's queries are its last ``q_len_b`` positions.
    """
    return flash_prefill_paged(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, max_seqlen_q,
                               causal=True, sliding_window=sliding_window, check=False)


def attention_prefill_ref(q, k, v, causal: bool = True):
    """The reference of :func:`attention_prefill` (the eager backend): exactly the reference
    model's SDPA call."""
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                            enable_gqa=q.shape[1] != k.shape[1])


def attention_prefill_paged_ref(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, max_seqlen_q: int,
                      sliding_window: int | None = None):
    """The reference of :func:`attention_prefill_paged` (the eager backend): each sequence's queries
    padded to [B, max_seqlen_q], its blocks gathered, the causal (bottom-right) and window mask, SDPA;
    then back to the packed rows.  q [n, nh, hd] -> [n, nh, hd].  Vectorised (no host sync), so it
    compiles."""
    n, nh, hd = q.shape
    B, nkv, dev = block_tables.shape[0], k_cache.shape[2], q.device
    if n == 0 or B == 0:
        return torch.empty_like(q)
    cu, lens = cu_seqlens_q.long(), seq_lens.long()
    q_lens = cu[1:] - cu[:-1]                                                      # [B]
    t = torch.arange(max_seqlen_q, device=dev)
    valid = t[None, :] < q_lens[:, None]                                           # [B, T]
    qb = q[(cu[:-1, None] + t[None, :]).clamp(max=n - 1)].transpose(1, 2)          # [B, nh, T, hd]
    k = k_cache[block_tables.long()].reshape(B, -1, nkv, hd).transpose(1, 2)       # [B, nkv, S_max, hd]
    v = v_cache[block_tables.long()].reshape(B, -1, nkv, hd).transpose(1, 2)
    q_pos = (lens - q_lens)[:, None, None] + t[None, :, None]                     # [B, T, 1]
    k_pos = torch.arange(k.shape[2], device=dev)[None, None, :]                    # [1, 1, S_max]
    mask = (k_pos <= q_pos) & (k_pos < lens[:, None, None])
    if sliding_window is not None:
        mask = mask & (k_pos > q_pos - sliding_window)
    mask = mask | (~valid[:, :, None] & (k_pos == 0))    # padded query rows see one key: finite, then dropped
    out = torch.nn.functional.scaled_dot_product_attention(qb, k, v, attn_mask=mask[:, None], enable_gqa=nh != nkv)
    row = torch.arange(n, device=dev)
    seq = torch.searchsorted(cu[1:], row, right=True)                              # each row's sequence
    return out[seq, :, row - cu[seq]]                                              # [n, nh, hd]


def _check_lens(q_lens: torch.Tensor, k_lens: torch.Tensor, max_seqlen: int) -> None:
    if q_lens.numel() and int(q_lens.max()) > max_seqlen:
        raise ValueError(f"max_seqlen={max_seqlen} is shorter than the longest query run ({int(q_lens.max())})")
    bad = (q_lens > k_lens).nonzero().flatten().tolist()
    if bad:
        raise ValueError(f"sequences {bad} have more queries than keys (q_lens {q_lens.tolist()}, "
                         f"k_lens {k_lens.tolist()}): queries must be the last q_len of the keys")


def _check_block_table(block_tables: torch.Tensor, seq_lens: torch.Tensor, num_blocks: int, page: int) -> None:
    """The blocks a sequence uses exist in the pool and its length fits its table row."""
    lens, table = seq_lens.cpu().long(), block_tables.cpu()
    if bool((lens > table.shape[1] * page).any()):
        raise ValueError(f"seq_lens {lens.tolist()} exceed block_tables capacity "
                         f"({table.shape[1]} blocks x {page} tokens)")
    used = torch.arange(table.shape[1])[None, :] < (-(-lens // page))[:, None]
    ids = table[used]
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_blocks):
        raise ValueError(f"block_tables holds block ids outside the pool [0, {num_blocks})")


def prefill_cost(q_lens, k_lens, nh: int, nkv: int, hd: int, elem_bytes: int, causal: bool = True) -> tuple[int, int]:
    """(FLOPs, minimum bytes) of one call, for benchmarks.

    FLOPs: two matmuls (q k^T and p v), 2 * hd FLOPs per (query, visible key, head) each:
    ``4 * hd * nh * sum_b visible_b`` with ``visible_b = T*S - T*(T-1)/2`` causal (query i of T
    sees S - T + i + 1 keys), ``T*S`` otherwise.  Bytes: each input read once, the output written
    once: ``elem_bytes * hd * (2 * nh * sum T + 2 * nkv * sum S)``.
    """
    visible = sum(t * s - (t * (t - 1)) // 2 if causal else t * s for t, s in zip(q_lens, k_lens))
    flops = 4 * hd * nh * visible
    nbytes = elem_bytes * hd * (2 * nh * sum(q_lens) + 2 * nkv * sum(k_lens))
    return flops, nbytes


# ---- plain-torch references ------------------------------------------------------------------------

def _attend_ref(q, k, v, scale, causal, sliding_window):
    """One sequence in fp32: q [T, nh, hd], k/v [S, nkv, hd] -> [T, nh, hd] (queries = last T keys)."""
    T, nh, hd = q.shape
    S, nkv = k.shape[0], k.shape[1]
    qf, kf, vf = (x.float().transpose(0, 1) for x in (q, k, v))          # [heads, len, hd]
    kf, vf = kf.repeat_interleave(nh // nkv, 0), vf.repeat_interleave(nh // nkv, 0)
    scores = (qf @ kf.transpose(1, 2)) * scale                           # [nh, T, S]
    pos_q = torch.arange(S - T, S, device=q.device)[:, None]
    pos_k = torch.arange(S, device=q.device)[None, :]
    visible = torch.ones(T, S, dtype=torch.bool, device=q.device)
    if causal:
        visible &= pos_k <= pos_q
    if sliding_window is not None:
        visible &= pos_k > pos_q - sliding_window
    probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
    return (probs @ vf).transpose(0, 1)                                  # [T, nh, hd] fp32


def flash_prefill_ref(q, k, v, cu_seqlens, max_seqlen=None, scale=None, causal=True, sliding_window=None,
                      *, cu_seqlens_k=None) -> torch.Tensor:
    """What :func:`flash_prefill` computes, sequence by sequence in fp32; returns q's dtype."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    cq = cu_seqlens.tolist()
    ck = cq if cu_seqlens_k is None else cu_seqlens_k.tolist()
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    for i in range(len(cq) - 1):
        out[cq[i]:cq[i + 1]] = _attend_ref(q[cq[i]:cq[i + 1]], k[ck[i]:ck[i + 1]], v[ck[i]:ck[i + 1]],
                                           scale, causal, sliding_window)
    return out.to(q.dtype)


def gather_paged(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """One sequence's first ``length`` rows of a paged cache: [num_blocks, B, nkv, hd] -> [length, nkv, hd]."""
    nb = -(-length // cache.shape[1])
    return cache[block_table[:nb].long()].reshape(-1, *cache.shape[2:])[:length]


def flash_prefill_paged_ref(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, max_seqlen_q=None,
                            scale=None, causal=True, sliding_window=None) -> torch.Tensor:
    """What :func:`flash_prefill_paged` computes: gather each sequence's K/V, then attend in fp32."""
    lens = seq_lens.tolist()
    k = torch.cat([gather_paged(k_cache, block_tables[i], n) for i, n in enumerate(lens)])
    v = torch.cat([gather_paged(v_cache, block_tables[i], n) for i, n in enumerate(lens)])
    cu_k = torch.tensor([0] + lens, device=q.device).cumsum(0)
    return flash_prefill_ref(q, k, v, cu_seqlens_q, scale=scale, causal=causal, sliding_window=sliding_window,
                             cu_seqlens_k=cu_k)
