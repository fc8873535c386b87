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
from dataclasses import dataclass, field
from typing import Any

from .errors import ConfigError

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


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
    def from_hf(cls, d: dict[str, Any], source: str = "config.json") -> "ModelConfig":
        archs = d.get("architectures") or []
        if not archs:
            raise ConfigError(f"{source}: field 'architectures' is missing or empty; expected one of "
                              f"{', '.join(SUPPORTED_ARCHITECTURES)}")
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
            qkv_bias = o_bias = bool(d.get("attention_bias", False))
            window = None
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
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                qkv_bias=qkv_bias,
                o_bias=o_bias,
                mlp_bias=bool(d.get("mlp_bias", False)),
                sliding_window=window,
                architecture=arch,
                bos_token_id=d.get("bos_token_id"),
                eos_token_id=d.get("eos_token_id"),
                torch_dtype=str(d.get("torch_dtype") or d.get("dtype") or "float32"),
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
    window = d.get("sliding_window") if d.get("use_sliding_window") else None
    if window is None:
        return None
    n = d["num_hidden_layers"]
    layer_types = d.get("layer_types")
    if isinstance(layer_types, list) and layer_types:
        sliding = [t == "sliding_attention" for t in layer_types]
        field_desc = "'layer_types'"
    else:
        mwl = d.get("max_window_layers", 28)
        if not isinstance(mwl, int) or isinstance(mwl, bool):
            raise ConfigError(f"{source}: field 'max_window_layers' must be an integer, got {mwl!r}")
        sliding = [i >= mwl for i in range(n if isinstance(n, int) else 0)]
        field_desc = f"'max_window_layers' ({mwl}) with 'num_hidden_layers' ({n})"
    if not any(sliding):
        return None
    if not all(sliding):
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
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ConfigError(f"config field 'rope_scaling.{key}' must be a positive number, got {value!r}")
        return float(value)

    number("factor")
    if scaling["rope_type"] == "llama3":
        low, high = number("low_freq_factor", 1.0), number("high_freq_factor", 4.0)
        number("original_max_position_embeddings", 8192)
        if high <= low:
            raise ConfigError(f"config field 'rope_scaling.high_freq_factor' ({high}) must be greater "
                              f"than 'rope_scaling.low_freq_factor' ({low})")


def _positive_float(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigError(f"config field '{name}' must be a positive number, got {value!r}")
    return float(value)
