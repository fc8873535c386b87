"""A quantization recipe: every setting a quantized model was made with, by name.

::

    r = QuantRecipe.parse("w4a16:g128")          # or QuantRecipe(weight_bits=4, group=128)
    r.name                                         # 'w4a16-g128-sym-rtn-fallback=pow2'
    r.layer_settings("model.layers.0.mlp.down_proj", in_features=704)   # -> g64 (the fallback)

Schemes (``wXaY``): weights in X bits, activations in Y bits.  **W8A16** and **W4A16** are
weight-only: "A16" means the model's own activation dtype - bf16 / fp16 on a GPU, **fp32 on a
CPU** (every figure says which).  **W4A8** and **W8A8** also quantize the activations entering
each quantized linear layer, dynamically, to int8 with one symmetric scale per token (row);
their weights must be symmetric.

Methods (``method``): ``rtn`` round-to-nearest; ``awq`` activation-aware scaling (a per-input
channel scale searched on calibration text, folded into the preceding norm / linear, then a
clipping search); ``gptq`` one-shot Hessian-based rounding with error feedback.  ``awq`` and
``gptq`` need calibration sequences (``quantize_model(..., calibration=...)``).
``smooth=alpha`` (SmoothQuant) migrates activation outliers into the weights before
quantizing (``s_j = max|X_j|^alpha / max|W_j|^(1 - alpha)``, folded like AWQ's scales); meant
for W8A8, allowed with any scheme, and needs calibration too.

Granularity: ``group`` = g input columns per scale; ``group=None`` with ``per_channel=True`` =
one scale per output channel; ``per_channel=False`` = one scale for the whole tensor.

**The group fallback rule** (``group_fallback``), for a layer whose input width is not a
multiple of ``group`` (the bundled model's ``down_proj``: 704 = 5 x 128 + 64):

* ``"pow2"`` (default) - the largest power of two <= ``group`` that divides the width
  (704 -> g64); if none >= 8 does, one scale per output channel;
* ``"per-channel"`` - one scale per output channel for that layer.

The chosen granularity of every layer is recorded in the model's recipe report
(:func:`workbench.quant.apply.quantization_report`).  The embedding and the LM head are not
quantized unless ``skip`` says otherwise; ``overrides`` give per-layer settings by dotted name
suffix (``(("down_proj", {"weight_bits": 8}),)``; later entries win).

**Per-layer mixes** (what ``workbench calibrate-quant`` writes): ``skip`` and ``overrides`` name
layers (:func:`name_matches`): one component wherever it occurs (``"lm_head"``, ``"down_proj"``,
``"mlp"``), or a dotted suffix of the module name up to the full name
(``"model.layers.3.mlp.down_proj"``) - so a mix is a base recipe, the layers it leaves dense in
``skip``, and the layers with other settings in ``overrides``.  An entry that names no layer of
the model is an error when the model is quantized (a recipe made for another model).
:meth:`QuantRecipe.to_dict` / :meth:`QuantRecipe.from_dict` round-trip a recipe through JSON;
:func:`save_recipe` / :func:`load_recipe` write and read a *recipe file* (the recipe
plus where its calibration text came from and what quality was measured with it), which
``LLM(quant="path/recipe.json")`` and ``--quant path/recipe.json`` accept.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path

from workbench.errors import ConfigError, DataError
from workbench.data import check_spec

SCHEMES = {"w8a16": (8, None), "w4a16": (4, None), "w4a8": (4, 8), "w8a8": (8, 8)}
FALLBACKS = ("pow2", "per-channel")
METHODS = ("rtn", "awq", "gptq")
RECIPE_FORMAT = "workbench-quant-recipe"


def _is_int(v) -> bool:
    """An integer (numpy's too), not a bool and not a float that happens to be whole."""
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def name_matches(name: str, entry: str) -> bool:
    """Whether a ``skip`` / ``overrides`` entry names the module ``name``: one component
    (``"down_proj"``, ``"mlp"``, ``"lm_head"``) matches wherever it occurs in the dotted name;
    a dotted entry matches whole components from the end (``"layers.3.mlp.down_proj"`` and the
    full name match ``"model.layers.3.mlp.down_proj"``; ``"3.mlp.down_proj"`` does not match
    ``"model.layers.13.mlp.down_proj"``)."""
    if "." not in entry:
        return entry in name.split(".")
    return name == entry or name.endswith("." + entry)


@dataclass(frozen=True)
class QuantRecipe:
    weight_bits: int = 8
    group: int | None = None
    per_channel: bool = True
    symmetric: bool = True
    method: str = "rtn"
    group_fallback: str = "pow2"
    skip: tuple[str, ...] = ("embed_tokens", "lm_head")
    overrides: tuple = field(default_factory=tuple)     # ((name suffix, {field: value}), ...)
    act_bits: int | None = None        # None: the model's dtype (A16); 8: dynamic per-token int8
    smooth: float | None = None        # SmoothQuant migration strength alpha in [0, 1]

    def __post_init__(self) -> None:
        if not _is_int(self.weight_bits) or self.weight_bits not in (4, 8):
            raise ConfigError(f"QuantRecipe field 'weight_bits' must be 4 or 8, got {self.weight_bits!r:.80}")
        if self.group is not None and (not _is_int(self.group) or self.group < 2 or self.group % 2):
            raise ConfigError(f"QuantRecipe field 'group' must be None or an even integer >= 2, got {self.group!r:.80}")
        for name in ("per_channel", "symmetric"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"QuantRecipe field {name!r} must be true or false, got {getattr(self, name)!r:.80}")
        if not isinstance(self.method, str) or self.method not in METHODS:
            raise ConfigError(f"QuantRecipe field 'method' must be one of {METHODS}, got {self.method!r:.80}")
        if self.act_bits is not None and (not _is_int(self.act_bits) or self.act_bits != 8):
            raise ConfigError(f"QuantRecipe field 'act_bits' must be None (the model's dtype) or 8, "
                              f"got {self.act_bits!r:.80}")
        if self.act_bits and not self.symmetric:
            raise ConfigError("QuantRecipe: int8 activations (W4A8 / W8A8) need symmetric weights; drop 'asym'")
        if self.smooth is not None and not (isinstance(self.smooth, (int, float)) and not isinstance(self.smooth, bool)
                                            and math.isfinite(self.smooth) and 0 <= self.smooth <= 1):
            raise ConfigError(f"QuantRecipe field 'smooth' must be None or an alpha in [0, 1], got {self.smooth!r:.80}")
        if not isinstance(self.group_fallback, str) or self.group_fallback not in FALLBACKS:
            raise ConfigError(f"QuantRecipe field 'group_fallback' must be one of {FALLBACKS}, "
                              f"got {self.group_fallback!r:.80}")
        if not isinstance(self.skip, tuple) or not all(isinstance(x, str) and x for x in self.skip):
            raise ConfigError(f"QuantRecipe field 'skip' must be a tuple of layer names, got {self.skip!r:.80}")
        if not isinstance(self.overrides, tuple):
            raise ConfigError(f"QuantRecipe field 'overrides' must be a tuple of (layer name, {{field: value}}) pairs, "
                              f"got {self.overrides!r:.80}")
        # method and smooth act on the whole model (calibration, folding): not per layer
        allowed = {f.name for f in dataclasses.fields(self)} - {"overrides", "skip", "method", "smooth"}
        for item in self.overrides:
            if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str) and item[0]
                    and isinstance(item[1], dict)):
                raise ConfigError(f"QuantRecipe field 'overrides': expected (name suffix, {{field: value}}) pairs, "
                                  f"got {item!r:.80}")
            bad = set(item[1]) - allowed
            if bad:
                raise ConfigError(f"QuantRecipe field 'overrides' for {item[0]!r}: unknown fields {sorted(bad)}")
            try:            # the settings the layer would get must be a valid recipe themselves
                dataclasses.replace(self, overrides=(), **item[1])
            except ConfigError as e:
                raise ConfigError(f"QuantRecipe field 'overrides' for {item[0]!r}: {e}") from None

    def skips(self, name: str) -> bool:
        """Whether the linear layer ``name`` stays dense (one of ``skip`` names it)."""
        return any(name_matches(name, s) for s in self.skip)

    @property
    def scheme(self) -> str:
        return f"w{self.weight_bits}a{self.act_bits or 16}"

    @property
    def needs_calibration(self) -> bool:
        """AWQ, GPTQ and SmoothQuant read activations: quantize_model needs calibration text."""
        return self.method != "rtn" or self.smooth is not None

    @property
    def granularity(self) -> str:
        return f"g{self.group}" if self.group else "per-channel" if self.per_channel else "per-tensor"

    @property
    def name(self) -> str:
        base = f"{self.scheme}-{self.granularity}-{'sym' if self.symmetric else 'asym'}-{self.method}"
        if self.smooth is not None:
            base += f"-smooth={self.smooth:g}"
        if self.group:
            base += f"-fallback={self.group_fallback}"
        extra_skip = [s for s in self.skip if s not in ("embed_tokens", "lm_head")]
        head = "" if "lm_head" in self.skip else "-head"
        return (base + head + (f"-dense={len(extra_skip)}" if extra_skip else "")
                + ("-overrides" if self.overrides else ""))

    @classmethod
    def parse(cls, spec: str) -> QuantRecipe:
        """``w8a16``, ``w4a16:g128``, ``w4a16:pc`` (per channel), ``w4a16:pt`` (per tensor),
        ``w4a8``, ``w8a8:smooth=0.5``; options joined by ``:`` - ``asym``, ``fallback=per-channel``,
        ``awq`` / ``gptq`` / ``rtn`` (or ``method=...``), ``smooth`` (alpha 0.5) / ``smooth=A``,
        ``head`` (the LM head quantized too: it is skipped by default)."""
        parts = [p.strip() for p in str(spec).lower().split(":") if p.strip()]
        if not parts or parts[0] not in SCHEMES:
            raise ConfigError(f"quantization scheme {spec!r}: expected one of {', '.join(SCHEMES)} "
                              "followed by options (e.g. w4a16:g128)")
        wb, ab = SCHEMES[parts[0]]
        kw: dict = {"weight_bits": wb, "act_bits": ab}
        for p in parts[1:]:
            if m := re.fullmatch(r"g(\d+)", p):
                kw["group"] = int(m.group(1))
            elif p in ("pc", "per-channel"):
                kw.update(group=None, per_channel=True)
            elif p in ("pt", "per-tensor"):
                kw.update(group=None, per_channel=False)
            elif p in ("asym", "sym"):
                kw["symmetric"] = p == "sym"
            elif p.startswith("fallback="):
                kw["group_fallback"] = p.split("=", 1)[1]
            elif p.startswith("method=") or p in METHODS:
                kw["method"] = p.split("=", 1)[-1]
            elif p == "head":
                kw["skip"] = tuple(x for x in cls().skip if x != "lm_head")
            elif p == "smooth" or p.startswith("smooth="):
                try:
                    kw["smooth"] = float(p.split("=", 1)[1]) if "=" in p else 0.5
                except ValueError:
                    raise ConfigError(f"quantization scheme {spec!r}: smooth=A needs a number, got {p!r}") from None
            else:
                raise ConfigError(f"quantization scheme {spec!r}: unknown option {p!r}")
        return cls(**kw)

    def layer_settings(self, name: str, in_features: int) -> dict:
        """The settings one linear layer gets: overrides applied, then the group fallback."""
        r = self
        for suffix, changes in self.overrides:
            if name_matches(name, suffix):
                r = dataclasses.replace(r, overrides=(), **changes)     # (the overrides were checked once, on self)
        group, per_channel, note = r.group, r.per_channel, None
        if group is not None and in_features % group:
            if r.group_fallback == "pow2":
                g = 1 << (group.bit_length() - 1)
                while g >= 8 and in_features % g:
                    g //= 2
                group, note = (g, f"g{r.group} -> g{g}") if g >= 8 else (None, f"g{r.group} -> per-channel")
            else:
                group, note = None, f"g{r.group} -> per-channel"
            per_channel = True if group is None else per_channel
        return {"bits": r.weight_bits, "group": group, "per_channel": per_channel, "symmetric": r.symmetric,
                "method": r.method, "fallback": note, "act_bits": r.act_bits}

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.update(name=self.name, scheme=self.scheme,
                 activations="int8, dynamic, one scale per token" if self.act_bits else
                 "the model's dtype (fp32 on a CPU, bf16/fp16 on a GPU)")
        return d

    def to_dict(self) -> dict:
        """The fields only, JSON-ready (tuples as lists): :meth:`from_dict` gives the recipe back."""
        d = dataclasses.asdict(self)
        d["skip"] = list(self.skip)
        d["overrides"] = [[suffix, dict(changes)] for suffix, changes in self.overrides]
        return d

    @classmethod
    def from_dict(cls, d: dict, where: str = "recipe") -> QuantRecipe:
        """A recipe from :meth:`to_dict`'s fields (or :meth:`as_dict`'s: its derived keys are
        ignored); an unknown field is a ConfigError naming it and ``where``."""
        if not isinstance(d, dict):
            raise ConfigError(f"{where}: expected a JSON object of QuantRecipe fields, got {type(d).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        derived = {"name", "scheme", "activations"}
        bad = set(d) - known - derived
        if bad:
            raise ConfigError(f"{where}: unknown QuantRecipe fields {sorted(bad)} (known: {', '.join(sorted(known))})")
        kw = {k: v for k, v in d.items() if k in known}
        if "skip" in kw:
            kw["skip"] = tuple(kw["skip"]) if isinstance(kw["skip"], (list, tuple)) else kw["skip"]
        if "overrides" in kw:
            items = kw["overrides"]
            if not isinstance(items, (list, tuple)):
                raise ConfigError(f"{where}: field 'overrides' must be a list of [layer suffix, {{field: value}}]")
            kw["overrides"] = tuple((it[0], dict(it[1])) if isinstance(it, (list, tuple)) and len(it) == 2
                                    and isinstance(it[1], dict) else it for it in items)
        try:
            return cls(**kw)
        except ConfigError as e:
            raise ConfigError(f"{where}: {e}") from None
        except TypeError as e:          # a field of the wrong JSON type deep inside
            raise ConfigError(f"{where}: {e}") from None


def save_recipe(path: str | Path, recipe: QuantRecipe, calibration: dict | None = None, **extra) -> Path:
    """Write a recipe file: ``{"format", "version", "name", "recipe": fields, "calibration":
    where the calibration text came from (or None), **extra}`` (``extra``: what the writer
    measured with it, e.g. the calibrator's quality figure)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"format": RECIPE_FORMAT, "version": 1, "name": recipe.name, "recipe": recipe.to_dict(),
           "calibration": calibration, **extra}
    path.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    return path


# A recipe file is a few kB; anything far larger is no recipe file (and is not read into memory).
MAX_RECIPE_BYTES = 16 * 2**20


def load_recipe(path: str | Path) -> tuple[QuantRecipe, dict]:
    """``(recipe, document)`` of a recipe file written by :func:`save_recipe`; every problem is
    a ConfigError naming the file (and the field): a missing or special file (a FIFO is refused
    unopened), bytes that are not UTF-8 JSON, a recipe field of the wrong type or range, a
    ``calibration`` spec whose fields :func:`workbench.data.check_spec` refuses."""
    path = Path(path)
    try:
        st = path.stat()
    except FileNotFoundError:
        raise ConfigError(f"{path}: recipe file not found") from None
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: cannot read the recipe file ({getattr(e, 'strerror', None) or e})") from None
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(f"{path}: not a regular file; expected a JSON recipe file")
    if st.st_size > MAX_RECIPE_BYTES:
        raise ConfigError(f"{path}: {st.st_size:,} bytes is too large for a recipe file (limit {MAX_RECIPE_BYTES:,})")
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the recipe file ({e.strerror or e})") from None
    except (UnicodeDecodeError, ValueError, RecursionError) as e:    # ValueError: JSONDecodeError, a 5,000-digit int
        raise ConfigError(f"{path}: not a JSON recipe file ({type(e).__name__}: {e})") from None
    if not isinstance(doc, dict) or doc.get("format") != RECIPE_FORMAT:
        raise ConfigError(f"{path}: not a workbench recipe file (expected \"format\": \"{RECIPE_FORMAT}\")")
    cal = doc.get("calibration")
    if cal is not None:
        if not isinstance(cal, dict):
            raise ConfigError(f"{path}: field 'calibration' must be an object (where the calibration text came from) "
                              f"or null, got {type(cal).__name__} {cal!r:.80}")
        if "dataset" in cal or "source" not in cal:   # a data spec (jsonl_windows), not the held-out corpus's
            # record ({"source": "bundled held-out corpus ...", ...}): LLM(quant=...) rebuilds its windows

            try:
                check_spec(cal, f"{path}: field 'calibration'")
            except DataError as e:
                raise ConfigError(str(e)) from None
    return QuantRecipe.from_dict(doc.get("recipe"), where=f"{path}: field 'recipe'"), doc


def is_recipe_file(spec) -> bool:
    """Whether a ``quant=`` value names a recipe file rather than a scheme string."""
    return isinstance(spec, (str, Path)) and str(spec).lower().endswith(".json")


def resolve_recipe(spec) -> tuple[QuantRecipe, dict | None]:
    """``quant=`` as given (a QuantRecipe, a scheme string, or a recipe file's path) ->
    ``(recipe, recipe file document or None)``."""
    if isinstance(spec, QuantRecipe):
        return spec, None
    if is_recipe_file(spec):
        return load_recipe(spec)
    return QuantRecipe.parse(spec), None
