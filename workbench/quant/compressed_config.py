"""The ``quantization_config`` of a compressed-tensors checkpoint: written from our quantized
layers, read back into per-layer settings (every field we cannot run refused by name), and the
:class:`~workbench.quant.recipe.QuantRecipe` equivalent to what a checkpoint stores.

What we write (compressed-tensors 0.20's own field names and defaults; one config group per
distinct layer setting)::

    {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
     "config_groups": {"group_0": {"targets": ["Linear"] | [layer names], "format": "pack-quantized",
                                   "weights": {"num_bits": 4, "type": "int", "symmetric": true,
                                               "strategy": "group", "group_size": 128, "dynamic": false},
                                   "input_activations": null | {"num_bits": 8, "type": "int", "strategy": "token",
                                                                "dynamic": true, "symmetric": true},
                                   "output_activations": null}, ...},
     "ignore": ["lm_head", dense linear layers ...], "kv_cache_scheme": null, "sparsity_config": {}, ...}

One group covering every quantized layer targets the class ``"Linear"`` (as llm-compressor
writes it); several groups name their layers exactly, because vLLM resolves a fused
``qkv_proj`` / ``gate_up_proj`` by its shards' names only when no class target shadows them.

How a layer finds its group (as compressed-tensors' ``match_targets`` does): a target is a full
module name, ``"re:<regex>"`` (``re.match`` on the name) or a class name; exact names beat
regexes beat classes, and among the groups naming the same target the last one wins.  A layer
matched by ``ignore`` stays dense.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass

from workbench.errors import CheckpointError
from workbench.quant.recipe import QuantRecipe

PACKED = "pack-quantized"
# Formats a compressed-tensors checkpoint may declare, and why each is not read here.
_OTHER_FORMATS = {
    "float-quantized": "FP8 weights (float-quantized) are not run here: only int4 / int8 (pack-quantized)",
    "naive-quantized": "int values stored unpacked (naive-quantized) are not read here: re-export as pack-quantized",
    "int-quantized": "int8 values stored unpacked (int-quantized, e.g. W8A8) are not read here: re-export as "
                     "pack-quantized",
    "nvfp4-pack-quantized": "NVFP4 (4-bit float, nvfp4-pack-quantized) is not run here: only int4 / int8",
    "mxfp4-pack-quantized": "MXFP4 (mxfp4-pack-quantized) is not run here: only int4 / int8",
    "mxfp6-pack-quantized": "MXFP6 (mxfp6-pack-quantized) is not run here: only int4 / int8",
    "mxfp8-quantized": "MXFP8 (mxfp8-quantized) is not run here: only int4 / int8",
    "marlin-24": "the 2:4-sparse Marlin layout (marlin-24) is not read here: only pack-quantized",
    "sparse-bitmask": "sparse checkpoints (sparse-bitmask) are not read here",
    "sparse-24-bitmask": "sparse checkpoints (sparse-24-bitmask) are not read here",
    "dense": "format 'dense' holds float (fake-quantized) weights, not packed integers: not read here",
}
ACT8 = {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True, "symmetric": True}


@dataclass(frozen=True)
class LayerScheme:
    """One layer's stored settings."""
    bits: int
    strategy: str                 # tensor | channel | group
    group: int | None
    symmetric: bool
    act_bits: int | None
    group_name: str = ""

    @property
    def key(self) -> tuple:
        """(bits, group, per_channel, symmetric, act_bits): a recipe's words for it."""
        return self.bits, self.group, self.strategy != "tensor", self.symmetric, self.act_bits


# ---- writing ------------------------------------------------------------------------------------

def scheme_dict(s: LayerScheme, targets: list[str]) -> dict:
    return {"targets": targets, "format": PACKED,
            "weights": {"num_bits": s.bits, "type": "int", "symmetric": s.symmetric, "strategy": s.strategy,
                        "group_size": s.group, "dynamic": False},
            "input_activations": dict(ACT8, group_size=None) if s.act_bits else None,
            "output_activations": None}


def build_config(layers: dict[str, LayerScheme], dense: list[str]) -> tuple[dict, dict[str, list[str]]]:
    """``(quantization_config, {group name: its layers})`` for ``layers`` (name -> scheme, in
    model order) and the dense linear layers ``dense`` (the ``ignore`` list)."""
    groups: dict[tuple, list[str]] = {}
    for name, s in layers.items():
        groups.setdefault((s.bits, s.strategy, s.group, s.symmetric, s.act_bits), []).append(name)
    config_groups, members = {}, {}
    for i, (_, names) in enumerate(groups.items()):
        s = layers[names[0]]
        config_groups[f"group_{i}"] = scheme_dict(s, ["Linear"] if len(groups) == 1 else names)
        members[f"group_{i}"] = names
    return ({"quant_method": "compressed-tensors", "format": PACKED, "quantization_status": "compressed",
             "config_groups": config_groups, "ignore": list(dense), "kv_cache_scheme": None,
             "global_compression_ratio": None, "sparsity_config": {}, "transform_config": {}}, members)


# ---- reading ------------------------------------------------------------------------------------

def _is_empty(v) -> bool:
    return v is None or v == {} or v == []


def _whole(v):
    """A JSON integer as an int (``4.0`` as 4: pydantic, which compressed-tensors reads configs
    with, takes it too); anything else - ``true``, ``4.5``, ``"4"``, NaN - as it is, to be refused."""
    if isinstance(v, float) and v.is_integer():
        return int(v)
    return v


def _int_field(v) -> bool:
    return type(v) is int


def _member(where: str, key: str) -> str:
    """``where.key``, or ``where[<key's repr>]`` for a key that would not read as one (a space, a
    newline, a dot)."""
    return f"{where}.{key}" if key.isidentifier() or key.replace("_", "").replace("-", "").isalnum() \
        else f"{where}[{key!r:.60}]"


def _format_error(where: str, fmt) -> str:
    why = _OTHER_FORMATS.get(fmt) if isinstance(fmt, str) else None
    return f"{where} is {fmt!r:.80}: " + (why or "only pack-quantized is read here")


def _weights(w, where: str) -> tuple[int, str, int | None, bool]:
    """Checked ``weights`` args -> (bits, strategy, group, symmetric)."""
    if not isinstance(w, dict):
        raise CheckpointError(f"{where}: activation-only quantization (no 'weights') is not run here")
    kind = w.get("type", "int")
    if not isinstance(kind, str):
        raise CheckpointError(f"{where}.type must be a string such as \"int\", got {kind!r:.80}")
    if kind.lower() != "int":
        raise CheckpointError(f"{where}.type is {kind.lower()!r:.80}: float weights (FP8 / FP4) are not run here, "
                              "only int4 / int8")
    bits = _whole(w.get("num_bits", 8))
    if not _int_field(bits) or bits not in (4, 8):
        raise CheckpointError(f"{where}.num_bits is {bits!r:.80}: only 4- and 8-bit integer weights are run here")
    group = _whole(w.get("group_size"))
    if group is not None and not _int_field(group):
        raise CheckpointError(f"{where}.group_size must be an integer or null, got {group!r:.80}")
    strategy = w.get("strategy")
    if strategy is None:        # compressed-tensors' inference from group_size
        strategy = "tensor" if group is None else "channel" if group == -1 else "group"
    if not isinstance(strategy, str):
        raise CheckpointError(f"{where}.strategy must be a string (tensor, channel or group), got {strategy!r:.80}")
    strategy = strategy.lower()
    if strategy not in ("tensor", "channel", "group"):
        raise CheckpointError(f"{where}.strategy is {strategy!r:.80}: only tensor, channel and group scales are run "
                              "here (not block / tensor_group / token / attn_head)")
    if w.get("block_structure") is not None:
        raise CheckpointError(f"{where}.block_structure is set: block-wise scales are not run here")
    dynamic = w.get("dynamic")
    if not (dynamic is None or dynamic is False or (type(dynamic) is int and dynamic == 0)):
        raise CheckpointError(f"{where}.dynamic is {w.get('dynamic')!r:.80}: weights need static scales (false)")
    actorder = w.get("actorder")
    if actorder is not None and actorder is not False and actorder not in ("weight", "static"):
        raise CheckpointError(f"{where}.actorder is {actorder!r:.80}: activation reordering with g_idx ('group') is "
                              "not run here (actorder 'weight' keeps the layout and is fine)")
    sym = w.get("symmetric", True)
    if not isinstance(sym, bool):
        raise CheckpointError(f"{where}.symmetric must be true or false, got {sym!r:.80}")
    if strategy == "group":
        if not _int_field(group) or group < 2 or group % 2:
            raise CheckpointError(f"{where}.group_size is {group!r:.80}: expected an even group of 2 or more columns")
        return bits, strategy, group, sym
    return bits, strategy, None, sym


def _activations(a, where: str) -> int | None:
    if a is None:
        return None
    if not isinstance(a, dict):
        raise CheckpointError(f"{where}: expected an object (num_bits, type, strategy, dynamic, symmetric) or null, "
                              f"got {type(a).__name__} {a!r:.80}")
    want = dict(ACT8)
    got = {k: (a.get(k).lower() if k in ("type", "strategy") and isinstance(a.get(k), str) else _whole(a.get(k)))
           for k in want}
    bad = next((k for k in want if got[k] != want[k] or type(got[k]) is not type(want[k])), None)
    if bad is not None:
        raise CheckpointError(f"{where}.{bad} is {a.get(bad)!r:.80}: activations are run only as dynamic symmetric "
                              f"int8 with one scale per token ({want})")
    return 8


def parse_groups(qc: dict, where: str) -> dict[str, LayerScheme]:
    """The checked config groups of a ``quantization_config`` (``where`` names config.json)."""
    if qc.get("quant_method") != "compressed-tensors":
        raise CheckpointError(f"{where}: quant_method is {qc.get('quant_method')!r}, expected 'compressed-tensors'")
    fmt = qc.get("format", PACKED)
    if not isinstance(fmt, str) or fmt not in (PACKED, "mixed-precision"):
        raise CheckpointError(_format_error(f"{where}.format", fmt))
    status = qc.get("quantization_status", "compressed")
    if status != "compressed":
        raise CheckpointError(f"{where}.quantization_status is {status!r:.80}: expected 'compressed' (packed "
                              "integers); a checkpoint saved before compression holds float weights")
    for f, what in (("kv_cache_scheme", "KV-cache quantization"), ("sparsity_config", "sparsity"),
                    ("transform_config", "transforms (rotations)")):
        if not _is_empty(qc.get(f)):
            raise CheckpointError(f"{where}.{f} is set: {what} is not run here")
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise CheckpointError(f"{where}.config_groups: expected an object of named schemes, got {groups!r:.80}")
    out = {}
    for gname, g in groups.items():
        w = _member(f"{where}.config_groups", gname)
        if not isinstance(g, dict):
            raise CheckpointError(f"{w}: a preset name ({g!r:.80}) is not read here; write the scheme out")
        gfmt = g.get("format") or fmt
        if gfmt != PACKED:
            raise CheckpointError(_format_error(f"{w}.format", gfmt))
        if g.get("output_activations") is not None:
            raise CheckpointError(f"{w}.output_activations is set: output quantization is not run here")
        bits, strategy, group, sym = _weights(g.get("weights"), f"{w}.weights")
        act = _activations(g.get("input_activations"), f"{w}.input_activations")
        if act and not sym:
            raise CheckpointError(f"{w}: int8 activations with asymmetric weights are not run here")
        targets = g.get("targets")
        if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
            raise CheckpointError(f"{w}.targets: expected a list of layer names / 're:' patterns / class names")
        out[gname] = (LayerScheme(bits, strategy, group, sym, act, gname), targets)
    return out


# A "re:" pattern is matched against module names with this time limit: a pattern that backtracks
# exponentially ("re:(.*)*x") would otherwise hold the loader forever (the `regex` module, a
# transformers dependency, takes a timeout; the standard `re` does not).
REGEX_SECONDS = 1.0


class _Patterns:
    """The ``re:`` targets and ignore entries of one config, compiled once, matched with a time limit."""

    def __init__(self, where: str) -> None:
        self.where, self.compiled = where, {}

    def compile(self, target: str, field: str) -> None:
        if not target.startswith("re:") or target in self.compiled:
            return
        try:
            import regex as engine  # lazy: optional (transformers brings it), else re
        except ImportError:          # pragma: no cover - transformers brings it
            engine = re
        try:
            self.compiled[target] = (engine.compile(target[3:]), field, engine is not re)
        except Exception as e:  # noqa: BLE001 - re.error, regex.error (not re.error), OverflowError, RecursionError
            raise CheckpointError(f"{self.where}.{field}: {target!r:.80} is not a valid regular expression "
                                  f"({type(e).__name__}: {e})") from None

    def matches(self, name: str, cls: str, target: str) -> bool:
        if not target.startswith("re:"):
            return target == name or target == cls
        pattern, field, timed = self.compiled[target]
        try:
            hit = pattern.match(name, timeout=REGEX_SECONDS) if timed else pattern.match(name)
        except TimeoutError:
            raise CheckpointError(f"{self.where}.{field}: {target!r:.80} takes more than {REGEX_SECONDS:g} s to match "
                                  f"{name!r} (a pattern that backtracks without end); write it without nested "
                                  "repeats") from None
        return hit is not None


def assign_layers(qc: dict, modules: dict[str, str], where: str) -> dict[str, LayerScheme | None]:
    """``{module name: its scheme, or None (dense)}`` for ``modules`` (name -> class name:
    ``"Linear"`` / ``"Embedding"``), resolved as compressed-tensors resolves targets."""
    groups = parse_groups(qc, where)
    ignore = qc.get("ignore") or []
    if not isinstance(ignore, list) or not all(isinstance(t, str) for t in ignore):
        raise CheckpointError(f"{where}.ignore: expected a list of layer names / 're:' patterns")
    patterns = _Patterns(where)
    for t in ignore:
        patterns.compile(t, "ignore")
    for gname, (_, targets) in groups.items():
        for t in targets:
            patterns.compile(t, _member("config_groups", gname) + ".targets")
    _matches = patterns.matches             # timed, and a bad pattern named
    by_target: dict[str, LayerScheme] = {}
    for scheme, targets in groups.values():
        for t in targets:
            by_target[t] = scheme                       # a later group naming the same target wins
            if not t.startswith("re:") and t not in modules and t not in ("Linear", "Embedding"):
                field = _member(f"{where}.config_groups", scheme.group_name)
                raise CheckpointError(f"{field}.targets: {t!r:.80} names no linear layer of this model (class "
                                      "targets other than 'Linear' are not read here)")
    ordered = sorted(by_target, key=lambda t: ("re:" in t, t))
    out: dict[str, LayerScheme | None] = {}
    for name, cls in modules.items():
        hits = [t for t in ordered if t != cls and _matches(name, cls, t)]      # names, then regexes
        hits += [t for t in ordered if t == cls]                                  # then the class
        if not hits or any(_matches(name, cls, i) for i in ignore):
            out[name] = None
            continue
        scheme = by_target[hits[0]]
        if cls == "Embedding":
            raise CheckpointError(f"{where}: config group {scheme.group_name!r} quantizes the embedding '{name}' "
                                  f"(target {hits[0]!r}); quantized embeddings are not run here")
        if name.split(".")[-1] == "lm_head":
            raise CheckpointError(f"{where}: config group {scheme.group_name!r} quantizes 'lm_head' (target "
                                  f"{hits[0]!r}); the LM head must stay dense here (add it to 'ignore')")
        out[name] = scheme
    return out


# ---- the equivalent recipe ---------------------------------------------------------------------

def _recipe_key(r: QuantRecipe, name: str, in_features: int) -> tuple:
    st = r.layer_settings(name, in_features)
    return st["bits"], st["group"], st["per_channel"] or st["group"] is not None, st["symmetric"], st["act_bits"]


def derive_recipe(layers: dict[str, LayerScheme], dense: list[str], in_features: dict[str, int]) -> QuantRecipe:
    """The recipe that gives every layer its stored settings: the most common setting as the
    base (the pow2 group fallback of a wider group counts), the rest as per-layer overrides
    (full names), the dense linear layers in ``skip``; method ``rtn`` (not recorded by the format)."""
    counts = Counter(s.key for s in layers.values())
    bits, group, per_channel, sym, act = counts.most_common(1)[0][0]
    skip = ("embed_tokens", "lm_head") + tuple(n for n in dense if n.split(".")[-1] not in ("lm_head",))
    base = QuantRecipe(weight_bits=bits, group=group, per_channel=per_channel, symmetric=sym, act_bits=act, skip=skip)
    fields = ("weight_bits", "group", "per_channel", "symmetric", "act_bits")
    overrides = []
    for name, s in layers.items():
        if _recipe_key(base, name, in_features[name]) != s.key:
            overrides.append((name, {f: v for f, v, b in zip(fields, s.key, base_key(base)) if v != b}))
    return QuantRecipe(weight_bits=bits, group=group, per_channel=per_channel, symmetric=sym, act_bits=act,
                       skip=skip, overrides=tuple(overrides))


def base_key(r: QuantRecipe) -> tuple:
    return r.weight_bits, r.group, r.per_channel, r.symmetric, r.act_bits


def check_recipe(recipe: QuantRecipe, layers: dict[str, LayerScheme], dense: list[str],
                 in_features: dict[str, int], where: str) -> None:
    """Refuse a side-file recipe that does not give the stored layers their settings."""
    for name in dense:
        if not recipe.skips(name) and name.split(".")[-1] != "lm_head":
            raise CheckpointError(f"{where}: the recipe quantizes '{name}', which the checkpoint stores dense "
                                  "(the recipe file does not belong to these weights)")
    for name, s in layers.items():
        got = None if recipe.skips(name) else _recipe_key(recipe, name, in_features[name])
        if got != s.key:
            raise CheckpointError(f"{where}: the recipe gives '{name}' {got} (bits, group, per_channel, symmetric, "
                                  f"act_bits) but the checkpoint stores {s.key}; the recipe file does not belong to "
                                  "these weights")


# ---- what vLLM will make of it ------------------------------------------------------------------

_FUSED = (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("mlp.gate_proj", "mlp.up_proj"))


def vllm_notes(layers: dict[str, LayerScheme], dense: list[str]) -> list[str]:
    """Settings this checkpoint stores that vLLM's compressed-tensors loader does not take
    (transformers decompresses any of them): read from vLLM's ``compressed_tensors.py`` - its
    W{4,8}A16 kernels (``CompressedTensorsWNA16``) take group or channel scales; its int8-activation
    schemes read the ``int-quantized`` format; a fused ``qkv_proj`` / ``gate_up_proj`` gets one scheme."""
    notes = []
    per_tensor = [n for n, s in layers.items() if s.strategy == "tensor"]
    if per_tensor:
        notes.append(f"vLLM: {len(per_tensor)} layer(s) have one scale per tensor (e.g. {per_tensor[0]}); its "
                     "pack-quantized kernels take group or channel scales")
    act = [n for n, s in layers.items() if s.act_bits]
    if act:
        notes.append(f"vLLM: {len(act)} layer(s) quantize activations to int8 (e.g. {act[0]}); vLLM reads its int8-"
                     "activation schemes from the int-quantized format, so it may refuse them in pack-quantized")
    prefixes = sorted({n.rsplit(".", 2)[0] for n in layers} | {n.rsplit(".", 2)[0] for n in dense if n.count(".") >= 2})
    for p in prefixes:
        for fused in _FUSED:
            got = {f: (layers[f"{p}.{f}"].key if f"{p}.{f}" in layers else "dense") for f in fused
                   if f"{p}.{f}" in layers or f"{p}.{f}" in dense}
            if len(got) == len(fused) and len(set(got.values())) > 1:
                notes.append(f"vLLM: {p}.{{{','.join(f.split('.')[-1] for f in fused)}}} have different settings; "
                             "vLLM fuses them into one matmul with one scheme")
    return notes
