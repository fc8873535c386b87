"""Model configuration: one dataclass for every Llama-family checkpoint we load.

``ModelConfig.from_hf(config_dict)`` reads a Hugging Face ``config.json`` of a Llama, Qwen2 or
Mistral model.  Real checkpoints carry RoPE settings in one of two styles and we read both:

* older transformers: top-level ``rope_theta`` plus an optional ``rope_scaling`` dict;
* transformers 5: a ``rope_parameters`` dict holding ``rope_theta`` and ``rope_type``.

Differences between the three families, as they matter here:

=========  ======================  ==================  ======================
family     q/k/v bias              o_proj bias         sliding window
=========  ======================  ==================  ======================
Llama      ``attention_bias``      ``attention_bias``  none
Qwen2      always                  never               only if ``use_sliding_window``
Mistral    none                    none                ``sliding_window`` (may be null)
=========  ======================  ==================  ======================
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from workbench.errors import ConfigError

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")

# Upper bounds on the shape fields, checked before anything is built from them.  Each is several
# times the largest released Llama / Qwen2 / Mistral checkpoint (Llama-3.1-405B: 126 layers,
# hidden 16384, intermediate 53248, 128 heads of 128; Qwen2: vocab 152064; 128k-1M contexts), so
# real models pass and a typo or a hostile config.json (a million layers, hidden_size 2**40)
# fails in microseconds instead of allocating for minutes.
MAX_VOCAB_SIZE = 2**22                  # 4,194,304
MAX_HIDDEN_SIZE = 2**17                 # 131,072
MAX_INTERMEDIATE_SIZE = 2**20           # 1,048,576
MAX_HIDDEN_LAYERS = 1024
MAX_ATTENTION_HEADS = 1024              # also bounds num_key_value_heads (a divisor of it)
MAX_HEAD_DIM = 1024
MAX_POSITION_EMBEDDINGS = 2**24         # 16,777,216 tokens of context
MAX_PARAMETERS = 2**42                  # ~4.4e12: ten times Llama-3.1-405B
_BOUNDS = {"vocab_size": MAX_VOCAB_SIZE, "hidden_size": MAX_HIDDEN_SIZE,
           "intermediate_size": MAX_INTERMEDIATE_SIZE, "num_hidden_layers": MAX_HIDDEN_LAYERS,
           "num_attention_heads": MAX_ATTENTION_HEADS, "num_key_value_heads": MAX_ATTENTION_HEADS,
           "head_dim": MAX_HEAD_DIM, "max_position_embeddings": MAX_POSITION_EMBEDDINGS,
           "sliding_window": MAX_POSITION_EMBEDDINGS}
# Checkpoint dtypes a config.json may name (``torch_dtype``, or ``dtype`` in transformers 5), with
# or without a "torch." prefix.  Quantized checkpoints name their float compute dtype here too.
SUPPORTED_TORCH_DTYPES = ("float32", "float16", "bfloat16", "float64", "fp32", "fp16", "bf16", "half",
                          "float", "double")


@dataclass
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int | None = None  # defaults to hidden_size // num_attention_heads
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # {"rope_type": "llama3", "factor": 32.0, ...} or None for plain RoPE.
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    sliding_window: int | None = None
    architecture: str = "LlamaForCausalLM"
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    torch_dtype: str = "float32"
    extra: dict[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        # Validate the integer fields before using them (a string hidden_size must not surface
        # as a TypeError from the head_dim default below).
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim",
                     "max_position_embeddings"):
            value = getattr(self, name)
            if name == "head_dim" and value is None:
                value = self.head_dim = self.hidden_size // self.num_attention_heads
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"config field '{name}' must be a positive integer, got {value!r}")
            if value > _BOUNDS[name]:
                raise ConfigError(f"config field '{name}' is {value}, above the bound of {_BOUNDS[name]} "
                                  "(no real checkpoint comes close; is config.json corrupt?)")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"config field 'num_attention_heads' ({self.num_attention_heads}) must be a multiple "
                f"of 'num_key_value_heads' ({self.num_key_value_heads}) for grouped-query attention")
        if self.head_dim % 2:
            raise ConfigError(f"config field 'head_dim' must be even for RoPE, got {self.head_dim}")
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(
                f"config field 'architectures' is {self.architecture!r}; supported: "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}")
        if self.rope_scaling is not None:
            if not isinstance(self.rope_scaling, dict):
                raise ConfigError(f"config field 'rope_scaling' must be a dict or null, got {self.rope_scaling!r}")
            rope_type = self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default"))
            if rope_type not in SUPPORTED_ROPE_TYPES:
                raise ConfigError(
                    f"config field 'rope_scaling.rope_type' is {rope_type!r}; supported: "
                    f"{', '.join(SUPPORTED_ROPE_TYPES)}")
            if rope_type == "default":
                self.rope_scaling = None
            else:
                self.rope_scaling = dict(self.rope_scaling, rope_type=rope_type)
                _check_rope_scaling(self.rope_scaling)
        if self.sliding_window is not None and (not isinstance(self.sliding_window, int)
                                                or isinstance(self.sliding_window, bool)
                                                or self.sliding_window <= 0):
            raise ConfigError(f"config field 'sliding_window' must be positive or null, got {self.sliding_window}")
        if self.sliding_window is not None and self.sliding_window > _BOUNDS["sliding_window"]:
            raise ConfigError(f"config field 'sliding_window' is {self.sliding_window}, above the bound of "
                              f"{_BOUNDS['sliding_window']}")
        check_torch_dtype(self.torch_dtype, "torch_dtype")
        for name in ("rms_norm_eps", "rope_theta"):
            _positive_float(getattr(self, name), name)
        for name in ("tie_word_embeddings", "qkv_bias", "o_bias", "mlp_bias"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"config field '{name}' must be true or false, got {getattr(self, name)!r}")
        _check_token_id(self.bos_token_id, "bos_token_id", allow_list=False)
        _check_token_id(self.eos_token_id, "eos_token_id", allow_list=True)
        n = self.num_parameters()
        if n > MAX_PARAMETERS:
            raise ConfigError(f"config describes {n:,} parameters, above the bound of {MAX_PARAMETERS:,} "
                              "('num_hidden_layers', 'hidden_size', 'intermediate_size' and 'vocab_size' "
                              f"are {self.num_hidden_layers}, {self.hidden_size}, {self.intermediate_size}, "
                              f"{self.vocab_size})")

    # ---- derived sizes -------------------------------------------------------------------
    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def num_parameters(self) -> int:
        """Parameter count computed from the shapes (embedding counted once when tied)."""
        h, q, kv, i = self.hidden_size, self.q_size, self.kv_size, self.intermediate_size
        attn = h * q + 2 * h * kv + q * h + (q + 2 * kv if self.qkv_bias else 0) + (h if self.o_bias else 0)
        mlp = 3 * h * i + ((2 * i + h) if self.mlp_bias else 0)
        per_layer = attn + mlp + 2 * h
        emb = self.vocab_size * h
        return emb * (1 if self.tie_word_embeddings else 2) + self.num_hidden_layers * per_layer + h

    def kv_bytes_per_token(self, bytes_per_element: int = 2) -> int:
        """Bytes of K and V one token occupies across all layers."""
        return 2 * self.num_hidden_layers * self.kv_size * bytes_per_element

    # ---- Hugging Face config.json --------------------------------------------------------
    @classmethod
    def from_hf(cls, d: dict[str, Any], source: str = "config.json") -> ModelConfig:
        archs = d.get("architectures") or []
        if not archs:
            raise ConfigError(f"{source}: field 'architectures' is missing or empty; expected one of "
                              f"{', '.join(SUPPORTED_ARCHITECTURES)}")
        if not isinstance(archs, list):
            raise ConfigError(f"{source}: field 'architectures' must be a list such as [\"LlamaForCausalLM\"], "
                              f"got {type(archs).__name__} {archs!r:.80}")
        arch = archs[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(f"{source}: field 'architectures' is {archs!r}; supported: "
                              f"{', '.join(SUPPORTED_ARCHITECTURES)}")
        required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads")
        missing = [k for k in required if k not in d]
        if missing:
            raise ConfigError(f"{source}: required field(s) {', '.join(missing)} missing")

        # RoPE: transformers-5 style first, then the older style.
        rope_params = d.get("rope_parameters")
        if isinstance(rope_params, dict) and "full_attention" in rope_params:  # per-layer-type dict
            rope_params = rope_params["full_attention"]
        if isinstance(rope_params, dict):
            theta = rope_params.get("rope_theta", d.get("rope_theta", 10000.0))
            scaling = {k: v for k, v in rope_params.items() if k != "rope_theta"}
        else:
            theta = d.get("rope_theta", 10000.0)
            scaling = d.get("rope_scaling") or None
            if scaling is not None and not isinstance(scaling, dict):
                raise ConfigError(f"{source}: field 'rope_scaling' must be an object or null, got {scaling!r}")
            scaling = dict(scaling) if scaling else None

        if arch == "Qwen2ForCausalLM":
            qkv_bias, o_bias = True, False
            window = _qwen2_sliding_window(d, source)
        elif arch == "MistralForCausalLM":
            qkv_bias = o_bias = False
            window = d.get("sliding_window")
        else:
            qkv_bias = o_bias = _flag(d, "attention_bias", source)
            window = None
        tied, mlp_bias = _flag(d, "tie_word_embeddings", source), _flag(d, "mlp_bias", source)
        dtype_key = "torch_dtype" if d.get("torch_dtype") is not None else "dtype"
        dtype = d.get(dtype_key)
        if dtype is None:
            dtype = "float32"
        else:
            try:
                check_torch_dtype(dtype, dtype_key)
            except ConfigError as e:
                raise ConfigError(f"{source}: {e}") from None
        known = {f.name for f in dataclasses.fields(cls)}
        try:
            return cls(
                vocab_size=d["vocab_size"],
                hidden_size=d["hidden_size"],
                intermediate_size=d["intermediate_size"],
                num_hidden_layers=d["num_hidden_layers"],
                num_attention_heads=d["num_attention_heads"],
                num_key_value_heads=d.get("num_key_value_heads") or d["num_attention_heads"],
                head_dim=d.get("head_dim"),
                max_position_embeddings=d.get("max_position_embeddings", 2048),
                rms_norm_eps=_positive_float(d.get("rms_norm_eps", 1e-6), "rms_norm_eps"),
                rope_theta=_positive_float(theta, "rope_theta"),
                rope_scaling=scaling,
                tie_word_embeddings=tied,
                qkv_bias=qkv_bias,
                o_bias=o_bias,
                mlp_bias=mlp_bias,
                sliding_window=window,
                architecture=arch,
                bos_token_id=d.get("bos_token_id"),
                eos_token_id=d.get("eos_token_id"),
                torch_dtype=dtype,
                extra={k: v for k, v in d.items() if k not in known},
            )
        except ConfigError as e:
            raise ConfigError(f"{source}: {e}") from None

    def to_hf(self) -> dict[str, Any]:
        """A config.json dict that transformers (4.x and 5.x) can load."""
        d: dict[str, Any] = {
            "architectures": [self.architecture],
            "model_type": {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
                           "MistralForCausalLM": "mistral"}[self.architecture],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "torch_dtype": self.torch_dtype,
        }
        if self.architecture == "LlamaForCausalLM":
            d["attention_bias"] = self.qkv_bias
            d["mlp_bias"] = self.mlp_bias
        elif self.architecture == "MistralForCausalLM":
            d["sliding_window"] = self.sliding_window
        else:
            d["use_sliding_window"] = self.sliding_window is not None
            d["sliding_window"] = self.sliding_window
            # transformers slides only layers i >= max_window_layers (default 28): 0 = all layers.
            d["max_window_layers"] = 0 if self.sliding_window is not None else self.num_hidden_layers
        return d


def _qwen2_sliding_window(d: dict[str, Any], source: str) -> int | None:
    """The sliding window of a Qwen2 config.json, as transformers applies it.

    transformers uses ``sliding_window`` only if ``use_sliding_window`` is true, and then only on
    the layers whose ``layer_types`` entry is ``"sliding_attention"`` (when ``layer_types`` is
    absent: layers ``i >= max_window_layers``, default 28).  So ``use_sliding_window: true`` with
    ``max_window_layers >= num_hidden_layers`` means full attention everywhere.  One window for
    all layers or none is supported; a mix is refused rather than computed wrongly.
    """
    window = d.get("sliding_window") if _flag(d, "use_sliding_window", source) else None
    if window is None:
        return None
    n = d["num_hidden_layers"]
    layer_types = d.get("layer_types")
    if isinstance(layer_types, list) and layer_types:
        sliding = [t == "sliding_attention" for t in layer_types]
        some, every = any(sliding), all(sliding)
        field_desc = "'layer_types'"
    else:
        mwl = d.get("max_window_layers", 28)
        if not isinstance(mwl, int) or isinstance(mwl, bool):
            raise ConfigError(f"{source}: field 'max_window_layers' must be an integer, got {mwl!r}")
        # layers i >= mwl slide; computed without a list of n flags (n is not bounded yet here)
        n_layers = n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 0
        some, every = n_layers > max(mwl, 0), n_layers > 0 and mwl <= 0
        field_desc = f"'max_window_layers' ({mwl}) with 'num_hidden_layers' ({n})"
    if not some:
        return None
    if not every:
        raise ConfigError(f"{source}: Qwen2 sliding window on only some layers ({field_desc}) is not "
                          "supported; expected it on all layers or on none")
    return window


def _check_rope_scaling(scaling: dict[str, Any]) -> None:
    """The numbers a 'linear' / 'llama3' RoPE scaling needs, checked up front (a missing
    'factor' would otherwise surface as a KeyError while building the model)."""
    def number(key: str, default: float | None = None) -> float:
        value = scaling.get(key, default)
        if value is None:
            raise ConfigError(f"config field 'rope_scaling.{key}' is required for rope_type "
                              f"{scaling['rope_type']!r}")
        if (isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0
                or not math.isfinite(value)):
            raise ConfigError(f"config field 'rope_scaling.{key}' must be a positive finite number, "
                              f"got {value!r}")
        return float(value)

    number("factor")
    if scaling["rope_type"] == "llama3":
        low, high = number("low_freq_factor", 1.0), number("high_freq_factor", 4.0)
        number("original_max_position_embeddings", 8192)
        if high <= low:
            raise ConfigError(f"config field 'rope_scaling.high_freq_factor' ({high}) must be greater "
                              f"than 'rope_scaling.low_freq_factor' ({low})")


def _positive_float(value: Any, name: str) -> float:
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0
            or not math.isfinite(value)):
        raise ConfigError(f"config field '{name}' must be a positive finite number, got {value!r}")
    return float(value)


def check_torch_dtype(value: Any, name: str = "torch_dtype") -> str:
    """A config.json checkpoint dtype: one of :data:`SUPPORTED_TORCH_DTYPES` (optionally "torch."-prefixed)."""
    if not isinstance(value, str) or value.removeprefix("torch.") not in SUPPORTED_TORCH_DTYPES:
        raise ConfigError(f"config field '{name}' is {value!r}; supported: float32, float16, bfloat16 "
                          "(or float64, and the aliases fp32, fp16, bf16, half, float, double)")
    return value


def _flag(d: dict[str, Any], key: str, source: str) -> bool:
    """A boolean config.json field: true, false or null (absent / null = false).  A string such as
    "false" is refused rather than read as true."""
    value = d.get(key)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ConfigError(f"{source}: field '{key}' must be true or false, got {value!r}")
    return value


def _check_token_id(value: Any, name: str, allow_list: bool) -> None:
    """Type only: a token id is compared with sampled ids, never used as an index, so an odd
    value (some exporters write -1) is harmless; a string or float is a broken config."""
    def ok(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    if value is None or ok(value):
        return
    if allow_list and isinstance(value, list) and value and all(ok(v) for v in value):
        return
    kind = "an integer, a non-empty list of integers, or null" if allow_list else "an integer or null"
    raise ConfigError(f"config field '{name}' must be {kind}, got {value!r}")
