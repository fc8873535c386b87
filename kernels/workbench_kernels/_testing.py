"""Comparison helpers shared by the kernel tests, the benchmark and the notebook.

:func:`assert_close` is ``torch.testing.assert_close`` that says *how many* elements mismatch
and *where* (the first few indices with both values), which is what you need to tell a
boundary bug (the last partial block is wrong) from a precision problem (everything is a
little off).

Low precision is judged against the arithmetic it replaces, not against a fixed tolerance
(Liger-Kernel's rule): compute a float32 reference on upcast inputs, measure torch's own error
in that dtype, and require ``our error <= 2 x torch's error`` (:func:`assert_lowp_close`).
"""

from __future__ import annotations

import math

import torch

# (atol, rtol) for ops whose arithmetic is the same as the reference's up to summation order,
# FMA contraction and libm differences: a few ulp (fp32 eps 1.2e-7).  Low-precision dtypes are
# checked with assert_lowp_close instead; these are the fallbacks for small-integer tensors.
TOLERANCES = {torch.float32: (1e-5, 1e-5), torch.float16: (1e-3, 1e-3), torch.bfloat16: (1e-2, 1e-2)}


def max_abs_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.double() - expected.double()).abs().max()) if actual.numel() else 0.0


def rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected|| in float64 (0 when both are zero)."""
    a, e = actual.double(), expected.double()
    den = float(e.norm())
    num = float((a - e).norm())
    return num / den if den else num


def _where(bad: torch.Tensor, a: torch.Tensor, e: torch.Tensor, limit: int) -> str:
    lines = []
    for idx in bad.nonzero()[:limit].tolist():
        t = tuple(idx)
        lines.append(f"    at {list(t)}: got {a[t].item():.6g}, expected {e[t].item():.6g} "
                     f"(|diff| {abs(a[t].item() - e[t].item()):.3g})")
    return "\n".join(lines)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, atol: float, rtol: float,
                 name: str = "output", max_report: int = 5) -> None:
    """``|actual - expected| <= atol + rtol * |expected|`` elementwise (NaN only where expected
    has NaN); on failure, the count, the fraction and the first ``max_report`` positions."""
    if actual.shape != expected.shape:
        raise AssertionError(f"{name}: shape {tuple(actual.shape)} != expected {tuple(expected.shape)}")
    a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
    nan_a, nan_e = a.isnan(), e.isnan()
    diff = (a - e).abs()
    ok = (diff <= atol + rtol * e.abs()) | (nan_a & nan_e)
    ok &= nan_a == nan_e
    bad = ~ok
    n_bad = int(bad.sum())
    if n_bad:
        d = diff.masked_fill(nan_a | nan_e, math.inf)
        worst = tuple(int(i) for i in torch.unravel_index(d.argmax(), d.shape)) if d.dim() else ()
        raise AssertionError(
            f"{name}: {n_bad} of {a.numel()} elements ({n_bad / a.numel():.2%}) differ beyond atol={atol:g}, "
            f"rtol={rtol:g}; largest |diff| {float(d.max()):.3g} at {list(worst)}; shape {tuple(a.shape)}; "
            f"first mismatches:\n{_where(bad, a, e, max_report)}")


def assert_lowp_close(ours: torch.Tensor, torch_lowp: torch.Tensor, ref_fp32: torch.Tensor,
                      factor: float = 2.0, name: str = "output") -> dict:
    """Our error against a float32 reference is at most ``factor`` times torch's own error in the
    same low-precision dtype, by relative L2 norm and by max abs error.  Returns the four errors.

    A small floor (one rounding of the output dtype: eps/2 relative) keeps a case where torch
    happens to be exact from demanding that we be exact too.
    """
    if not (ours.shape == torch_lowp.shape == ref_fp32.shape):
        raise AssertionError(f"{name}: shapes differ: ours {tuple(ours.shape)}, torch {tuple(torch_lowp.shape)}, "
                             f"reference {tuple(ref_fp32.shape)}")
    eps = torch.finfo(ours.dtype).eps
    errs = {"ours_rel": rel_error(ours, ref_fp32), "torch_rel": rel_error(torch_lowp, ref_fp32),
            "ours_max": max_abs_error(ours, ref_fp32), "torch_max": max_abs_error(torch_lowp, ref_fp32)}
    if ours.isnan().any() != ref_fp32.isnan().any():
        raise AssertionError(f"{name}: NaN where the reference has none (or the reverse)")
    scale = float(ref_fp32.double().abs().max()) if ref_fp32.numel() else 0.0
    if errs["ours_rel"] > factor * errs["torch_rel"] + eps / 2:
        raise AssertionError(f"{name} ({ours.dtype}): relative error {errs['ours_rel']:.3g} > {factor} x torch's "
                             f"{errs['torch_rel']:.3g} against the float32 reference")
    if errs["ours_max"] > factor * errs["torch_max"] + eps / 2 * scale:
        raise AssertionError(f"{name} ({ours.dtype}): max abs error {errs['ours_max']:.3g} > {factor} x torch's "
                             f"{errs['torch_max']:.3g} against the float32 reference")
    return errs
