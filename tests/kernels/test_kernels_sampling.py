"""The sampling kernel (greedy argmax; temperature / top-k / top-p by Gumbel-max) against torch,
at small awkward shapes under the Triton interpreter on a CPU.

* Greedy is compared with ``torch.argmax`` exactly: V prime, V = 1, B = 1, vocabularies of one
  block and of several (the kernel loops over blocks of 1024 columns: 1,031 and 4,099 cover a
  second block with 7 columns and a fifth with 3), bf16 / fp16 logits (many exact ties), a
  row-strided slice.  Tie rule: the lowest index, as ``torch.argmax``.
* Sampling is compared with ``sample_tokens_ref`` token for token: the same generator gives both
  the same Gumbel noise, and the reference masks top-k / top-p its own way (row by row, as
  ``workbench.engine.sampling.sample`` does), so the kernel's host-side thresholds are checked too.
* The distribution: many draws in one batched call against ``softmax(logits / T)`` restricted to
  the top-k (or the nucleus); the bound is stated where it is used.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"        # before the kernel module creates its jit function
pytest.importorskip("triton", reason="triton is not installed (the kernels need it, also on CPU)")

__import__("workbench")  # registers the workbench_kernels import name
import workbench_kernels  # noqa: E402
from workbench_kernels.sampling import (_sampling_fwd_kernel, greedy_tokens, greedy_tokens_ref,  # noqa: E402
                                        gumbel_noise, sample_tokens, sample_tokens_ref)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and "Interpreted" not in type(_sampling_fwd_kernel).__name__:
    pytest.fail("the sampling kernel was created for a GPU before TRITON_INTERPRET=1 was set: "
                "tests/conftest.py sets it on a machine without CUDA before anything imports triton", pytrace=False)

NEG_INF = float("-inf")


def randn(*shape, dtype=torch.float32, seed=0, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=g)).to(dtype).to(DEVICE)


def gen(seed):
    return torch.Generator(device=DEVICE).manual_seed(seed)


# ---- greedy -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("B,V", [(1, 1), (3, 1), (1, 7), (5, 13), (4, 1031), (2, 4099), (1, 1024)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_equals_argmax(B, V, dtype):
    x = randn(B, V, dtype=dtype, seed=B * 7919 + V)
    got = greedy_tokens(x)
    assert got.dtype == torch.int64 and got.shape == (B,)
    assert torch.equal(got, torch.argmax(x, -1)), (got, torch.argmax(x, -1))
    assert torch.equal(got, greedy_tokens_ref(x))


def test_greedy_on_a_row_strided_slice():
    wide = randn(3, 2100, seed=5)
    x = wide[:, 17:1048]                  # row stride 2100, V = 1031
    assert torch.equal(greedy_tokens(x), x.argmax(-1))


def test_greedy_ties_take_the_lowest_index():
    V = 2100                               # three blocks: 1024 + 1024 + 52
    x = torch.zeros(6, V, device=DEVICE)
    x[0, [5, 1500]] = 4.0                  # tie across blocks, different lanes
    x[1, [3, 3 + 1024, 3 + 2048]] = 4.0    # tie in the same lane of three blocks
    x[2, [1500, 1501]] = 4.0               # tie inside one block
    x[3] = NEG_INF                         # all -inf: torch.argmax says 0
    x[4, :] = 1.0                          # all equal: 0
    x[5, [2099, 1024]] = 4.0               # the last column ties with the second block's first
    expected = torch.tensor([5, 3, 1500, 0, 0, 1024], device=DEVICE)
    assert torch.equal(torch.argmax(x.cpu(), -1), expected.cpu())     # torch's CPU rule, the one we define
    assert torch.equal(greedy_tokens(x), expected)
    assert torch.equal(greedy_tokens(x.to(torch.bfloat16)), expected)


def test_nan_is_never_chosen():
    """Documented rule: a NaN logit is skipped (torch.argmax would return it)."""
    x = torch.tensor([[float("nan"), 1.0, 2.0, float("nan")]], device=DEVICE)
    assert greedy_tokens(x).tolist() == [2]


def test_greedy_is_one_launch():
    before = workbench_kernels.LAUNCHES.get("greedy_tokens", 0)
    greedy_tokens(randn(3, 1031))
    assert workbench_kernels.LAUNCHES["greedy_tokens"] == before + 1


# ---- sampling against the reference ------------------------------------------------------------

PARAMS = [
    dict(temperature=1.0),
    dict(temperature=0.7, top_k=50),
    dict(temperature=1.3, top_p=0.9),
    dict(temperature=0.8, top_k=20, top_p=0.6),
    dict(temperature=2.0, top_k=-1, top_p=0.3),
]


@pytest.mark.parametrize("B,V", [(4, 1031), (3, 4099), (6, 13)])
@pytest.mark.parametrize("params", PARAMS, ids=lambda p: ",".join(f"{k}={v}" for k, v in p.items()))
def test_sample_equals_reference(B, V, params):
    x = randn(B, V, seed=V + B)
    got = sample_tokens(x, **params, generator=gen(11))
    ref = sample_tokens_ref(x, **params, generator=gen(11))
    assert torch.equal(got, ref), (got, ref)


def test_sample_bf16_top_k_equals_reference():
    """bf16 logits have many exact ties: top-k keeps every token tied with the k-th (both sides)."""
    x = randn(5, 1031, dtype=torch.bfloat16, seed=3)
    for k in (1, 7, 100):
        got = sample_tokens(x, temperature=0.9, top_k=k, generator=gen(k))
        assert torch.equal(got, sample_tokens_ref(x, temperature=0.9, top_k=k, generator=gen(k)))


def test_per_row_parameters_mix_greedy_and_sampling():
    B, V = 6, 1031
    x = randn(B, V, seed=21)
    params = dict(temperature=[0.0, 1.0, 0.5, 2.0, 0.0, 1.1], top_k=[0, 3, 10, 1, 5, -1],
                  top_p=torch.tensor([1.0, 0.5, 0.9, 1.0, 0.2, 0.95]))
    got = sample_tokens(x, **params, generator=gen(2))
    assert torch.equal(got, sample_tokens_ref(x, **params, generator=gen(2)))
    assert got[0] == x[0].argmax() and got[4] == x[4].argmax() and got[3] == x[3].argmax()


def test_explicit_noise_equals_generator_noise():
    x = randn(3, 1031, seed=8)
    g = gumbel_noise(3, 1031, gen(4), DEVICE)
    a = sample_tokens(x, temperature=0.9, top_k=40, gumbel=g)
    assert torch.equal(a, sample_tokens(x, temperature=0.9, top_k=40, generator=gen(4)))
    assert torch.equal(a, sample_tokens_ref(x, temperature=0.9, top_k=40, gumbel=g))


def test_seeded_draws_are_reproducible_and_seeds_differ():
    x = randn(16, 1031, scale=0.5, seed=9)       # flat logits: draws spread over many tokens
    a, b = sample_tokens(x, generator=gen(1)), sample_tokens(x, generator=gen(1))
    assert torch.equal(a, b)
    assert not torch.equal(a, sample_tokens(x, generator=gen(2)))


@pytest.mark.parametrize("V", [13, 1031, 4099])
def test_top_k_1_and_tiny_top_p_equal_greedy(V):
    x = randn(4, V, seed=V)
    greedy = x.argmax(-1)
    assert torch.equal(sample_tokens(x, temperature=1.5, top_k=1, generator=gen(0)), greedy)
    assert torch.equal(sample_tokens(x, temperature=1.5, top_p=1e-6, generator=gen(0)), greedy)
    assert torch.equal(sample_tokens(x, temperature=0.0, generator=gen(0)), greedy)


def test_one_token_vocabulary_and_empty_batch():
    assert sample_tokens(randn(3, 1), temperature=0.7, top_p=0.5, generator=gen(0)).tolist() == [0, 0, 0]
    assert sample_tokens(randn(0, 17)).shape == (0,)
    assert greedy_tokens(randn(0, 17)).shape == (0,)


def test_ties_at_the_top_k_threshold_are_kept():
    x = torch.tensor([[3.0, 1.0, 3.0, 3.0, 0.0]], device=DEVICE).expand(3000, 5)
    got = sample_tokens(x, top_k=2, generator=gen(5))
    assert set(got.tolist()) == {0, 2, 3}


# ---- the distribution ---------------------------------------------------------------------------

def test_empirical_distribution_matches_softmax():
    """N = 20,000 draws per setting, all in one call (B = 2N rows of the same V = 10 logits).

    Per token the empirical frequency f_i of a draw with probability p_i has standard deviation
    sigma_i = sqrt(p_i (1 - p_i) / N) (<= 0.0035 here); we require |f_i - p_i| <= 5 sigma_i + 1e-4
    for every token.  For a correct sampler the chance that any of the 20 tokens fails is below
    20 x P(|Z| > 5) = 1.1e-5 (normal approximation, Bonferroni); the seed is fixed, so the test is
    deterministic anyway.  A wrong temperature (T = 1 instead of 0.7) or a token dropped from the
    top-k moves some p_i by 0.03 or more, beyond 5 sigma_max = 0.018.  Tokens outside the allowed
    set must never be drawn.
    """
    N, V = 20_000, 10
    logits = randn(1, V, seed=42, scale=1.5)[0]
    x = logits.expand(2 * N, V)                      # row stride 0: the same logits for every draw
    temps = [0.7] * N + [1.3] * N
    ks = [6] * N + [0] * N
    ps = [1.0] * N + [0.8] * N
    tokens = sample_tokens(x, temperature=temps, top_k=ks, top_p=ps, generator=gen(123)).cpu()

    def expected_topk(T, k):
        s = logits.double().cpu() / T
        s = s.masked_fill(s < torch.topk(s, k).values[-1], NEG_INF)
        return torch.softmax(s, -1)

    def expected_topp(T, p):
        probs = torch.softmax(logits.double().cpu() / T, -1)
        sp, order = probs.sort(descending=True)
        sp = sp.masked_fill((sp.cumsum(-1) - sp) >= p, 0.0)
        sp = torch.zeros_like(probs).scatter_(-1, order, sp)
        return sp / sp.sum()

    for name, part, p in [("top-k 6, T 0.7", tokens[:N], expected_topk(0.7, 6)),
                          ("top-p 0.8, T 1.3", tokens[N:], expected_topp(1.3, 0.8))]:
        f = torch.bincount(part, minlength=V).double() / N
        assert torch.all(f[p == 0] == 0), f"{name}: drew excluded tokens: {f}"
        sigma = (p * (1 - p) / N).sqrt()
        bad = (f - p).abs() > 5 * sigma + 1e-4
        assert not bad.any(), f"{name}: frequencies {f.tolist()} vs probabilities {p.tolist()}"
        assert 2 <= int((p > 0).sum()) < V, name          # the restriction really restricts here


# ---- bad inputs ---------------------------------------------------------------------------------

@pytest.mark.parametrize("call,exc,name", [
    (lambda: greedy_tokens(torch.zeros(2, 5, dtype=torch.int64)), TypeError, "logits"),
    (lambda: greedy_tokens(torch.zeros(5)), ValueError, "logits"),
    (lambda: greedy_tokens(torch.zeros(2, 0)), ValueError, "logits"),
    (lambda: greedy_tokens(torch.zeros(5, 3).t()), ValueError, "logits"),
    (lambda: sample_tokens(torch.zeros(2, 5), temperature=-1.0), ValueError, "temperature"),
    (lambda: sample_tokens(torch.zeros(2, 5), temperature=float("inf")), ValueError, "temperature"),
    (lambda: sample_tokens(torch.zeros(2, 5), temperature=[1.0, 1.0, 1.0]), ValueError, "temperature"),
    (lambda: sample_tokens(torch.zeros(2, 5), temperature="hot"), TypeError, "temperature"),
    (lambda: sample_tokens(torch.zeros(2, 5), top_k=1.5), ValueError, "top_k"),
    (lambda: sample_tokens(torch.zeros(2, 5), top_k=-2), ValueError, "top_k"),
    (lambda: sample_tokens(torch.zeros(2, 5), top_p=0.0), ValueError, "top_p"),
    (lambda: sample_tokens(torch.zeros(2, 5), top_p=torch.tensor([0.5, 1.5])), ValueError, "top_p"),
    (lambda: sample_tokens(torch.zeros(2, 5), top_p=torch.ones(3)), ValueError, "top_p"),
    (lambda: sample_tokens(torch.zeros(2, 5), generator=7), TypeError, "generator"),
    (lambda: sample_tokens(torch.zeros(2, 5), gumbel=torch.zeros(2, 4)), ValueError, "gumbel"),
    (lambda: sample_tokens(torch.zeros(2, 5), gumbel=torch.zeros(2, 5, dtype=torch.float64)), TypeError, "gumbel"),
])
def test_bad_inputs_name_the_argument(call, exc, name):
    with pytest.raises(exc, match=name):
        call()


def test_reference_rejects_what_the_kernel_rejects():
    with pytest.raises(ValueError, match="top_p"):
        sample_tokens_ref(torch.zeros(2, 5), top_p=2.0)
    assert math.isfinite(float(gumbel_noise(4, 8, gen(0)).max()))
