"""The CPU thread policy: how many intra-op threads the engine uses, chosen by measurement.

PyTorch runs each op on ``torch.get_num_threads()`` threads (one per core by default).  For a
small model the ops are tiny, and each OpenMP parallel region waits for its slowest thread: when
another process holds one of the cores, that thread is not scheduled for milliseconds and every
op stalls.  Measured on a 2-core VM with one busy background process, the bundled model's decode
step took ~4.8 ms with 1 thread and 9-48 ms with 2; idle, the two were equal.  A thread count
that is right on an idle machine can be 2-10x wrong a minute later, and every comparison made
with it teaches the wrong lesson.

So the engine measures at load (:func:`choose_threads`): decode steps of *the loaded model*
with each candidate thread count, interleaved, and takes the **fewest threads whose median step
is within ``margin`` of the fastest**.  Fewer threads win ties because the downside is
asymmetric: an extra thread buys little on an idle machine and costs a lot on a busy one.

Overrides, strongest first: ``LLM(threads=N)`` / ``--threads N``; the environment variable
``WORKBENCH_THREADS`` (an integer, or ``auto``).  A count above the cores this process may use
(``os.sched_getaffinity``) is refused in one line (:func:`usable_threads`), never handed to torch.
An engine built on a model another engine already chose for (``LLM(llm.model, kv=...)``)
inherits that choice.  The measurement times the model as it is at load: per-op backends
applied later (``--backend``) are not part of it.  On a GPU the host threads only launch work
and are left as they are.

The OpenMP *wait policy* (``OMP_WAIT_POLICY=PASSIVE``) also rescues 2 threads under load, but
it is read once, when torch is imported, and it costs an idle machine: measured here, a 64-token
prefill with 2 threads took 17 ms PASSIVE vs 10 ms by default.  With the measured thread count
the default policy is never the problem (one thread opens no parallel region), so the workbench
leaves it alone.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import asdict, dataclass, field

import torch

from workbench.errors import ConfigError
from workbench.measure.probe import available_cores

ENV = "WORKBENCH_THREADS"
_CACHE: dict[tuple, ThreadChoice] = {}


@dataclass
class ThreadChoice:
    threads: int
    policy: str                  # measured | cached | inherited | argument | environment | single candidate | cuda
    step_ms: dict[int, float] = field(default_factory=dict)   # median decode step per candidate
    spread_ms: dict[int, tuple[float, float]] = field(default_factory=dict)
    seconds: float = 0.0                         # what measuring cost
    note: str = ""

    def describe(self) -> str:
        if self.step_ms:
            steps = ", ".join(f"{t} thread{'s' if t > 1 else ''} {ms:.2f} ms" for t, ms in sorted(self.step_ms.items()))
            when = f"measured in {self.seconds:.2f} s" if self.policy == "measured" else self.note
            return (f"{self.threads} thread{'s' if self.threads > 1 else ''} "
                    f"({self.policy}: decode step {steps}; {when})")
        return (f"{self.threads} thread{'s' if self.threads > 1 else ''} "
                f"({self.policy}{': ' + self.note if self.note else ''})")

    def as_dict(self) -> dict:
        d = asdict(self)
        d["step_ms"] = {str(k): v for k, v in self.step_ms.items()}
        d["spread_ms"] = {str(k): list(v) for k, v in self.spread_ms.items()}
        return d


def candidate_threads(cores: int | None = None) -> list[int]:
    """1, 2, 4, ... up to the cores this process may use (always including that number).
    ``OMP_NUM_THREADS``, when set to a positive integer, caps them: Ray sets it to a task's CPUs,
    and a kernel sharing the machine with others must not measure its way past its share."""
    cores = cores or available_cores()
    omp = os.environ.get("OMP_NUM_THREADS", "").strip()
    if omp.isdigit() and int(omp) > 0:
        cores = min(cores, int(omp))
    out, t = [], 1
    while t < cores:
        out.append(t)
        t *= 2
    return out + [cores]


def parse_threads(value, where: str = "threads") -> int | None:
    """``None``/``"auto"`` -> None (measure); a positive integer -> that; anything else raises.
    (:func:`usable_threads` also holds it to the cores this process may use.)"""
    if value is None or (isinstance(value, str) and value.strip().lower() in ("", "auto")):
        return None
    try:
        n = int(value)
    except (TypeError, ValueError, OverflowError):
        n = 0
    if isinstance(value, bool) or n < 1 or (isinstance(value, float) and value != n):
        raise ConfigError(f"{where}: expected a positive integer or 'auto', got {value!r}")
    return n


def usable_threads(value, where: str = "threads") -> int | None:
    """:func:`parse_threads`, and no more than the cores this process may use
    (:func:`~workbench.measure.probe.available_cores`: ``os.sched_getaffinity``).  More is refused,
    not capped: OpenMP starts every thread it is given (``--threads 100000`` crashed inside libgomp,
    and other processes on the machine could not fork meanwhile), and past the cores a thread only
    waits for one, so a figure measured with it misleads; a one-line error says what to give."""
    n = parse_threads(value, where)
    cores = available_cores()
    if n is not None and n > cores:
        raise ConfigError(f"{where}: {n:,} threads is more than the {cores} core{'s' if cores > 1 else ''} "
                          f"this process may use (os.sched_getaffinity); give 1 to {cores}, or auto (measured)")
    return n


@torch.inference_mode()
def _step_times(model, threads: list[int], budget_s: float, min_rounds: int = 3, max_rounds: int = 7,
                prompt_tokens: int = 8) -> dict[int, list[float]]:
    """Decode-step times per thread count, round-robin (order alternates each round).  Each
    sample is the median of up to 4 timed steps after a warm one; a model whose step is slow
    compared with ``budget_s`` gets 1 timed step and, past ``4 x budget_s``, a single round.
    torch's thread count is restored if anything fails."""
    cfg = model.config
    steps_per = 4
    cache_len = min(prompt_tokens + 2 + steps_per, cfg.max_position_embeddings)
    device = model.device
    x = torch.zeros(1, 1, dtype=torch.long, device=device)
    ids = torch.arange(prompt_tokens, device=device).remainder(cfg.vocab_size).unsqueeze(0)
    times: dict[int, list[float]] = {t: [] for t in threads}
    before = torch.get_num_threads()
    start = time.perf_counter()
    try:
        for r in range(max_rounds):
            for t in (threads if r % 2 == 0 else threads[::-1]):
                torch.set_num_threads(t)
                cache = model.new_cache(1, cache_len)
                model(ids, 0, cache, logits_to_keep=1)          # prefill (and wakes the threads)
                pos = prompt_tokens
                t0 = time.perf_counter()
                model(x, pos, cache, logits_to_keep=1)          # first decode step: warm, and a cost estimate
                if time.perf_counter() - t0 > budget_s / (4 * len(threads)):
                    steps_per = 1                               # a slow model: one timed step per sample
                per = []
                for _ in range(steps_per):
                    pos += 1
                    if pos >= cache_len:
                        break
                    t0 = time.perf_counter()
                    model(x, pos, cache, logits_to_keep=1)
                    per.append(time.perf_counter() - t0)
                times[t].append(statistics.median(per) if per else float("inf"))
            elapsed = time.perf_counter() - start
            if (r + 1 >= min_rounds and elapsed > budget_s) or elapsed > 4 * budget_s:
                break
    except BaseException:
        torch.set_num_threads(before)
        raise
    return times


def pick_threads(step_ms: dict[int, float], margin: float = 1.15) -> int:
    """The fewest threads whose median step time is within ``margin`` of the fastest."""
    if not step_ms:
        raise ValueError("pick_threads: no measurements")
    best = min(step_ms.values())
    return min(t for t, ms in step_ms.items() if ms <= margin * best)


def choose_threads(model, candidates: list[int] | None = None, budget_s: float = 0.5,
                   margin: float = 1.15) -> ThreadChoice:
    """Measure decode steps of ``model`` with each candidate thread count and pick the fewest
    threads whose median is within ``margin`` of the fastest.  Leaves torch set to the choice."""
    t0 = time.perf_counter()
    candidates = sorted(set(candidates or candidate_threads()))
    if len(candidates) == 1:
        torch.set_num_threads(candidates[0])
        return ThreadChoice(candidates[0], "single candidate",
                            note="one core available" if candidates == [available_cores()] else "nothing to compare")
    times = _step_times(model, candidates, budget_s)
    med = {t: statistics.median(v) * 1e3 for t, v in times.items()}
    chosen = pick_threads(med, margin)
    torch.set_num_threads(chosen)
    return ThreadChoice(chosen, "measured", step_ms=med,
                        spread_ms={t: (min(v) * 1e3, max(v) * 1e3) for t, v in times.items()},
                        seconds=time.perf_counter() - t0)


def _cache_key(model) -> tuple:
    w = model.lm_head.weight
    c = model.config
    return (c.hidden_size, c.intermediate_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads,
            c.vocab_size, str(w.dtype), str(w.device), available_cores())


def apply_thread_policy(model, threads=None, remeasure: bool = False) -> ThreadChoice:
    """Set torch's intra-op thread count for ``model`` and say why (see the module docstring).

    ``threads``: a positive integer up to the cores this process may use (used as is; more is a
    ConfigError: :func:`usable_threads`), or None / ``"auto"``: the ``WORKBENCH_THREADS``
    environment variable if set; else the choice an earlier engine made for this same model
    object (so ``LLM(llm.model, kv=...)`` keeps ``llm``'s threads, given or measured); else
    measured once per process and model shape (``remeasure`` measures again).  The choice is
    remembered on the model (``model.thread_choice``)."""
    choice = _resolve(model, threads, remeasure)
    try:
        model.thread_choice = choice
    except AttributeError:      # a model class that refuses new attributes: nothing to inherit later
        pass
    return choice


def _resolve(model, threads, remeasure: bool) -> ThreadChoice:
    n = usable_threads(threads)
    if n is not None:
        torch.set_num_threads(n)
        return ThreadChoice(n, "argument")
    env = os.environ.get(ENV)
    if env is not None and env.strip():
        n = usable_threads(env, where=f"environment variable {ENV}")
        if n is not None:
            torch.set_num_threads(n)
            return ThreadChoice(n, "environment", note=f"{ENV}={env}")
    if model.device.type != "cpu":
        return ThreadChoice(torch.get_num_threads(), "cuda" if model.device.type == "cuda" else model.device.type,
                            note="host threads only launch device work; left as they are")
    prev = getattr(model, "thread_choice", None)
    if not remeasure and isinstance(prev, ThreadChoice):
        torch.set_num_threads(prev.threads)
        return ThreadChoice(prev.threads, "inherited", step_ms=prev.step_ms, spread_ms=prev.spread_ms,
                            note=f"chosen for this model earlier ({prev.policy})")
    key = _cache_key(model)
    if not remeasure and key in _CACHE:
        prev = _CACHE[key]
        torch.set_num_threads(prev.threads)
        return ThreadChoice(prev.threads, "cached", step_ms=prev.step_ms, spread_ms=prev.spread_ms,
                            note="measured earlier in this process for this model shape")
    choice = choose_threads(model)
    _CACHE[key] = choice
    return choice


__all__ = ["ThreadChoice", "apply_thread_policy", "choose_threads", "pick_threads", "candidate_threads",
           "parse_threads", "usable_threads", "ENV"]
