"""Solutions to notebook 04's exercises (workbench exercises list 04)."""


def admit(waiting: list[dict], budget: int, scheduled_tokens: int, free_seqs: int, free_blocks: int,
          chunked_prefill: bool) -> list[tuple[str, int]]:
    """[(request id, prompt tokens it computes this step), ...], in the order they are admitted."""
    left = budget - scheduled_tokens
    busy = scheduled_tokens > 0          # does anything compute in this step already?
    admitted = []
    for r in sorted(waiting, key=lambda r: (-r["priority"], -r["cached"], r["arrival"])):
        if left <= 0 or free_seqs <= 0 or r["blocks"] > free_blocks:
            break                        # no overtaking: the first that does not fit stops admission
        if r["tokens"] <= left:
            n = r["tokens"]
        elif chunked_prefill:
            n = left
        else:
            n = 0 if busy else r["tokens"]
        admitted.append((r["id"], n))
        left -= n
        free_seqs -= 1
        free_blocks -= r["blocks"]
        busy = busy or n > 0
    return admitted


def ewma_breaker(baseline: float | None, p95: float, samples: int, alpha: float, factor: float,
                 learn_factor: float, min_samples: int, min_threshold: float) -> tuple:
    """(the baseline after this sample, whether the guard trips)."""
    if samples < min_samples:
        return baseline, False
    if baseline is None:
        return p95, False
    if p95 > max(factor * baseline, min_threshold):
        return baseline, True
    if p95 <= learn_factor * baseline:
        return alpha * p95 + (1 - alpha) * baseline, False
    return baseline, False
