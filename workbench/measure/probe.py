"""How noisy is this machine right now?  A half-second probe run at the top of every notebook.

Two measurements, both of fixed work, so they say something about the machine and not the code:

* **jitter**: a ~16 ms single-threaded task (the time scale of a prefill chunk or a few decode
  steps) repeated ``repeats`` times; the spread of its times, ``(p90 - p10) / median``, and its
  interquartile range over the median.  Two identical workloads measured a few times each differ
  in their *medians* by about the interquartile range, so that (at least 5 %) becomes the
  *noise floor* of every comparison in the run (:attr:`NoiseProbe.threshold`): a ratio smaller
  than ``1 + threshold`` is "within noise".  The floor is capped at 25 %: noise at this time
  scale overstates the noise of runs that last seconds (measured on a 2-core VM with one busy
  background process: the task's interquartile range was 1-5 % most of the time but reached
  50-88 % for minutes at a stretch, while 3-second replays in the same minutes varied by
  +-15 %); beyond the cap, the rule that the runs' own ranges must not overlap carries the test.
* **free cores**: a matrix multiply with every core's thread vs with one thread.  On an idle
  2-core machine two threads are ~1.8x faster; when another process holds a core they are
  *slower* than one (each parallel region waits for a thread that is not scheduled).  That is
  why the engine chooses its thread count by measurement (:mod:`workbench.measure.threads`).

The load average is not used: in a VM it counts other tenants' work, or none of it.  The floor
is measured once, on a short CPU-bound task; longer, memory-bound runs can be noisier than that,
which is why a verdict also needs the runs' own ranges apart (:mod:`workbench.measure.compare`):
the floor is a lower bound on what counts as a difference, not the whole test.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import asdict, dataclass

_LAST: NoiseProbe | None = None
MIN_THRESHOLD = 0.05
MAX_THRESHOLD = 0.25


@dataclass
class NoiseProbe:
    repeats: int
    task_ms: float                 # median time of the fixed single-threaded task
    spread: float                  # (p90 - p10) / median of that task
    iqr: float                     # (p75 - p25) / median
    worst: float                   # max / median
    cores: int                     # CPUs this process may run on
    parallel_speedup: float | None  # all-cores matmul vs one thread (None with one core)
    threshold: float               # the noise floor comparisons use: iqr, within [5 %, 25 %]

    def describe(self) -> str:
        line = (f"machine noise: a {self.task_ms:.1f} ms task varies by {self.spread:.0%} (p10..p90 over "
                f"{self.repeats} runs; interquartile {self.iqr:.0%}; worst {self.worst:.1f}x the median); "
                f"comparisons call differences below {self.threshold:.0%} 'within noise'"
                + (" (the floor's cap: the runs' own ranges carry the test beyond it)" if self.iqr > MAX_THRESHOLD
                   else ""))
        if self.parallel_speedup is not None:
            busy = self.parallel_speedup < 0.75 * min(self.cores, 2)
            line += (f". {self.cores} cores: a {self.cores}-thread matmul runs {self.parallel_speedup:.2f}x as fast as "
                     f"one thread" + (" -- some cores are busy with other work" if busy else ""))
        return line

    def as_dict(self) -> dict:
        return asdict(self)


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _python_task(n: int) -> int:
    s = 0
    for i in range(n):
        s += i * i
    return s


def _time(fn, *args) -> float:
    t = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t


def _calibrate(target_s: float) -> int:
    """Iterations of the task that take ``target_s`` (the fastest of 3 timings at each size, so
    one descheduled run does not shrink the task)."""
    n = 2_000
    while True:
        dt = min(_time(_python_task, n) for _ in range(3))
        if dt >= target_s / 4 or n > 50_000_000:
            return max(1, int(n * target_s / max(dt, 1e-9)))
        n *= 4


def _parallel_speedup(cores: int, rounds: int = 5) -> float | None:
    if cores < 2:
        return None
    import torch  # lazy: torch (~3 s) only for this probe; lab and the sweep executors import this module

    before = torch.get_num_threads()
    a = torch.randn(384, 384)
    times = {1: [], cores: []}
    try:
        for r in range(rounds):
            for t in ((1, cores) if r % 2 == 0 else (cores, 1)):
                torch.set_num_threads(t)
                torch.mm(a, a)   # wakes the threads up
                times[t].append(_time(lambda: [torch.mm(a, a) for _ in range(4)]))
    finally:
        torch.set_num_threads(before)
    return statistics.median(times[1]) / statistics.median(times[cores])


def noise_probe(repeats: int = 16, task_ms: float = 16.0, parallel: bool = True) -> NoiseProbe:
    """Measure the machine's noise now (about ``repeats x task_ms`` plus ~0.1 s); remembered
    as the default noise floor of :func:`workbench.measure.compare.compare` in this process."""
    global _LAST
    if repeats < 5:
        raise ValueError(f"noise_probe: repeats must be >= 5 to estimate a spread, got {repeats}")
    n = _calibrate(task_ms / 1e3)
    _python_task(n)
    times = sorted(_time(_python_task, n) for _ in range(repeats))
    med = statistics.median(times)
    q = lambda f: times[int(round(f * (repeats - 1)))]   # noqa: E731 - quantile of the sorted times
    spread, iqr = (q(0.9) - q(0.1)) / med, (q(0.75) - q(0.25)) / med
    cores = available_cores()
    probe = NoiseProbe(repeats=repeats, task_ms=med * 1e3, spread=spread, iqr=iqr, worst=times[-1] / med,
                       cores=cores, parallel_speedup=_parallel_speedup(cores) if parallel else None,
                       threshold=min(MAX_THRESHOLD, max(MIN_THRESHOLD, iqr)))
    _LAST = probe
    return probe


def last_probe() -> NoiseProbe | None:
    """The most recent :func:`noise_probe` of this process, if any."""
    return _LAST


__all__ = ["NoiseProbe", "noise_probe", "last_probe", "available_cores", "MIN_THRESHOLD", "MAX_THRESHOLD"]
