"""Exact byte accounting of a paged KV cache.

Per layer the cache holds K and V, each ``[num_blocks, block_size, num_kv_heads, head_dim]``::

    bytes_per_block_per_layer = 2 (K and V) * block_size * num_kv_heads * head_dim * dtype_bytes
    bytes_per_block           = num_layers * bytes_per_block_per_layer
    bytes_per_token           = bytes_per_block / block_size

Example, Llama-3-8B (32 layers, 8 KV heads of 128) in bf16: 128 KiB per token, 2 MiB per
16-token block, so 16 GiB of KV holds 8,192 blocks = 131,072 tokens.

No torch import: a torch dtype is read by its name or ``itemsize``.
"""

from __future__ import annotations

from dataclasses import dataclass

from workbench.errors import ConfigError

DTYPE_BYTES = {
    "float64": 8, "double": 8, "float32": 4, "float": 4, "fp32": 4,
    "bfloat16": 2, "bf16": 2, "float16": 2, "half": 2, "fp16": 2,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1,
    "fp8": 1, "int8": 1, "uint8": 1,
}


def dtype_bytes(dtype) -> int:
    """Bytes per element of a torch dtype or a dtype name ("bfloat16", "torch.float32", "fp8")."""
    name = str(dtype).removeprefix("torch.")
    if name in DTYPE_BYTES:
        return DTYPE_BYTES[name]
    size = getattr(dtype, "itemsize", None)
    if isinstance(size, int) and size > 0:
        return size
    raise ConfigError(f"KV cache dtype {dtype!r} is unknown; use one of {', '.join(DTYPE_BYTES)} or a torch dtype")


@dataclass(frozen=True)
class KVLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype_bytes: int

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size", "dtype_bytes"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"KVLayout.{name} must be a positive integer, got {v!r}")

    @classmethod
    def from_model_config(cls, cfg, block_size: int, dtype="bfloat16") -> KVLayout:
        """From a :class:`workbench.model.config.ModelConfig`; ``dtype`` a torch dtype or its name."""
        return cls(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, block_size, dtype_bytes(dtype))

    @property
    def bytes_per_block_per_layer(self) -> int:
        return 2 * self.block_size * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def bytes_per_block(self) -> int:
        return self.num_layers * self.bytes_per_block_per_layer

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    def num_blocks_for_bytes(self, budget_bytes: int) -> int:
        """Whole blocks (all layers, K and V) that fit in ``budget_bytes``."""
        if budget_bytes < 0:
            raise ConfigError(f"KV cache budget must be >= 0 bytes, got {budget_bytes}")
        return int(budget_bytes) // self.bytes_per_block

    def bytes_for_tokens(self, num_tokens: int) -> int:
        """Bytes of the blocks a sequence of ``num_tokens`` occupies (its last block rounded up)."""
        return -(-num_tokens // self.block_size) * self.bytes_per_block
