"""Sizes checked before allocation: what an entry point is about to allocate, against what the
machine has.

Why.  A KV pool, a contiguous cache or a calibration set is sized by a few numbers a user types
(``--num-blocks``, ``--block-size``, ``--max-num-seqs``, ``--max-model-len``, a JSONL file), and
``torch.zeros`` does what it is asked: ``--num-blocks 2000000`` on the bundled model touched
7 GB in 26 s and was still growing when it was stopped, and an engine that outgrows the machine
is killed by the kernel's OOM killer - no message, no file or flag named, other processes
starved on the way.  So every engine, server and calibrator computes the bytes first, from the
same shapes it will allocate, and refuses in one line that names the figure, how it was reached
and the flag that sets it::

    plan = MemoryPlan(budget=parse_bytes("8G"))
    plan.add("KV pool", 2_000_000 * 98_304, "num_blocks / --num-blocks",
             "2,000,000 blocks x 96.0 KiB a block", place="cpu")
    plan.check()     # ConfigError: KV pool: 2,000,000 blocks x 96.0 KiB a block = 183.1 GiB, more than ...

    check_allocation("KV pool", nbytes, "num_blocks / --num-blocks", budget=None, device="cpu")

What "available" means (:func:`available_memory`): on a CPU (and for host memory beside a GPU)
``MemAvailable`` of ``/proc/meminfo`` - what the kernel can hand out without swapping - or the
cgroup's limit minus its usage when that is smaller (a container); on CUDA the free bytes of
``torch.cuda.mem_get_info`` (the weights are loaded by then, so they are already taken); for an
offload file, the free space of its file system.  A *budget* (``memory_budget=`` /
``--memory-budget``, :func:`parse_bytes`: ``8G``, ``512M``) caps the sum of everything one plan
holds, wherever it lives; the machine caps each place.  Nothing here allocates: the check is
arithmetic, so a refusal takes no memory and no time.

This module imports no torch (it is imported by command-line code that must answer fast); CUDA's
free memory is asked for only when a plan has a CUDA place.
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass, field

from workbench.errors import ConfigError

UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40, "p": 1 << 50}
BUDGET_FLAG = "memory_budget / --memory-budget"


def format_bytes(n: float) -> str:
    """``183.1 GiB``, ``96.0 KiB``, ``512 B`` (binary units, one decimal)."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def parse_bytes(value, where: str = "memory_budget") -> int | None:
    """Bytes from ``8G`` / ``8GiB`` / ``8GB``, ``512M``, ``64k``, ``1.5G``, ``8e9`` or an integer
    (K, M, G, T, P are powers of 1024: ``8G`` = 8 GiB); None / ``""`` -> None (no budget).  Anything
    else, or less than one byte, is a ConfigError naming ``where``."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    if isinstance(value, bool):
        raise ConfigError(f"{where}: expected a size in bytes (8G, 512M, 1000000), got {value!r}")
    if isinstance(value, (int, float)):
        number, scale = float(value), 1
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([kmgtp]?)(?:i?b)?\s*", str(value), re.I)
        if m is None:
            raise ConfigError(f"{where}: expected a size in bytes such as 8G, 512M or 1000000 (K, M, G, T = "
                              f"powers of 1024), got {value!r:.80}")
        number, scale = float(m.group(1)), UNITS[m.group(2).lower()]
    nbytes = number * scale
    if not nbytes >= 1 or nbytes > 1 << 62:       # also NaN
        raise ConfigError(f"{where}: {value!r:.80} is not a size between 1 byte and 4 EiB")
    return int(nbytes)


@dataclass(frozen=True)
class Available:
    """Bytes that can be allocated at one place, and where the figure comes from."""

    nbytes: int
    where: str            # "available on this host (MemAvailable)", "free on cuda:0 (torch.cuda.mem_get_info)", ...


def _meminfo_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _cgroup_room() -> int | None:
    """The cgroup's memory limit minus its usage (v2, else v1), or None without a limit."""
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            with open(limit_file) as f:
                limit = f.read().strip()
            with open(usage_file) as f:
                usage = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if not limit.isdigit() or int(limit) >= 1 << 60:      # "max", or v1's "no limit" figure
            return None
        return max(0, int(limit) - usage)
    return None


def host_available() -> Available:
    """Host memory that can be allocated now: ``MemAvailable``, or a container's room when smaller."""
    avail = _meminfo_available()
    where = "available on this host (MemAvailable)"
    if avail is None:
        try:
            import psutil  # lazy: psutil is optional (not a dependency)

            avail = int(psutil.virtual_memory().available)
            where = "available on this host (psutil)"
        except Exception:  # noqa: BLE001 - no psutil, or it cannot read the figure here
            try:
                avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
                where = "free on this host (sysconf)"
            except (ValueError, OSError, AttributeError):
                avail, where = 1 << 62, "(host memory unknown: not checked)"
    room = _cgroup_room()
    if room is not None and room < avail:
        avail, where = room, "left in this container's memory limit (cgroup)"
    return Available(int(avail), where)


def available_memory(place="cpu") -> Available:
    """What can be allocated at ``place``: ``"cpu"`` (host memory), a CUDA device (``"cuda"``,
    ``"cuda:1"``, a torch.device: the free bytes ``torch.cuda.mem_get_info`` reports) or
    ``"disk:<folder>"`` (the free space of that folder's file system)."""
    name = str(place)
    if name.startswith("disk:"):
        folder = name.removeprefix("disk:") or "."
        try:
            return Available(shutil.disk_usage(folder).free, f"free on the file system of {folder}")
        except OSError:
            return Available(1 << 62, f"(free space of {folder} unknown: not checked)")
    if name.startswith("cuda"):
        import torch  # lazy: torch (~3 s) only for a CUDA device; parse_bytes / format_bytes callers need none

        dev = torch.device(name)
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        free, _ = torch.cuda.mem_get_info(dev)
        return Available(int(free), f"free on {dev} (torch.cuda.mem_get_info)")
    if name.startswith("cpu"):
        return host_available()
    return Available(1 << 62, f"(free memory of {name} unknown: not checked)")


@dataclass
class Planned:
    what: str              # "KV pool", "offload tier (host)", "calibration data"
    nbytes: int
    flag: str              # what sets it: "num_blocks / --num-blocks"
    detail: str = ""       # how the figure is reached: "2,000,000 blocks x 96.0 KiB a block (...)"
    place: str = "cpu"
    fix: str = ""          # what to do instead of "set <flag> lower", when that is not the whole answer


@dataclass
class MemoryPlan:
    """Allocations one entry point is about to make, checked together before any is made.

    ``budget``: bytes of memory the plan may hold in all, host and devices together (a file
    system's bytes are not in it; None: only the machine limits it); each place
    (host, a CUDA device, a file system) is also limited by what it has available when
    :meth:`check` runs.  ``available``: a function from place to :class:`Available` (tests give a
    small machine here)."""

    budget: int | None = None
    budget_flag: str = BUDGET_FLAG
    items: list[Planned] = field(default_factory=list)
    available: object = None

    def add(self, what: str, nbytes: int, flag: str, detail: str = "", place="cpu", fix: str = "") -> None:
        self.items.append(Planned(what, int(nbytes), flag, detail, _place(place), fix))

    @property
    def total(self) -> int:
        return sum(i.nbytes for i in self.items)

    def check(self) -> MemoryPlan:
        """Raise ConfigError at the first item that does not fit (the budget, then its place)."""
        look = self.available or available_memory
        have: dict[str, Available] = {}
        used: dict[str, int] = {}
        total = 0
        for item in self.items:
            if item.nbytes <= 0:
                continue
            disk = item.place.startswith("disk:")        # a budget is memory: a file's bytes are not in it
            total += 0 if disk else item.nbytes
            if self.budget is not None and not disk and total > self.budget:
                raise ConfigError(_refusal(item, total - item.nbytes, self.budget, f"{self.budget_flag} of",
                                           f"{item.fix or item.flag + ' lower'}, or raise {self.budget_flag}"))
            if item.place not in have:
                have[item.place] = look(item.place)
            used[item.place] = used.get(item.place, 0) + item.nbytes
            avail = have[item.place]
            if used[item.place] > avail.nbytes:
                raise ConfigError(_refusal(item, used[item.place] - item.nbytes, avail.nbytes, None,
                                           item.fix or f"{item.flag} lower", avail.where))
        return self

    def describe(self) -> list[str]:
        """One line per planned allocation (logs, ``--json`` reports)."""
        return [f"{i.what}: {format_bytes(i.nbytes)} on {i.place}" + (f" ({i.detail})" if i.detail else "")
                for i in self.items]


def _place(place) -> str:
    name = str(place)
    return "cpu" if name.startswith("cpu") else name


def _refusal(item: Planned, before: int, limit: int, limit_name: str | None, fix: str, where: str = "") -> str:
    figure = f"{item.detail} = {format_bytes(item.nbytes)}" if item.detail else format_bytes(item.nbytes)
    others = f" (with {format_bytes(before)} planned before it)" if before else ""
    cap = f"the {limit_name} {format_bytes(limit)}" if limit_name else f"the {format_bytes(limit)} {where}"
    return f"{item.what}: {figure}{others}, more than {cap}; set {fix}"


def check_allocation(what: str, nbytes: int, flag: str, budget: int | None = None, device="cpu",
                     detail: str = "", available=None) -> None:
    """One allocation of ``nbytes`` at ``device``, checked against ``budget`` and what the device
    has available (:class:`MemoryPlan` with one item): a ConfigError naming ``what``, the figure
    (``detail`` says how it is reached) and ``flag``, the setting that makes it smaller."""
    plan = MemoryPlan(budget=budget, available=available)
    plan.add(what, nbytes, flag, detail, device)
    plan.check()


__all__ = ["Available", "MemoryPlan", "Planned", "available_memory", "check_allocation", "format_bytes",
           "host_available", "parse_bytes"]
