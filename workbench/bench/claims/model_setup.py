"""The model claims' shared pieces: number formats, one torch thread, held-out prompts, a
reference engine on the run's loaded model.

The model / memory / precision claims (11-16, :mod:`~workbench.bench.claims.catalogue`) are measured
on this machine's CPU with the bundled model (and, where the claim is arithmetic about a real
checkpoint's shape, a real allocation of that shape).  Each has a *rule* (a pure function of the
measured numbers, unit-tested on synthetic inputs: ``share_rule``, ``slope_rule``,
``kv_size_rule``, ``release_rule``, ``reuse_rule``, ``domain_rule``) and a *measurement*
(``measure_*``, on ``ctx.llm()``'s model) that feeds it.  The measurements live in
``workbench.bench`` (``request_profile``, ``prefill_scaling``, ``kv_sizing``, ``request_memory``,
``tier_reuse``) and ``workbench.quant.calibrate_report``; the claims' modules
(:mod:`~workbench.bench.claims.model_compute`, :mod:`~workbench.bench.claims.model_memory`,
:mod:`~workbench.bench.claims.model_quality`) only size them by mode, state the rule and word the finding.
"""

from __future__ import annotations

from contextlib import contextmanager

from workbench.bench.claims.core import ClaimContext

GB, GiB, MiB = 1e9, 2 ** 30, 2 ** 20


def _pct(x: float | None, digits: int = 1) -> str:
    return "n/a" if x is None else f"{100 * x:.{digits}f} %"


def _ms(s: float | None) -> str:
    return "n/a" if s is None else f"{s * 1e3:.3f} ms"


def _cap(text: str) -> str:
    return text[:1].upper() + text[1:]


@contextmanager
def _one_thread():
    """One torch thread while a quality-only measurement runs (its timing is not the point, and on a
    shared 2-core machine two threads can stall for minutes); the engine's choice is restored."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _prompt(ctx: ClaimContext, length: int, seed: int = 0) -> list[int]:
    """``length`` token ids of held-out text (random ids when the model has no tokenizer)."""
    llm = ctx.llm()
    if llm.tokenizer is not None:
        from workbench.data import heldout_token_windows

        w = heldout_token_windows(llm.tokenizer, 1, length, seed=seed)
        if w:
            return w[0]
    import random

    rng = random.Random(seed)
    return [rng.randrange(1, llm.model.config.vocab_size) for _ in range(length)]


def _reference_engine(ctx: ClaimContext, kv="contiguous"):
    """A new engine on the shared model: one request at a time, the whole prompt in one step."""
    from workbench.engine.core import LLMEngine
    from workbench.engine.llm import reference_scheduler

    loaded = ctx.llm().loaded
    return LLMEngine(loaded, kv=kv, scheduler=reference_scheduler(loaded.max_model_len))
