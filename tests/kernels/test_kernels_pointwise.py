"""Pointwise kernels (RMSNorm, RMSNorm + residual, RoPE, RoPE + paged KV write, SwiGLU) against
their torch references, at small awkward shapes under the Triton interpreter on a CPU.

Shapes: size 1, primes (7, 13, 257, 4231), non-powers of two (96, head_dim 6 / 40), rows with
a stride larger than their length (a slice of a wider tensor, as a packed qkv projection gives),
ragged token positions, KV blocks of 3 and 16 slots with a partially filled last block.

Tolerances, per dtype:

* float32: ``atol = rtol = 1e-5`` (SwiGLU ``atol 1e-6``).  The kernels do the reference's
  arithmetic in float32 with another reduction order (a tree sum instead of torch's mean), FMA
  contraction and another exp/sigmoid, which moves results by a few ulp (~1e-7 relative), far
  below the tolerance; an indexing bug (wrong row, wrong half, wrong position) is O(1).
* bfloat16 / float16: the references round in the dtype after every op (that is what the
  model computes), the kernels compute in float32 and round once, so they cannot agree to a
  fixed number of ulp in both directions.  The criterion is Liger-Kernel's: against a float32
  reference on the same inputs, our error is at most 2x torch's own error in that dtype
  (``assert_lowp_close``; relative L2 and max-abs).
* Exact equality where no arithmetic happens or it is the same single rounding: the residual
  stream ``h = x + r`` of add_rmsnorm, v written to the cache, cache slots not written.  (One
  exception, on the CPU only: the interpreter rounds float32 -> bfloat16 toward zero, so a
  bf16 ``x + r`` may sit one ulp from torch's round-to-nearest-even there.)

Keep shapes small: every program is a Python loop iteration under the interpreter.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"        # before the kernel modules create their jit functions
pytest.importorskip("triton", reason="triton is not installed (the kernels need it, also on CPU)")

__import__("workbench")  # registers the workbench_kernels import name
import workbench_kernels  # noqa: E402
from workbench.model.config import ModelConfig  # noqa: E402
from workbench.model.decoder import RotaryEmbedding  # noqa: E402
from workbench_kernels._testing import assert_close, assert_lowp_close  # noqa: E402
from workbench_kernels.rmsnorm import _rmsnorm_fwd_kernel, add_rmsnorm, add_rmsnorm_ref, rmsnorm, rmsnorm_ref  # noqa: E402
from workbench_kernels.rope import rope, rope_kv_write, rope_kv_write_ref, rope_ref  # noqa: E402
from workbench_kernels.swiglu import swiglu, swiglu_ref  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and "Interpreted" not in type(_rmsnorm_fwd_kernel).__name__:
    pytest.fail("the pointwise kernels were created for a GPU before TRITON_INTERPRET=1 was set: "
                "tests/conftest.py sets it on a machine without CUDA before anything imports triton", pytrace=False)

FP32 = dict(atol=1e-5, rtol=1e-5)
LOWP = [torch.bfloat16, torch.float16]


def randn(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype).to(DEVICE)


def up32(*ts):
    return [t.float() for t in ts]


# ---- RMSNorm ------------------------------------------------------------------------------------
NORM_SHAPES = [(1, 1), (1, 7), (3, 13), (2, 5, 96), (4, 257), (1, 4231)]


@pytest.mark.parametrize("shape", NORM_SHAPES)
def test_rmsnorm_fp32(shape):
    x, w = randn(*shape, seed=1), randn(shape[-1], seed=2)
    assert_close(rmsnorm(x, w, 1e-5), rmsnorm_ref(x, w, 1e-5), **FP32, name=f"rmsnorm {shape}")


@pytest.mark.parametrize("dtype", LOWP)
def test_rmsnorm_low_precision_within_2x_torch(dtype):
    x, w = randn(6, 257, dtype=dtype, seed=3), randn(257, dtype=dtype, seed=4)
    ours, torch_lowp = rmsnorm(x, w, 1e-6), rmsnorm_ref(x, w, 1e-6)
    assert ours.dtype == torch_lowp.dtype == dtype
    assert_lowp_close(ours, torch_lowp, rmsnorm_ref(*up32(x, w), 1e-6), name="rmsnorm")


def test_rmsnorm_strided_rows_and_fp32_weight_on_bf16_input():
    """Rows 96 apart holding 37 elements (a slice of a wider tensor); a float32 weight on bf16
    activations promotes the output to float32, as torch's ``weight * x`` does."""
    wide = randn(5, 96, seed=5)
    x, w = wide[:, 10:47], randn(37, seed=6)
    assert x.stride(0) == 96
    assert_close(rmsnorm(x, w, 1e-5), rmsnorm_ref(x, w, 1e-5), **FP32, name="strided rows")
    xb = x.to(torch.bfloat16)
    y = rmsnorm(xb, w, 1e-5)
    assert y.dtype == torch.float32
    # the bf16-rounded normalised row times an fp32 weight: both sides round at the same point
    assert_close(y, rmsnorm_ref(xb, w, 1e-5), atol=1e-2, rtol=1e-2, name="bf16 x fp32 w")


@pytest.mark.parametrize("shape", [(1, 1), (3, 13), (2, 3, 96)])
def test_add_rmsnorm_fp32(shape):
    x, r, w = randn(*shape, seed=7), randn(*shape, seed=8), randn(shape[-1], seed=9)
    y, h = add_rmsnorm(x, r, w, 1e-5)
    y_ref, h_ref = add_rmsnorm_ref(x, r, w, 1e-5)
    assert torch.equal(h, h_ref), "the residual stream x + r must be torch's add exactly (one rounding)"
    assert_close(y, y_ref, **FP32, name="add_rmsnorm")


@pytest.mark.parametrize("dtype", LOWP)
def test_add_rmsnorm_low_precision(dtype):
    x, r, w = randn(7, 96, dtype=dtype, seed=10), randn(7, 96, dtype=dtype, seed=11), randn(96, dtype=dtype, seed=12)
    y, h = add_rmsnorm(x, r, w, 1e-6)
    y_ref, h_ref = add_rmsnorm_ref(x, r, w, 1e-6)
    if dtype == torch.bfloat16 and DEVICE == "cpu":
        # The interpreter rounds float32 -> bfloat16 toward zero (interpreter.py cast_impl passes no
        # rounding mode); compiled Triton and torch round to nearest even.  So here: within one
        # bf16 ulp (2^-7 relative), never further; on a GPU the exact check below applies.
        assert bool(((h.float() - h_ref.float()).abs() <= h_ref.float().abs() * 2 ** -7).all())
    else:
        assert torch.equal(h, h_ref), f"{dtype}: x + r rounded once to the dtype, as torch does"
    assert_lowp_close(y, y_ref, rmsnorm_ref(h.float(), w.float(), 1e-6), name="add_rmsnorm")


def test_rmsnorm_errors_name_the_argument():
    x, w = randn(3, 8), randn(8)
    with pytest.raises(ValueError, match=r"weight has shape \(7,\)"):
        rmsnorm(x, randn(7), 1e-5)
    with pytest.raises(TypeError, match="x must be a floating-point"):
        rmsnorm(torch.ones(3, 8, dtype=torch.int32, device=DEVICE), w, 1e-5)
    with pytest.raises(ValueError, match="x's last dimension must be contiguous"):
        rmsnorm(randn(8, 3).t(), w, 1e-5)
    with pytest.raises(TypeError, match="residual dtype"):
        add_rmsnorm(x, x.double(), w, 1e-5)
    with pytest.raises(ValueError, match="residual shape"):
        add_rmsnorm(x, randn(2, 8), w, 1e-5)


# ---- RoPE ---------------------------------------------------------------------------------------
def rope_tables(D, P=64, theta=10000.0):
    cfg = ModelConfig(vocab_size=8, hidden_size=D, intermediate_size=8, num_hidden_layers=1,
                      num_attention_heads=1, num_key_value_heads=1, head_dim=D, rope_theta=theta,
                      max_position_embeddings=P)
    cos, sin = RotaryEmbedding(cfg)._table(P, torch.device(DEVICE))
    return cos[:P], sin[:P]


def qkv(N, nh, nkv, D, dtype=torch.float32, seed=0):
    """q, k, v as views of one packed [N, (nh + 2 nkv), D] projection: token stride > heads * D."""
    packed = randn(N, nh + 2 * nkv, D, dtype=dtype, seed=seed)
    return packed[:, :nh], packed[:, nh:nh + nkv], packed[:, nh + nkv:]


@pytest.mark.parametrize("N,nh,nkv,D", [(1, 1, 1, 2), (5, 3, 1, 6), (13, 4, 2, 40), (7, 8, 8, 32)])
def test_rope_fp32(N, nh, nkv, D):
    cos, sin = rope_tables(D)
    q, k, _ = qkv(N, nh, nkv, D, seed=N)
    pos = torch.randperm(64, generator=torch.Generator().manual_seed(N))[:N].to(DEVICE)   # ragged positions
    qo, ko = rope(q, k, cos, sin, pos)
    qr, kr = rope_ref(q, k, cos, sin, pos)
    assert qo.is_contiguous() and ko.is_contiguous()
    assert_close(qo, qr, **FP32, name="rope q")
    assert_close(ko, kr, **FP32, name="rope k")


@pytest.mark.parametrize("dtype", LOWP)
def test_rope_low_precision_within_2x_torch(dtype):
    cos, sin = rope_tables(40)
    q, k, _ = qkv(9, 4, 2, 40, dtype=dtype, seed=21)
    pos = torch.tensor([0, 3, 63, 1, 17, 17, 2, 40, 5], device=DEVICE)
    c, s = cos.to(dtype), sin.to(dtype)          # the model passes tables in its dtype
    ours, theirs = rope(q, k, c, s, pos), rope_ref(q, k, c, s, pos)
    ref = rope_ref(*up32(q, k, c, s), pos)
    for i, name in enumerate("qk"):
        assert ours[i].dtype == dtype
        assert_lowp_close(ours[i], theirs[i], ref[i], name=f"rope {name}")


def paged_layout(lens, block_size, extra_blocks=2, seed=0):
    """Shuffled block ids for sequences of ``lens`` tokens: (block tables, num_blocks)."""
    need = [-(-n // block_size) for n in lens]
    num_blocks = sum(need) + extra_blocks
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    tables, i = [], 0
    for n in need:
        tables.append(perm[i:i + n])
        i += n
    return tables, num_blocks


@pytest.mark.parametrize("block_size", [3, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_kv_write_ragged_prefill_and_decode(block_size, dtype):
    """A ragged step: sequence 0 prefills 7 tokens (positions 0..6: with block size 3 its last
    block is partly filled), sequence 1 decodes one token at position 10, and one padding token
    (slot -1) that must not be written.  Both caches are compared whole: written slots against
    the reference, every other slot untouched."""
    nh, nkv, D = 4, 2, 6
    cos, sin = rope_tables(D, P=32)
    c, s = cos.to(dtype), sin.to(dtype)
    lens = [7, 11]
    tables, num_blocks = paged_layout(lens, block_size, seed=block_size)
    positions = list(range(7)) + [10, 0]
    seq_of = [0] * 7 + [1, None]
    slots = [-1 if sq is None else tables[sq][p // block_size] * block_size + p % block_size
             for sq, p in zip(seq_of, positions)]
    N = len(slots)
    q, k, v = qkv(N, nh, nkv, D, dtype=dtype, seed=31)
    pos_t, slot_t = torch.tensor(positions, device=DEVICE), torch.tensor(slots, device=DEVICE)
    sentinel = 7.0
    kc, vc = (torch.full((num_blocks, block_size, nkv, D), sentinel, dtype=dtype, device=DEVICE) for _ in "kv")
    kc_ref, vc_ref = kc.clone(), vc.clone()
    qo, ko = rope_kv_write(q, k, v, c, s, pos_t, kc, vc, slot_t)
    qr, kr = rope_kv_write_ref(q, k, v, c, s, pos_t, kc_ref, vc_ref, slot_t)

    written = torch.zeros(num_blocks, block_size, dtype=torch.bool, device=DEVICE)
    for sl in slots:
        if sl >= 0:
            written[sl // block_size, sl % block_size] = True
    assert int(written.sum()) == 8
    assert torch.equal(kc[~written], kc_ref[~written]) and bool((kc[~written] == sentinel).all()), \
        "k_cache: a slot that no token maps to was written"
    assert torch.equal(vc, vc_ref), "v_cache: v is copied unchanged to exactly its slots"
    if dtype == torch.float32:
        assert_close(kc, kc_ref, **FP32, name="k_cache")
        assert_close(qo, qr, **FP32, name="q")
        assert_close(ko, kr, **FP32, name="k")
    else:   # the written k is the returned rotated k, bit for bit; accuracy as in the rope test
        keep = slot_t >= 0
        assert torch.equal(kc[slot_t[keep] // block_size, slot_t[keep] % block_size], ko[keep])
        ref = rope_ref(*up32(q, k, c, s), pos_t)
        assert_lowp_close(qo, qr, ref[0], name="q")
        assert_lowp_close(ko, kr, ref[1], name="k")


def test_rope_kv_write_into_the_contiguous_cache_layout():
    """The reference engine's cache [B, nkv, max_len, D] permuted to [B, max_len, nkv, D]: a paged
    cache with one block of max_len slots per sequence and non-standard strides."""
    B, nkv, nh, D, L = 2, 3, 3, 8, 5
    cos, sin = rope_tables(D, P=16)
    k_store, v_store = (torch.zeros(B, nkv, L, D, device=DEVICE) for _ in "kv")
    kc, vc = k_store.permute(0, 2, 1, 3), v_store.permute(0, 2, 1, 3)
    q, k, v = qkv(B, nh, nkv, D, seed=41)
    pos = torch.tensor([4, 2], device=DEVICE)
    slots = torch.tensor([0 * L + 4, 1 * L + 2], device=DEVICE)
    _, ko = rope_kv_write(q, k, v, cos, sin, pos, kc, vc, slots)
    assert torch.equal(k_store[0, :, 4], ko[0]) and torch.equal(k_store[1, :, 2], ko[1])
    assert torch.equal(v_store[0, :, 4], v[0]) and torch.equal(v_store[1, :, 2], v[1])
    assert int((k_store != 0).any(-1).sum()) == B * nkv, "only the two tokens' slots are written"


def test_rope_strided_positions_and_slot_mapping_match_contiguous():
    """Index tensors as non-contiguous views (every other element of a wider tensor) give the
    same result as contiguous ones."""
    def strided(t):
        return torch.stack([t, torch.full_like(t, 1)], 1)[:, 0]

    cos, sin = rope_tables(8, P=16)
    q, k, v = qkv(4, 2, 1, 8, seed=51)
    pos = torch.tensor([3, 1, 4, 1], device=DEVICE)
    pos_s = strided(pos)
    assert not pos_s.is_contiguous() and torch.equal(pos_s, pos)
    for a, b in zip(rope(q, k, cos, sin, pos_s), rope(q, k, cos, sin, pos)):
        assert torch.equal(a, b)
    slots = torch.tensor([5, 0, -1, 9], device=DEVICE)
    kc, vc = (torch.zeros(4, 3, 1, 8, device=DEVICE) for _ in "kv")
    kc2, vc2 = kc.clone(), vc.clone()
    out = rope_kv_write(q, k, v, cos, sin, pos_s, kc, vc, strided(slots))
    want = rope_kv_write(q, k, v, cos, sin, pos, kc2, vc2, slots)
    assert all(torch.equal(a, b) for a, b in zip(out, want))
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)


def test_rope_errors_name_the_argument():
    cos, sin = rope_tables(6)
    q, k, v = qkv(3, 2, 1, 6)
    pos = torch.arange(3, device=DEVICE)
    with pytest.raises(ValueError, match="head_dim must be even"):
        rope(randn(3, 2, 5), randn(3, 1, 5), *rope_tables(6), pos)
    with pytest.raises(ValueError, match="positions must be an integer"):
        rope(q, k, cos, sin, pos.float())
    with pytest.raises(TypeError, match="q dtype"):
        rope(q, k.double(), cos, sin, pos)
    with pytest.raises(ValueError, match=r"cos must be \[positions, 6\]"):
        rope(q, k, cos[:, :4], sin, pos)
    kc = torch.zeros(4, 3, 1, 6, device=DEVICE)
    with pytest.raises(ValueError, match="slot_mapping must be int64"):
        rope_kv_write(q, k, v, cos, sin, pos, kc, kc.clone(), pos.int())
    with pytest.raises(ValueError, match=r"k_cache must be \[num_blocks, block_size, 1, 6\]"):
        rope_kv_write(q, k, v, cos, sin, pos, torch.zeros(4, 3, 2, 6, device=DEVICE), kc, pos)


# ---- SwiGLU -------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (2, 3, 13), (5, 96), (1, 4231)])
def test_swiglu_fp32_two_inputs_and_merged(shape):
    g, u = randn(*shape, seed=51) * 3, randn(*shape, seed=52)
    # one rounding (kernel) vs silu rounded then the product rounded (reference): a few ulp
    assert_close(swiglu(g, u), swiglu_ref(g, u), atol=1e-6, rtol=1e-5, name="swiglu")
    merged = torch.cat([g, u], dim=-1)                         # [.., 2I] = [gate | up]
    out = swiglu(merged)
    assert out.shape == shape
    assert_close(out, swiglu_ref(g, u), atol=1e-6, rtol=1e-5, name="swiglu merged")


@pytest.mark.parametrize("dtype", LOWP)
def test_swiglu_low_precision_within_2x_torch(dtype):
    g, u = randn(6, 257, dtype=dtype, seed=53) * 3, randn(6, 257, dtype=dtype, seed=54)
    ours, theirs = swiglu(g, u), swiglu_ref(g, u)
    assert ours.dtype == dtype
    assert_lowp_close(ours, theirs, swiglu_ref(*up32(g, u)), name="swiglu")


def test_swiglu_errors_name_the_argument():
    with pytest.raises(ValueError, match=r"gate \(2, 3\) and up \(2, 4\)"):
        swiglu(randn(2, 3), randn(2, 4))
    with pytest.raises(ValueError, match=r"\[\.\.\., 2I\]"):
        swiglu(randn(2, 5))
    with pytest.raises(TypeError, match="gate dtype"):
        swiglu(randn(2, 3), randn(2, 3).double())
    with pytest.raises(ValueError, match="last dimension must be contiguous"):
        swiglu(randn(3, 2).t(), randn(3, 2).t())


# ---- the reporting helpers the tests rely on ----------------------------------------------------
def test_assert_close_reports_count_and_position():
    want = torch.zeros(4, 5)
    got = want.clone()
    got[3, 4] = 1.0
    with pytest.raises(AssertionError, match=r"1 of 20 elements .* at \[3, 4\]"):
        assert_close(got, want, atol=1e-5, rtol=0)


def test_assert_lowp_close_rejects_an_error_beyond_2x_torch():
    ref = torch.linspace(-2, 2, 101)
    torch_lowp = ref.to(torch.bfloat16)
    with pytest.raises(AssertionError, match="relative error"):
        assert_lowp_close((ref * 1.05).to(torch.bfloat16), torch_lowp, ref)


def test_each_wrapper_call_counts_one_launch():
    before = dict(workbench_kernels.LAUNCHES)
    x, w = randn(2, 8), randn(8)
    rmsnorm(x, w, 1e-5)
    add_rmsnorm(x, x, w, 1e-5)
    swiglu(x, x)
    delta = {k: v - before.get(k, 0) for k, v in workbench_kernels.LAUNCHES.items()}
    assert {k: v for k, v in delta.items() if v} == {"rmsnorm": 1, "add_rmsnorm": 1, "swiglu": 1}
