"""The per-layer precision search: which option each layer gets, so that the cost (latency or
bytes) is smallest while the quality target holds.

::

    opts = search_space("w8a16,w4a16:g128,w4a8")       # {"dense": None, "w8a16": QuantRecipe, ...}
    front = lagrangian_front(targets, opts, delta, cost)   # mixes on the lower convex hull, cheapest first
    recipe = mix_recipe(front[0].assignment, opts)          # one QuantRecipe: base + overrides + skip

**The prediction.** With ``d(l, o)`` the degradation measured with only layer ``l`` under option
``o`` (:mod:`workbench.quant.sensitivity`, negative values - noise - counted as 0) and ``c(l, o)``
its measured cost, a mix ``a`` is predicted to cost ``sum c(l, a_l)`` and to degrade by
``sum d(l, a_l)``.  Minimising ``cost + lambda * degradation`` separately per layer, for every
``lambda`` from 0 (the cheapest option everywhere) to infinity (the most faithful), traces the
*lower convex hull* of all mixes in the (degradation, cost) plane: each breakpoint of lambda
changes one layer's choice, so there are at most ``layers x options^2`` distinct mixes, and each
is the cheapest for its predicted degradation among mixes on the hull.  (The exact
multiple-choice knapsack would also find mixes inside the hull's chords; the hull's are the ones
a budget sweep reaches, and cheap to list.)

**The decision** is not the prediction's: degradations need not add up (two quantized layers
can interact), so the calibrator measures the mixes themselves (:mod:`workbench.quant.calibrate`)
and picks among measured ones.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass

from workbench.errors import ConfigError
from workbench.quant.recipe import QuantRecipe

DENSE = "dense"
# the settings a layer's option may change through an override (method / smooth are per model)
MIX_FIELDS = ("weight_bits", "group", "per_channel", "symmetric", "act_bits", "group_fallback")


def search_space(spec: str | list[str]) -> dict:
    """``"w8a16,w4a16:g128,w4a8"`` -> ``{"dense": None, "w8a16": QuantRecipe, ...}`` in the
    given order.  Every option must share one method and one SmoothQuant alpha (a mix is
    quantized in one pass); ``dense`` (the layer unquantized) is always an option."""
    items = [s.strip() for s in (spec.split(",") if isinstance(spec, str) else spec) if s and s.strip()]
    if not items:
        raise ConfigError("--search-space: give at least one scheme, e.g. w8a16,w4a16:g128,w4a8")
    opts: dict = {DENSE: None}
    for s in items:
        s = s.lower()
        if s == DENSE:
            continue
        r = QuantRecipe.parse(s)
        same = next((k for k, v in opts.items() if v == r), None)
        if same is not None:
            raise ConfigError(f"--search-space: {s!r} is the same scheme as {same!r}")
        opts[s] = r
    recipes = [r for r in opts.values() if r is not None]
    if not recipes:
        raise ConfigError("--search-space: no quantized scheme given (only 'dense')")
    methods = {(r.method, r.smooth) for r in recipes}
    if len(methods) > 1:
        raise ConfigError("--search-space: every scheme of one search must use the same method and SmoothQuant "
                          f"alpha (a mix is quantized in one pass); got {sorted(str(m) for m in methods)} - "
                          "e.g. w8a16:gptq,w4a16:g128:gptq")
    return opts


@dataclass
class Mix:
    """One assignment of an option to every layer, with its predicted cost and degradation."""

    assignment: dict[str, str]
    cost: float
    degradation: float

    def counts(self) -> dict[str, int]:
        return dict(Counter(self.assignment.values()))

    def label(self) -> str:
        c = self.counts()
        return ", ".join(f"{n} {o}" for o, n in sorted(c.items(), key=lambda kv: -kv[1]))


def _choose(layer: str, options: list[str], delta: dict, cost: dict, lam: float) -> str:
    # ties: the more faithful option, then the cheaper one, then the listed order
    return min(options, key=lambda o: (cost[(layer, o)] + lam * delta[(layer, o)], delta[(layer, o)],
                                       cost[(layer, o)], options.index(o)))


def _mix(layers, options, delta, cost, lam) -> Mix:
    a = {l: _choose(l, options, delta, cost, lam) for l in layers}
    return Mix(a, sum(cost[(l, o)] for l, o in a.items()), sum(delta[(l, o)] for l, o in a.items()))


def lagrangian_front(layers: list[str], options: list[str], delta: dict, cost: dict) -> list[Mix]:
    """The distinct mixes that minimise ``cost + lambda * degradation`` per layer over every
    ``lambda >= 0`` (see the module docstring), cheapest first.  ``delta[(layer, option)]`` >= 0
    (the caller clamps noise) and ``cost[(layer, option)]`` for every pair."""
    missing = [(l, o) for l in layers for o in options if (l, o) not in delta or (l, o) not in cost]
    if missing:
        raise ConfigError(f"lagrangian_front: no delta / cost for {missing[:3]}")
    breaks = {0.0}
    for l in layers:
        for i, a in enumerate(options):
            for b in options[i + 1:]:
                dd = delta[(l, a)] - delta[(l, b)]
                dc = cost[(l, b)] - cost[(l, a)]
                if dd * dc > 0:                 # one is cheaper, the other more faithful
                    breaks.add(dc / dd)
    lams = sorted(breaks)
    probes = [0.0] + [(x + y) / 2 for x, y in zip(lams, lams[1:])] + [lams[-1] * 2 + 1.0]
    seen, out = set(), []
    for lam in probes:
        m = _mix(layers, options, delta, cost, lam)
        key = tuple(sorted(m.assignment.items()))
        if key not in seen:
            seen.add(key)
            out.append(m)
    return sorted(out, key=lambda m: (m.cost, m.degradation))


def uniform_mix(layers: list[str], option: str, delta: dict, cost: dict) -> Mix:
    a = {l: option for l in layers}
    return Mix(a, sum(cost[(l, option)] for l in layers), sum(delta[(l, option)] for l in layers))


def expand(mix: Mix, units: dict[str, list[str]]) -> Mix:
    """A mix over units as a mix over their layers (same predicted cost and degradation)."""
    return Mix({layer: o for u, o in mix.assignment.items() for layer in units[u]}, mix.cost, mix.degradation)


def mix_recipe(assignment: dict[str, str], options: dict, skip_default: tuple = ("embed_tokens", "lm_head")
               ) -> QuantRecipe | None:
    """One :class:`QuantRecipe` for an assignment: the most common quantized option is the base,
    layers under another option get overrides (by full name), dense layers join ``skip``; None
    when every layer stays dense."""
    quantized = {l: o for l, o in assignment.items() if o != DENSE}
    if not quantized:
        return None
    base_name = Counter(quantized.values()).most_common(1)[0][0]
    base: QuantRecipe = options[base_name]
    overrides = []
    for layer, o in quantized.items():
        if o == base_name:
            continue
        r: QuantRecipe = options[o]
        changes = {f: getattr(r, f) for f in MIX_FIELDS if getattr(r, f) != getattr(base, f)}
        if changes:
            overrides.append((layer, changes))
    dense = tuple(l for l, o in assignment.items() if o == DENSE)
    return dataclasses.replace(base, skip=tuple(skip_default) + dense,
                               overrides=tuple(base.overrides) + tuple(overrides))
