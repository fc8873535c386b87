"""Notebook 05's exercises: asymmetric int4 group scales and zero points, nibble packing, and back.

The learner's ``group_scales`` and ``pack_int4`` quantize the bundled model in the notebook
(``quantize_model(model, "w4a16:g128:asym", group_scales=..., pack=...)``, :mod:`workbench.quant.hooks`)
and its perplexity stands beside the package's; their ``dequantize`` reads that model's buffers back.
"""

from __future__ import annotations

import torch

from workbench.exercises.core import Case, Exercise, compare_tensors
from workbench.quant.rtn import QuantizedWeight, compute_scales, pack_int4

LEVELS = 15            # int4 asymmetric codes 0..15: 15 steps


# ---- 05.group_scales -----------------------------------------------------------------------------------
def _group_scales(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The package's asymmetric int4 scales and zero points, as the W4A16 layer stores them."""
    s, z = compute_scales(w, bits=4, group=group, symmetric=False)
    return s, z.to(torch.int8)


def _weight(out: int, n: int, seed: int, kind: str = "normal", group: int = 4) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, n, generator=g) * 0.05
    if kind == "negative":
        w = -w.abs() - 0.01
    elif kind == "positive":
        w = w.abs() + 0.01
    elif kind == "zero group":
        w[0, -group:] = 0.0
    elif kind == "constant group":
        w[-1, :group] = 0.03
    return w


def _straddle(w: torch.Tensor, group: int) -> torch.Tensor:
    """Every group holds a negative and a positive value (its range already holds 0)."""
    w = w.clone()
    w[:, 0::group] = -w[:, 0::group].abs() - 0.01
    w[:, 1::group] = w[:, 1::group].abs() + 0.01
    return w


def _scales_cases() -> list[Case]:
    w_zero = _straddle(_weight(2, 16, 1), 4)
    w_zero[0, 12:16] = 0.0
    w_const = _straddle(_weight(2, 8, 2), 4)
    w_const[1, 0:4] = 0.5
    return [
        Case("two rows, two groups of 4", dict(w=torch.tensor([[-0.3, 0.1, 0.2, 0.6, 0.05, -0.02, 0.04, 0.01],
                                                               [0.9, -0.6, 0.3, 0.0, -0.1, -0.4, 0.2, 0.7]]), group=4)),
        Case("a group of zeros (group 3 of row 0): max - min = 0", dict(w=w_zero, group=4)),
        Case("a constant group of 0.5 (group 0 of row 1): the range still starts at 0", dict(w=w_const, group=4)),
        Case("all-negative weights: the range must reach up to 0", dict(w=_weight(2, 8, 3, "negative"), group=4)),
        Case("all-positive weights: the range must reach down to 0", dict(w=_weight(2, 8, 4, "positive"), group=4)),
        Case("the group is the whole width: one scale per row", dict(w=_weight(3, 8, 5), group=8)),
        Case("one output row (out = 1), groups of 2", dict(w=_weight(1, 8, 6), group=2)),
        Case("a bfloat16 weight: the scales are still float32", dict(w=_weight(2, 8, 7).to(torch.bfloat16), group=4)),
    ]


def _scales_strategy():
    from hypothesis import strategies as st

    @st.composite
    def kw(draw):
        out, ng = draw(st.integers(1, 3)), draw(st.integers(1, 3))
        group = draw(st.sampled_from([2, 4, 8]))
        kind = draw(st.sampled_from(["normal", "negative", "positive", "zero group", "constant group"]))
        return dict(w=_weight(out, ng * group, draw(st.integers(0, 2**16)), kind, group), group=group)
    return kw()


def _group_range(w: torch.Tensor, group: int, r: int, k: int) -> tuple[torch.Tensor, float, float]:
    x = w[r, k * group:(k + 1) * group].float()
    return x, float(x.min()), float(x.max())


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-6 * max(abs(a), abs(b), 1e-30)


def _scale_rule(w: torch.Tensor, group: int, r: int, k: int, got: float, exp: float) -> str:
    x, mn, mx = _group_range(w, group, r, k)
    cols = f"columns {k * group}..{(k + 1) * group - 1}"
    lo, hi = min(mn, 0.0), max(mx, 0.0)
    where = f"group {k} of row {r} ({cols})"
    if hi - lo == 0:
        return (f"{where}: max - min = 0 (every value is 0), the scale must not be 0 (the package uses "
                f"scale = max((max - min) / 15, 1e-12)): the zero point divides by it")
    if mn == mx:
        return (f"{where} is constant ({mn:.4g}): max - min = 0, but the range must include 0, min = min(w, 0) = "
                f"{lo:.4g} and max = max(w, 0) = {hi:.4g}, so scale = {hi - lo:.4g} / 15 (never 0)")
    if (mn > 0 or mx < 0) and _close(got, (mx - mn) / LEVELS):
        side = "all negative: max = max(w, 0) = 0" if mx < 0 else "all positive: min = min(w, 0) = 0"
        return (f"{where} is {side}. The range must include 0, so that 0 is exactly a code (the zero point): "
                f"scale = (max(w, 0) - min(w, 0)) / 15 = {hi - lo:.4g} / 15")
    if _close(got, (hi - lo) / 16):
        return f"{where}: int4 has 16 codes, 0..15, so 15 steps between min and max: scale = (max - min) / 15, not / 16"
    if _close(got, max(abs(mn), abs(mx)) / 7):
        return (f"{where}: that is the symmetric scale max|w| / 7; the asymmetric one spans min..max over the 15 "
                f"steps of codes 0..15: scale = (max(w, 0) - min(w, 0)) / 15 = {hi - lo:.4g} / 15")
    return (f"{where}: scale = (max - min) / 15 with min = min(w, 0) = {lo:.4g} and max = max(w, 0) = {hi:.4g} "
            f"(one scale per row and per {group} consecutive columns)")


def _scales_compare(kw: dict, got, expected) -> str | None:
    w, group = kw["w"], kw["group"]
    out, n = w.shape
    if not isinstance(got, (tuple, list)) or len(got) != 2:
        return f"return a pair (scales, zeros), got {type(got).__name__}"
    (gs, gz), (es, ez) = got, expected
    shape_rule = (f"one per row and per group of {group} columns: [out, in // group] = [{out}, {n // group}]")
    for what, g, e, dtype_rule in (("scales", gs, es, "scales are float32 (whatever the weight's dtype)"),
                                   ("zeros", gz, ez, "zero points are int8 (the layer's `zeros` buffer), whole "
                                                     "numbers in [0, 15]")):
        msg = compare_tensors(g, e, what=what)
        if msg and (not isinstance(g, torch.Tensor) or g.dtype != e.dtype):
            return f"{msg}\n{dtype_rule}"
        if msg and tuple(g.shape) != tuple(e.shape):
            return f"{msg}\n{shape_rule}"
    msg = compare_tensors(gs, es, rtol=1e-6, atol=0.0, what="scales")
    if msg:
        bad = ~torch.isclose(gs.double(), es.double(), rtol=1e-6, atol=0.0)
        r, k = (int(i) for i in bad.nonzero()[0])
        return f"{msg}\n{_scale_rule(w, group, r, k, float(gs[r, k]), float(es[r, k]))}"
    msg = compare_tensors(gz, ez, what="zeros")
    if msg:
        r, k = (int(i) for i in (gz != ez).nonzero()[0])
        _, mn, _ = _group_range(w, group, r, k)
        lo, s = min(mn, 0.0), float(es[r, k])
        raw = -lo / s
        rule = (f"group {k} of row {r}: zero = round(-min / scale) with min = min(w, 0) = {lo:.4g}: "
                f"-min / scale = {raw:.4f} rounds to {int(ez[r, k])} (torch.round: to the nearest, halves to even), "
                "clamped to [0, 15]")
        if int(gz[r, k]) == int(torch.tensor(raw).floor()) or int(gz[r, k]) == int(torch.tensor(raw).ceil()):
            rule += "; truncating (int(), floor, ceil) is not rounding"
        return f"{msg}\n{rule}"
    return None


# ---- 05.pack_int4 --------------------------------------------------------------------------------------
def _pack(codes: torch.Tensor) -> torch.Tensor:
    return pack_int4(codes)


def _codes(rows: int, n: int, seed: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 16, (rows, n), generator=g).to(dtype)


def _pack_cases() -> list[Case]:
    u8 = torch.uint8
    return [
        Case("one byte: codes 3 and 10", dict(codes=torch.tensor([[3, 10]], dtype=u8))),
        Case("codes 0 and 15, the extremes (15 needs all four bits)",
             dict(codes=torch.tensor([[15, 0, 0, 15, 15, 15]], dtype=u8))),
        Case("a row of 8: byte b holds codes 2b and 2b + 1", dict(codes=torch.arange(8, dtype=u8)[None] + 4)),
        Case("two rows: pairs are neighbours along a row, never across rows",
             dict(codes=torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]], dtype=u8))),
        Case("codes as int64: the bytes are still uint8", dict(codes=_codes(3, 4, 12, torch.int64))),
        Case("a wider weight, 4 x 32", dict(codes=_codes(4, 32, 13))),
    ]


def _pack_strategy():
    from hypothesis import strategies as st

    return st.builds(lambda rows, half, seed, dtype: dict(codes=_codes(rows, 2 * half, seed, dtype)),
                     st.integers(1, 3), st.integers(1, 6), st.integers(0, 2**16),
                     st.sampled_from([torch.uint8, torch.int32, torch.int64]))


def _pack_compare(kw: dict, got, expected) -> str | None:
    codes = kw["codes"]
    rows, n = codes.shape
    msg = compare_tensors(got, expected, what="the packed weight")
    if msg is None:
        return None
    if not isinstance(got, torch.Tensor) or got.dtype != expected.dtype:
        return f"{msg}\nthe packed weight is uint8: one byte holds two 4-bit codes, whatever dtype the codes come in"
    if tuple(got.shape) != tuple(expected.shape):
        return (f"{msg}\ntwo codes per byte along the last (input) dimension, rows stay rows: [{rows}, {n}] -> "
                f"[{rows}, {n // 2}]")
    r, b = (int(i) for i in (got != expected).nonzero()[0])
    lo, hi, gb = int(codes[r, 2 * b]), int(codes[r, 2 * b + 1]), int(got[r, b])
    formula = f"byte {b} = codes[{2 * b}] | codes[{2 * b + 1}] << 4 = {lo} | {hi} << 4 = {lo | hi << 4}"
    if gb == (hi | lo << 4) & 0xFF:
        return (f"{msg}\ncode {2 * b + 1} of row {r} must be the HIGH nibble of byte {b}, and code {2 * b} the low one "
                f"(even column low): {formula}")
    return (f"{msg}\nbyte {b} of row {r} holds codes {2 * b} (low nibble) and {2 * b + 1} (high nibble), neighbours "
            f"in the row: {formula}; yours has low nibble {gb & 0xF} and high nibble {gb >> 4}")


# ---- 05.dequantize -------------------------------------------------------------------------------------
def _dequantize(packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int) -> torch.Tensor:
    out, half = packed.shape
    return QuantizedWeight(packed, scales, zeros, 4, group, (out, 2 * half), torch.float32).dequantize(torch.float32)


def _dq_inputs(out: int, ng: int, group: int, seed: int, zero: int | None = None) -> dict:
    g = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (out, ng * group // 2), generator=g).to(torch.uint8)
    scales = (torch.rand(out, ng, generator=g) * 0.02 + 0.001)
    zeros = torch.randint(0, 16, (out, ng), generator=g).to(torch.int8) if zero is None else \
        torch.full((out, ng), zero, dtype=torch.int8)
    return dict(packed=packed, scales=scales, zeros=zeros, group=group)


def _dq_cases() -> list[Case]:
    return [
        Case("one byte, one group: codes 3 (low nibble) and 10 (high nibble), zero point 8",
             dict(packed=torch.tensor([[0xA3]], dtype=torch.uint8), scales=torch.tensor([[0.5]]),
                  zeros=torch.tensor([[8]], dtype=torch.int8), group=2)),
        Case("two groups of 4: column 4 is the first of group 1", _dq_inputs(1, 2, 4, 1)),
        Case("codes 0 and 15 with zero point 15 (an all-negative group)",
             dict(packed=torch.tensor([[0xF0, 0x0F]], dtype=torch.uint8), scales=torch.tensor([[0.1]]),
                  zeros=torch.tensor([[15]], dtype=torch.int8), group=4)),
        Case("zero point 0 (an all-positive group)", _dq_inputs(2, 2, 4, 2, zero=0)),
        Case("the group is the whole width", _dq_inputs(3, 1, 8, 3)),
        Case("three rows, four groups of 2", _dq_inputs(3, 4, 2, 4)),
    ]


def _dq_strategy():
    from hypothesis import strategies as st

    return st.builds(lambda out, ng, group, seed: _dq_inputs(out, ng, group, seed),
                     st.integers(1, 3), st.integers(1, 3), st.sampled_from([2, 4, 8]), st.integers(0, 2**16))


def _cat_code(packed: torch.Tensor, r: int, c: int) -> int:
    """The code at column c if the nibbles were concatenated (all low ones, then all high ones)."""
    half = packed.shape[1]
    return int(packed[r, c] & 0xF) if c < half else int(packed[r, c - half] >> 4)


def _dq_compare(kw: dict, got, expected) -> str | None:
    packed, scales, zeros, group = kw["packed"], kw["scales"], kw["zeros"], kw["group"]
    out, half = packed.shape
    msg = compare_tensors(got, expected, rtol=1e-5, atol=1e-7, what="the weight")
    if msg is None:
        return None
    if not isinstance(got, torch.Tensor) or got.dtype != expected.dtype:
        return f"{msg}\nthe dequantized weight is float32: (code - zero) * scale"
    if tuple(got.shape) != tuple(expected.shape):
        return f"{msg}\nevery byte holds two columns: [out, in // 2] packed -> [out, in] = [{out}, {2 * half}]"
    bad = ~torch.isclose(got.double(), expected.double(), rtol=1e-5, atol=1e-7)
    r, c = (int(i) for i in bad.nonzero()[0])
    byte, k = int(packed[r, c // 2]), c // group
    code = byte & 0xF if c % 2 == 0 else byte >> 4
    other = byte >> 4 if c % 2 == 0 else byte & 0xF
    s, z, gv = float(scales[r, k]), int(zeros[r, k]), float(got[r, c])
    formula = f"w[{r}, {c}] = (code - zeros[{r}, {k}]) * scales[{r}, {k}] = ({code} - {z}) * {s:.5g}"
    if _close(gv, (other - z) * s) and code != other:
        rule = (f"column {c} is the {'low' if c % 2 == 0 else 'high'} nibble of byte {c // 2} "
                f"({byte} = {byte & 0xF} | {byte >> 4} << 4): even columns low, odd columns high")
    elif _close(gv, (_cat_code(packed, r, c) - z) * s) and _cat_code(packed, r, c) != code:
        rule = (f"the unpacked columns interleave: column 2b is byte b's low nibble and column 2b + 1 its high "
                f"nibble (stack the two on a new last dimension, then reshape: concatenating puts every low nibble "
                f"first); column {c} is the {'low' if c % 2 == 0 else 'high'} nibble of byte {c // 2}")
    elif _close(gv, code * s) and z:
        rule = "subtract the zero point before scaling: the code that means 0.0 is the zero point, not 0"
    elif any(_close(gv, (code - int(zeros[r, j])) * float(scales[r, j])) for j in range(scales.shape[1]) if j != k):
        rule = (f"column {c} is in group {c} // {group} = {k}: each group's scale covers {group} consecutive "
                "columns (repeat_interleave, not repeat)")
    else:
        rule = f"column {c} of row {r} is in group {k}"
    return f"{msg}\n{rule}: {formula}"


EXERCISES = [
    Exercise(
        id="05.group_scales", notebook="05_quantization", title="Asymmetric int4 scales and zero points per group",
        teaches="how a group's min and max become a scale and an integer zero point, and why the range must hold 0",
        statement=(
            "Asymmetric int4 maps each group of `group` consecutive weights of a row onto the codes 0..15: "
            "`code = round(w / scale) + zero`. Given a weight `w` `[out, in]` and a `group` that divides `in`, return "
            "`(scales, zeros)`, one per row and group (`[out, in // group]`): the scale spans the group's range in 15 "
            "steps, the zero point is the code that stands for 0.0. Return them as the W4A16 layer stores them: "
            "scales float32, zero points int8. The package's rule: the range always includes 0, and a scale is never "
            "0."),
        hints=["Reshape to `[out, in // group, group]` (after `.float()`) and reduce over the last dimension: "
               "`amin` / `amax`.",
               "Stretch the range to hold 0: `min = min(w, 0)`, `max = max(w, 0)` (`clamp`). Then `scale = (max - "
               "min) / 15`, and a group of zeros gives 0: keep it at least `1e-12`.",
               "`zeros = torch.round(-min / scale).clamp(0, 15).to(torch.int8)`; `scales = ((max - min) / 15)"
               ".clamp(min=1e-12)` stays float32."],
        stub=('import torch\n\n\n'
              'def group_scales(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:\n'
              '    """Asymmetric int4 (codes 0..15) per row and group of `group` columns of w [out, in]:\n'
              '    (scales float32 [out, in // group], zeros int8 [out, in // group])."""\n'
              '    # your code here\n'
              '    raise NotImplementedError'),
        reference=_group_scales, cases=_scales_cases, strategy=_scales_strategy, compare=_scales_compare,
        plugs_into="the W4A16 g128 asym model after section 2: your scales and zero points quantize every layer, "
                   "and its perplexity stands beside the package's"),
    Exercise(
        id="05.pack_int4", notebook="05_quantization", title="Two int4 codes per byte",
        teaches="how int4 weights are stored: nibble order and the packed dimension that every int4 kernel reads",
        statement=(
            "An int4 weight is stored two codes per byte. Given `codes` `[out, in]` (whole numbers 0..15, any "
            "integer dtype; `in` even), return the packed weight `[out, in // 2]` as uint8, in the package's layout: "
            "byte `b` of a row holds the row's codes `2b` (low nibble, bits 0-3) and `2b + 1` (high nibble, bits 4-7). "
            "(The package refuses an odd `in` with a ConfigError: a row must fill whole bytes.)"),
        hints=["Convert to uint8 first: the shift and the OR then stay in one byte, and the result has the "
               "packed weight's dtype.",
               "Even columns are `codes[:, 0::2]`, odd ones `codes[:, 1::2]`: the odd one is shifted up by 4 bits.",
               "`c = codes.to(torch.uint8); return c[:, 0::2] | (c[:, 1::2] << 4)`"],
        stub=('import torch\n\n\n'
              'def pack_int4(codes: torch.Tensor) -> torch.Tensor:\n'
              '    """codes [out, in] in 0..15 (in even) -> uint8 [out, in // 2]: '
              'byte b = codes[2b] | codes[2b + 1] << 4."""\n'
              '    # your code here\n'
              '    raise NotImplementedError'),
        reference=_pack, cases=_pack_cases, strategy=_pack_strategy, compare=_pack_compare,
        plugs_into="the same model: your packer writes every layer's qweight buffer, which the layer unpacks "
                   "(a wrong nibble order would scramble the model)"),
    Exercise(
        id="05.dequantize", notebook="05_quantization", title="From packed bytes back to weights",
        teaches="what a W4A16 kernel computes before each multiply: unpack, subtract the zero point, scale per group",
        statement=(
            "The way back: given `packed` uint8 `[out, in // 2]` (as your `pack_int4` writes it), `scales` float32 "
            "and `zeros` int8 `[out, in // group]` (as your `group_scales` gives them) and the `group` size, return "
            "the float32 weight `[out, in]`: `w = (code - zero) * scale`, each column with its group's scale and "
            "zero point."),
        hints=["Unpack first: the low nibble is `packed & 0x0F` (the even column), the high one `packed >> 4` "
               "(the odd column); interleave them back into `[out, in]`.",
               "Column `c` belongs to group `c // group`: `scales.repeat_interleave(group, dim=1)` gives every column "
               "its scale (and the same for the zero points, as float).",
               "`codes = torch.stack([packed & 15, packed >> 4], -1).reshape(out, -1).float()`, then "
               "`(codes - z) * s` with `z`, `s` repeated along the columns."],
        stub=('import torch\n\n\n'
              'def dequantize(packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int) '
              '-> torch.Tensor:\n'
              '    """uint8 [out, in // 2] + float32 scales / int8 zeros [out, in // group] -> float32 [out, in]."""\n'
              '    # your code here\n'
              '    raise NotImplementedError'),
        reference=_dequantize, cases=_dq_cases, strategy=_dq_strategy, compare=_dq_compare,
        plugs_into="the same model: your dequantize reads every layer's buffers back, and its weight error is "
                   "compared with the layer's own"),
]
