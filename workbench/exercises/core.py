"""An exercise, its checker, and what a check says.

An :class:`Exercise` is one piece of a layer that a learner writes as a Python function: its
statement, a starter stub, a hint ladder, the package's own implementation as the reference, a
list of named edge cases and a hypothesis strategy of property-based inputs.  :func:`check_fn`
runs the learner's function against the reference:

1. the signature first (the checker calls the stub's parameter names);
2. every named edge case, in order (an empty prompt, a block boundary, ...);
3. then property-based inputs: ``hypothesis.find`` searches for an input on which the learner's
   function disagrees with the reference and *shrinks* it, so the failure shown is the smallest
   one hypothesis could find.

A failure names the case, the input, what was expected and what came back, and the rule that was
broken (an exercise's ``compare`` says which: "element 4: expected slot 28, got 16: position 4 is
the first token of block 1").  A wrong type, dtype or shape is said in one line before any value
is compared, and an exception inside the learner's code is reported with the line of *their* code
that raised it, never a traceback from inside the checker.

Exercises whose answer is not unique (an eviction policy, an admission rule) give ``rules``
instead of comparing with the reference: every input must obey them.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import linecache
import math
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any

from workbench.errors import WorkbenchError

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep

#: how many property-based inputs a check tries (``find`` stops at the first failure it shrinks)
DEFAULT_EXAMPLES = 150


@dataclasses.dataclass(frozen=True)
class Case:
    """A named edge case: the keyword arguments the learner's function is called with."""
    name: str
    kwargs: dict


@dataclasses.dataclass
class Exercise:
    """One exercise. ``id`` is ``"<notebook number>.<function>"`` (``"02.slot_mapping"``)."""
    id: str
    notebook: str                 # the notebook's stem, "02_kv_tiers"
    title: str                    # "The slot mapping"
    teaches: str                  # one line: what writing it teaches
    statement: str                # markdown: what to write
    hints: list[str]              # the ladder, gentlest first (2-3)
    stub: str                     # the starter cell: imports + ``def function(...)`` raising NotImplementedError
    reference: Callable           # the package's own implementation (same parameters as the stub)
    cases: Callable[[], list[Case]]          # named edge cases
    strategy: Callable[[], Any] | None = None  # () -> a hypothesis strategy of kwargs dicts
    # (kwargs, got, expected) -> None when right, else the rule that was broken (one line or a few)
    compare: Callable[[dict, Any, Any], str | None] | None = None
    # (kwargs, got) -> None or the broken rule; for answers that are not unique (no reference compared)
    rules: Callable[[dict, Any], str | None] | None = None
    plugs_into: str = ""          # where the learner's function replaces the package's, "" if nowhere
    examples: int = DEFAULT_EXAMPLES

    @property
    def function(self) -> str:
        """The function name the stub defines."""
        for line in self.stub.splitlines():
            if line.startswith("def "):
                return line[4:line.index("(")].strip()
        raise WorkbenchError(f"exercise {self.id}: its stub defines no function")

    @property
    def number(self) -> str:
        return self.id.split(".", 1)[0]


@dataclasses.dataclass
class Result:
    """What one check found. ``status``: ``passed``, ``failed`` or ``not written`` (the stub still
    raises NotImplementedError)."""
    exercise: str
    status: str
    case: str = ""            # the edge case's name, or "property-based input (shrunk)"
    call: str = ""            # the call that failed, as the learner would type it
    expected: str = ""
    got: str = ""
    rule: str = ""            # which rule was broken / what was wrong
    cases_run: int = 0
    examples_run: int = 0

    @property
    def passed(self) -> bool:
        return self.status == "passed"

    def summary(self) -> str:
        """One line: the exercise, the status and the case (the instructors' table)."""
        if self.passed:
            return f"{self.exercise}: passed ({self.cases_run} edge cases, {self.examples_run} property-based inputs)"
        if self.status == "not written":
            return f"{self.exercise}: not written yet"
        return f"{self.exercise}: failed on {self.case}: {self.rule.splitlines()[0] if self.rule else ''}"

    def __str__(self) -> str:
        if self.status != "failed":
            return self.summary()
        lines = [f"{self.exercise}: failed on {self.case}", "  call:     " + self.call.replace("\n", "\n" + " " * 12)]
        if self.expected:
            lines.append(f"  expected: {self.expected}")
        if self.got:
            lines.append(f"  got:      {self.got}")
        lines += [("  rule:     " if i == 0 else "            ") + r for i, r in enumerate(self.rule.splitlines())]
        return "\n".join(lines)


# ---- showing values ------------------------------------------------------------------------------
def show(v: Any, limit: int = 160) -> str:
    """A value as a learner reads it: small tensors in full with dtype, large ones by shape."""
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        torch = None
    if torch is not None and isinstance(v, torch.Tensor):
        head = f"tensor(shape={tuple(v.shape)}, dtype={str(v.dtype).replace('torch.', '')}"
        if v.numel() <= 16:
            vals = v.detach().cpu().tolist()
            if v.is_floating_point():
                vals = _round(vals)
            return f"{head}, values={vals})"
        return head + ")"
    if isinstance(v, float):
        return repr(v) if len(repr(v)) <= 10 else f"{v:.6g}"
    if isinstance(v, dict):
        s = "{" + ", ".join(f"{k!r}: {show(x, limit)}" for k, x in v.items()) + "}"
    elif isinstance(v, (list, tuple)) and any(isinstance(x, float) for x in v):
        s = repr(_round(list(v)) if isinstance(v, list) else tuple(_round(list(v))))
    else:
        s = repr(v)
    return s if len(s) <= limit else s[:limit - 25] + f" ... ({len(s)} characters)"


def _round(vals):
    if isinstance(vals, list):
        return [_round(x) for x in vals]
    return float(f"{vals:.5g}") if isinstance(vals, float) else vals


def call_text(function: str, kwargs: dict, width: int = 100) -> str:
    """The call as a learner would type it: on one line when short, else one argument a line and a
    long list one item a line (nothing the failure turns on is cut off)."""
    one = f"{function}(" + ", ".join(f"{k}={show(v, 120)}" for k, v in kwargs.items()) + ")"
    if len(one) <= width:
        return one
    lines = []
    for k, v in kwargs.items():
        text = show(v, 2000)
        if isinstance(v, (list, tuple)) and len(v) > 1 and len(text) > width - 8:
            open_, close = ("[", "]") if isinstance(v, list) else ("(", ")")
            items = [show(x, 400) for x in v[:40]] + ([f"... ({len(v) - 40} more)"] if len(v) > 40 else [])
            pad = " " * (len(k) + 6)
            text = open_ + (",\n" + pad).join(items) + close
        lines.append(f"    {k}={text},")
    return f"{function}(\n" + "\n".join(lines) + "\n)"


# ---- comparing -----------------------------------------------------------------------------------
def compare_values(got: Any, expected: Any, *, rel: float = 1e-6, abs_: float = 1e-9, path: str = "") -> str | None:
    """Exact for ints, bools, strings and None; within ``rel`` / ``abs_`` for floats; element by
    element for lists / tuples / dicts; tensors through :func:`compare_tensors`.  None when equal,
    else one line naming where they differ."""
    where = path or "the result"
    try:
        import torch
        if isinstance(expected, torch.Tensor):
            return compare_tensors(got, expected, rtol=rel, atol=abs_, what=where)
    except ImportError:  # pragma: no cover
        pass
    if expected is None:
        return None if got is None else f"{where}: expected None, got {show(got)}"
    if isinstance(expected, bool):
        return None if got is expected or (isinstance(got, bool) and got == expected) else \
            f"{where}: expected {expected}, got {show(got)}"
    if isinstance(expected, (int, float)) and not isinstance(expected, bool):
        if isinstance(got, bool) or not isinstance(got, (int, float)):
            try:
                import numpy as np
                if isinstance(got, np.generic):
                    got = got.item()
            except ImportError:  # pragma: no cover
                pass
        if isinstance(got, bool) or not isinstance(got, (int, float)):
            return f"{where}: expected a number ({type(expected).__name__}), got {type(got).__name__} {show(got)}"
        if isinstance(expected, int) and not isinstance(got, int) and not float(got).is_integer():
            return f"{where}: expected the integer {expected}, got {show(got)}"
        if isinstance(expected, float) and math.isnan(expected):
            return None if isinstance(got, float) and math.isnan(got) else f"{where}: expected nan, got {show(got)}"
        if not math.isclose(got, expected, rel_tol=rel, abs_tol=abs_):
            return f"{where}: expected {show(expected)}, got {show(got)}"
        return None
    if isinstance(expected, str):
        return None if got == expected else f"{where}: expected {expected!r}, got {show(got)}"
    if isinstance(expected, (list, tuple)):
        if not isinstance(got, (list, tuple)):
            return (f"{where}: expected a {type(expected).__name__} of {len(expected)}, "
                    f"got {type(got).__name__} {show(got)}")
        if len(got) != len(expected):
            return f"{where}: expected {len(expected)} items, got {len(got)}"
        for i, (g, e) in enumerate(zip(got, expected)):
            msg = compare_values(g, e, rel=rel, abs_=abs_, path=f"{path}[{i}]" if path else f"item {i}")
            if msg:
                return msg
        return None
    if isinstance(expected, dict):
        if not isinstance(got, dict):
            return f"{where}: expected a dict, got {type(got).__name__}"
        if set(got) != set(expected):
            missing, extra = sorted(set(expected) - set(got), key=str), sorted(set(got) - set(expected), key=str)
            return f"{where}: keys differ (missing {missing}, unexpected {extra})"
        for k in expected:
            msg = compare_values(got[k], expected[k], rel=rel, abs_=abs_, path=f"{path}[{k!r}]" if path else repr(k))
            if msg:
                return msg
        return None
    return None if got == expected else f"{where}: expected {show(expected)}, got {show(got)}"


def compare_tensors(got: Any, expected, *, rtol: float = 1e-5, atol: float = 1e-6,
                    what: str = "the result") -> str | None:
    """Type, then dtype, then shape, then values: the first that differs, in one line."""
    import torch

    if not isinstance(got, torch.Tensor):
        return f"{what}: expected a torch.Tensor, got {type(got).__name__}"
    if got.dtype != expected.dtype:
        return f"{what}: expected dtype {expected.dtype}, got {got.dtype}"
    if tuple(got.shape) != tuple(expected.shape):
        return f"{what}: expected shape {tuple(expected.shape)}, got {tuple(got.shape)}"
    if got.numel() == 0:
        return None
    g, e = got.detach().cpu(), expected.detach().cpu()
    if g.is_floating_point():
        g64, e64 = g.double(), e.double()
        bad = ~torch.isclose(g64, e64, rtol=rtol, atol=atol, equal_nan=True)
    else:
        bad = g != e
    if not bool(bad.any()):
        return None
    idx = tuple(int(i) for i in bad.nonzero()[0])
    n = int(bad.sum())
    ev, gv = e[idx].item(), g[idx].item()
    diff = f", max abs difference {float((g.double() - e.double()).abs().max()):.3g}" if g.is_floating_point() else ""
    return (f"{what}: element {list(idx)} expected {show(ev)}, got {show(gv)} "
            f"({n} of {g.numel()} elements differ{diff}; tolerance rtol {rtol:g}, atol {atol:g})")


# ---- calling the learner's code --------------------------------------------------------------------
class _Raised(Exception):
    def __init__(self, exc: BaseException, where: str) -> None:
        super().__init__(str(exc))
        self.exc, self.where = exc, where


def _learner_frame(tb, fn) -> str:
    """The deepest frame of the traceback that is in the learner's code (their cell), as
    ``line N: <source>``; the checker's own frames are never shown."""
    code_file = getattr(getattr(fn, "__code__", None), "co_filename", None)
    ours = (_PACKAGE_DIR, sys.prefix, sys.base_prefix, "<frozen")
    best = ""
    for frame, lineno in traceback.walk_tb(tb):
        fname = frame.f_code.co_filename
        if fname == code_file or not fname.startswith(ours):
            src = linecache.getline(fname, lineno).strip()
            best = (f"line {lineno} of {frame.f_code.co_name}: {src}" if src
                    else f"line {lineno} of {frame.f_code.co_name}")
    return best


def _raised_by_the_stub(e: NotImplementedError, fn: Callable) -> bool:
    """Did the learner's own function raise it (the stub's ``raise NotImplementedError``), rather
    than a library it called (torch raises NotImplementedError for, e.g., a shift of a float tensor)?"""
    frames = list(traceback.walk_tb(e.__traceback__))
    if not frames:
        return False
    frame, lineno = frames[-1]
    line = linecache.getline(frame.f_code.co_filename, lineno).strip()
    # a C function (torch's) that raises leaves the learner's line calling it as the last Python frame
    return line.startswith("raise NotImplementedError") or (not line and not e.args)


def _call(fn: Callable, kwargs: dict) -> Any:
    try:
        return fn(**copy.deepcopy(kwargs))
    except NotImplementedError as e:
        if _raised_by_the_stub(e, fn):
            raise
        raise _Raised(e, _learner_frame(e.__traceback__, fn)) from None
    except Exception as e:  # the learner's code raised: say where in their code
        raise _Raised(e, _learner_frame(e.__traceback__, fn)) from None


def signature_problem(ex: Exercise, fn: Any) -> str | None:
    """None when ``fn`` can be called with the stub's parameters, else what to fix."""
    if not callable(fn):
        return f"expected a function named {ex.function}, got {type(fn).__name__} {show(fn, 60)}"
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    names = list(ex.cases()[0].kwargs) if ex.cases() else []
    try:
        sig.bind(**{n: None for n in names})
    except TypeError:
        return (f"{ex.function}'s parameters are ({', '.join(sig.parameters)}); the checker calls it with "
                f"({', '.join(names)}), as the stub does: keep the stub's parameter names")
    return None


# ---- checking ------------------------------------------------------------------------------------
def _verdict(ex: Exercise, fn: Callable, kwargs: dict) -> tuple[str, str, str] | None:
    """None when ``fn`` is right on ``kwargs``; else (expected, got, rule)."""
    try:
        got = _call(fn, kwargs)
    except _Raised as r:
        where = f" at {r.where}" if r.where else ""
        return "", "", f"your function raised {type(r.exc).__name__}: {r.exc}{where}"
    if ex.rules is not None:
        broken = ex.rules(copy.deepcopy(kwargs), got)
        return None if broken is None else ("", show(got), broken)
    expected = ex.reference(**copy.deepcopy(kwargs))
    broken = (ex.compare or (lambda kw, g, e: compare_values(g, e)))(copy.deepcopy(kwargs), got, expected)
    return None if broken is None else (show(expected), show(got), broken)


def check_fn(ex: Exercise, fn: Any, *, examples: int | None = None) -> Result:
    """Check ``fn`` against exercise ``ex``: signature, edge cases, then shrunk property-based
    inputs (module doc)."""
    sig = signature_problem(ex, fn)
    if sig:
        return Result(ex.id, "failed", case="the signature", call=ex.function, rule=sig)
    cases = ex.cases()
    for i, case in enumerate(cases):
        try:
            bad = _verdict(ex, fn, case.kwargs)
        except NotImplementedError:
            return Result(ex.id, "not written", cases_run=i)
        if bad:
            exp, got, rule = bad
            return Result(ex.id, "failed", case=f'edge case "{case.name}"', call=call_text(ex.function, case.kwargs),
                          expected=exp, got=got, rule=rule, cases_run=i + 1)
    n = ex.examples if examples is None else examples
    if ex.strategy is None or n <= 0:
        return Result(ex.id, "passed", cases_run=len(cases))
    from hypothesis import HealthCheck, Phase, find, settings
    from hypothesis.errors import NoSuchExample

    tried = [0]

    def fails(kwargs: dict) -> bool:
        tried[0] += 1
        try:
            return _verdict(ex, fn, kwargs) is not None
        except NotImplementedError:
            return True

    try:
        smallest = find(ex.strategy(), fails, settings=settings(
            max_examples=n, database=None, derandomize=True, deadline=None,
            phases=[Phase.generate, Phase.shrink], suppress_health_check=list(HealthCheck)))
    except NoSuchExample:
        return Result(ex.id, "passed", cases_run=len(cases), examples_run=min(tried[0], n))
    bad = _verdict(ex, fn, smallest) or ("", "", "failed on this input while shrinking, but not on a re-run "
                                                   "(does your function keep state between calls?)")
    exp, got, rule = bad
    return Result(ex.id, "failed", case="a property-based input (the smallest hypothesis found)",
                  call=call_text(ex.function, smallest), expected=exp, got=got, rule=rule,
                  cases_run=len(cases), examples_run=tried[0])
