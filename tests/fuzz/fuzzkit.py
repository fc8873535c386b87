"""What every fuzz test of tests/fuzz/ shares: its example budget, its time and memory bound per
example, the check that a refusal is one line naming the file (and the field), and mutations of
JSON documents and of bytes.

Each fuzz test mutates a *valid* input file and asserts the outcome is either a correct load or
the project's own error (:class:`workbench.errors.WorkbenchError`) whose message is one line naming
the file - never another exception, never a hang, never an allocation the file does not justify.

Budget: ``fuzz(ci)`` runs ``ci`` examples (a few seconds a file, derandomized: every run draws
the same examples); ``WORKBENCH_FUZZ_EXAMPLES=10000`` runs that many instead (a long run)::

    WORKBENCH_FUZZ_EXAMPLES=10000 nice -n 19 .venv/bin/python -m pytest tests/fuzz/test_fuzz_recipe.py
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import threading
import time
import tracemalloc
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from workbench.errors import WorkbenchError

EXAMPLES_ENV = "WORKBENCH_FUZZ_EXAMPLES"
# An example that runs longer than this is a hang (the hypothesis deadline, below, is far tighter:
# this bound only ends an example that would never end by itself).
HANG_SECONDS = 20.0
MiB = 2**20


def examples(ci: int) -> int:
    """``ci``, or the long run's count from WORKBENCH_FUZZ_EXAMPLES."""
    raw = os.environ.get(EXAMPLES_ENV, "").strip()
    return int(raw) if raw else ci


def fuzz(ci: int, deadline_ms: int = 5000):
    """The hypothesis settings of one fuzz test: ``ci`` examples in CI (or the long run's count),
    a per-example deadline, the same examples on every run, no example database.  A long run also
    lifts pytest-timeout's per-test limit (pyproject: 900 s), which 10,000 examples can pass."""
    s = settings(max_examples=examples(ci), deadline=timedelta(milliseconds=deadline_ms), derandomize=True,
                 database=None, print_blob=True,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                        HealthCheck.data_too_large, HealthCheck.filter_too_much,
                                        HealthCheck.large_base_example])

    def apply(test):
        test = s(test)
        return pytest.mark.timeout(0)(test) if os.environ.get(EXAMPLES_ENV, "").strip() else test
    return apply


class Hang(BaseException):
    """An example ran past its time bound.  A BaseException, as KeyboardInterrupt: code under test
    that turns every ``Exception`` into its own error cannot hide a hang."""


def _rss_kib(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def _reset_peak_rss() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")          # VmHWM := VmRSS (Linux)
        return True
    except OSError:
        return False


@dataclass
class Usage:
    seconds: float = 0.0
    python_peak: int = 0          # bytes, tracemalloc (Python objects and numpy arrays)
    rss_growth: int | None = None  # bytes the resident set grew to at its peak (torch tensors too); None: not measured


@contextlib.contextmanager
def bounded(seconds: float = HANG_SECONDS, max_bytes: int | None = None, trace_python: bool = True):
    """Run the block under a time bound (SIGALRM raises :class:`Hang`, main thread only) and, with
    ``max_bytes``, check afterwards that neither the Python heap (tracemalloc peak) nor the
    resident set (the peak RSS, reset at the start) grew by more - whether the block returned or
    raised (a refusal must be bounded too)."""
    usage = Usage()
    main = threading.current_thread() is threading.main_thread()
    old = None
    if main:
        def on_alarm(signum, frame):
            raise Hang(f"still running after {seconds:g} s")
        old = signal.signal(signal.SIGALRM, on_alarm)
        signal.setitimer(signal.ITIMER_REAL, seconds)
    started = False
    if max_bytes is not None and trace_python:
        if not tracemalloc.is_tracing():
            tracemalloc.start()
            started = True
        tracemalloc.reset_peak()
        base_py = tracemalloc.get_traced_memory()[0]
    rss0 = _rss_kib("VmRSS") if max_bytes is not None and _reset_peak_rss() else None
    t0 = time.perf_counter()
    hung = False
    try:
        yield usage
    except Hang:
        hung = True
        raise
    finally:
        usage.seconds = time.perf_counter() - t0
        if main:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)
        if max_bytes is not None:
            if trace_python:
                usage.python_peak = tracemalloc.get_traced_memory()[1] - base_py
                if started:
                    tracemalloc.stop()
            hwm = _rss_kib("VmHWM")
            if rss0 is not None and hwm is not None:
                usage.rss_growth = max(0, hwm - rss0) * 1024
        # checked also when the block raised: a refusal that first allocated gigabytes is not bounded
        if max_bytes is not None and not hung:
            assert usage.python_peak <= max_bytes, (f"the Python heap grew by {usage.python_peak / MiB:.1f} MiB "
                                                    f"(limit {max_bytes / MiB:.1f} MiB)")
            assert usage.rss_growth is None or usage.rss_growth <= max_bytes, (
                f"the resident set grew by {usage.rss_growth / MiB:.1f} MiB (limit {max_bytes / MiB:.1f} MiB)")


def check_refusal(e: BaseException, names, fields=()) -> str:
    """``e`` is the project's error, one line, naming one of ``names`` (a file or folder: its
    path or its name) and, where ``fields`` are given, one of them.  Returns the message."""
    msg = str(e)
    assert isinstance(e, WorkbenchError), f"{type(e).__name__} is not a WorkbenchError: {msg}"
    assert msg.strip() and "\n" not in msg.strip(), f"not one line: {msg!r}"
    names = [str(n) for n in names]
    assert any(n in msg for n in names), f"the message names none of {names}: {msg}"
    if fields:
        assert any(str(f) in msg for f in fields), f"the message names none of the fields {list(fields)}: {msg}"
    return msg


def outcome(call, errors=(WorkbenchError,), seconds: float = HANG_SECONDS, max_bytes: int | None = None,
            trace_python: bool = True):
    """``("ok", result)`` or ``("error", exception)`` for one of ``errors``; a hang or the memory
    bound fails the test; any other exception propagates (and fails it)."""
    try:
        with bounded(seconds, max_bytes, trace_python):
            return "ok", call()
    except Hang as e:
        pytest.fail(f"hang: {e}")
    except errors as e:
        return "error", e


def note(label: str) -> None:
    """A hypothesis event (counted in ``--hypothesis-show-statistics``), also outside a test."""
    from hypothesis import event
    from hypothesis.control import currently_in_test_context

    if currently_in_test_context():
        event(label)


class Shown:
    """A drawn or fixture value that a falsifying example shows by its label (a file's bytes or a
    model would fill the screen)."""

    def __init__(self, value, label: str, **more) -> None:
        self.value, self.label = value, label
        self.__dict__.update(more)

    def __repr__(self) -> str:
        return self.label


# ---- JSON mutations --------------------------------------------------------------------------------

ODD_STRINGS = ["", " ", "null", "0", "-1", "4", "true", "re:(", "re:.*", "[", "\x00", "é", "💥", "a" * 300,
               "Linear", "Embedding", "lm_head", "group", "channel", "tensor", "token", "int", "float",
               "pack-quantized", "compressed-tensors", "NaN", "1e999"]
ODD_NUMBERS = [0, 1, -1, 2, 3, 4, 7, 8, 16, 32, 64, 127, 128, 255, 256, 2**31, 2**32, 2**53 + 1, 2**63, 2**64,
               -2**63, 10**30, 0.5, -0.0, 1e-300, 1e300, math.inf, -math.inf, math.nan]

json_leaves = (st.none() | st.booleans() | st.sampled_from(ODD_NUMBERS) | st.integers(-2**70, 2**70)
               | st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from(ODD_STRINGS) | st.text(max_size=12))


def json_values(keys=()):
    """Any JSON value (NaN and Infinity included: Python's json reads them), nested a little."""
    key = st.sampled_from(list(keys)) | st.text(max_size=8) if keys else st.text(max_size=8)
    return st.recursive(json_leaves, lambda inner: st.lists(inner, max_size=4)
                        | st.dictionaries(key, inner, max_size=4), max_leaves=8)


def json_paths(doc, prefix=()):
    """Every path into ``doc`` (a tuple of keys / indexes), the root's ``()`` first."""
    out = [prefix]
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += json_paths(v, prefix + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out += json_paths(v, prefix + (i,))
    return out


def get_path(doc, path):
    for k in path:
        doc = doc[k]
    return doc


def get_value(doc, path, missing="<removed>"):
    """The value at ``path``, or ``missing`` when it is not there."""
    try:
        return get_path(doc, path)
    except (KeyError, IndexError, TypeError):
        return missing


def _retyped(draw, v):
    """The same value in another JSON type (4 -> "4", [4], {"v": 4}, 4.0, true ...)."""
    options = [str(v), [v], {"value": v}, None, not bool(v) if isinstance(v, bool) else True]
    if isinstance(v, bool):
        options += [int(v), str(v).lower()]
    elif isinstance(v, (int, float)):
        options += [float(v), -v, v + 1, v - 1, v * 2, v // 2 if isinstance(v, int) else v / 2, 0]
    elif isinstance(v, str):
        options += [v.upper(), v + "x", v[:-1], " " + v, v.replace("_", "-")]
        with contextlib.suppress(ValueError):
            options.append(int(v))
    elif isinstance(v, list):
        options += [v[1:], v + v[:1], {str(i): x for i, x in enumerate(v)}, list(reversed(v))]
    elif isinstance(v, dict):
        options += [list(v.values()), list(v), {}]
    return draw(st.sampled_from(options))


@st.composite
def mutated_json(draw, doc, keys=(), paths=None):
    """``(new document, path, action)``: one change at one place of ``doc`` - a value replaced by
    any JSON value or the same value retyped, a key removed or added, a list item dropped or
    repeated.  ``paths``: where to choose from (default: every path); ``keys``: key names to
    prefer when adding or nesting (the schema's own)."""
    new = json.loads(json.dumps(doc))
    paths = paths if paths is not None else json_paths(new)
    path = draw(st.sampled_from(paths))
    here = get_path(new, path)
    actions = ["replace", "retype"]
    if path:
        actions.append("delete")
    if isinstance(here, dict):
        actions.append("add")
    if isinstance(here, list) and here:
        actions += ["drop_item", "repeat_item"]
    action = draw(st.sampled_from(actions))
    if action in ("replace", "retype"):
        value = draw(json_values(keys)) if action == "replace" else _retyped(draw, here)
        if path:
            get_path(new, path[:-1])[path[-1]] = value
        else:
            new = value
    elif action == "delete":
        parent = get_path(new, path[:-1])
        del parent[path[-1]]
    elif action == "add":
        key = draw(st.sampled_from(list(keys)) | st.text(max_size=8)) if keys else draw(st.text(max_size=8))
        here[key] = draw(json_values(keys))
        path = path + (key,)
    elif action == "drop_item":
        here.pop(draw(st.integers(0, len(here) - 1)))
    else:
        here.append(here[draw(st.integers(0, len(here) - 1))])
    return new, path, action


def dump_json(doc) -> str:
    return json.dumps(doc, indent=1, allow_nan=True)


# ---- byte mutations -------------------------------------------------------------------------------------

@st.composite
def mutated_bytes(draw, data: bytes, region: tuple[int, int] | None = None):
    """``(new bytes, description)``: ``data`` truncated, with bytes flipped / overwritten / inserted /
    deleted, or a little-endian integer at some offset replaced by an odd value; ``region``:
    the byte range to aim at (default: all of it)."""
    lo, hi = region or (0, len(data))
    hi = max(lo + 1, min(hi, len(data)))
    kind = draw(st.sampled_from(["truncate", "flip", "overwrite", "insert", "delete", "int"]))
    pos = draw(st.integers(lo, hi - 1))
    b = bytearray(data)
    if kind == "truncate":
        return bytes(b[:pos]), f"truncated to {pos} bytes"
    if kind == "flip":
        b[pos] ^= draw(st.integers(1, 255))
        return bytes(b), f"byte {pos} flipped"
    if kind == "overwrite":
        new = draw(st.binary(min_size=1, max_size=16))
        b[pos:pos + len(new)] = new
        return bytes(b), f"{len(new)} bytes overwritten at {pos}"
    if kind == "insert":
        new = draw(st.binary(min_size=1, max_size=16))
        b[pos:pos] = new
        return bytes(b), f"{len(new)} bytes inserted at {pos}"
    if kind == "delete":
        n = draw(st.integers(1, 16))
        del b[pos:pos + n]
        return bytes(b), f"{n} bytes deleted at {pos}"
    width = draw(st.sampled_from([1, 2, 4, 8]))
    value = draw(st.sampled_from([0, 1, 2**(8 * width) - 1, 2**(8 * width - 1), 2**(8 * width - 1) - 1, 255, 256,
                                  65535, 2**31, 2**32 - 1]) | st.integers(0, 2**(8 * width) - 1)) % 2**(8 * width)
    b[pos:pos + width] = value.to_bytes(width, "little")
    return bytes(b[:len(data)]) if pos + width > len(data) else bytes(b), f"uint{8 * width} {value} at {pos}"
