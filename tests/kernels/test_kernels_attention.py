"""Attention kernels (flash prefill, paged decode) against their torch references, torch SDPA
and the model's own attention over a real PagedKVPool.

Runs on the CPU through the Triton interpreter (set below, before anything imports triton's
kernels), at small, awkward shapes: ragged lengths 1/7/13/31, primes, head_dim 32/64 and a
non-power-of-two 40, GQA ratios 1/2/4 and MQA, KV block sizes 1/3/16 with shuffled block ids
and partially filled last blocks, split-K with several splits vs one.

Tolerances.  fp32: atol = rtol = 1e-5 -- the same arithmetic in another summation order
(tiles, online rescaling) lands near 1e-6.  fp16/bf16: the kernel rounds P to the input dtype
before P @ V, as FlashAttention does on tensor cores, so it cannot match an fp32 reference
to fp32 precision; the criterion (Liger's) is that our error against an fp32 reference on the
same inputs is at most 2x torch's own error in that dtype.  "Torch's own" is eager attention
in that dtype with the rounding points of transformers' eager path (scores and P @ V in the
dtype, softmax in fp32): CPU SDPA keeps P in fp32 internally, so it is not the yardstick for
a kernel built the GPU way.  Errors are relative Frobenius norms (a max-abs error of a few
hundred elements is noisy).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"        # before the kernel modules create their jit functions
pytest.importorskip("triton", reason="triton is not installed (the kernels need it, also on CPU)")

import torch.nn.functional as F  # noqa: E402

__import__("workbench")  # registers the workbench_kernels import name
from workbench.model.config import ModelConfig  # noqa: E402
from workbench.kv.paged import PagedKVConfig, PagedKVPool  # noqa: E402
from workbench.model.decoder import CausalLM, init_weights  # noqa: E402
from workbench_kernels.flash_prefill import (  # noqa: E402
    _flash_prefill_kernel, flash_prefill, flash_prefill_paged, flash_prefill_paged_ref, flash_prefill_ref,
    prefill_cost)
from workbench_kernels.paged_decode import choose_num_splits, decode_cost, paged_decode, paged_decode_ref  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and "Interpreted" not in type(_flash_prefill_kernel.fn).__name__:
    pytest.fail("the attention kernels were created for a GPU before TRITON_INTERPRET=1 was set: "
                "tests/conftest.py sets it on a machine without CUDA before anything imports triton", pytrace=False)

torch.set_num_threads(1)
ATOL = RTOL = 1e-5
LENS = [1, 7, 13, 31]


def assert_close(got: torch.Tensor, want: torch.Tensor, atol: float = ATOL, rtol: float = RTOL) -> None:
    """allclose that says how many elements are off, and where the worst one is."""
    got, want = got.float().cpu(), want.float().cpu()
    assert got.shape == want.shape, f"shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert not got.isnan().any(), f"{int(got.isnan().sum())} NaNs in the output"
    bad = (got - want).abs() > atol + rtol * want.abs()
    if bad.any():
        err = (got - want).abs()
        worst = tuple(int(i) for i in torch.unravel_index(err.argmax(), err.shape))
        raise AssertionError(f"{int(bad.sum())}/{bad.numel()} elements differ; worst at {worst}: "
                             f"got {got[worst].item():.6g}, want {want[worst].item():.6g}")


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.float() - ref.float()).norm() / ref.float().norm()).item()


def cu(lens) -> torch.Tensor:
    return torch.tensor([0, *lens], device=DEVICE).cumsum(0).to(torch.int32)


def packed(lens, heads, hd, dtype, gen):
    return torch.randn(sum(lens), heads, hd, generator=gen).to(DEVICE, dtype)


def sdpa_per_sequence(q, k, v, cq, ck, causal=True, window=None):
    """Torch SDPA, sequence by sequence, queries = the last T of S keys (bottom-right mask)."""
    out, cq, ck = [], cq.tolist(), ck.tolist()
    for i in range(len(cq) - 1):
        qs, ks, vs = (x.transpose(0, 1)[None] for x in (q[cq[i]:cq[i + 1]], k[ck[i]:ck[i + 1]], v[ck[i]:ck[i + 1]]))
        T, S = qs.shape[2], ks.shape[2]
        pq, pk = torch.arange(S - T, S, device=q.device)[:, None], torch.arange(S, device=q.device)[None, :]
        mask = (pk <= pq) if causal else torch.ones(T, S, dtype=torch.bool, device=q.device)
        if window is not None:
            mask &= pk > pq - window
        out.append(F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, enable_gqa=True)[0].transpose(0, 1))
    return torch.cat(out)


def eager_in_dtype(q, k, v, cq, ck):
    """transformers' eager attention in q's dtype: scores and P @ V in the dtype, softmax in fp32."""
    out, cq, ck = [], cq.tolist(), ck.tolist()
    for i in range(len(cq) - 1):
        qs, ks, vs = (x.transpose(0, 1) for x in (q[cq[i]:cq[i + 1]], k[ck[i]:ck[i + 1]], v[ck[i]:ck[i + 1]]))
        g = qs.shape[0] // ks.shape[0]
        ks, vs = ks.repeat_interleave(g, 0), vs.repeat_interleave(g, 0)
        T, S = qs.shape[1], ks.shape[1]
        s = (qs @ ks.transpose(1, 2)) * qs.shape[-1] ** -0.5
        s = s.masked_fill(~torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T), float("-inf"))
        out.append((torch.softmax(s.float(), -1).to(q.dtype) @ vs).transpose(0, 1))
    return torch.cat(out)


# ---- flash prefill ---------------------------------------------------------------------------------

@pytest.mark.parametrize("nh,nkv,hd", [(4, 4, 32), (4, 2, 64), (8, 2, 32), (4, 1, 40)],
                         ids=["mha-hd32", "gqa2-hd64", "gqa4-hd32", "mqa-hd40"])
def test_flash_prefill_fp32_matches_ref_and_sdpa(nh, nkv, hd):
    gen = torch.Generator().manual_seed(nh * 100 + hd)
    q, k, v = packed(LENS, nh, hd, torch.float32, gen), packed(LENS, nkv, hd, torch.float32, gen), \
        packed(LENS, nkv, hd, torch.float32, gen)
    c = cu(LENS)
    out = flash_prefill(q, k, v, c, max(LENS))
    assert_close(out, flash_prefill_ref(q, k, v, c))
    assert_close(out, sdpa_per_sequence(q, k, v, c, c))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_flash_prefill_low_precision_within_2x_torch(dtype):
    gen = torch.Generator().manual_seed(5)
    q, k, v = packed(LENS, 4, 64, dtype, gen), packed(LENS, 2, 64, dtype, gen), packed(LENS, 2, 64, dtype, gen)
    c = cu(LENS)
    ref = flash_prefill_ref(q.float(), k.float(), v.float(), c)
    ours, torch_own = rel_err(flash_prefill(q, k, v, c, max(LENS)), ref), rel_err(eager_in_dtype(q, k, v, c, c), ref)
    assert ours <= 2 * torch_own, f"{dtype}: our error {ours:.2e} > 2x torch's {torch_own:.2e}"


@pytest.mark.parametrize("causal,window", [(True, None), (True, 4), (True, 1), (False, None)])
def test_flash_prefill_chunked_queries_are_the_last_keys(causal, window):
    """Chunked prefill: sequence i has q_len_i <= k_len_i (one with q == k, one prime-long context)."""
    q_lens, k_lens = [1, 3, 13, 5], [4, 7, 13, 37]
    gen = torch.Generator().manual_seed(11)
    q, k, v = packed(q_lens, 4, 32, torch.float32, gen), packed(k_lens, 2, 32, torch.float32, gen), \
        packed(k_lens, 2, 32, torch.float32, gen)
    cq, ck = cu(q_lens), cu(k_lens)
    out = flash_prefill(q, k, v, cq, max(q_lens), causal=causal, sliding_window=window, cu_seqlens_k=ck)
    assert_close(out, flash_prefill_ref(q, k, v, cq, causal=causal, sliding_window=window, cu_seqlens_k=ck))
    assert_close(out, sdpa_per_sequence(q, k, v, cq, ck, causal=causal, window=window))


def shuffled_pool(lens, page, nkv, hd, dtype, gen, spare=3):
    """A paged cache whose block ids are shuffled across sequences; unused table entries = -1."""
    nblocks = [-(-n // page) for n in lens]
    perm = torch.randperm(sum(nblocks) + spare, generator=gen).to(torch.int32)
    table = torch.full((len(lens), max(nblocks) + 1), -1, dtype=torch.int32)
    start = 0
    for i, n in enumerate(nblocks):
        table[i, :n] = perm[start:start + n]
        start += n
    shape = (sum(nblocks) + spare, page, nkv, hd)
    kc, vc = (torch.randn(shape, generator=gen).to(DEVICE, dtype) for _ in range(2))
    return kc, vc, table.to(DEVICE), torch.tensor(lens, dtype=torch.int32, device=DEVICE)


@pytest.mark.parametrize("page", [1, 3, 16])
def test_flash_prefill_paged_matches_packed(page):
    """Prefill chunks reading K/V in place from a shuffled paged cache (last blocks part-filled)."""
    q_lens, k_lens = [1, 4, 13], [7, 4, 29]
    gen = torch.Generator().manual_seed(page)
    kc, vc, table, seq_lens = shuffled_pool(k_lens, page, 2, 32, torch.float32, gen)
    q, cq = packed(q_lens, 8, 32, torch.float32, gen), cu(q_lens)
    out = flash_prefill_paged(q, kc, vc, table, cq, seq_lens, max(q_lens))
    assert_close(out, flash_prefill_paged_ref(q, kc, vc, table, cq, seq_lens))


def test_flash_prefill_rejects_bad_input_clearly():
    q, k = torch.randn(8, 4, 32), torch.randn(8, 2, 32)
    c = torch.tensor([0, 3, 8], dtype=torch.int32)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        flash_prefill(q, torch.randn(8, 3, 32), torch.randn(8, 3, 32), c, 5)
    with pytest.raises(ValueError, match="head_dim 512 > 256"):
        flash_prefill(torch.randn(8, 2, 512), torch.randn(8, 2, 512), torch.randn(8, 2, 512), c, 5)
    with pytest.raises(TypeError, match="share a dtype"):
        flash_prefill(q, k.half(), k.half(), c, 5)
    with pytest.raises(ValueError, match="int32"):
        flash_prefill(q, k, k, c.long(), 5)
    with pytest.raises(ValueError, match="max_seqlen=4"):
        flash_prefill(q, k, k, c, 4)
    with pytest.raises(ValueError, match="rise from 0"):
        flash_prefill(q, k, k, torch.tensor([0, 3, 7], dtype=torch.int32), 5)
    with pytest.raises(ValueError, match="more queries than keys"):
        flash_prefill(q, k[:6], k[:6], c, 5, cu_seqlens_k=torch.tensor([0, 4, 6], dtype=torch.int32))
    with pytest.raises(ValueError, match="needs causal=True"):
        flash_prefill(q, k, k, c, 5, causal=False, sliding_window=4)


def strided(t: torch.Tensor) -> torch.Tensor:
    """The same values in a non-contiguous layout: a 1-D view with stride 2, a 2-D table column-major."""
    if t.dim() == 1:
        return torch.stack([t, torch.full_like(t, -7)], 1)[:, 0]
    return t.t().contiguous().t()


def test_flash_prefill_strided_index_tensors_match_contiguous():
    """Offsets, lengths and block tables in non-contiguous layouts give the same result."""
    q_lens, k_lens = [2, 5], [6, 5]
    gen = torch.Generator().manual_seed(11)
    kc, vc, table, seq_lens = shuffled_pool(k_lens, 3, 2, 16, torch.float32, gen)
    q, cq = packed(q_lens, 4, 16, torch.float32, gen), cu(q_lens)
    want = flash_prefill_paged(q, kc, vc, table, cq, seq_lens, max(q_lens))
    st, sq, sl = strided(table), strided(cq), strided(seq_lens)
    assert not (st.is_contiguous() or sq.is_contiguous() or sl.is_contiguous()) and torch.equal(st, table)
    assert_close(flash_prefill_paged(q, kc, vc, st, sq, sl, max(q_lens)), want)
    k, v = packed(k_lens, 2, 16, torch.float32, gen), packed(k_lens, 2, 16, torch.float32, gen)
    ck = cu(k_lens)
    want = flash_prefill(q, k, v, cq, max(q_lens), cu_seqlens_k=ck)
    assert_close(flash_prefill(q, k, v, strided(cq), max(q_lens), cu_seqlens_k=strided(ck)), want)


def test_flash_prefill_paged_block_tables_on_another_device_is_refused():
    q_lens, k_lens = [2, 5], [6, 5]
    gen = torch.Generator().manual_seed(12)
    kc, vc, table, seq_lens = shuffled_pool(k_lens, 3, 2, 16, torch.float32, gen)
    q, cq = packed(q_lens, 4, 16, torch.float32, gen), cu(q_lens)
    with pytest.raises(ValueError, match="block_tables is on meta"):
        flash_prefill_paged(q, kc, vc, table.to("meta"), cq, seq_lens, max(q_lens))


# ---- paged decode ----------------------------------------------------------------------------------

def decode_inputs(lens, nh, nkv, hd, page, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    kc, vc, table, ctx = shuffled_pool(lens, page, nkv, hd, dtype, gen)
    return torch.randn(len(lens), nh, hd, generator=gen).to(DEVICE, dtype), kc, vc, table, ctx


def sdpa_decode(q, kc, vc, table, ctx):
    page, out = kc.shape[1], []
    for b, n in enumerate(ctx.tolist()):
        blocks = table[b, : -(-n // page)].long()
        k, v = (c[blocks].reshape(-1, *c.shape[2:])[:n].transpose(0, 1)[None] for c in (kc, vc))
        out.append(F.scaled_dot_product_attention(q[b][None, :, None], k, v, enable_gqa=True)[0, :, 0])
    return torch.stack(out)


@pytest.mark.parametrize("page,nh,nkv,hd", [(1, 4, 4, 32), (3, 8, 4, 64), (16, 8, 2, 32), (3, 4, 1, 40)],
                         ids=["bs1-mha", "bs3-gqa2-hd64", "bs16-gqa4", "bs3-mqa-hd40"])
def test_paged_decode_fp32_matches_ref_sdpa_and_one_split(page, nh, nkv, hd):
    lens = LENS if page != 1 else [1, 7, 13]          # block size 1: many blocks, fewer tokens
    q, kc, vc, table, ctx = decode_inputs(lens, nh, nkv, hd, page, torch.float32, seed=page + hd)
    one = paged_decode(q, kc, vc, table, ctx, num_splits=1)
    three = paged_decode(q, kc, vc, table, ctx, num_splits=3)   # 31 tokens: splits of 16, 15 and none
    assert_close(one, paged_decode_ref(q, kc, vc, table, ctx))
    assert_close(three, one)
    assert_close(one, sdpa_decode(q, kc, vc, table, ctx))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_paged_decode_low_precision_within_2x_torch(dtype):
    q, kc, vc, table, ctx = decode_inputs([5, 31, 23], 8, 2, 64, 3, dtype, seed=7)
    ref = paged_decode_ref(q.float(), kc.float(), vc.float(), table, ctx)
    ours = rel_err(paged_decode(q, kc, vc, table, ctx, num_splits=2), ref)
    page, cq = kc.shape[1], cu([1] * len(ctx))
    k = torch.cat([kc[table[b, : -(-n // page)].long()].reshape(-1, 2, 64)[:n] for b, n in enumerate(ctx.tolist())])
    v = torch.cat([vc[table[b, : -(-n // page)].long()].reshape(-1, 2, 64)[:n] for b, n in enumerate(ctx.tolist())])
    torch_own = rel_err(eager_in_dtype(q, k, v, cq, cu(ctx.tolist())), ref)
    assert ours <= 2 * torch_own, f"{dtype}: our error {ours:.2e} > 2x torch's {torch_own:.2e}"


def test_paged_decode_many_splits_merge_exactly():
    """Prime and block-aligned contexts (67, 48 = 3 full blocks of 16) cut into 1, 4 and 7 splits,
    some of them empty for the short sequence."""
    q, kc, vc, table, ctx = decode_inputs([67, 48, 2], 4, 2, 32, 16, torch.float32, seed=2)
    ref = paged_decode_ref(q, kc, vc, table, ctx)
    for splits in (1, 4, 7):
        assert_close(paged_decode(q, kc, vc, table, ctx, num_splits=splits), ref)


def test_paged_decode_sliding_window_and_default_splits():
    q, kc, vc, table, ctx = decode_inputs([1, 9, 31], 4, 2, 32, 3, torch.float32, seed=3)
    assert_close(paged_decode(q, kc, vc, table, ctx, num_splits=2, sliding_window=5),
                 paged_decode_ref(q, kc, vc, table, ctx, sliding_window=5))
    assert_close(paged_decode(q, kc, vc, table, ctx), paged_decode_ref(q, kc, vc, table, ctx))  # heuristic


def test_choose_num_splits_fills_the_chip_but_not_with_tiny_splits():
    assert choose_num_splits(1, 8, 32768, num_sms=132) == 32          # idle SMs: split the long context
    assert choose_num_splits(64, 8, 32768, num_sms=132) == 1          # 512 programs already fill 132 SMs
    assert choose_num_splits(1, 8, 1000, num_sms=132) == 2            # no split under 256 tokens
    assert choose_num_splits(1, 8, 100, num_sms=132) == 1
    for b in (1, 3, 16):
        s = choose_num_splits(b, 2, 5000, num_sms=132)
        assert s & (s - 1) == 0 and 1 <= s <= 32


def test_paged_decode_strided_block_tables_and_context_lens_match_contiguous():
    q, kc, vc, table, ctx = decode_inputs([7, 6], 4, 2, 16, 4, torch.float32, seed=5)
    want = paged_decode(q, kc, vc, table, ctx, num_splits=1)
    st, sc = strided(table), strided(ctx)
    assert not (st.is_contiguous() or sc.is_contiguous()) and torch.equal(st, table)
    for splits in (1, 2):
        assert_close(paged_decode(q, kc, vc, st, sc, num_splits=splits), want)
    with pytest.raises(ValueError, match="block_tables and context_lens must be on one device"):
        paged_decode(q, kc, vc, table.to("meta"), ctx)


def test_paged_decode_rejects_bad_input_clearly():
    q, kc, vc, table, ctx = decode_inputs([5, 7], 4, 2, 32, 3, torch.float32, seed=1)
    with pytest.raises(ValueError, match="must lie in"):
        paged_decode(q, kc, vc, table, torch.tensor([0, 7], dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="must lie in"):
        paged_decode(q, kc, vc, table, torch.tensor([5, 100], dtype=torch.int32, device=DEVICE))
    bad = table.clone()
    bad[0, 0] = kc.shape[0]
    with pytest.raises(ValueError, match="outside the pool"):
        paged_decode(q, kc, vc, bad, ctx)
    with pytest.raises(ValueError, match="block_tables must be int32"):
        paged_decode(q, kc, vc, table.long(), ctx)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        paged_decode(q[:, :3], kc, vc, table, ctx)
    with pytest.raises(TypeError, match="share a dtype"):
        paged_decode(q.half(), kc, vc, table, ctx)


def test_cost_formulas():
    # one sequence, T = S = 4, causal: 4+3+2+1 = 10 visible (query, key) pairs
    assert prefill_cost([4], [4], nh=2, nkv=1, hd=8, elem_bytes=2) == (4 * 8 * 2 * 10, 2 * 8 * (2 * 2 * 4 + 2 * 1 * 4))
    assert prefill_cost([2], [5], nh=1, nkv=1, hd=8, elem_bytes=4)[0] == 4 * 8 * (4 + 5)   # chunk: 4 + 5 keys
    assert decode_cost([3, 5], nh=4, nkv=2, hd=8, elem_bytes=2) == (4 * 8 * 4 * 8, 2 * 8 * (2 * 2 * 8 + 2 * 2 * 4))


# ---- against the model, through the real paged pool -------------------------------------------------

class _CapturingF:
    """Stands in for torch.nn.functional inside workbench.model.decoder: records every SDPA call."""

    def __init__(self):
        self.calls = []

    def scaled_dot_product_attention(self, q, k, v, **kw):
        out = F.scaled_dot_product_attention(q, k, v, **kw)
        self.calls.append((q.detach().clone(), out.detach().clone()))
        return out

    def __getattr__(self, name):
        return getattr(F, name)


@pytest.mark.parametrize("window", [None, 5])
def test_kernels_equal_model_attention_over_paged_pool(monkeypatch, window):
    """Two sequences written through PagedKVPool by the reference model (prefill in two chunks,
    then interleaved decode steps, block size 3): the kernels, reading the pool in place, give
    the model's own attention outputs, layer by layer."""
    cfg = ModelConfig(vocab_size=61, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=64,
                      sliding_window=window, architecture="MistralForCausalLM")
    model = init_weights(CausalLM(cfg), seed=1).eval().to(DEVICE)
    pool = PagedKVPool(cfg, PagedKVConfig(block_size=3, num_blocks=24, enable_prefix_caching=False),
                       torch.device(DEVICE), torch.float32, default_tokens=0)
    row = lambda x: torch.tensor([x], device=DEVICE)  # noqa: E731  [1, T] token ids
    spy = _CapturingF()
    monkeypatch.setattr("workbench.model.decoder.F", spy)
    L, prompts = cfg.num_hidden_layers, {"a": [5, 9, 2, 33, 14, 7, 21, 3, 8, 40, 11], "b": [17, 4, 29, 6, 1]}
    caches = {}
    with torch.no_grad():
        for sid, ids in prompts.items():
            caches[sid], _ = pool.begin(sid, ids)
        # "a": prefill in two chunks, positions [0, 6) then [6, 11): the second chunk's queries
        # are the last 5 of 11 keys.
        model(row(prompts["a"][:6]), 0, caches["a"])
        spy.calls.clear()
        model(row(prompts["a"][6:]), 6, caches["a"])
        chunk = spy.calls[:L]
        model(row(prompts["b"]), 0, caches["b"])
        for sid, ids in prompts.items():
            pool.commit(sid, len(ids))
        # interleaved decode steps: a, b, a, b, ... so their new blocks interleave in the pool
        lengths = {sid: len(ids) for sid, ids in prompts.items()}
        last = {}
        for step in range(4):
            for sid in prompts:
                token = (7 * step + len(sid)) % cfg.vocab_size
                pool.reserve(sid, token)
                spy.calls.clear()
                model(row([token]), lengths[sid], caches[sid])
                lengths[sid] += 1
                pool.commit(sid, lengths[sid])
                last[sid] = spy.calls[:L]

    tables = [pool.manager.block_table(sid) for sid in prompts]
    width = max(map(len, tables))
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=DEVICE)
    ctx = torch.tensor([lengths[sid] for sid in prompts], dtype=torch.int32, device=DEVICE)
    for layer in range(L):
        kc, vc = pool.k_cache[layer], pool.v_cache[layer]
        # decode: both sequences in one call; the model's q/out are [1, nh, 1, hd]
        q = torch.cat([last[sid][layer][0][:, :, 0] for sid in prompts])
        want = torch.cat([last[sid][layer][1][:, :, 0] for sid in prompts])
        for splits in (1, 2):
            assert_close(paged_decode(q, kc, vc, block_tables, ctx, num_splits=splits, sliding_window=window), want)
        # the second prefill chunk of "a", read from the pool in place; model q/out [1, nh, 5, hd]
        qc, wantc = (x[0].transpose(0, 1) for x in chunk[layer])
        got = flash_prefill_paged(qc.contiguous(), kc, vc, block_tables[:1], cu([5]), ctx.new_tensor([11]), 5,
                                  sliding_window=window)
        assert_close(got, wantc)
    for sid in prompts:
        pool.end(sid)
    assert pool.manager.num_used_blocks == 0


def test_paged_decode_page_size_is_a_run_time_argument():
    """One compiled variant serves every page size (the contiguous cache's page is a whole row,
    one per request length): the page size is neither constexpr nor in the autotune key, and the
    arguments that vary within a generation are not specialized."""
    import ast
    import inspect

    from workbench_kernels import paged_decode as pd

    k = pd._paged_decode_split_kernel
    assert "PAGE_SIZE" not in k.keys and "page_size" not in k.keys
    src = Path(inspect.getsourcefile(pd)).read_text()
    fn = next(n for n in ast.walk(ast.parse(src))
              if isinstance(n, ast.FunctionDef) and n.name == "_paged_decode_split_kernel")
    ann = {a.arg: ast.unparse(a.annotation) if a.annotation else "" for a in fn.args.args}
    assert "page_size" in ann and "constexpr" not in ann["page_size"] and "PAGE_SIZE" not in ann
    jit = next(d for d in fn.decorator_list if isinstance(d, ast.Call) and ast.unparse(d.func) == "triton.jit")
    dns = next(kw for kw in jit.keywords if kw.arg == "do_not_specialize")
    assert set(ast.literal_eval(dns.value)) >= {"page_size", "num_splits", "stride_bt"}


def test_flash_prefill_tunes_per_length_bucket():
    """The autotune key includes the query length's bucket (a 16-token prompt's choice is not
    reused for a 4096-token prefill), a run-time argument the kernel does not specialize on."""
    from workbench_kernels import flash_prefill as fp

    assert "max_seqlen_bucket" in _flash_prefill_kernel.keys
    assert [fp.seqlen_bucket(n) for n in (1, 16, 65, 1000, 4096, 100_000)] == [64, 64, 128, 1024, 4096, 4096]
