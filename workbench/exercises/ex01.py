"""Notebook 01's exercises: RMSNorm and SwiGLU as Triton kernels.

The learner writes a ``@triton.jit`` kernel and the launcher that calls it; the checker calls the
launcher.  On a CPU the kernel runs under the Triton interpreter (``TRITON_INTERPRET=1``, which the
notebook sets before anything imports a kernel), so the shapes here stay small: every program
instance is a Python loop iteration of a few milliseconds.

The references are what the model runs, the package's ``workbench_kernels.rmsnorm.rmsnorm_ref`` and
``workbench_kernels.swiglu.swiglu_ref`` (exactly ``workbench.model.decoder``'s RMSNorm and MLP, the
``eager`` backend of :mod:`workbench.transforms.backends`).  A kernel computes in float32 and rounds
once where torch rounds two or three times, so values are compared within a tolerance: a few float32
ulp, about two float16 ulp (:data:`TOLERANCE`).  When they differ, ``compare`` looks for the usual
mistakes first (a mean over the padded block, squares that overflowed float16, rows or columns no
program wrote, the gate and up swapped, ...) and names the rule.
"""

from __future__ import annotations

from workbench.errors import WorkbenchError
from workbench.exercises.core import Case, Exercise, compare_tensors

#: dtype name -> (rtol, atol) the values are compared with
TOLERANCE = {"float32": (1e-5, 1e-5), "float16": (2e-3, 1e-3)}
FLOAT16_MAX = 65504.0


def _device() -> str:
    """Where the checker's tensors live: the GPU when the kernels are compiled for one, else the
    CPU, where they run only under the Triton interpreter."""
    import torch
    import workbench_kernels

    if torch.cuda.is_available() and not workbench_kernels.interpreter_active():
        return "cuda"
    if not workbench_kernels.interpreter_active():
        raise WorkbenchError("the Triton exercises run on a CPU under the Triton interpreter: set TRITON_INTERPRET=1 "
                             "before triton is first imported (the notebook's first code cells do, and so does "
                             "workbench exercises check where there is no GPU; in Python: "
                             "TRITON_INTERPRET=1 python ...)")
    return "cpu"


def _tensor(shape, seed: int, dtype: str = "float32", scale: float = 1.0):
    import torch

    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(device=_device(), dtype=getattr(torch, dtype))


def _weight(n: int, seed: int, dtype: str = "float32"):
    import torch

    g = torch.Generator().manual_seed(seed + 7919)
    return (1 + 0.1 * torch.randn(n, generator=g)).to(device=_device(), dtype=getattr(torch, dtype))


# Memory a kernel never wrote still holds what was there before: a launcher that allocates y with
# torch.empty and launches too few programs can receive the memory of an earlier right answer (the
# same case checked a minute ago) and pass.  So a right answer is overwritten with nan before its
# memory can be reused: ``compare`` holds the reference's result until two newer ones exist (the
# checker shows it after ``compare`` returns), and overwrites a learner's result that passed.  Only
# what the checker computed is touched: the reference that drives a notebook when a check fails
# returns its results untouched.
_HELD: list = []


def _hold(t):
    """Keep the reference's result ``t`` alive; overwrite the one two results back with nan and let it go."""
    _HELD.append(t)
    while len(_HELD) > 2:
        _poison(_HELD.pop(0))
    return t


def _poison(t) -> None:
    import torch

    if isinstance(t, torch.Tensor) and t.is_floating_point():
        with torch.inference_mode():        # also an inference tensor (a result made under inference_mode)
            t.fill_(float("nan"))


def _tol(t) -> tuple[float, float]:
    return TOLERANCE.get(str(t.dtype).removeprefix("torch."), TOLERANCE["float32"])


def _close(a, b, rtol: float, atol: float) -> bool:
    import torch

    return a.shape == b.shape and bool(torch.isclose(a.double(), b.double(), rtol=rtol, atol=atol,
                                                     equal_nan=True).all())


def _span(idx: list[int]) -> str:
    return f"{idx[0]}" if len(idx) == 1 else (f"{idx[0]}..{idx[-1]}" if idx == list(range(idx[0], idx[-1] + 1))
                                              else ", ".join(map(str, idx[:8])) + (" ..." if len(idx) > 8 else ""))


def _rows(n: int, word: str = "row") -> str:
    """The first ``n`` rows (or columns), in words: "row 0", "rows 0..4"."""
    return f"{word} 0" if n == 1 else f"{word}s 0..{n - 1}"


def _where_wrong(got, expected, rtol: float, atol: float, x_shape, what: str, grid: str) -> str | None:
    """The rows or columns (of the [M, N] view) that are wrong while the others are right: what a
    grid that launches too few programs, or a block narrower than the row, leaves behind."""
    import torch

    N = expected.shape[-1]
    g2, e2 = got.reshape(-1, N).double(), expected.reshape(-1, N).double()
    bad = ~torch.isclose(g2, e2, rtol=rtol, atol=atol, equal_nan=True)
    M = g2.shape[0]
    rows = [int(i) for i in bad.any(1).nonzero().flatten()]
    cols = [int(j) for j in bad.any(0).nonzero().flatten()]
    flat = f" (x {tuple(x_shape)} is {M} rows of {N}: flatten it with x.reshape(-1, {N}))" if len(x_shape) > 2 else ""
    if 0 < len(rows) < M:
        if rows == list(range(rows[0], M)):
            return (f"rows {_span(rows)} of {M} are wrong, {_rows(rows[0])} right: the grid launches too few "
                    f"programs: one per row, {grid} with M = {M}{flat}")
        return (f"rows {_span(rows)} are wrong, the other rows right: the program of row r must read and write "
                f"row r, at r times the row stride (tl.program_id(0) * stride)")
    if 0 < len(cols) < N and cols == list(range(cols[0], N)):
        return (f"columns {_span(cols)} of every row are wrong, {_rows(cols[0], 'column')} right: the {what} must "
                f"cover all {N} columns (a block of triton.next_power_of_2({N}) = {1 << (N - 1).bit_length()}, or "
                f"several blocks), masked with cols < {N}")
    return None


# ---- 01.rmsnorm --------------------------------------------------------------------------------------
def _rmsnorm(x, weight, eps: float):
    from workbench_kernels.rmsnorm import rmsnorm_ref

    return rmsnorm_ref(x, weight, eps)


def _rmsnorm_cases() -> list[Case]:
    zeros = _tensor((2, 32), 5)
    zeros[1] = 0.0
    return [
        Case("one row of 8 (a power of two)", dict(x=_tensor((1, 8), 0), weight=_weight(8, 0), eps=1e-5)),
        Case("3 rows of 576, SmolLM2's hidden size (not a power of two: the block is 1024)",
             dict(x=_tensor((3, 576), 1), weight=_weight(576, 1), eps=1e-5)),
        Case("5 rows of 96 (padded to a block of 128)", dict(x=_tensor((5, 96), 2), weight=_weight(96, 2), eps=1e-5)),
        Case("float16 in, float16 out", dict(x=_tensor((4, 64), 3, "float16"), weight=_weight(64, 3, "float16"),
                                             eps=1e-5)),
        Case("float16 values near 1000: x² overflows float16 (largest 65504)",
             dict(x=_tensor((2, 64), 4, "float16", scale=1000.0), weight=_weight(64, 4, "float16"), eps=1e-5)),
        Case("a row of zeros (row 1): eps keeps rsqrt finite", dict(x=zeros, weight=_weight(32, 5), eps=1e-5)),
        Case("eps = 0.1, as given", dict(x=_tensor((2, 16), 6, scale=0.3), weight=_weight(16, 6), eps=0.1)),
        Case("3-D input [2, 3, 64], as the model passes it (batch, tokens, hidden)",
             dict(x=_tensor((2, 3, 64), 7), weight=_weight(64, 7), eps=1e-5)),
    ]


def _rmsnorm_strategy():
    from hypothesis import strategies as st

    @st.composite
    def kw(draw):
        M, N = draw(st.integers(1, 6)), draw(st.integers(1, 300))
        dtype = draw(st.sampled_from(["float32", "float16"]))
        scale = draw(st.sampled_from([1.0, 10.0, 300.0]))
        seed = draw(st.integers(0, 1000))
        return dict(x=_tensor((M, N), seed, dtype, scale), weight=_weight(N, seed, dtype),
                    eps=draw(st.sampled_from([1e-5, 1e-6, 0.1])))
    return kw()


def _norm_variant(x, weight, eps: float, *, divide_by: int | None = None, use_weight: bool = True, sqrt: bool = True):
    """RMSNorm with one thing changed: what a common mistake computes."""
    import torch

    xf = x.float()
    ms = xf.pow(2).sum(-1, keepdim=True) / (divide_by or x.shape[-1])
    xn = (xf * (torch.rsqrt(ms + eps) if sqrt else 1 / (ms + eps))).to(x.dtype)
    return weight * xn if use_weight else xn


_RMSNORM = ("y = weight * x / sqrt(mean(x²) + eps) over each row of N, the mean of squares in float32, "
            "rounded to x's dtype before the weight multiply (rmsnorm_ref)")


def _rmsnorm_compare(kw: dict, got, expected) -> str | None:
    _hold(expected)
    rule = _rmsnorm_rule(kw, got, expected)
    if rule is None:
        _poison(got)           # a right answer's memory must not pass a later kernel that leaves rows unwritten
    return rule


def _rmsnorm_rule(kw: dict, got, expected) -> str | None:
    import torch

    x, w, eps = kw["x"], kw["weight"], kw["eps"]
    rtol, atol = _tol(expected)
    msg = compare_tensors(got, expected, rtol=rtol, atol=atol, what="y")
    if msg is None:
        return None
    if not isinstance(got, torch.Tensor):
        return f"{msg}\nrmsnorm returns y: allocate it (torch.empty_like), launch the kernel to fill it, return it"
    if got.dtype != expected.dtype:
        return (f"{msg}\ny has x's dtype ({str(x.dtype).removeprefix('torch.')}): compute in float32 inside the "
                "kernel, allocate y with x's dtype and store y.to(Y.dtype.element_ty)")
    if tuple(got.shape) != tuple(expected.shape):
        return (f"{msg}\ny has x's shape {tuple(x.shape)}: normalise each row of the last dimension "
                f"(x.reshape(-1, N)) and return y.view(x.shape)")
    N = x.shape[-1]
    g2, x2 = got.reshape(-1, N), x.reshape(-1, N).float()
    zero_rows = (x2 == 0).all(1)
    if bool(zero_rows.any()) and not bool(torch.isfinite(g2[zero_rows]).all()):
        return (f"{msg}\na row of zeros gave nan or inf: eps goes under the square root, rsqrt(mean(x²) + eps), so "
                f"0 * rsqrt(0 + eps) = 0 (not 0 * rsqrt(0) = 0 * inf = nan)")
    if x.dtype == torch.float16:
        big = (x2.pow(2).amax(1) > FLOAT16_MAX) | (x2.pow(2).sum(1) > FLOAT16_MAX)
        bad_rows = ~torch.isclose(g2.double(), expected.reshape(-1, N).double(), rtol=rtol, atol=atol).all(1)
        if bool(big.any()) and bool((bad_rows <= big).all()):
            return (f"{msg}\nthe mean of squares overflowed float16: x² reaches {float(x2.pow(2).amax()):.3g} here, "
                    f"float16's largest value is {FLOAT16_MAX:.0f}: convert x to float32 before squaring "
                    f"(x.to(tl.float32)), then divide the sum by N")
    if eps != 1e-5 and _close(got, _norm_variant(x, w, 1e-5), rtol, atol):
        return f"{msg}\nthis is RMSNorm with eps = 1e-5, but eps = {eps:g} here: use the eps argument"
    block = 1 << (N - 1).bit_length()
    if block != N and _close(got, _norm_variant(x, w, eps, divide_by=block), rtol, atol):
        return (f"{msg}\nthe mean divides by N = {N}, the row's length, not by BLOCK_N = {block} (the block padded to "
                f"a power of two; its masked lanes are zeros that add nothing to the sum)")
    if _close(got, _norm_variant(x, w, eps, divide_by=1), rtol, atol) and N > 1:
        return f"{msg}\nthe mean of squares is the sum divided by N = {N}: tl.sum(x * x, axis=0) / N"
    if _close(got, _norm_variant(x, w, eps, use_weight=False), rtol, atol):
        return f"{msg}\nthe normalised row is multiplied by the weight: y = weight * (x * rstd), weight[j] per column j"
    if _close(got, _norm_variant(x, w, eps, sqrt=False), rtol, atol):
        return f"{msg}\nRMSNorm divides by the root of the mean square: x * rsqrt(mean(x²) + eps), not x / (mean + eps)"
    where = _where_wrong(got, expected, rtol, atol, x.shape, "block", "grid = (M,)")
    return f"{msg}\n{where or _RMSNORM}"


# ---- 01.swiglu ---------------------------------------------------------------------------------------
def _swiglu(gate, up):
    from workbench_kernels.swiglu import swiglu_ref

    return swiglu_ref(gate, up)


def _swiglu_cases() -> list[Case]:
    import torch

    big = torch.tensor([[100.0, -100.0, 90.0, -90.0, 0.0, 1.0, -1.0, 20.0]], device=_device())
    return [
        Case("one element", dict(gate=_tensor((1, 1), 10), up=_tensor((1, 1), 11))),
        Case("23 rows of 177 columns (not a power of two)",
             dict(gate=_tensor((23, 177), 12), up=_tensor((23, 177), 13))),
        Case("2 rows of 704, the bundled model's MLP width",
             dict(gate=_tensor((2, 704), 14), up=_tensor((2, 704), 15))),
        Case("float16 in, float16 out",
             dict(gate=_tensor((3, 64), 16, "float16", 3.0), up=_tensor((3, 64), 17, "float16"))),
        Case("gates of ±100: exp(100) overflows float32 (largest 3.4e38)", dict(gate=big, up=_tensor((1, 8), 18))),
        Case("3-D input [2, 3, 48], as the model passes it (batch, tokens, intermediate)",
             dict(gate=_tensor((2, 3, 48), 19), up=_tensor((2, 3, 48), 20))),
    ]


def _swiglu_strategy():
    from hypothesis import strategies as st

    @st.composite
    def kw(draw):
        M, I = draw(st.integers(1, 4)), draw(st.integers(1, 200))
        dtype = draw(st.sampled_from(["float32", "float16"]))
        scale = draw(st.sampled_from([1.0, 4.0, 30.0]))
        seed = draw(st.integers(0, 1000))
        return dict(gate=_tensor((M, I), seed, dtype, scale), up=_tensor((M, I), seed + 1, dtype))
    return kw()


def _swiglu_compare(kw: dict, got, expected) -> str | None:
    _hold(expected)
    rule = _swiglu_rule(kw, got, expected)
    if rule is None:
        _poison(got)
    return rule


def _swiglu_rule(kw: dict, got, expected) -> str | None:
    import torch
    import torch.nn.functional as F

    g, u = kw["gate"], kw["up"]
    rtol, atol = _tol(expected)
    msg = compare_tensors(got, expected, rtol=rtol, atol=atol, what="y")
    if msg is None:
        return None
    if not isinstance(got, torch.Tensor):
        return f"{msg}\nswiglu returns y: allocate it (torch.empty_like(gate)), launch the kernel to fill it, return it"
    if got.dtype != expected.dtype:
        return (f"{msg}\ny has the inputs' dtype ({str(g.dtype).removeprefix('torch.')}): compute in float32 inside "
                f"the kernel, allocate y with gate's dtype and store y.to(Y.dtype.element_ty)")
    if tuple(got.shape) != tuple(expected.shape):
        return (f"{msg}\ny has gate's shape {tuple(g.shape)}: silu(gate) * up is elementwise; flatten to rows "
                f"(reshape(-1, I)) and return y.view(gate.shape)")
    gf, uf = g.float(), u.float()
    nonfinite = ~torch.isfinite(got) & torch.isfinite(expected)
    if bool(nonfinite.any()) and bool((gf.abs() > 80)[nonfinite].any()):
        return (f"{msg}\nexp overflowed for a large gate (exp(89) is past float32's largest value): "
                f"silu(g) = g * sigmoid(g) with sigmoid(g) = 1 / (1 + exp(-g)) (tl.sigmoid) stays finite for any g")
    for other, rule in ((F.silu(uf) * gf, "silu applies to the gate (the first argument); up multiplies the result: "
                                          "silu(gate) * up, not silu(up) * gate"),
                        (torch.sigmoid(gf) * uf, "silu(g) = g * sigmoid(g): the gate multiplies its own sigmoid"),
                        (F.silu(gf), "y = silu(gate) * up: up multiplies the activation"),
                        (gf * uf, "silu(gate) = gate * sigmoid(gate) is the activation: y = silu(gate) * up, "
                                  "not gate * up")):
        if _close(got, other.to(expected.dtype), rtol, atol):
            return f"{msg}\n{rule}"
    where = _where_wrong(got, expected, rtol, atol, g.shape, "grid's column blocks",
                         "grid = (M, triton.cdiv(I, BLOCK))")
    return f"{msg}\n{where or 'y = silu(gate) * up = gate * sigmoid(gate) * up, elementwise, in float32, rounded once'}"


EXERCISES = [
    Exercise(
        id="01.rmsnorm", notebook="01_fused_kernels", title="RMSNorm as a Triton kernel",
        teaches="a row-wise Triton kernel: one program per row, a power-of-two block masked to the row, "
                "statistics in float32, the output in the input's dtype",
        statement=(
            "Write RMSNorm as a Triton kernel (`@triton.jit`) and the launcher `rmsnorm(x, weight, eps)` that runs it: "
            "for each row of `x` `[..., N]` (the model passes `[batch, tokens, N]`), "
            "`y = weight * x / sqrt(mean(x²) + eps)`, the mean of squares in float32 and the normalised row rounded "
            "to `x`'s dtype before the weight multiply, as the model's `RMSNorm` (`rmsnorm_ref`, printed above). "
            "`y` has `x`'s shape and dtype. It is compared with `rmsnorm_ref` within rtol 1e-5, atol 1e-5 in float32 "
            "and rtol 2e-3 (about two ulp), atol 1e-3 in float16, on one row, widths that are not a power of two (576, "
            "SmolLM2's hidden size, and 96), float16 values whose squares overflow float16, a row of zeros and a 3-D "
            "input. On a CPU the kernel runs in the Triton interpreter (`TRITON_INTERPRET=1`, set at the top of this "
            "notebook)."),
        hints=["Flatten `x` to rows: `x2 = x.reshape(-1, N)`, `M = x2.shape[0]`, and launch one program per row: "
               "`_rmsnorm_kernel[(M,)](...)`; in the kernel `row = tl.program_id(0)`. A block's length must be a "
               "power of two: `BLOCK_N = triton.next_power_of_2(N)`, and the mask `cols < N` keeps the padding out.",
               "Load the row with `mask=mask, other=0.0` and `.to(tl.float32)` *before* squaring: a float16 value of "
               "300 squares to 90,000, past float16's largest 65,504. The mean is `tl.sum(x * x, axis=0) / N`: "
               "`N`, not `BLOCK_N` (the padded lanes are zeros).",
               "`rstd = tl.rsqrt(mean + eps)`; `xn = (x * rstd).to(X.dtype.element_ty)`; "
               "`y = xn.to(tl.float32) * w` with `w` loaded as the row; "
               "`tl.store(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), mask=mask)`. In the launcher "
               "`y = torch.empty_like(x2)`, and return `y.view(x.shape)`."],
        stub=('import torch\n'
              'import triton\n'
              'import triton.language as tl\n'
              '\n'
              '\n'
              'def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:\n'
              '    """RMSNorm over the last dimension of x [..., N] by launching _rmsnorm_kernel (below);\n'
              '    y has x\'s shape and dtype."""\n'
              '    # your code here: rows [M, N], y, then _rmsnorm_kernel[grid](...)\n'
              '    raise NotImplementedError\n'
              '\n'
              '\n'
              '@triton.jit\n'
              'def _rmsnorm_kernel(X, W, Y, stride_x, stride_y, N, eps, BLOCK_N: tl.constexpr):\n'
              '    """One program per row: y = w * (x * rsqrt(mean(x^2) + eps)), the statistics in float32."""\n'
              '    # your code here\n'
              '    pass'),
        reference=_rmsnorm, cases=_rmsnorm_cases, strategy=_rmsnorm_strategy, compare=_rmsnorm_compare,
        plugs_into="section 2's measurement (your kernel timed beside the package's) and section 7's greedy tokens: "
                   "your kernel is every RMSNorm of the bundled model",
        examples=30),
    Exercise(
        id="01.swiglu", notebook="01_fused_kernels", title="A fused SwiGLU kernel",
        teaches="an elementwise kernel over a 2-D grid (rows x column blocks), and computing silu in float32 "
                "so that exp cannot overflow",
        statement=(
            "Write `swiglu(gate, up)`: `silu(gate) * up` for `gate` and `up` `[..., I]` in one Triton kernel, "
            "which reads both once and writes `y` once (eager torch writes `silu(gate)` and reads it back). "
            "`silu(g) = g * sigmoid(g)`. `y` has `gate`'s shape and dtype. It is compared with `swiglu_ref` "
            "(`F.silu(gate) * up`, the model's MLP) within the tolerances of exercise 01.1, on one "
            "element, widths that are not a power of two (177) or wider than one block (704, the bundled model's "
            "MLP width), float16, gates of ±100 and a 3-D input. (Under the interpreter numpy may warn "
            "`overflow encountered in exp` on the ±100 gates even when your kernel is right: `exp(100)` is inf, "
            "and `1 / (1 + inf)` is the right 0.)"),
        hints=["Flatten both to rows `[M, I]` and tile each row with blocks of `BLOCK` columns: a 2-D grid "
               "`(M, triton.cdiv(I, BLOCK))`; in the kernel `row = tl.program_id(0)` and "
               "`cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)`, masked with `cols < I`.",
               "Load `g` and `u` and convert them to float32 (`tl.exp` / `tl.sigmoid` want float32); "
               "`tl.sigmoid(g) = 1 / (1 + exp(-g))` is finite for any `g`, while `exp(g) / (1 + exp(g))` is "
               "inf / inf = nan once `g > 88`.",
               "`y = g * tl.sigmoid(g) * u`; `tl.store(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), "
               "mask=mask)`; in the launcher `y = torch.empty_like(g2)` and return `y.view(gate.shape)`."],
        stub=('import torch\n'
              'import triton\n'
              'import triton.language as tl\n'
              '\n'
              '\n'
              'def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:\n'
              '    """silu(gate) * up for gate, up [..., I] in one Triton kernel (_swiglu_kernel, below);\n'
              '    y has gate\'s shape and dtype."""\n'
              '    # your code here: rows [M, I], y, then _swiglu_kernel[grid](...)\n'
              '    raise NotImplementedError\n'
              '\n'
              '\n'
              '@triton.jit\n'
              'def _swiglu_kernel(G, U, Y, stride_g, stride_u, stride_y, I, BLOCK: tl.constexpr):\n'
              '    """One program per (row, block of BLOCK columns): y = g * sigmoid(g) * u in float32."""\n'
              '    # your code here\n'
              '    pass'),
        reference=_swiglu, cases=_swiglu_cases, strategy=_swiglu_strategy, compare=_swiglu_compare,
        plugs_into="section 7's greedy tokens: your kernel is the MLP activation of every layer of the bundled model",
        examples=25),
]
