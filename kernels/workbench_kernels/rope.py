"""Rotary position embedding (RoPE) on q and k, optionally fused with the paged KV-cache write.

Math (Su et al. 2021, "RoFormer"), Hugging Face's *rotate-half* layout (not interleaved): a
head vector x = [x1, x2] (halves of D/2) at position p is rotated pairwise::

    out = x * cos[p] + rotate_half(x) * sin[p],   rotate_half([x1, x2]) = [-x2, x1]
    out1 = x1 * cos1 - x2 * sin1,   out2 = x2 * cos2 + x1 * sin2

``cos`` / ``sin`` are tables [P, D] (HF duplicates the halves: both are read, so any table
works), and ``positions[i]`` picks token i's row: tokens of a ragged batch at any positions.

The cache write is the step that follows in every paged engine (vLLM's ``reshape_and_cache``):
the rotated k and the untouched v of token i go to ``slot_mapping[i]`` of a layer's cache::

    k_cache, v_cache: [num_blocks, block_size, nkv, D]      slot = block * block_size + offset
    k_cache[slot // block_size, slot % block_size] = rope(k)[i]     (slot < 0: padding, skipped)

Any strides are accepted for the caches (last dim contiguous), so the reference engine's
contiguous cache ``[B, nkv, max_len, D]`` permuted to ``[B, max_len, nkv, D]`` is a paged cache
with one block of ``max_len`` slots per sequence.

Bytes per token (e bytes per element, nh / nkv heads; the cos/sin rows are negligible)::

    rope (q and k)             read + write (nh + nkv) D e
    + cache write, fused       + read v, write k and v: 2 nkv D e more; rotated k is not re-read
    eager torch, rope          per tensor: x*cos, chunk/neg/cat, *sin, + : ~5 reads + 5 writes
    eager + cache write        + index_put of k and v (re-read both)

A decode step moves only a few KB here, so on a GPU this op is launch-bound: the win is one
launch instead of ~15, which is what CUDA graphs also remove.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import check_device, count_launch, interpreter_active


@triton.jit
def _rope_fwd_kernel(
    Q,                  # *in  q [N, NH, D] (token / head strides free, last dim contiguous)
    K,                  # *in  k [N, NKV, D]
    V,                  # *in  v [N, NKV, D] (read only when WRITE_CACHE)
    QO,                 # *out rotated q [N, NH, D], contiguous
    KO,                 # *out rotated k [N, NKV, D], contiguous
    COS, SIN,           # *in  [P, D] tables (row stride stride_cs, last dim contiguous)
    POS,                # *in  [N] integer row of COS/SIN for each token
    KC, VC,             # *out caches [num_blocks, block_size, NKV, D] (written when WRITE_CACHE)
    SLOT,               # *in  [N] int64 slot of each token (block * block_size + offset); < 0 skips
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cs,
    stride_cb, stride_co, stride_ch,            # cache strides: block, offset in block, head
    N, NH, NKV, HALF,   # tokens, query heads, kv heads, D / 2
    block_size,
    WRITE_CACHE: tl.constexpr,
    BLOCK_T: tl.constexpr,   # tokens per program
    BLOCK_H: tl.constexpr,   # power of two >= max(NH, NKV)
    BLOCK_D: tl.constexpr,   # power of two >= HALF
):
    """out1 = x1 cos1 - x2 sin1, out2 = x2 cos2 + x1 sin2 in fp32, rounded once (reference:
    ``rope_ref``); with WRITE_CACHE, rotated k and v also go to their slot (``rope_kv_write_ref``)."""
    pid = tl.program_id(0)
    t = (pid * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    t_ok = t < N
    d_ok = d < HALF
    pos = tl.load(POS + t, mask=t_ok, other=0).to(tl.int64)
    cs = pos[:, None] * stride_cs + d[None, :]                    # [BLOCK_T, BLOCK_D]
    cs_ok = t_ok[:, None] & d_ok[None, :]
    c1 = tl.load(COS + cs, mask=cs_ok, other=0.0).to(tl.float32)[:, None, :]
    c2 = tl.load(COS + cs + HALF, mask=cs_ok, other=0.0).to(tl.float32)[:, None, :]
    s1 = tl.load(SIN + cs, mask=cs_ok, other=0.0).to(tl.float32)[:, None, :]
    s2 = tl.load(SIN + cs + HALF, mask=cs_ok, other=0.0).to(tl.float32)[:, None, :]
    t3 = t[:, None, None]
    h3 = h[None, :, None]
    d3 = d[None, None, :]
    base_ok = t_ok[:, None, None] & d_ok[None, None, :]

    # q: [BLOCK_T, BLOCK_H, BLOCK_D] per half
    q_ok = base_ok & (h3 < NH)
    q_ptr = Q + t3 * stride_qt + h3 * stride_qh + d3
    q1 = tl.load(q_ptr, mask=q_ok, other=0.0).to(tl.float32)
    q2 = tl.load(q_ptr + HALF, mask=q_ok, other=0.0).to(tl.float32)
    qo_ptr = QO + t3 * (NH * 2 * HALF) + h3 * (2 * HALF) + d3
    tl.store(qo_ptr, (q1 * c1 - q2 * s1).to(QO.dtype.element_ty), mask=q_ok)
    tl.store(qo_ptr + HALF, (q2 * c2 + q1 * s2).to(QO.dtype.element_ty), mask=q_ok)

    # k: the same rotation, NKV heads
    k_ok = base_ok & (h3 < NKV)
    k_ptr = K + t3 * stride_kt + h3 * stride_kh + d3
    k1 = tl.load(k_ptr, mask=k_ok, other=0.0).to(tl.float32)
    k2 = tl.load(k_ptr + HALF, mask=k_ok, other=0.0).to(tl.float32)
    ko1 = (k1 * c1 - k2 * s1).to(KO.dtype.element_ty)
    ko2 = (k2 * c2 + k1 * s2).to(KO.dtype.element_ty)
    ko_ptr = KO + t3 * (NKV * 2 * HALF) + h3 * (2 * HALF) + d3
    tl.store(ko_ptr, ko1, mask=k_ok)
    tl.store(ko_ptr + HALF, ko2, mask=k_ok)

    if WRITE_CACHE:
        slot = tl.load(SLOT + t, mask=t_ok, other=-1).to(tl.int64)
        blk = slot // block_size
        off = slot - blk * block_size
        c_off = (blk * stride_cb + off * stride_co)[:, None, None] + h3 * stride_ch + d3
        c_ok = k_ok & (slot >= 0)[:, None, None]
        tl.store(KC + c_off, ko1, mask=c_ok)
        tl.store(KC + c_off + HALF, ko2, mask=c_ok)
        v_ptr = V + t3 * stride_vt + h3 * stride_vh + d3
        tl.store(VC + c_off, tl.load(v_ptr, mask=c_ok, other=0.0), mask=c_ok)
        tl.store(VC + c_off + HALF, tl.load(v_ptr + HALF, mask=c_ok, other=0.0), mask=c_ok)


def _check_qk(op, q, k, cos, sin, positions):
    for name, x in (("q", q), ("k", k)):
        if x.dim() != 3:
            raise ValueError(f"{op}: {name} must be [tokens, heads, head_dim], got shape {tuple(x.shape)}")
        if x.stride(-1) != 1:
            raise ValueError(f"{op}: {name}'s head_dim must be contiguous (stride 1)")
        if not x.is_floating_point():
            raise TypeError(f"{op}: {name} must be floating point, got {x.dtype}")
    N, _, D = q.shape
    if not (k.shape[0] == N and k.shape[2] == D):
        raise ValueError(f"{op}: q {tuple(q.shape)} and k {tuple(k.shape)} must agree on tokens and head_dim")
    if k.dtype != q.dtype:
        raise TypeError(f"{op}: q dtype {q.dtype} != k dtype {k.dtype}")
    if D % 2:
        raise ValueError(f"{op}: head_dim must be even for rotate-half RoPE, got {D}")
    for name, c in (("cos", cos), ("sin", sin)):
        if not (c.dim() == 2 and c.shape[1] == D):
            raise ValueError(f"{op}: {name} must be [positions, {D}], got {tuple(c.shape)}")
        if c.stride(1) != 1:
            raise ValueError(f"{op}: {name}'s last dimension must be contiguous")
    if not (cos.stride(0) == sin.stride(0) and cos.shape == sin.shape):
        raise ValueError(f"{op}: cos and sin must have one layout")
    if not (positions.shape == (N,) and not positions.is_floating_point()):
        raise ValueError(f"{op}: positions must be an integer tensor of shape ({N},), "
                         f"got {positions.dtype} {tuple(positions.shape)}")


def _launch(q, k, v, cos, sin, positions, k_cache, v_cache, slot_mapping):
    N, NH, D = q.shape
    NKV = k.shape[1]
    qo = torch.empty((N, NH, D), device=q.device, dtype=q.dtype)
    ko = torch.empty((N, NKV, D), device=k.device, dtype=k.dtype)
    if N == 0:
        return qo, ko
    write = k_cache is not None
    # the kernel reads positions / slot_mapping densely (PTR + i): make them so (a no-op returning
    # the same tensor when already contiguous, as under CUDA-graph capture)
    positions = positions.contiguous()
    if write:
        slot_mapping = slot_mapping.contiguous()
    interp = interpreter_active()
    BLOCK_H = triton.next_power_of_2(max(NH, NKV))
    BLOCK_D = triton.next_power_of_2(D // 2)
    per_token = BLOCK_H * BLOCK_D
    BLOCK_T = min(triton.next_power_of_2(N), max(1, (1 << 15 if interp else 1024) // per_token))
    BLOCK_T = 1 << (BLOCK_T.bit_length() - 1)
    kc, vc, slots, vv = (k_cache, v_cache, slot_mapping, v) if write else (ko, ko, positions, k)
    extra = {} if interp else {"num_warps": 4}
    _rope_fwd_kernel[(triton.cdiv(N, BLOCK_T),)](
        q, k, vv, qo, ko, cos, sin, positions, kc, vc, slots,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), vv.stride(0), vv.stride(1),
        cos.stride(0),
        kc.stride(0), kc.stride(1), kc.stride(2) if write else 0,
        N, NH, NKV, D // 2, kc.shape[1] if write else 1,
        WRITE_CACHE=write, BLOCK_T=BLOCK_T, BLOCK_H=BLOCK_H, BLOCK_D=BLOCK_D, **extra)
    count_launch("rope_kv_write" if write else "rope")
    return qo, ko


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
         positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [N, nh, D] and k [N, nkv, D]; token i uses row ``positions[i]`` of cos/sin [P, D].
    Returns new contiguous (q, k) in the input dtype."""
    _check_qk("rope", q, k, cos, sin, positions)
    check_device(_rope_fwd_kernel, q, k, cos, sin, positions, op="rope")
    return _launch(q, k, None, cos, sin, positions, None, None, None)


def rope_kv_write(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  positions: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`rope`, and rotated k / v [N, nkv, D] written to ``slot_mapping`` [N] (int64; < 0
    skips) of ``k_cache`` / ``v_cache`` [num_blocks, block_size, nkv, D].  Returns (q, k)."""
    op = "rope_kv_write"
    _check_qk(op, q, k, cos, sin, positions)
    if not (v.shape == k.shape and v.dtype == k.dtype and v.stride(-1) == 1):
        raise ValueError(f"{op}: v {tuple(v.shape)} {v.dtype} must match k {tuple(k.shape)} {k.dtype} "
                         "(last dim contiguous)")
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not (c.dim() == 4 and c.shape[2:] == k.shape[1:]):
            raise ValueError(f"{op}: {name} must be [num_blocks, block_size, {k.shape[1]}, {k.shape[2]}], "
                             f"got {tuple(c.shape)}")
        if c.dtype != k.dtype:
            raise TypeError(f"{op}: {name} dtype {c.dtype} != k dtype {k.dtype}")
        if c.stride(-1) != 1:
            raise ValueError(f"{op}: {name}'s head_dim must be contiguous (stride 1)")
    if not (k_cache.shape == v_cache.shape and k_cache.stride() == v_cache.stride()):
        raise ValueError(f"{op}: k_cache and v_cache must have one shape and layout")
    if not (slot_mapping.shape == (q.shape[0],) and slot_mapping.dtype == torch.int64):
        raise ValueError(f"{op}: slot_mapping must be int64 of shape ({q.shape[0]},), "
                         f"got {slot_mapping.dtype} {tuple(slot_mapping.shape)}")
    check_device(_rope_fwd_kernel, q, k, v, cos, sin, positions, k_cache, v_cache, slot_mapping, op=op)
    return _launch(q, k, v, cos, sin, positions, k_cache, v_cache, slot_mapping)


def rope_ref(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference: ``workbench.model.decoder.apply_rope`` (in the input dtype) per token's row."""
    c, s = cos[positions][:, None, :], sin[positions][:, None, :]     # [N, 1, D]

    def rot(x):
        x1, x2 = x.chunk(2, dim=-1)
        return x * c + torch.cat((-x2, x1), dim=-1) * s

    return rot(q), rot(k)


def rope_kv_write_ref(q, k, v, cos, sin, positions, k_cache, v_cache, slot_mapping):
    """The reference: :func:`rope_ref`, then an index_put of k / v into their slots.  Negative
    slots are dropped with a boolean mask (a host sync: not capturable in a CUDA graph)."""
    q, k = rope_ref(q, k, cos, sin, positions)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    bs = k_cache.shape[1]
    k_cache[slots // bs, slots % bs] = k[keep]
    v_cache[slots // bs, slots % bs] = v[keep]
    return q, k
