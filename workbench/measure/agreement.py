"""Greedy token agreement between two paths, and how close the first disagreement was.

A non-exact path (a Triton kernel, ``torch.compile``, another reduction order) may flip a
greedy token where the reference's top two logits nearly tie; after that the sequences differ
for good.  So agreement is reported with the *margin at the first divergence*: the reference's
logit of its own token minus its logit of the token the other path chose (and the gap between
its top two).  A margin of 1e-5 is a tie broken by rounding; a margin of 3 is a bug::

    agreement(ref_tokens, other_tokens)                     # {"same", "total", "rate", "first_divergence"}
    divergence_margin(model, prompt_ids, ref_tokens, other_tokens)
    ok, why = tokens_match(ref_runs, other_runs, exact)     # a notebook's check: identical, or >= MIN_AGREEMENT

Whether two engine paths must give *identical* tokens depends on where they run: on a CPU in
float32 the engine is batch invariant (``workbench.engine.runners``: padded packed steps, float64
paged attention), so batching, chunking, preemption and a window change no token; on a GPU in
bf16 (and with GPU GEMMs whose reduction order follows the batch size) they may flip near-ties, as
in every serving engine.  :func:`tokens_match` checks identity where the path is exact and a
stated agreement (:data:`MIN_AGREEMENT`) elsewhere, and says which it checked.
"""

from __future__ import annotations

import torch


def first_divergence(ref: list[int], other: list[int]) -> int | None:
    """Index of the first differing token (over the common length), or None."""
    return next((i for i, (a, b) in enumerate(zip(ref, other)) if a != b), None)


def agreement(refs: list[list[int]], others: list[list[int]]) -> dict:
    """Token-by-token agreement over sequences (compared position by position)."""
    same = sum(a == b for r, o in zip(refs, others) for a, b in zip(r, o))
    total = sum(min(len(r), len(o)) for r, o in zip(refs, others))
    firsts = [first_divergence(r, o) for r, o in zip(refs, others)]
    return {"same": same, "total": total, "rate": same / total if total else None,
            "identical_sequences": sum(f is None for f in firsts), "sequences": len(firsts),
            "first_divergence": firsts}


MIN_AGREEMENT = 0.9     # where tokens need not be identical: at least 90 % of greedy tokens, position by position


def tokens_match(ref: list[list[int]], others: list[list[list[int]]], exact: bool,
                 min_agreement: float = MIN_AGREEMENT) -> tuple[bool, str]:
    """Do the runs ``others`` (each a list of sequences, one per prompt) give the greedy tokens of
    ``ref``?  ``exact``: every run identical to ``ref``; otherwise each run's :func:`agreement`
    rate at least ``min_agreement``.  Returns (ok, what was checked and found), e.g.
    ``"identical (3 runs x 8 sequences)"`` or ``"agreement >= 0.9 required (not an exact path): 0.94
    worst run, 2 of 8 sequences differ, first at token 5"``."""
    if not isinstance(exact, bool):
        raise TypeError(f"tokens_match: exact must be a bool, got {exact!r}")
    runs = [[list(t) for t in run] for run in others]
    ref = [list(t) for t in ref]
    shape = f"{len(runs)} run{'s' if len(runs) != 1 else ''} x {len(ref)} sequences"
    bad = [i for i, run in enumerate(runs) if len(run) != len(ref)]
    if bad:
        return False, f"run {bad[0] + 1} has {len(runs[bad[0]])} sequences, the reference {len(ref)}"
    stats = [agreement(ref, run) for run in runs]
    if all(run == ref for run in runs):
        return True, f"identical ({shape})"
    worst = min(stats, key=lambda a: (a["rate"] if a["rate"] is not None else 1.0))
    firsts = [f for f in worst["first_divergence"] if f is not None]
    detail = (f"{worst['rate']:.3f} worst run, {worst['sequences'] - worst['identical_sequences']} of "
              f"{worst['sequences']} sequences differ" + (f", first at token {min(firsts)}" if firsts else "")
              )
    if exact:
        return False, f"identical required (an exact path, {shape}): {detail}"
    ok = all(a["rate"] is None or a["rate"] >= min_agreement for a in stats)
    return ok, f"agreement >= {min_agreement} required (not an exact path, {shape}): {detail}"


@torch.inference_mode()
def divergence_margin(model, prompt_ids: list[int], ref: list[int], other: list[int]) -> dict | None:
    """At the first position where ``other`` leaves ``ref``: the reference model's logits there
    (prompt + ``ref`` up to that point, one plain forward): ``margin`` = logit(ref token) -
    logit(other token), ``top2_gap`` = top-1 minus top-2 logit.  None when they agree."""
    i = first_divergence(ref, other)
    if i is None:
        return None
    ids = torch.tensor([list(prompt_ids) + list(ref[:i])], device=model.device)
    logits = model(ids)[0, -1].float()
    top = logits.topk(2).values
    return {"position": i, "ref_token": ref[i], "other_token": other[i],
            "margin": float(logits[ref[i]] - logits[other[i]]), "top2_gap": float(top[0] - top[1])}
