"""Notebook 01's exercises (``workbench.exercises.ex01``): the solutions and the references pass,
planted mistakes are rejected with the case and the rule named, and the hook that plugs a
learner's kernel into the model (``workbench.transforms.backends.replace_entry_points``).

Runs on the CPU under the Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1 before
triton is imported): each planted kernel fails on an early case, so the file takes seconds.
"""

from __future__ import annotations

import copy
import dataclasses
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"        # before any kernel below is decorated
triton = pytest.importorskip("triton", reason="triton is not installed (the kernels need it, also on CPU)")
import triton.language as tl  # noqa: E402

from workbench.errors import ConfigError, WorkbenchError  # noqa: E402
from workbench.exercises import check_fn, get, load_solution  # noqa: E402
from workbench.model.config import ModelConfig  # noqa: E402
from workbench.model.decoder import CausalLM, init_weights  # noqa: E402
from workbench.transforms.backends import (OPS, apply_backends, current_backends, remove_backends,  # noqa: E402
                                           replace_entry_points)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def rejected(eid: str, fn, case: str, *rule: str, examples: int | None = None):
    r = check_fn(get(eid), fn, examples=examples)
    assert r.status == "failed", r
    assert case in r.case, r
    for part in rule:
        assert part in r.rule, r
    return r


@pytest.mark.parametrize("eid", ["01.rmsnorm", "01.swiglu"])
def test_solution_and_reference_pass(eid):
    ex = get(eid)
    for fn in (load_solution(eid), ex.reference):
        r = check_fn(ex, fn)
        assert r.passed, r
        assert r.cases_run == len(ex.cases()) and r.examples_run == ex.examples


def test_stubs_are_not_written_yet():
    for eid in ("01.rmsnorm", "01.swiglu"):
        ns: dict = {}
        exec(compile(get(eid).stub, f"<stub {eid}>", "exec"), ns)
        assert check_fn(get(eid), ns[get(eid).function]).status == "not written"


# ---- planted RMSNorm mistakes ----------------------------------------------------------------------
# One kernel, its mistakes chosen by constexpr flags; each launcher below plants one of them.
@triton.jit
def _norm_kernel(X, W, Y, stride_x, stride_y, N, eps, BLOCK_N: tl.constexpr, DIVIDE_BY_BLOCK: tl.constexpr,
                 SQUARE_IN_X_DTYPE: tl.constexpr, USE_EPS: tl.constexpr, USE_WEIGHT: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
    if SQUARE_IN_X_DTYPE:
        sq = (x * x).to(tl.float32)                # float16 x² overflows past 255.9
    else:
        sq = x.to(tl.float32) * x.to(tl.float32)
    if DIVIDE_BY_BLOCK:
        ms = tl.sum(sq, axis=0) / BLOCK_N
    else:
        ms = tl.sum(sq, axis=0) / N
    if USE_EPS:
        rstd = tl.rsqrt(ms + eps)
    else:
        rstd = tl.rsqrt(ms)
    y = (x.to(tl.float32) * rstd).to(X.dtype.element_ty).to(tl.float32)
    if USE_WEIGHT:
        y = y * tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), mask=mask)


def _norm(x, weight, eps, *, programs=None, out_dtype=None, rows_from_dim0=False, **flags):
    N = x.shape[-1]
    x2 = x.reshape(-1, N)
    M = x.shape[0] if rows_from_dim0 else x2.shape[0]
    y = torch.empty(x2.shape, dtype=out_dtype or x.dtype, device=x.device)
    opts = {**dict(DIVIDE_BY_BLOCK=False, SQUARE_IN_X_DTYPE=False, USE_EPS=True, USE_WEIGHT=True), **flags}
    _norm_kernel[(programs or M,)](x2, weight, y, x2.stride(0), y.stride(0), N, eps,
                                   BLOCK_N=triton.next_power_of_2(N), **opts)
    return y.view(x.shape)


def test_the_planted_kernel_without_mistakes_passes():
    def rmsnorm(x, weight, eps):
        return _norm(x, weight, eps)
    assert check_fn(get("01.rmsnorm"), rmsnorm).passed


def test_rmsnorm_mean_over_the_padded_block_is_rejected():
    def rmsnorm(x, weight, eps):
        return _norm(x, weight, eps, DIVIDE_BY_BLOCK=True)
    rejected("01.rmsnorm", rmsnorm, "576", "the mean divides by N = 576", "not by BLOCK_N = 1024")


def test_rmsnorm_squares_in_float16_are_rejected():
    def rmsnorm(x, weight, eps):
        return _norm(x, weight, eps, SQUARE_IN_X_DTYPE=True)
    r = rejected("01.rmsnorm", rmsnorm, "x² overflows float16", "overflowed float16",
                 "float16's largest value is 65504", "x.to(tl.float32)")
    assert "of 128 elements differ" in r.rule


def test_rmsnorm_output_in_float32_is_rejected():
    def rmsnorm(x, weight, eps):
        return _norm(x, weight, eps, out_dtype=torch.float32)
    rejected("01.rmsnorm", rmsnorm, "float16 in, float16 out", "expected dtype torch.float16, got torch.float32",
             "y has x's dtype (float16)")


def test_rmsnorm_one_program_for_all_rows_is_rejected():
    def rmsnorm(x, weight, eps):
        return _norm(x, weight, eps, programs=1)
    rejected("01.rmsnorm", rmsnorm, "3 rows of 576", "rows 1..2 of 3 are wrong, row 0 right",
             "grid = (M,) with M = 3")


def test_rmsnorm_rows_of_a_3d_input_taken_from_its_first_dimension_are_rejected():
    def rmsnorm(x, weight, eps):
        return _norm(x, weight, eps, rows_from_dim0=True)
    rejected("01.rmsnorm", rmsnorm, "3-D input", "rows 2..5 of 6 are wrong", "x (2, 3, 64) is 6 rows of 64",
             "x.reshape(-1, 64)")


def test_rmsnorm_without_eps_is_rejected_on_the_row_of_zeros():
    def rmsnorm(x, weight, eps):
        return _norm(x, weight, eps, USE_EPS=False)
    rejected("01.rmsnorm", rmsnorm, "a row of zeros", "eps goes under the square root", "0 * inf = nan")


def test_rmsnorm_with_eps_fixed_at_1e_5_is_rejected():
    def rmsnorm(x, weight, eps):
        return _norm(x, weight, 1e-5)
    rejected("01.rmsnorm", rmsnorm, "eps = 0.1", "eps = 0.1 here: use the eps argument")


def test_rmsnorm_without_the_weight_is_rejected():
    def rmsnorm(x, weight, eps):
        return _norm(x, weight, eps, USE_WEIGHT=False)
    rejected("01.rmsnorm", rmsnorm, "one row of 8", "multiplied by the weight")


def test_rmsnorm_that_returns_nothing_is_rejected():
    def rmsnorm(x, weight, eps):
        _norm(x, weight, eps)
    rejected("01.rmsnorm", rmsnorm, "one row of 8", "expected a torch.Tensor, got NoneType", "rmsnorm returns y")


def test_rmsnorm_learner_exception_names_the_learner_line():
    def rmsnorm(x, weight, eps):
        return _norm(x, weight)                      # the missing eps is the mistake
    r = rejected("01.rmsnorm", rmsnorm, "one row of 8", "your function raised TypeError")
    assert "return _norm(x, weight)" in r.rule


def test_hypothesis_shrinks_the_padded_block_mean_to_the_smallest_width():
    # without the edge cases the property-based inputs find it, shrunk to one row of 3 (the smallest
    # width that is not a power of two)
    ex = dataclasses.replace(get("01.rmsnorm"), cases=lambda: get("01.rmsnorm").cases()[:1])

    def rmsnorm(x, weight, eps):
        return _norm(x, weight, eps, DIVIDE_BY_BLOCK=True)
    r = check_fn(ex, rmsnorm)
    assert r.status == "failed" and "property-based" in r.case, r
    assert "x=tensor(shape=(1, 3)" in r.call and "the mean divides by N = 3" in r.rule, r


# ---- planted SwiGLU mistakes -----------------------------------------------------------------------
@triton.jit
def _glu_kernel(G, U, Y, stride_g, stride_u, stride_y, I, BLOCK: tl.constexpr, MISTAKE: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    g = tl.load(G + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    if MISTAKE == 1:                               # silu of the wrong input
        y = u * tl.sigmoid(u) * g
    elif MISTAKE == 2:                             # exp(g) / (1 + exp(g)): inf / inf past g = 88
        y = g * (tl.exp(g) / (1 + tl.exp(g))) * u
    elif MISTAKE == 3:                             # sigmoid, not silu
        y = tl.sigmoid(g) * u
    else:
        y = g * tl.sigmoid(g) * u
    tl.store(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), mask=mask)


def _glu(gate, up, *, mistake=0, block=64, column_blocks=True, out_dtype=None):
    I = gate.shape[-1]
    g2, u2 = gate.reshape(-1, I), up.reshape(-1, I)
    y = torch.empty(g2.shape, dtype=out_dtype or gate.dtype, device=gate.device)
    grid = (g2.shape[0], triton.cdiv(I, block) if column_blocks else 1)
    _glu_kernel[grid](g2, u2, y, g2.stride(0), u2.stride(0), y.stride(0), I, BLOCK=block, MISTAKE=mistake)
    return y.view(gate.shape)


def test_the_planted_swiglu_without_mistakes_passes():
    def swiglu(gate, up):
        return _glu(gate, up)
    assert check_fn(get("01.swiglu"), swiglu).passed


def test_swiglu_with_gate_and_up_swapped_is_rejected():
    def swiglu(gate, up):
        return _glu(gate, up, mistake=1)
    rejected("01.swiglu", swiglu, "one element", "silu applies to the gate", "not silu(up) * gate")


def test_swiglu_that_overflows_exp_is_rejected():
    def swiglu(gate, up):
        return _glu(gate, up, mistake=2)
    rejected("01.swiglu", swiglu, "gates of ±100", "exp overflowed for a large gate", "tl.sigmoid")


def test_swiglu_sigmoid_instead_of_silu_is_rejected():
    def swiglu(gate, up):
        return _glu(gate, up, mistake=3)
    rejected("01.swiglu", swiglu, "one element", "the gate multiplies its own sigmoid")


def test_swiglu_one_block_per_row_is_rejected_naming_the_columns():
    def swiglu(gate, up):
        return _glu(gate, up, block=128, column_blocks=False)
    rejected("01.swiglu", swiglu, "23 rows of 177", "columns 128..176 of every row are wrong, columns 0..127 right",
             "cover all 177 columns")


def test_swiglu_output_in_float32_is_rejected():
    def swiglu(gate, up):
        return _glu(gate, up, out_dtype=torch.float32)
    rejected("01.swiglu", swiglu, "float16 in, float16 out", "expected dtype torch.float16", "y has the inputs' dtype")


def test_swiglu_flat_output_is_rejected_naming_the_shape():
    def swiglu(gate, up):
        return _glu(gate, up).reshape(-1, gate.shape[-1])
    rejected("01.swiglu", swiglu, "3-D input", "expected shape (2, 3, 48), got (6, 48)", "y has gate's shape")


# ---- the hook: a learner's function in place of an entry point ---------------------------------------
@pytest.fixture(scope="module")
def tiny():
    cfg = ModelConfig(vocab_size=61, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64)
    return init_weights(CausalLM(cfg), seed=5).eval().to(DEVICE)


def logits(model, ids=(3, 17, 42, 5)):
    with torch.inference_mode():
        return model(torch.tensor([list(ids)], device=DEVICE), 0, model.new_cache(1, 8))


def test_replaced_entry_points_run_in_every_module_and_the_next_apply_undoes_them(tiny):
    model = copy.deepcopy(tiny)
    ref = logits(model)
    sol_norm, sol_glu = load_solution("01.rmsnorm"), load_solution("01.swiglu")
    calls = {"rmsnorm": 0, "swiglu": 0}

    def rmsnorm(x, weight, eps):
        calls["rmsnorm"] += 1
        return sol_norm(x, weight, eps)

    def add_rmsnorm(x, residual, weight, eps):
        h = residual + x
        return rmsnorm(h, weight, eps), h

    def swiglu(gate, up):
        calls["swiglu"] += 1
        return sol_glu(gate, up)

    apply_backends(model, {"rmsnorm": "eager"})
    assert replace_entry_points(model, rmsnorm=rmsnorm, add_rmsnorm=add_rmsnorm, swiglu=swiglu) is model
    assert model.ops.replaced == {"rmsnorm": "rmsnorm", "add_rmsnorm": "add_rmsnorm", "swiglu": "swiglu"}
    assert all(m.ops is model.ops for m in model.modules() if hasattr(m, "ops") and m is not model)
    assert current_backends(model) == {op: "eager" for op in OPS}
    torch.testing.assert_close(logits(model), ref, atol=1e-4, rtol=1e-4)
    assert calls == {"rmsnorm": 2 * 2 + 1, "swiglu": 2}      # 2 layers x 2 norms + the final norm; one MLP each
    apply_backends(model, {"swiglu": "eager"})
    assert model.ops.replaced == {} and logits(model) is not None and calls["swiglu"] == 2
    remove_backends(model)
    assert model.model.norm.ops is None


@pytest.mark.parametrize("bad, rule", [
    (lambda x, weight, eps: None, "rmsnorm, replaced by <lambda>: y must be a torch.Tensor, got NoneType"),
    (lambda x, weight, eps: x.reshape(-1, x.shape[-1]), "y must have shape (1, 4, 64), got (4, 64)"),
    (lambda x, weight, eps: x.double(), "y must have dtype float32, got float64"),
])
def test_a_wrong_result_is_one_workbench_error_naming_the_rule(tiny, bad, rule):
    model = apply_backends(copy.deepcopy(tiny), {"rmsnorm": "eager"})
    replace_entry_points(model, rmsnorm=bad)
    with pytest.raises(WorkbenchError) as e:
        logits(model)
    assert rule in str(e.value) and "\n" not in str(e.value)
    assert "the entry point returns y: x's shape" in str(e.value)


def test_a_wrong_pair_from_add_rmsnorm_is_named():
    x, r, w = torch.ones(2, 8), torch.ones(2, 8), torch.ones(8)
    model = apply_backends(CausalLM(ModelConfig(vocab_size=11, hidden_size=8, intermediate_size=16,
                                                num_hidden_layers=1, num_attention_heads=2,
                                                num_key_value_heads=1, head_dim=4)), {"rmsnorm": "eager"})
    replace_entry_points(model, add_rmsnorm=lambda x, residual, weight, eps: x)
    with pytest.raises(WorkbenchError, match=r"add_rmsnorm, replaced by <lambda>: the result must be a pair \(y, h\)"):
        model.ops.add_rmsnorm(x, r, w, 1e-5)
    replace_entry_points(model, add_rmsnorm=lambda x, residual, weight, eps: (x, (x + residual).half()))
    with pytest.raises(WorkbenchError, match="h must have dtype float32, got float16"):
        model.ops.add_rmsnorm(x, r, w, 1e-5)


def test_bad_replacements_raise_config_error_and_change_nothing(tiny):
    model = copy.deepcopy(tiny)
    with pytest.raises(ConfigError, match=r"apply_backends\(model, \.\.\.\) first"):
        replace_entry_points(model, rmsnorm=lambda x, weight, eps: x)
    apply_backends(model, {"rmsnorm": "eager"})
    before = model.ops
    with pytest.raises(ConfigError, match="'rope' cannot be replaced; "
                                          "entry points that can: rmsnorm, add_rmsnorm, swiglu"):
        replace_entry_points(model, rope=lambda *a: a)
    with pytest.raises(ConfigError, match="rmsnorm must be a function, got int"):
        replace_entry_points(model, rmsnorm=3)
    with pytest.raises(ConfigError, match="expected a workbench CausalLM"):
        replace_entry_points(torch.nn.Linear(2, 2), rmsnorm=lambda x, weight, eps: x)
    assert model.ops is before


def test_unwritten_columns_fail_even_right_after_a_right_answer_to_the_same_case():
    # the memory of a right answer is overwritten before it can be reused: without that, torch.empty in
    # the wrong launcher below received the right answer's memory and the check passed
    ex = get("01.swiglu")

    def right(gate, up):
        return _glu(gate, up)

    def wrong(gate, up):
        return _glu(gate, up, block=128, column_blocks=False)
    for _ in range(2):
        assert check_fn(ex, right, examples=0).passed
        assert check_fn(ex, ex.reference, examples=0).passed
        assert "columns 128..176" in check_fn(ex, wrong, examples=0).rule


def test_the_reference_that_drives_a_notebook_returns_results_nothing_overwrites():
    # when a check fails the reference drives what follows: its results must stay intact however many
    # checks run afterwards (only what the checker itself computed is overwritten)
    ex = get("01.rmsnorm")
    kw = ex.cases()[1].kwargs
    y = ex.reference(**kw)
    want = y.clone()
    for _ in range(3):
        assert check_fn(ex, ex.reference, examples=0).passed
    assert torch.equal(y, want)
