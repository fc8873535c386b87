"""What a precision choice costs, measured: resident bytes and time per layer, and a whole
model's decode step.

::

    mem = layer_bytes(model, targets, options)              # {(layer, option): bytes}, from real allocations
    lat = layer_latency(model, targets, options, rows=1)    # {(layer, option): {"ms", "ms_min", "ms_max"}}
    decode_step_ms(model, steps=16)                         # ms of each of 16 single-sequence decode steps

``options`` maps a name to a :class:`~workbench.quant.recipe.QuantRecipe` (``None``: the layer
stays dense, in the model's dtype).  A layer's cost under an option is measured on the module the
option would really build - :func:`~workbench.quant.apply.quantize_linear` with the recipe's
settings for that layer (group fallbacks included), put on the quantization backend
(:func:`~workbench.quant.apply.set_quant_backend`) - so it counts what the backend keeps beside
the stored weight (torch's int4 CPU op holds a repacked copy) and runs the kernel that would run.

**Bytes** are the storages of the module's tensors (integers, scales, zero points, bias: what
the format stores, and what a GPU's kernels hold), and with ``op_copies`` also the backend's own
copies (torch's int4 CPU op repacks every int4 weight into a second buffer): exact, no noise.
**Time** is one forward of ``rows`` input rows (1 = a decode step's matrix-vector product),
median of ``repeats`` calls, the options of one layer shape interleaved over ``rounds``
(A B C, C B A, ...) so that drift hits all of them; layers of the same shape and settings share
one measurement.  Layer times do not add up to a step's
time (norms, attention and launch overheads are outside them): the calibrator ranks mixes by
the sum and then measures whole decode steps (:func:`decode_step_ms`).

On CUDA one layer call is a few microseconds of GPU work and tens of microseconds of Python
launch and synchronize: a layer's time is then ``repeats`` calls captured in one CUDA graph and
replayed between timing events (:func:`workbench.measure.timing.time_replays`), per call.  A
decode step is timed whole, with a synchronize at both ends (its launch overhead is part of its
real cost).
"""

from __future__ import annotations

import statistics

import torch
from torch import nn

from workbench.measure import timing
from workbench.measure.memory import storage_bytes
from workbench.model.kv_cache import KVCache
from workbench.quant.apply import quantize_linear, set_quant_backend


def _own_tensors(mod: nn.Module) -> list[torch.Tensor]:
    return list(mod.parameters()) + list(mod.buffers())


def build_option(lin: nn.Linear, name: str, recipe, backend: str = "auto") -> nn.Module:
    """The module ``lin`` becomes under ``recipe`` (None: ``lin`` itself), on ``backend``."""
    if recipe is None:
        return lin
    q = quantize_linear(lin, recipe.layer_settings(name, lin.in_features))
    set_quant_backend(q, backend)
    return q


def module_bytes(mod: nn.Module, op_copies: bool = False) -> int:
    """Bytes of one (quantized) linear: its storages (integers, scales, zero points, bias: the
    stored format) plus, with ``op_copies``, what its backend keeps beside them."""
    extra = getattr(getattr(mod, "_op", None), "extra_bytes", 0) if op_copies else 0
    return storage_bytes(_own_tensors(mod)) + extra


def _class_key(lin: nn.Linear, name: str, option: str, recipe) -> tuple:
    st = None if recipe is None else tuple(sorted(recipe.layer_settings(name, lin.in_features).items()))
    return (lin.in_features, lin.out_features, lin.bias is not None, option, st)


def layer_bytes(model: nn.Module, targets: list[str], options: dict, backend: str = "auto",
                op_copies: bool = False) -> dict:
    """``{(layer, option): bytes}`` for every target layer (an ``nn.Linear``) and option: the
    stored format's bytes, plus the backend's own copies with ``op_copies``."""
    out, cache = {}, {}
    for name in targets:
        lin = model.get_submodule(name)
        for opt, recipe in options.items():
            key = _class_key(lin, name, opt, recipe)
            if key not in cache:
                cache[key] = module_bytes(build_option(lin, name, recipe, backend), op_copies)
            out[(name, opt)] = cache[key]
    return out


def interleaved(sides: dict, rounds: int) -> dict[str, list[float]]:
    """``{name: [one sample per round]}``: each side's function called once a round, in order
    on even rounds and reversed on odd ones (A B C, C B A, ...), so drift hits every side."""
    keys = list(sides)
    samples: dict = {k: [] for k in keys}
    for r in range(rounds):
        for k in (keys if r % 2 == 0 else keys[::-1]):
            samples[k].append(sides[k](r))
    return samples


def _time_call(fn, x, repeats: int) -> float:
    """Median milliseconds of ``fn(x)``: on CUDA, per call of ``repeats`` calls in a CUDA graph
    (replayed 3 times); elsewhere ``repeats`` calls timed one by one."""
    dev = x.device
    if dev.type == "cuda":
        return statistics.median(timing.time_replays(lambda: fn(x), dev, calls=repeats, repeats=3))
    return statistics.median(timing.time_call(lambda: fn(x), dev, warmup=1, repeats=repeats))


@torch.no_grad()
def layer_latency(model: nn.Module, targets: list[str], options: dict, rows: int = 1, backend: str = "auto",
                  repeats: int = 30, rounds: int = 5, seed: int = 0) -> dict:
    """``{(layer, option): {"ms": median over rounds, "ms_min", "ms_max", "rounds"}}``: one
    forward of ``rows`` rows through the module each option builds (see the module docstring)."""
    out: dict = {}
    by_shape: dict[tuple, list[str]] = {}
    for name in targets:
        lin = model.get_submodule(name)
        by_shape.setdefault((lin.in_features, lin.out_features, lin.bias is not None), []).append(name)
    g = torch.Generator().manual_seed(seed)
    for (inp, _, _), names in by_shape.items():
        # one measurement per (shape, settings): the first layer of the shape stands for the others
        classes: dict[tuple, tuple[str, str]] = {}
        for name in names:
            lin = model.get_submodule(name)
            for opt, recipe in options.items():
                classes.setdefault(_class_key(lin, name, opt, recipe), (name, opt))
        first = model.get_submodule(names[0])
        x = torch.randn(rows, inp, generator=g).to(device=first.weight.device, dtype=first.weight.dtype)
        mods = {k: build_option(model.get_submodule(n), n, options[o], backend) for k, (n, o) in classes.items()}
        times = interleaved({k: (lambda r, m=m: _time_call(m, x, repeats)) for k, m in mods.items()}, rounds)
        for name in names:
            lin = model.get_submodule(name)
            for opt, recipe in options.items():
                t = times[_class_key(lin, name, opt, recipe)]
                out[(name, opt)] = {"ms": statistics.median(t), "ms_min": min(t), "ms_max": max(t), "rounds": rounds}
    return out


@torch.no_grad()
def decode_step_ms(model: nn.Module, steps: int = 16, prompt_len: int = 16, seed: int = 0) -> list[float]:
    """Milliseconds of each of ``steps`` greedy single-sequence decode steps after a
    ``prompt_len``-token random prompt (contiguous KV cache), one warm-up step first."""
    cfg = model.config
    p = next(model.parameters())
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (1, prompt_len), generator=g).to(p.device)
    cache = KVCache(cfg, 1, prompt_len + steps + 2, device=p.device, dtype=p.dtype)
    tok = model(ids, 0, cache)[:, -1:].argmax(-1)
    tok = model(tok, prompt_len, cache)[:, -1:].argmax(-1)          # warm-up step
    times = []
    for i in range(steps):
        with timing.device_timer(p.device, events=False) as t:       # a whole step, launches included
            tok = model(tok, prompt_len + 1 + i, cache)[:, -1:].argmax(-1)
        times.append(t.ms)
    return times
