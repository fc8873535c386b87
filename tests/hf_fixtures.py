"""Small random ``transformers`` checkpoints, built offline, for oracle and loader tests.

``build_hf_model(arch, **overrides)`` returns a randomly initialised ``LlamaForCausalLM`` /
``Qwen2ForCausalLM`` / ``MistralForCausalLM`` in float32 eval mode.  Weights are drawn so that
the tests have teeth: attention scores are O(1) (not the near-uniform attention of
``initializer_range=0.02``), RMSNorm weights are not all ones and biases are not all zeros, so
a forgotten bias, a wrong norm, a wrong RoPE frequency or a wrong mask shows up in the logits.

``save_hf_checkpoint(model, folder)`` writes it with ``save_pretrained`` (safetensors).
``hf_logits(model, ids)`` is the oracle: transformers' own forward in float32.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import torch

VOCAB = 300

# Small defaults per family; every test config overrides some of them.
_BASE: dict[str, dict[str, Any]] = {
    "llama": dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
                  rms_norm_eps=1e-5, tie_word_embeddings=False),
    "qwen2": dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  rms_norm_eps=1e-6, tie_word_embeddings=False, use_sliding_window=False),
    "mistral": dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                    rms_norm_eps=1e-5, tie_word_embeddings=False, sliding_window=None),
}


def _classes(family: str):
    import transformers as tf

    return {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
        "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
    }[family]


def quiet_transformers() -> None:
    """Silence transformers' progress bars and advisory warnings."""
    try:
        from transformers.utils import logging as tf_logging

        tf_logging.set_verbosity_error()
        tf_logging.disable_progress_bar()
    except Exception:  # pragma: no cover - cosmetic only
        pass


def build_hf_model(family: str, seed: int = 0, **overrides: Any):
    """A random float32 ``<Family>ForCausalLM`` in eval mode with eager attention."""
    quiet_transformers()
    config_cls, model_cls = _classes(family)
    kwargs = dict(_BASE[family])
    kwargs.update(overrides)
    cfg = config_cls(**kwargs)
    cfg._attn_implementation = "eager"  # the plainest reference path
    torch.manual_seed(seed)
    model = model_cls(cfg).to(torch.float32).eval()
    randomize_(model, seed=seed)
    return model


@torch.no_grad()
def randomize_(model: torch.nn.Module, seed: int = 0) -> None:
    """Re-draw every parameter so that no feature is invisible (see module docstring)."""
    gen = torch.Generator().manual_seed(seed + 1234)
    for name, p in model.named_parameters():  # tied weights are visited once
        if name.endswith("norm.weight"):
            p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
        elif name.endswith(".bias"):
            p.copy_(0.2 * torch.randn(p.shape, generator=gen))
        elif "embed_tokens" in name:
            p.copy_(torch.randn(p.shape, generator=gen))
        else:  # Linear [out, in]: unit-variance outputs for unit-variance inputs
            p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[1]))


def save_hf_checkpoint(model, folder: Path, **save_kwargs: Any) -> Path:
    """``model.save_pretrained(folder)``: config.json + safetensors (transformers 5 always
    writes safetensors; ``max_shard_size`` forces an index + shards)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(folder), **save_kwargs)
    return folder


@torch.no_grad()
def hf_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """transformers' logits [B, T, V] for a full forward in float32 (no padding)."""
    return model(input_ids=ids, use_cache=False).logits.float()


def random_ids(batch: int, length: int, vocab: int = VOCAB, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, length), generator=gen)


def read_config_json(folder: Path) -> dict[str, Any]:
    return json.loads((Path(folder) / "config.json").read_text())


def write_config_json(folder: Path, d: dict[str, Any]) -> None:
    (Path(folder) / "config.json").write_text(json.dumps(d, indent=2) + "\n")


def to_old_rope_style(d: dict[str, Any], key: str = "rope_type") -> dict[str, Any]:
    """Rewrite a transformers-5 ``config.json`` dict (``rope_parameters``) in the older style:
    top-level ``rope_theta`` plus a ``rope_scaling`` dict (None for plain RoPE).  ``key`` is
    the name of the type field in ``rope_scaling`` ("rope_type", or "type" in the oldest
    configs)."""
    d = dict(d)
    params = dict(d.pop("rope_parameters", None) or {})
    if "full_attention" in params:
        params = dict(params["full_attention"])
    d["rope_theta"] = params.pop("rope_theta", 10000.0)
    rope_type = params.pop("rope_type", params.pop("type", "default"))
    d["rope_scaling"] = None if rope_type == "default" else {key: rope_type, **params}
    return d


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> tuple[float, float]:
    """(relative L2 error, max abs error) of ``actual`` against ``expected`` (in float64)."""
    a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
    if a.shape != e.shape:
        raise AssertionError(f"shape mismatch: got {tuple(a.shape)}, expected {tuple(e.shape)}")
    diff = a - e
    rel = (diff.norm() / e.norm().clamp_min(1e-30)).item()
    return rel, diff.abs().max().item()


def assert_close_report(actual: torch.Tensor, expected: torch.Tensor, rtol: float = 1e-4,
                        what: str = "logits") -> float:
    """Assert relative L2 error <= rtol; the message reports rel L2 and max abs error (and
    where the worst element is).  Returns the relative error."""
    rel, max_abs = rel_err(actual, expected)
    if not (rel <= rtol):  # also catches NaN
        diff = (actual.double() - expected.double()).abs()
        worst = tuple(int(i) for i in torch.unravel_index(diff.argmax(), diff.shape)) if diff.numel() else ()
        raise AssertionError(
            f"{what}: relative L2 error {rel:.3e} > {rtol:.1e} (max abs error {max_abs:.3e} at index "
            f"{worst}; |expected| L2 {expected.double().norm().item():.3e}, shape {tuple(expected.shape)})")
    return rel
