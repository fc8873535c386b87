"""Paged decode attention with split-K (Flash-Decoding), in Triton.

Motivation.  A decode step has one new query token per sequence, so attention is a
matrix-*vector* product per head: it reads the whole context's K and V (``2 * S * nkv * hd``
elements per sequence) and does only ~4 FLOPs per element read.  It is bound by memory
bandwidth, and the whole game is to read each K/V byte once, with enough programs in flight
to keep every SM streaming:

* **In place.**  K/V stay in the paged pool (``k_cache[num_blocks, block_size, nkv, hd]``,
  ``block_tables[b, i]`` = physical block of sequence b's tokens ``i*block_size ..``); each
  key tile's rows are found through the block table, nothing is gathered into a contiguous
  copy first (the torch reference, ``workbench.kv.paged.PagedSequenceCache.update``, copies
  the whole context every step).
* **GQA groups.**  One program handles all ``nh // nkv`` query heads that share a kv head, as
  the rows of one tile, so each K/V tile is read once per group, not once per query head.
* **Split-K.**  With a small batch, ``B * nkv`` programs leave most SMs idle.  Flash-Decoding
  (Dao, Haziza, Massa, Sizov, 2023, "Flash-Decoding for long-context inference") splits each
  context into ``num_splits`` chunks processed in parallel; each writes a partial
  ``(max, sum, acc)``, and a second small kernel merges them exactly.

Bytes/FLOPs for benchmarks: see :func:`decode_cost`.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from . import check_interpreter, count_launch, interpreter_active

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256

if interpreter_active():
    _CONFIGS = [triton.Config({"BLOCK_N": 16}, num_warps=4, num_stages=1)]
else:
    _CONFIGS = [triton.Config({"BLOCK_N": bn}, num_warps=w, num_stages=s)
                for bn, w, s in [(32, 4, 2), (64, 4, 2), (64, 4, 3), (128, 4, 2), (128, 8, 3)]]


@triton.jit
def _dot(a, b, FP32_IEEE: tl.constexpr):
    """a @ b, fp32 accumulation; FP32_IEEE as in flash_prefill._dot (fp32 inputs, and bf16 under
    the interpreter whose bf16 dot is wrong: triton-lang/triton#11584)."""
    if FP32_IEEE:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b)


# The page size is a run-time argument, out of the autotune key and never specialized: the
# contiguous per-sequence cache hands a whole row (prompt + max_tokens positions) as one page, so
# a compile-time page size meant a fresh 5-config autotune (and JIT compiles) for every distinct
# request length, inside timed requests.  num_splits and stride_bt (the block-table width, which
# grows with the context) are not specialized either (Triton's == 1 / % 16 variants: more compiles
# in the middle of a generation).
@triton.autotune(configs=_CONFIGS, key=["HEAD_DIM", "BLOCK_G", "SINGLE_SPLIT"])
@triton.jit(do_not_specialize=["page_size", "num_splits", "stride_bt"])
def _paged_decode_split_kernel(
    Q,                      # [B, nh, hd] the new token's queries
    K_CACHE, V_CACHE,       # [num_blocks, page_size, nkv, hd] paged pool of one layer
    BLOCK_TABLES,           # [B, max_blocks] int32: physical block of each logical block
    CONTEXT_LENS,           # [B] int32: tokens in each sequence's context (>= 1, incl. the new one)
    M_PART, L_PART,         # [B, nh, num_splits] fp32: per split, running max (base 2) and sum
    ACC_PART,               # [B, nh, num_splits, hd] fp32: per split, unnormalised output
    O,                      # [B, nh, hd] output (written here only when SINGLE_SPLIT)
    qk_scale,               # softmax scale * log2(e)
    window,                 # sliding window (keys with position > ctx - 1 - window), if WINDOWED
    num_splits,             # splits per sequence (runtime: any number; the heuristic uses powers of 2)
    num_heads,
    page_size,              # tokens per page (run time: see above)
    stride_qb, stride_qh, stride_qd,
    stride_kb, stride_kt, stride_kh, stride_kd,
    stride_vb, stride_vt, stride_vh, stride_vd,
    stride_bt,              # BLOCK_TABLES row stride
    stride_ob, stride_oh, stride_od,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr,     # query heads per kv head; tile rows >= 16 for tl.dot
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    WINDOWED: tl.constexpr, SINGLE_SPLIT: tl.constexpr,
    FP32_IEEE: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """One program: one split of one sequence's context, for the GROUP query heads of one kv
    head; grid (B, nkv, num_splits).

    Within a split, the online softmax of FlashAttention (see flash_prefill's kernel) over key
    tiles, the GROUP query heads as the rows of the tile::

        m = max(m, max s);  alpha = 2^(m_old - m);  l = alpha*l + sum 2^(s - m);  acc = alpha*acc + p @ V

    Split k covers context positions [lo + k*chunk, lo + (k+1)*chunk), chunk = the context
    divided evenly and rounded up to BLOCK_N; a split past the end stores m = -1e30, l = 0,
    acc = 0, which the merge weighs by 2^(-1e30 - M) = 0.  With one split the program
    normalises and stores the output itself (no second launch, no partials written).
    """
    b, kvh, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    ctx = tl.load(CONTEXT_LENS + b)
    lo = 0
    if WINDOWED:
        lo = tl.maximum(0, ctx - window)
    chunk = tl.cdiv(tl.cdiv(ctx - lo, num_splits), BLOCK_N) * BLOCK_N
    start = lo + split * chunk
    end = tl.minimum(start + chunk, ctx)

    offs_g = tl.arange(0, BLOCK_G)
    g_ok = offs_g < GROUP
    heads = kvh * GROUP + offs_g                        # the query heads of this kv head
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    q = tl.load(Q + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                mask=g_ok[:, None] & d_ok[None, :], other=0.0)                 # [BLOCK_G, BLOCK_D]

    m_i = tl.full([BLOCK_G], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for start_n in range(start, end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_ok = offs_n < end
        blk = tl.load(BLOCK_TABLES + b * stride_bt + offs_n // page_size, mask=n_ok, other=0).to(tl.int64)
        in_blk = offs_n % page_size
        kT = tl.load(K_CACHE + blk[None, :] * stride_kb + in_blk[None, :] * stride_kt + kvh * stride_kh
                     + offs_d[:, None] * stride_kd, mask=n_ok[None, :] & d_ok[:, None], other=0.0)
        s = _dot(q, kT, FP32_IEEE) * qk_scale                                  # [BLOCK_G, BLOCK_N]
        s = tl.where(n_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V_CACHE + blk[:, None] * stride_vb + in_blk[:, None] * stride_vt + kvh * stride_vh
                    + offs_d[None, :] * stride_vd, mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, FP32_IEEE)
        m_i = m_new

    if SINGLE_SPLIT:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(O + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :] * stride_od,
                 out.to(O.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])
    else:
        row = (b * num_heads + heads).to(tl.int64) * num_splits + split     # [B, nh, num_splits] index
        tl.store(M_PART + row, m_i, mask=g_ok)
        tl.store(L_PART + row, l_i, mask=g_ok)
        tl.store(ACC_PART + row[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=g_ok[:, None] & d_ok[None, :])


@triton.jit
def _paged_decode_merge_kernel(
    M_PART, L_PART,         # [B, nh, num_splits] fp32 partial max (base 2) and sum
    ACC_PART,               # [B, nh, num_splits, hd] fp32 partial unnormalised outputs
    O,                      # [B, nh, hd] output
    num_splits, num_heads,
    stride_ob, stride_oh, stride_od,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """One program per (sequence, query head); grid (B, nh).  The exact merge of the splits::

        M = max_k m_k;   w_k = 2^(m_k - M);   o = sum_k w_k acc_k / sum_k w_k l_k
    """
    b, h = tl.program_id(0), tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    s_ok = offs_s < num_splits
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    row = (b * num_heads + h).to(tl.int64) * num_splits + offs_s
    m = tl.load(M_PART + row, mask=s_ok, other=float("-inf"))
    l = tl.load(L_PART + row, mask=s_ok, other=0.0)
    acc = tl.load(ACC_PART + row[:, None] * HEAD_DIM + offs_d[None, :], mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    w = tl.exp2(m - tl.max(m, 0))
    denom = tl.sum(w * l, 0)
    out = tl.sum(w[:, None] * acc, 0) / tl.where(denom == 0.0, 1.0, denom)
    tl.store(O + b.to(tl.int64) * stride_ob + h * stride_oh + offs_d * stride_od, out.to(O.dtype.element_ty), mask=d_ok)


# ---- host side ------------------------------------------------------------------------------------

def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1


def choose_num_splits(batch: int, num_kv_heads: int, max_context_len: int, num_sms: int,
                      programs_per_sm: int = 2, min_tokens_per_split: int = 256, max_splits: int = 32) -> int:
    """Splits per sequence: enough programs to give each SM ``programs_per_sm`` of them, but no
    split shorter than ``min_tokens_per_split`` (each split costs a partial write and a merge
    read of ``nh/nkv * hd`` fp32), rounded down to a power of two (few compiled variants).

    Example: H100 (132 SMs), batch 1, 8 kv heads, 32k context: 264 / 8 -> 33, capped at 32.
    Batch 64 x 8 kv heads = 512 programs already fill the chip -> 1 split.  (Defaults are
    leads to be tuned on the GPU; see the benchmark.)
    """
    want = -(-programs_per_sm * num_sms // max(1, batch * num_kv_heads))
    splits = max(1, min(want, max_context_len // min_tokens_per_split, max_splits))
    return 1 << (splits.bit_length() - 1)


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, scale: float | None = None, num_splits: int | None = None,
                 *, sliding_window: int | None = None, max_context_len: int | None = None,
                 check: bool = True) -> torch.Tensor:
    """Decode attention of one new token per sequence over its paged context -> [B, nh, hd].

    q [B, nh, hd]; k_cache/v_cache [num_blocks, block_size, nkv, hd] (one layer of the pool;
    nh a multiple of nkv); block_tables [B, max_blocks] int32; context_lens [B] int32 (>= 1,
    the new token's K/V already written).  ``num_splits=None`` picks one with
    :func:`choose_num_splits` from ``max_context_len`` (read from ``context_lens`` -- a device
    sync -- when not given).  ``check=True`` validates lengths and block ids (a small
    device->host copy); pass False in a hot loop or under CUDA-graph capture.
    """
    if q.dim() != 3:
        raise ValueError(f"q must be [batch, num_heads, head_dim], got shape {tuple(q.shape)}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache/v_cache must be one shape [num_blocks, block_size, num_kv_heads, head_dim], "
                         f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if q.dtype not in _DTYPES or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise TypeError(f"q, k_cache, v_cache must share a dtype among float16/bfloat16/float32, got "
                        f"{q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    B, nh, hd = q.shape
    num_blocks, page, nkv = k_cache.shape[:3]
    if k_cache.shape[3] != hd:
        raise ValueError(f"head_dim differs: q has {hd}, k_cache has {k_cache.shape[3]}")
    if nh % nkv:
        raise ValueError(f"num_heads ({nh}) must be a multiple of num_kv_heads ({nkv}) for grouped-query attention")
    if hd > MAX_HEAD_DIM:
        raise ValueError(f"head_dim {hd} > {MAX_HEAD_DIM}: a query tile would not fit in registers")
    if block_tables.dtype != torch.int32 or block_tables.dim() != 2 or block_tables.shape[0] != B:
        raise ValueError(f"block_tables must be int32 [B={B}, max_blocks], got {block_tables.dtype} "
                         f"{tuple(block_tables.shape)}")
    if context_lens.dtype != torch.int32 or context_lens.shape != (B,):
        raise ValueError(f"context_lens must be int32 [B={B}], got {context_lens.dtype} {tuple(context_lens.shape)}")
    if not (q.device == k_cache.device == v_cache.device == block_tables.device == context_lens.device):
        raise ValueError("q, k_cache, v_cache, block_tables and context_lens must be on one device")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    if check:
        lens, table = context_lens.cpu().long(), block_tables.cpu()
        if B and (int(lens.min()) < 1 or int(lens.max()) > table.shape[1] * page):
            raise ValueError(f"context_lens {lens.tolist()} must lie in [1, {table.shape[1] * page}] "
                             f"(block_tables has {table.shape[1]} blocks of {page} tokens per sequence)")
        ids = table[torch.arange(table.shape[1])[None, :] < (-(-lens // page))[:, None]]
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_blocks):
            raise ValueError(f"block_tables holds block ids outside the pool [0, {num_blocks})")
    # the kernel reads block_tables by row stride only and context_lens densely: make them so
    # (a no-op returning the same tensor when already contiguous, as under CUDA-graph capture)
    block_tables, context_lens = block_tables.contiguous(), context_lens.contiguous()
    o = torch.empty_like(q)
    if B == 0:
        return o
    if num_splits is None:
        max_ctx = int(context_lens.max()) if max_context_len is None else max_context_len
        if sliding_window is not None:
            max_ctx = min(max_ctx, sliding_window)
        num_splits = choose_num_splits(B, nkv, max_ctx, _num_sms(q.device))
    scale = 1.0 / math.sqrt(hd) if scale is None else float(scale)
    group, block_d = nh // nkv, max(16, triton.next_power_of_2(hd))
    single = num_splits == 1
    if single:
        m_part = l_part = acc_part = o            # unused: any pointer will do
    else:
        m_part = torch.empty(B, nh, num_splits, device=q.device, dtype=torch.float32)
        l_part = torch.empty_like(m_part)
        acc_part = torch.empty(B, nh, num_splits, hd, device=q.device, dtype=torch.float32)
    check_interpreter()
    _paged_decode_split_kernel[(B, nkv, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens, m_part, l_part, acc_part, o,
        scale * math.log2(math.e), sliding_window or 0, num_splits, nh, page,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), block_tables.stride(0), *o.stride(),
        GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)), HEAD_DIM=hd, BLOCK_D=block_d,
        WINDOWED=sliding_window is not None, SINGLE_SPLIT=single,
        FP32_IEEE=q.dtype == torch.float32 or (q.dtype == torch.bfloat16 and interpreter_active()))
    count_launch("paged_decode")
    if not single:
        _paged_decode_merge_kernel[(B, nh)](
            m_part, l_part, acc_part, o, num_splits, nh, *o.stride(),
            HEAD_DIM=hd, BLOCK_D=block_d, BLOCK_S=triton.next_power_of_2(num_splits),
            num_warps=4 if hd >= 128 else 2)
        count_launch("paged_decode_merge")
    return o


def attention_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, sliding_window: int | None = None) -> torch.Tensor:
    """The entry point of ``workbench.transforms.backends`` (op ``attention_decode``): :func:`paged_decode`
    without any device->host copy, so it can run inside a CUDA graph.  The split count is chosen
    from the block tables' capacity (``max_blocks * block_size``, known on the host; at most the
    window) instead of the largest length, and the lengths / block ids are not validated (the
    caller made them).  ``sliding_window``: the new token sees the last ``sliding_window``
    positions of its context only."""
    cap = block_tables.shape[1] * k_cache.shape[1] if block_tables.dim() == 2 and k_cache.dim() == 4 else None
    return paged_decode(q, k_cache, v_cache, block_tables, seq_lens, sliding_window=sliding_window,
                        max_context_len=cap, check=False)


def attention_decode_ref(q, k_cache, v_cache, block_tables, seq_lens, sliding_window: int | None = None):
    """The reference of :func:`attention_decode` (the eager backend): gather each sequence's blocks,
    mask slots past its length (and before its window), SDPA.  q [B, nh, hd] -> [B, nh, hd].
    Vectorised (no host sync), so it compiles and captures."""
    B, nh, hd = q.shape
    nkv = k_cache.shape[2]
    k = k_cache[block_tables.long()].reshape(B, -1, nkv, hd).transpose(1, 2)     # [B, nkv, S_max, hd]
    v = v_cache[block_tables.long()].reshape(B, -1, nkv, hd).transpose(1, 2)
    k_pos = torch.arange(k.shape[2], device=q.device)[None, :]
    mask = k_pos < seq_lens[:, None]                                               # [B, S_max]
    if sliding_window is not None:
        mask = mask & (k_pos >= seq_lens[:, None] - sliding_window)
    out = torch.nn.functional.scaled_dot_product_attention(q[:, :, None], k, v, attn_mask=mask[:, None, None, :],
                                         enable_gqa=nh != nkv)
    return out[:, :, 0]


def attention_decode_torch(q, k_cache, v_cache, block_tables, seq_lens, sliding_window: int | None = None):
    """What :func:`attention_decode` computes, written for ``torch.compile`` on a CPU: scores and
    output as two reductions over the gathered keys / values (fp32), which inductor fuses into loops
    that read the pool's blocks through the block table in place - no contiguous copy of the
    context, and no call into an SDPA kernel that would need one.  Eagerly it materialises a
    ``[B, S, nh, hd]`` product: use :func:`attention_decode_ref` there.  q [B, nh, hd] -> [B, nh, hd]."""
    B, nh, hd = q.shape
    nkv, page = k_cache.shape[2], k_cache.shape[1]
    g, S = nh // nkv, block_tables.shape[1] * page
    idx = block_tables.long()
    k = k_cache[idx].reshape(B, S, nkv, 1, hd)
    v = v_cache[idx].reshape(B, S, nkv, 1, hd)
    qg = q.view(B, 1, nkv, g, hd).float() * (1.0 / math.sqrt(hd))
    s = (qg * k.float()).sum(-1)                                                   # [B, S, nkv, g]
    pos = torch.arange(S, device=q.device)[None, :]
    mask = pos < seq_lens[:, None]
    if sliding_window is not None:
        mask = mask & (pos >= seq_lens[:, None] - sliding_window)
    p = torch.softmax(s.masked_fill(~mask[:, :, None, None], float("-inf")), dim=1)
    out = (p[..., None] * v.float()).sum(1)                                          # [B, nkv, g, hd]
    return out.reshape(B, nh, hd).to(q.dtype)


def decode_cost(context_lens, nh: int, nkv: int, hd: int, elem_bytes: int, num_splits: int = 1) -> tuple[int, int]:
    """(FLOPs, minimum bytes) of one call, for benchmarks.

    FLOPs: ``4 * hd * nh * sum_b S_b`` (q.k and p.v, 2*hd each, per head and context token).
    Bytes: the context's K and V once per *kv* head (GQA groups share them), q read and o
    written: ``elem_bytes * hd * (2 * nkv * sum S + 2 * B * nh)``; block-table reads are
    negligible.  The split-K partials add ``4 * B * nh * num_splits * (hd + 2)`` bytes written
    and read again: report them separately (they are overhead, not the floor).
    """
    total = sum(int(s) for s in context_lens)
    flops = 4 * hd * nh * total
    nbytes = elem_bytes * hd * (2 * nkv * total + 2 * len(context_lens) * nh)
    return flops, nbytes


def paged_decode_ref(q, k_cache, v_cache, block_tables, context_lens, scale=None, num_splits=None,
                     *, sliding_window=None, max_context_len=None) -> torch.Tensor:
    """What :func:`paged_decode` computes, sequence by sequence in fp32 (gathers each context)."""
    B, nh, hd = q.shape
    scale = 1.0 / math.sqrt(hd) if scale is None else scale
    page = k_cache.shape[1]
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    for b, n in enumerate(context_lens.tolist()):
        blocks = block_tables[b, : -(-n // page)].long()
        k = k_cache[blocks].reshape(-1, *k_cache.shape[2:])[:n].float()     # [n, nkv, hd]
        v = v_cache[blocks].reshape(-1, *v_cache.shape[2:])[:n].float()
        if sliding_window is not None:
            k, v = k[-sliding_window:], v[-sliding_window:]
        k, v = k.repeat_interleave(nh // k.shape[1], 1), v.repeat_interleave(nh // v.shape[1], 1)
        probs = torch.softmax(torch.einsum("hd,shd->hs", q[b].float(), k) * scale, dim=-1)  # [nh, n]
        out[b] = torch.einsum("hs,shd->hd", probs, v)
    return out.to(q.dtype)
