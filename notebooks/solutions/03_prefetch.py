"""Solutions to notebook 03's exercises (workbench exercises list 03)."""


def next_fetch(rank: int, streamed: int, distance: int) -> dict:
    """{"buffers": ..., "fetch": ...}: the streaming buffers, and the rank whose copy starts into the
    buffer rank `rank` frees when it has computed (a rank of the next step past the last; None at
    distance 0)."""
    if distance == 0:
        return {"buffers": 1, "fetch": None}
    buffers = min(distance + 1, streamed)
    nxt = rank + buffers
    return {"buffers": buffers, "fetch": nxt if nxt < streamed else rank % buffers}


def ideal_times(t_resident: float, compute: dict, copy: dict, streamed: list) -> dict:
    """{"t_ideal": ..., "t_lane": ...} in seconds: the all-resident run with every streamed execution
    costing max(copy, compute), and the one-copy-lane bound."""
    t_ideal, copies = t_resident, 0.0
    for (step, layer), c in compute.items():
        if layer in streamed:
            t_ideal += max(copy[layer], c) - c
            copies += copy[layer]
    return {"t_ideal": t_ideal, "t_lane": max(t_resident, copies)}
