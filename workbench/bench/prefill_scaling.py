"""How prefill time grows with the prompt: attention with an explicit score matrix vs the fused
(flash) kernel, on the same model call, and the log-log slope of each.

::

    res = prefill_scaling(model, lengths=(512, 1024, 2048), repeats=3)
    res["slopes"]["math"]        # {"per_repeat": [...], "median", "min", "max"}: d log t / d log n
    res["rows"]                  # per (backend, length): prefill ms (median / min / max), attention-core ms, share

The two sides are torch's own implementations of ``F.scaled_dot_product_attention``, chosen with
``torch.nn.attention.sdpa_kernel`` around the *unchanged* model call ``model(ids, 0, cache,
logits_to_keep=1)`` (the reference attention is one SDPA call per layer):

* ``math`` -- q k^T materialised as a [B, nh, T, T] tensor, masked, softmax, then @ v: what an
  unfused eager stack does (the "old architecture" of the articles);
* ``flash`` -- torch's blocked flash-attention kernel (on a CPU ``_scaled_dot_product_flash_attention_for_cpu``,
  on CUDA FlashAttention): no T x T tensor, the scores live in tiles.  Its FLOPs are still
  O(T^2): it saves memory traffic and allocations, not arithmetic.

The Triton ``flash_prefill`` kernel of this package runs on a CPU only under the Triton
interpreter, whose timings say nothing: it is not timed here.

How it is timed: one warm-up prefill per side; then ``repeats`` rounds, each over every length in
a rotated order and both sides in alternating order (A B, B A, ...), a fresh contiguous cache per
call, ``gc`` paused, the device synchronised around each call.  Inside the same calls, forward hooks
time each layer's attention *core* (RoPE, the KV write and the SDPA call: ``self_attn`` minus its
q / k / v / o projections), so the *attention share* of a prefill is measured in place, not assumed:
on a small model the linear layers (O(T)) dominate a prefill and hide how attention grows.

The slope of log(time) against log(length) is fitted over ``fit_lengths`` (least squares) per round
-- its spread over rounds is the measurement's uncertainty -- and through each length's fastest and
median round (:func:`slope_summary`), which one slow round on a shared machine cannot move much.
Lengths beyond the model's trained context (``max_position_embeddings``) are allowed for timing
(RoPE tables grow on demand; the cost of a step does not depend on the values) and are listed in
``beyond_context``.
"""

from __future__ import annotations

import gc
import math
import statistics
import time
from functools import partial

import torch

from workbench.errors import ConfigError
from workbench.measure import timing

BACKENDS = ("math", "flash")


def _sdpa_backend(name: str, device: torch.device | None = None, dtype: torch.dtype | None = None):
    """The SDPA backend of side ``name``; refuses a combination torch has no kernel for (on CUDA,
    FlashAttention takes fp16/bf16 only: an fp32 model would fail with "No available kernel")."""
    from torch.nn.attention import SDPBackend

    if name == "flash" and device is not None and torch.device(device).type == "cuda" and dtype == torch.float32:
        raise ConfigError("prefill_scaling: FlashAttention on CUDA needs fp16/bf16; load the model in bfloat16 "
                          "(or measure only backends=('math',))")
    return {"math": SDPBackend.MATH, "flash": SDPBackend.FLASH_ATTENTION}[name]


class _AttentionCore:
    """Seconds of each layer's attention *core* in one forward -- RoPE, the KV write and the SDPA
    call: the ``self_attn`` module's time minus its four projections' (forward hooks, the device
    synchronised at each; a few dozen Python calls per prefill, under 1 % of it)."""

    def __init__(self, model, sync) -> None:
        self.sync, self.seconds, self._t, self._handles = sync, 0.0, {}, []
        self.pairs = []
        for layer in model.model.layers:
            a = layer.self_attn
            self.pairs.append((a, 1.0))
            self.pairs += [(getattr(a, name), -1.0) for name in ("q_proj", "k_proj", "v_proj", "o_proj")]

    def attach(self) -> None:
        for mod, sign in self.pairs:
            self._handles.append(mod.register_forward_pre_hook(self._pre))
            self._handles.append(mod.register_forward_hook(self._post(sign)))

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def reset(self) -> None:
        self.seconds = 0.0

    def _pre(self, mod, _args) -> None:
        self.sync()
        self._t[id(mod)] = time.perf_counter()

    def _post(self, sign: float):
        def hook(mod, _args, _out) -> None:
            self.sync()
            self.seconds += sign * (time.perf_counter() - self._t.pop(id(mod)))
        return hook


def loglog_slope(lengths, times) -> float:
    """Least-squares slope of log(time) on log(length) (2 points or more)."""
    if len(lengths) != len(times) or len(lengths) < 2:
        raise ValueError(f"loglog_slope: need >= 2 (length, time) pairs, got {len(lengths)} and {len(times)}")
    xs = [math.log(n) for n in lengths]
    ys = [math.log(t) for t in times]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        raise ValueError("loglog_slope: the lengths must differ")
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx


def slope_summary(fit, samples: dict) -> dict:
    """Slopes of one side from its samples ``{length: [seconds per round]}``: per round, and through
    the per-length minima and medians (robust to a slow outlier: noise on a shared machine only
    adds time, so the fastest round is the least disturbed, and a median ignores one bad round of 3)."""
    rounds = min(len(samples[n]) for n in fit)
    per = [loglog_slope(fit, [samples[n][r] for n in fit]) for r in range(rounds)]
    return {"per_repeat": per, "median": statistics.median(per), "min": min(per), "max": max(per),
            "of_minima": loglog_slope(fit, [min(samples[n]) for n in fit]),
            "of_medians": loglog_slope(fit, [statistics.median(samples[n]) for n in fit])}


@torch.inference_mode()
def prefill_scaling(model, lengths=(256, 512, 1024), repeats: int = 3, backends=BACKENDS,
                    fit_lengths=None, seed: int = 0, threads: int | None = None) -> dict:
    """Prefill and attention-core times per (backend, length); slopes per backend (see the module
    docstring).  ``model``: a :class:`~workbench.model.decoder.CausalLM`; ``fit_lengths``: the lengths
    the slopes are fitted over (default: all); ``threads``: torch's intra-op threads while timing
    (restored afterwards; None: as set)."""
    from torch.nn.attention import sdpa_kernel

    lengths = sorted({int(n) for n in lengths})
    if len(lengths) < 2 or lengths[0] < 2:
        raise ConfigError(f"prefill_scaling: need >= 2 lengths of >= 2 tokens, got {lengths}")
    if not isinstance(repeats, int) or repeats < 1:
        raise ConfigError(f"prefill_scaling: repeats must be an integer >= 1, got {repeats!r}")
    bad = [b for b in backends if b not in BACKENDS]
    if bad:
        raise ConfigError(f"prefill_scaling: unknown backend {bad[0]!r}; choose from {', '.join(BACKENDS)}")
    fit = sorted(fit_lengths) if fit_lengths else lengths
    if len(fit) < 2 or any(n not in lengths for n in fit):
        raise ConfigError(f"prefill_scaling: fit_lengths {fit} must be >= 2 of the measured lengths {lengths}")
    cfg = model.config
    dev, dtype = model.device, model.lm_head.weight.dtype
    sdpa = {b: _sdpa_backend(b, dev, dtype) for b in backends}       # refuses before anything runs
    sync = partial(timing.sync, dev)                                  # no-op off CUDA
    g = torch.Generator(device="cpu").manual_seed(seed)
    ids = torch.randint(1, cfg.vocab_size, (1, lengths[-1]), generator=g).to(dev)
    core = _AttentionCore(model, sync)

    def prefill(backend: str, n: int) -> tuple[float, float]:
        cache = model.new_cache(1, n)
        with sdpa_kernel(sdpa[backend]):
            core.reset()
            sync()
            t0 = time.perf_counter()
            model(ids[:, :n], 0, cache, logits_to_keep=1)
            sync()
            return time.perf_counter() - t0, core.seconds

    pre = {(b, n): [] for b in backends for n in lengths}
    att = {(b, n): [] for b in backends for n in lengths}
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    t_start = time.perf_counter()
    threads_before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    used_threads = torch.get_num_threads()
    try:
        core.attach()
        for b in backends:                      # warm-up: kernels, allocator, RoPE tables
            prefill(b, lengths[-1])
        for r in range(repeats):
            order = lengths[r % len(lengths):] + lengths[:r % len(lengths)]
            for i, n in enumerate(order):
                sides = list(backends) if (r + i) % 2 == 0 else list(backends)[::-1]
                for b in sides:
                    total, attn = prefill(b, n)
                    pre[(b, n)].append(total)
                    att[(b, n)].append(attn)
    finally:
        core.detach()
        torch.set_num_threads(threads_before)
        if enabled:
            gc.enable()
    rows = []
    for b in backends:
        for n in lengths:
            p, a = pre[(b, n)], att[(b, n)]
            rows.append({"backend": b, "tokens": n, "prefill_ms": statistics.median(p) * 1e3,
                         "prefill_ms_min": min(p) * 1e3, "prefill_ms_max": max(p) * 1e3,
                         "attention_ms": statistics.median(a) * 1e3, "attention_ms_min": min(a) * 1e3,
                         "attention_ms_max": max(a) * 1e3,
                         "attention_share": statistics.median(x / y for x, y in zip(a, p))})
    slopes = {b: slope_summary(fit, {n: pre[(b, n)] for n in fit}) for b in backends}
    att_slopes = {b: slope_summary(fit, {n: att[(b, n)] for n in fit}) for b in backends}
    return {"lengths": lengths, "fit_lengths": fit, "repeats": repeats, "backends": list(backends), "rows": rows,
            "slopes": slopes, "attention_slopes": att_slopes,
            "samples_ms": {f"{b}@{n}": [x * 1e3 for x in pre[(b, n)]] for b in backends for n in lengths},
            "max_position_embeddings": cfg.max_position_embeddings,
            "beyond_context": [n for n in lengths if n > cfg.max_position_embeddings],
            "device": str(dev), "dtype": str(dtype).removeprefix("torch."), "threads": used_threads,
            "seconds": time.perf_counter() - t_start}


__all__ = ["BACKENDS", "loglog_slope", "prefill_scaling", "slope_summary"]
