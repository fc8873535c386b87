"""Shape presets: random weights with the shapes of well-known checkpoints.

For speed studies on a GPU (bandwidth and latency do not depend on weight values), so no
download is needed.  ``load_model("preset:llama-3.2-1b")``.  Shapes are those published in
each model's ``config.json``; the tiny preset is for tests.
"""

from __future__ import annotations

from workbench.model.config import ModelConfig
from workbench.errors import ConfigError

_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}

PRESETS: dict[str, dict] = {
    "llama-3.2-1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                         max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
                         rope_scaling=_LLAMA3_ROPE, tie_word_embeddings=True, bos_token_id=128000,
                         eos_token_id=128001, torch_dtype="bfloat16"),
    "llama-3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                       max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0,
                       bos_token_id=128000, eos_token_id=128001, torch_dtype="bfloat16"),
    "llama-2-7b": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=32, head_dim=128,
                       max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=10000.0,
                       bos_token_id=1, eos_token_id=2, torch_dtype="float16"),
    "qwen2.5-0.5b": dict(architecture="Qwen2ForCausalLM", vocab_size=151936, hidden_size=896,
                         intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, head_dim=64, max_position_embeddings=32768,
                         rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True, qkv_bias=True,
                         bos_token_id=151643, eos_token_id=151643, torch_dtype="bfloat16"),
    # weight-streaming demos on a CPU: a ~47 MB fp32 layer copies from disk in ~40 ms, about what
    # a prefill step of a few hundred tokens computes it in (workbench.bench.prefetch)
    "stream-demo": dict(vocab_size=8192, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
                        num_attention_heads=16, num_key_value_heads=8, head_dim=64, max_position_embeddings=2048,
                        rms_norm_eps=1e-5, tie_word_embeddings=True, torch_dtype="float32"),
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                 rms_norm_eps=1e-5, tie_word_embeddings=True, torch_dtype="float32"),
}


def preset_config(name: str) -> ModelConfig:
    try:
        return ModelConfig(**PRESETS[name.lower()])
    except KeyError:
        raise ConfigError(f"unknown preset {name!r}; available: {', '.join(PRESETS)}") from None
