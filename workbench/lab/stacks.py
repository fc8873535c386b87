"""Where a stuck notebook was: a kernel with a time limit per cell writes its threads' stacks
shortly before the limit (``WORKBENCH_STACK_DUMP``, :func:`stack_dump_spec`; the kernel side is
``workbench._arm_stack_dump``), and a notebook past its limit is recorded with the last dump
(:func:`last_stack_dump`) summed up in one line per thread (:func:`stack_summary`).  The batch
runner (:mod:`workbench.lab.runner`) and the browser run (:mod:`workbench.lab.browser`) use them."""

from __future__ import annotations

import re
from pathlib import Path


def stack_dump_spec(timeout: float | None, folder: Path) -> str | None:
    """The ``WORKBENCH_STACK_DUMP`` value for a kernel that has ``timeout`` seconds per cell: it
    writes its threads' stacks into ``folder`` shortly before that much time has passed, and again
    at each such interval (see ``workbench._arm_stack_dump``), so a cell stuck for ``timeout``
    seconds is caught in at least one dump; None without a limit."""
    if not timeout:
        return None
    return f"{max(float(timeout) - 15.0, 0.75 * float(timeout)):g}:{folder}"


def last_stack_dump(folder: Path) -> str | None:
    """The latest stack dump written into ``folder`` (the newest file's last dump), or None."""
    files = sorted(Path(folder).glob("stacks-*.txt"), key=lambda f: f.stat().st_mtime) if Path(folder).is_dir() else []
    for f in reversed(files):
        text = f.read_text(errors="replace")
        if "Timeout (" in text:
            return "Timeout (" + text.rsplit("Timeout (", 1)[1]
    return None


def stack_summary(dump: str, frames: int = 6) -> str:
    """One line per thread of a faulthandler dump that runs code of this project or of a
    notebook cell (not the kernel's idle machinery), innermost ``frames`` of those frames first."""
    out, rest = [], []
    for block in re.split(r"\n(?=(?:Current thread|Thread) 0x)", dump):
        calls = re.findall(r'File "([^"]+)", line (\d+) in (\S+)', block)
        ours = [c for c in calls if "/lib/python" not in c[0]]
        if calls:
            line = " <- ".join(f"{Path(f).name}:{ln} {fn}" for f, ln, fn in (ours or calls)[:frames])
            (out if ours else rest).append(line)
    return "; ".join(f"[thread {i}] {line}" for i, line in enumerate(out or rest))
