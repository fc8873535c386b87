"""Greedy token agreement between two paths, and how close the first disagreement was.

A non-exact path (a Triton kernel, ``torch.compile``, another reduction order) may flip a
greedy token where the reference's top two logits nearly tie; after that the sequences differ
for good.  So agreement is reported with the *margin at the first divergence*: the reference's
logit of its own token minus its logit of the token the other path chose (and the gap between
its top two).  A margin of 1e-5 is a tie broken by rounding; a margin of 3 is a bug::

    agreement(ref_tokens, other_tokens)                     # {"same", "total", "rate", "first_divergence"}
    divergence_margin(model, prompt_ids, ref_tokens, other_tokens)
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
