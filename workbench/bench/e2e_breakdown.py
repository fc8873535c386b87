"""Where a configuration's time goes, measured: one more replay of the trace with every op timed.

A verdict says *that* a layer costs; this says *where*.  For each configuration asked for (the
notebook asks for the baseline, every layer that did not pay and the stack), the trace is replayed
once more on a fresh engine (a kept, compiled one starts cold: its pool is reset) with an op timer
on (:class:`OpTimer`, a ``TorchDispatchMode``), and the replay's time is split into:

* **scheduling** and **output** - the engine's own records (:class:`~workbench.engine.step_records.StepRecord`:
  the scheduler's pure-Python pass, and detokenization / stop checks after the forward);
* **model** - the rest of each step (``model_s``: swaps, the forward, sampling), split into
  ``static step`` (the calls of a static decode step - compiled or graphed - timed as a whole: a
  dispatch mode would make ``torch.compile`` run the step eagerly, so the timer is off inside it)
  and, for every other op, by what the op does (:data:`OP_GROUPS`): ``matmul`` (every projection,
  quantized or not), ``attention`` (SDPA and its softmax / masks), ``gather`` (reading KV blocks or
  rows by index, writing K/V to their slots, stacking blocks for a copy), and ``other model`` -
  everything else: small ops, Python and framework glue; the timer's own cost per op is measured and
  taken out of it (``timer_overhead_ms``);
* **idle** - the replay's wall time with no step running (waiting for the next arrival);
* **steps** - how many steps ran, how many were decode-only (every row one token: what a static
  decode step runs) and the median model time of each kind of step.

On a CPU every op is timed as it returns (ops there are synchronous).  On CUDA ops return before
they run, so only the step-level columns are filled and the op columns are None (use
``torch.profiler`` with CUDA activities there).  The timer only wraps ops: the profiler's event
tree, which cost 65 s to read back for one replay of the tiered cache (1.5 M events), is not used.
"""

from __future__ import annotations

import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# ATen ops by what they do (the overload packet's name, as a dispatch mode sees it)
OP_GROUPS = {
    "matmul": ("mm", "addmm", "bmm", "baddbmm", "_int_mm", "_weight_int8pack_mm", "_weight_int4pack_mm_for_cpu",
               "_weight_int4pack_mm", "mkldnn_linear", "linear"),
    "attention": ("scaled_dot_product_attention", "_scaled_dot_product_flash_attention_for_cpu",
                  "_scaled_dot_product_attention_math", "softmax",
                  "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention", "_softmax",
                  "masked_fill", "masked_fill_"),
    "gather": ("index", "index_select", "gather", "_index_put_impl_", "index_put_", "index_put", "index_copy_",
               "index_copy", "take", "scatter_", "stack"),
}
COLUMNS = ("wall_ms", "idle_ms", "steps", "decode_steps", "mixed_steps", "decode_step_ms_p50", "mixed_step_ms_p50",
           "scheduling_ms", "output_ms", "model_ms", "static_step_ms", "matmul_ms", "attention_ms", "gather_ms",
           "other_model_ms", "ops", "timer_overhead_ms")


class OpTimer(TorchDispatchMode):
    """Wall milliseconds of the ATen ops of :data:`OP_GROUPS`, summed per group, and the number of
    ops seen.  Ops inside a ``torch.compile``'d region that inductor fused are not ATen calls and are
    not seen; its extern calls (matmuls) are."""

    def __init__(self) -> None:
        super().__init__()
        self.ms = dict.fromkeys(OP_GROUPS, 0.0)
        self.ops = 0
        self._where = {op: g for g, ops in OP_GROUPS.items() for op in ops}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        g = self._where.get(func.overloadpacket.__name__)
        if g is None:
            return func(*args, **(kwargs or {}))
        t0 = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        self.ms[g] += (time.perf_counter() - t0) * 1e3
        return out


def timer_cost_ms(n: int = 2000) -> float:
    """What :class:`OpTimer` adds to one op it does not time (ms, measured on a small add)."""
    a = torch.ones(4)
    best = []
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(n):
            torch.add(a, a)
        plain = time.perf_counter() - t0
        with OpTimer():
            t0 = time.perf_counter()
            for _ in range(n):
                torch.add(a, a)
            timed = time.perf_counter() - t0
        best.append(max(0.0, timed - plain) / n * 1e3)
    return min(best)


def _time_static_steps(engine, spent: list):
    """Wrap the engine's static decoder (if it has one) so that its calls run with the op timer off
    and add their wall time to ``spent[0]``; returns the undo function.  On CUDA a decode call
    (a graph replay) returns once enqueued: the device is synchronized at both ends of each call
    (``measure.timing``, ``events=False``: wall time, like the other columns)."""
    from torch.utils._python_dispatch import _disable_current_modes

    from workbench.measure.timing import device_timer

    dec = getattr(engine.runner, "decoder", None)
    if dec is None:
        return lambda: None
    real = dec.decode

    def timed(*args, **kwargs):
        with _disable_current_modes():
            with device_timer(engine.device, events=False) as t:
                out = real(*args, **kwargs)
            spent[0] += t.ms
        return out

    dec.decode = timed
    return lambda: dec.__dict__.pop("decode", None)


def profiled_replay(engine, trace, per_op_ms: float | None = None) -> dict:
    """Replay ``trace`` on ``engine`` with the op timer on (CPU): one row of :data:`COLUMNS` (ms)."""
    from workbench.engine.traces import replay

    cpu = engine.device.type == "cpu"
    timer, static = OpTimer(), [0.0]
    undo = _time_static_steps(engine, static)
    t0 = time.perf_counter()
    try:
        if cpu:
            with timer:
                res = replay(engine, trace)
        else:
            res = replay(engine, trace)
    finally:
        undo()
    wall = (time.perf_counter() - t0) * 1e3
    st = res.steps
    st = st[st["num_seqs"] > 0]
    decode = st["prefill_tokens"] == 0
    model = float(st["model_s"].sum() * 1e3)
    sched, post = float(st["schedule_s"].sum() * 1e3), float(st["post_s"].sum() * 1e3)
    row = {"wall_ms": wall, "idle_ms": max(0.0, wall - model - sched - post), "steps": len(st),
           "decode_steps": int(decode.sum()), "mixed_steps": int((~decode).sum()),
           "decode_step_ms_p50": float(st.loc[decode, "model_s"].median() * 1e3) if decode.any() else None,
           "mixed_step_ms_p50": float(st.loc[~decode, "model_s"].median() * 1e3) if (~decode).any() else None,
           "scheduling_ms": sched, "output_ms": post, "model_ms": model, "static_step_ms": static[0]}
    if cpu:
        overhead = timer.ops * (per_op_ms if per_op_ms is not None else timer_cost_ms())
        row.update({f"{g}_ms": v for g, v in timer.ms.items()}, ops=timer.ops, timer_overhead_ms=overhead)
        row["other_model_ms"] = max(0.0, model - static[0] - sum(timer.ms.values()) - overhead)
    else:
        row.update({f"{g}_ms": None for g in OP_GROUPS}, other_model_ms=None, ops=None, timer_overhead_ms=None)
    return row


def breakdown(ab, names, progress=None) -> pandas.DataFrame:  # noqa: F821
    """:func:`profiled_replay` of each named configuration of the ablation ``ab`` (measured ones only;
    a configuration that fails here gets its error in the ``error`` column), one row each.
    ``progress(k, n, name)`` (optional): called before the k-th of n replays, and with k == n at the end."""
    import pandas as pd

    names = list(names)
    traces = {p: ab.workload.trace(priorities=p) for p in (False, True)}
    per_op = timer_cost_ms()
    rows = []
    for k, name in enumerate(names):
        if progress is not None:
            progress(k, len(names), name)
        c = ab.config(name)
        row = {"config": name, "layers": " + ".join(c.layers) or "-"}
        try:
            if c.spec.persistent:
                engine = c.front.engine
                if engine.kv_pool is not None:
                    engine.kv_pool.reset()
            else:
                engine = ab._llm(c.spec, net=c.front.model).engine
            row.update(profiled_replay(engine, traces[c.spec.priorities], per_op))
            if not c.spec.persistent:
                from workbench.bench.e2e_measure import close_engine

                close_engine(engine)
        except Exception as e:  # noqa: BLE001 - recorded; the other rows go on
            row["error"] = f"{type(e).__name__}: {e}"
        rows.append(row)
    if progress is not None:
        progress(len(names), len(names), "")
    return pd.DataFrame(rows).set_index("config")
