"""Where does a decode step's time go?  Measured with hooks, not guessed.

A decode step of the reference engine is ``model(token, pos, cache, logits_to_keep=1)``
followed by :func:`workbench.engine.sampling.sample`.  :func:`profile_decode_step` drives those steps
itself and times each component with forward pre/post hooks and ``time.perf_counter()``::

    df = profile_decode_step(llm, "The list data type", steps=16)
    df            # ms per step (median over steps) and share of the step, one row per component
    df.attrs      # plain_step_ms, hooked_step_ms, hook_overhead_ms, hook_overhead_pct, ...

Components (the hooked modules never nest, so their intervals are disjoint and their sum can
never exceed the measured step)::

    embedding  model.model.embed_tokens
    attention  every layer's self_attn (q/k/v/o projections, RoPE, SDPA, KV-cache write)
               + model.model.rotary_emb (the cos/sin table lookup the layers share)
    mlp        every layer's mlp (gate/up/down + SiLU)
    norm       input_layernorm, post_attention_layernorm, model.norm
    lm_head    model.lm_head
    sampling   the sample() call, including the host read of the token id
    other      measured step time - the above: Python and framework glue, residual adds,
               building the input tensor, and the hooks' own cost

Instrumentation is not free: each hook is a Python call and on a GPU it must synchronise
before reading the clock (which also serialises what would otherwise overlap).  So the same
run also times steps *without* hooks, interleaved with the hooked ones (plain, hooked,
plain, ...) so both see the same cache lengths and the same machine drift; the difference is
reported as the hook overhead.  Read the breakdown as "shares of an instrumented step".

:func:`op_profile` is the complementary view from ``torch.profiler``: the top ATen ops by
self CPU time (and device time on CUDA).
"""

from __future__ import annotations

import gc
import statistics
import time
from collections import defaultdict
from contextlib import contextmanager

import torch

from workbench.errors import ConfigError
from workbench.engine.sampling import SamplingParams

COMPONENTS = ("embedding", "attention", "mlp", "norm", "lm_head", "sampling", "other")


def _component_modules(model) -> list[tuple[str, torch.nn.Module]]:
    """(component, module) pairs; no module in the list contains another."""
    stack = model.model
    named = [("embedding", stack, "embed_tokens"), ("attention", stack, "rotary_emb")]
    for layer in stack.layers:
        named += [("norm", layer, "input_layernorm"), ("attention", layer, "self_attn"),
                  ("norm", layer, "post_attention_layernorm"), ("mlp", layer, "mlp")]
    named += [("norm", stack, "norm"), ("lm_head", model, "lm_head")]
    # A transformed model (fused or quantized modules) may lack some: those land in "other".
    return [(comp, getattr(parent, attr)) for comp, parent, attr in named
            if isinstance(getattr(parent, attr, None), torch.nn.Module)]


class _HookTimer:
    """Accumulates seconds per component between a module's pre- and post-forward hooks."""

    def __init__(self, sync) -> None:
        self.sync = sync
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._start: dict[int, float] = {}
        self._handles = []

    def attach(self, pairs) -> None:
        for comp, module in pairs:
            self._handles.append(module.register_forward_pre_hook(self._pre(module)))
            self._handles.append(module.register_forward_hook(self._post(comp, module)))

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _pre(self, module):
        key = id(module)

        def hook(_module, _args):
            self.sync()                       # work queued before this module is not its own
            self._start[key] = time.perf_counter()
        return hook

    def _post(self, comp, module):
        key = id(module)

        def hook(_module, _args, _out):
            self.sync()                       # the module's kernels have finished
            self.seconds[comp] += time.perf_counter() - self._start.pop(key)
            self.calls[comp] += 1
        return hook

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()


@contextmanager
def _gc_paused():
    """A garbage collection inside a timed step would be charged to whatever ran then."""
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _prefill(llm, prompt, extra_tokens: int, params: SamplingParams):
    """The bare decode loop (:class:`workbench.engine.llm.ReferenceLoop`) after its prefill step."""
    from workbench.engine.llm import ReferenceLoop

    _, ids = llm.encode(prompt)
    need = len(ids) + extra_tokens + 1
    if need > llm.max_model_len:
        raise ConfigError(f"profile: prompt ({len(ids)} tokens) + {extra_tokens} decode steps exceed the "
                          f"model's context ({llm.max_model_len}); use a shorter prompt or fewer steps")
    loop = ReferenceLoop(llm.model, ids, extra_tokens + 1, params)
    loop.step()
    return loop


@torch.inference_mode()
def profile_decode_step(llm, prompt, steps: int = 16, warmup: int = 3,
                        params: SamplingParams | None = None) -> pandas.DataFrame:  # noqa: F821
    """Time each component of a decode step; one row per component of :data:`COMPONENTS`.

    ``prompt``: text or a list of token ids (prefilled once).  ``steps`` hooked steps and
    ``steps`` plain steps are interleaved after ``warmup`` of each.  ``params`` defaults to
    greedy sampling.  Columns: ``ms`` (median per step; for "other", median step minus the
    other rows), ``share`` (of the hooked step), ``calls_per_step``.  ``df.attrs`` holds
    ``plain_step_ms``, ``hooked_step_ms`` (medians), ``hook_overhead_ms``,
    ``hook_overhead_pct``, ``steps``, ``prompt_tokens``, ``device``, ``dtype``.
    """
    import pandas as pd

    if steps < 1 or warmup < 0:
        raise ConfigError(f"profile: steps must be >= 1 and warmup >= 0, got steps={steps}, warmup={warmup}")
    params = params or SamplingParams(temperature=0.0)
    dev = llm.device
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    loop = _prefill(llm, prompt, 2 * (steps + warmup), params)
    model, prompt_tokens = llm.model, loop.pos
    timer = _HookTimer(sync)
    pairs = _component_modules(model)

    plain_totals: list[float] = []
    hooked_totals: list[float] = []
    per_step: dict[str, list[float]] = defaultdict(list)
    calls: dict[str, int] = {}
    with _gc_paused():
        try:
            for i in range(2 * (steps + warmup)):
                hooked = i % 2 == 1
                if hooked:
                    timer.attach(pairs)
                    timer.reset()
                sync()
                t0 = time.perf_counter()
                logits = loop.forward()
                if hooked:
                    sync()
                t_sample = time.perf_counter()
                loop.sample(logits)                          # the token id is on the host
                t1 = time.perf_counter()
                if hooked:
                    timer.detach()
                if i < 2 * warmup:
                    continue
                if not hooked:
                    plain_totals.append(t1 - t0)
                    continue
                hooked_totals.append(t1 - t0)
                for comp in COMPONENTS[:-2]:
                    per_step[comp].append(timer.seconds.get(comp, 0.0))
                per_step["sampling"].append(t1 - t_sample)
                calls = {**dict(timer.calls), "sampling": 1}
        finally:
            timer.detach()                  # never leave hooks on the caller's model

    ms = {comp: statistics.median(v) * 1e3 for comp, v in per_step.items()}
    hooked_ms = statistics.median(hooked_totals) * 1e3
    plain_ms = statistics.median(plain_totals) * 1e3
    measured = sum(ms.values())
    # Medians are not additive, so in a noisy run the component medians could sum to more
    # than the median step; then "other" is 0 and shares are taken of the component sum.
    ms["other"] = max(hooked_ms - measured, 0.0)
    denom = max(hooked_ms, measured)
    df = pd.DataFrame({"ms": [ms[c] for c in COMPONENTS],
                       "share": [ms[c] / denom for c in COMPONENTS],
                       "calls_per_step": [calls.get(c, 0) for c in COMPONENTS]},
                      index=pd.Index(COMPONENTS, name="component"))
    df.attrs.update({"plain_step_ms": plain_ms, "hooked_step_ms": hooked_ms,
                     "hook_overhead_ms": hooked_ms - plain_ms,
                     "hook_overhead_pct": 100.0 * (hooked_ms - plain_ms) / plain_ms,
                     "steps": steps, "prompt_tokens": prompt_tokens,
                     "device": str(dev), "dtype": str(model.lm_head.weight.dtype).removeprefix("torch.")})
    return df


def describe_overhead(df) -> str:
    """One line on what the instrumentation cost, from :func:`profile_decode_step`'s attrs."""
    a = df.attrs
    return (f"plain step {a['plain_step_ms']:.3f} ms, hooked step {a['hooked_step_ms']:.3f} ms: the hooks add "
            f"{a['hook_overhead_ms']:.3f} ms ({a['hook_overhead_pct']:+.0f}%) per step "
            f"(median of {a['steps']} steps each, {a['device']}, {a['dtype']})")


@torch.inference_mode()
def op_profile(llm, prompt, steps: int = 8, top: int = 15,
               params: SamplingParams | None = None) -> pandas.DataFrame:  # noqa: F821
    """The ``top`` ATen ops by self CPU time over ``steps`` decode steps (torch.profiler).

    Columns: ``calls_per_step``, ``self_cpu_ms_per_step``, ``cpu_total_ms_per_step`` and
    ``self_cpu_share`` (of all ops' self CPU time); on CUDA also ``self_device_ms_per_step``.
    One untimed step warms up first.
    """
    import pandas as pd
    from torch.profiler import ProfilerActivity, profile

    if steps < 1:
        raise ConfigError(f"op_profile: steps must be >= 1, got {steps}")
    params = params or SamplingParams(temperature=0.0)
    dev = llm.device
    loop = _prefill(llm, prompt, steps + 1, params)
    step = loop.step
    step()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
    events = prof.key_averages()
    total_self = sum(e.self_cpu_time_total for e in events) or 1.0
    rows = []
    for e in events:
        row = {"op": e.key, "calls_per_step": e.count / steps,
               "self_cpu_ms_per_step": e.self_cpu_time_total / 1e3 / steps,
               "cpu_total_ms_per_step": e.cpu_time_total / 1e3 / steps,
               "self_cpu_share": e.self_cpu_time_total / total_self}
        if dev.type == "cuda":
            row["self_device_ms_per_step"] = getattr(e, "self_device_time_total", 0.0) / 1e3 / steps
        rows.append(row)
    df = pd.DataFrame(rows).sort_values("self_cpu_ms_per_step", ascending=False).head(top)
    return df.set_index("op")
