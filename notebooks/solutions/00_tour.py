"""Solutions to notebook 00's exercises (workbench exercises list 00)."""


def latencies(arrival: float, token_times: list[float], finished: float) -> dict:
    """{"ttft": ..., "tpot": ..., "e2e": ...} in seconds; None where a latency does not exist."""
    ttft = token_times[0] - arrival if token_times else None
    n = len(token_times)
    tpot = (token_times[-1] - token_times[0]) / (n - 1) if n > 1 else None
    return {"ttft": ttft, "tpot": tpot, "e2e": finished - arrival}


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0-100), linearly interpolated; None for no values."""
    if not values:
        return None
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)
