"""A Llama-family decoder in plain PyTorch (Llama, Qwen2, Mistral).

This is the *reference* network: every later optimisation (fused kernels, paged KV, quantized
weights) is a transformation applied to this module and is checked against it.  Module and
parameter names mirror Hugging Face's (``model.layers.3.self_attn.q_proj.weight`` ...) so a
checkpoint's state dict loads with no renaming, and so a learner can read both side by side.

Shapes (B = batch, T = new tokens this call, S = tokens in the cache after this call,
H = hidden size, nh / nkv = query / key-value heads, hd = head dim, V = vocab)::

    input_ids [B, T] -> embed [B, T, H] -> L x DecoderLayer -> norm -> lm_head -> logits [B, T, V]

    DecoderLayer:  x = x + Attention(RMSNorm(x));  x = x + MLP(RMSNorm(x))
    Attention:     q [B, nh, T, hd], k/v [B, nkv, S, hd]  (GQA: nh / nkv query heads share a kv head)
    MLP (SwiGLU):  down( silu(gate(x)) * up(x) )
"""

from __future__ import annotations

import math
import zlib
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from workbench.model.config import ModelConfig

if TYPE_CHECKING:
    from workbench.model.kv_cache import KVCache
    from workbench.model.ops import Ops


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * w, computed in float32 like the HF reference."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.ops: Ops | None = None      # backend entry points (workbench.transforms.backends); None: this code

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies theta^(-2i/d), i < d/2, optionally rescaled.

    ``linear`` divides every frequency by ``factor`` (position interpolation).  ``llama3``
    (Llama 3.1+) leaves high frequencies alone, divides low frequencies (wavelength longer than
    ``original_max_position_embeddings / low_freq_factor``) by ``factor`` and interpolates
    smoothly in between.
    """
    # Always on the CPU in float32 (also when a model is built under torch.device("meta")).
    exps = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (theta ** exps)
    if not scaling:
        return inv_freq
    kind = scaling["rope_type"]
    factor = float(scaling["factor"])
    if kind == "linear":
        return inv_freq / factor
    # llama3
    low_ff = float(scaling.get("low_freq_factor", 1.0))
    high_ff = float(scaling.get("high_freq_factor", 4.0))
    old_ctx = float(scaling.get("original_max_position_embeddings", 8192))
    low_wavelen, high_wavelen = old_ctx / low_ff, old_ctx / high_ff
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low_ff) / (high_ff - low_ff)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """cos/sin tables, grown on demand, indexed by absolute position."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        # A plain attribute, not a buffer: model.to(bfloat16) must not round the frequencies.
        self.inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        self._cos = self._sin = None

    def _table(self, n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if self._cos is None or self._cos.shape[0] < n or self._cos.device != device:
            size = 1 << max(n - 1, 1).bit_length()  # next power of two: few regrowths
            pos = torch.arange(size, device=device, dtype=torch.float32)
            freqs = pos[:, None] * self.inv_freq.to(device)[None, :]      # [size, hd/2]
            emb = torch.cat((freqs, freqs), dim=-1)                        # [size, hd]
            self._cos, self._sin = emb.cos(), emb.sin()
        return self._cos, self._sin

    def forward(self, start: int, end: int, device: torch.device, dtype: torch.dtype):
        """cos, sin [end - start, hd] for positions start..end-1."""
        cos, sin = self._table(end, device)
        return cos[start:end].to(dtype), sin[start:end].to(dtype)

    def at(self, positions: torch.Tensor, dtype: torch.dtype, max_position: int | None = None):
        """cos, sin [T, hd] for the given absolute positions (a [T] long tensor), any order.
        ``max_position`` (known on the host) saves reading the largest one from the device."""
        if max_position is None:
            max_position = int(positions.max()) if positions.numel() else 0
        n = max_position + 1
        cos, sin = self._table(n, positions.device)
        return cos[positions].to(dtype), sin[positions].to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, T, hd]; cos/sin [T, hd] (HF's "rotate half" layout, not interleaved)."""
    return x * cos + rotate_half(x) * sin


def attention_mask(q_pos: torch.Tensor, k_len: int, window: int | None, k_start: int = 0) -> torch.Tensor:
    """Boolean [T, S] mask: query at absolute position p sees keys at positions <= p
    (and > p - window with a sliding window).  The S keys sit at absolute positions
    ``k_start .. k_start + S - 1`` (0 with a cache; ``start_pos`` without one)."""
    k_pos = torch.arange(k_start, k_start + k_len, device=q_pos.device)
    mask = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        mask &= k_pos[None, :] > q_pos[:, None] - window
    return mask


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.nh, self.nkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.window = cfg.sliding_window
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.q_size, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.kv_size, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.ops: Ops | None = None      # backend entry points (workbench.transforms.backends); None: this code

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, start: int,
                cache: KVCache | None) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.nh, self.hd).transpose(1, 2)   # [B, nh, T, hd]
        k = self.k_proj(x).view(B, T, self.nkv, self.hd).transpose(1, 2)  # [B, nkv, T, hd]
        v = self.v_proj(x).view(B, T, self.nkv, self.hd).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is None:                     # no cache: the keys are these tokens, from `start`
            out = reference_attention(q, k, v, start, self.window)
        else:                                 # the cache writes k/v and attends (workbench.model.kv_cache)
            out = cache.attend(self, q, k, v, start)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.nh * self.hd))


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int,
                        window: int | None) -> torch.Tensor:
    """The reference attention: queries q [B, nh, T, hd] at positions start..start+T-1 over keys
    k, v [B, nkv, S, hd] that end where the queries end (S = start + T with a cache, S = T
    without one).  Causal, with the model's sliding window; GQA by SDPA's ``enable_gqa``."""
    T, S = q.shape[2], k.shape[2]
    if start == 0 and T == S and window is None:
        mask, causal = None, T > 1          # plain causal prefill: SDPA's fast path
    elif T == 1 and (window is None or S <= window):
        mask, causal = None, False          # one new token sees the whole cache
    else:
        positions = torch.arange(start, start + T, device=q.device)
        mask, causal = attention_mask(positions, S, window, k_start=start + T - S), False
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                          enable_gqa=q.shape[1] != k.shape[1])


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.ops: Ops | None = None      # backend entry points (workbench.transforms.backends); None: this code

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)
        self.ops: Ops | None = None      # backend entry points (workbench.transforms.backends); None: this code

    def forward(self, x, cos, sin, start, cache):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, start, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderStack(nn.Module):
    """HF's ``LlamaModel``: embeddings, layers, final norm (named ``model`` in the checkpoint)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(cfg)


class CausalLM(nn.Module):
    """``CausalLM(cfg)(input_ids) -> logits``; with a :class:`KVCache`, incremental decoding.

    ``start_pos`` is the absolute position of ``input_ids[:, 0]`` (all rows share it: the
    reference engine runs one sequence, or equal-length sequences, at a time).
    ``logits_to_keep=k`` computes the LM head for the last k positions only (0 = all), as
    generation needs only the last one.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = DecoderStack(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.ops: Ops | None = None      # the backends' entry points, sampling's for the engine; None: the reference

    def forward(self, input_ids: torch.Tensor, start_pos: int = 0, cache: KVCache | None = None,
                logits_to_keep: int = 0, positions: torch.Tensor | None = None,
                logits_rows: torch.Tensor | None = None, max_position: int | None = None) -> torch.Tensor:
        """Logits [B, T or logits_to_keep, V].

        ``positions`` (a [T] long tensor) replaces ``start_pos`` for a *packed* step: one row of
        tokens from many sequences, each at its own position; the cache (a batch view such as
        :class:`~workbench.kv.paged.PagedBatchCache`) knows which token belongs to which
        sequence.  ``logits_rows`` then picks the rows that get logits ([k] long) -> [k, V];
        ``max_position``: the largest position, when the caller knows it without a device read.
        """
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, tokens], got shape {tuple(input_ids.shape)}")
        B, T = input_ids.shape
        x = self.model.embed_tokens(input_ids)
        if positions is None:
            if cache is not None and start_pos != cache.length:
                raise ValueError(f"start_pos {start_pos} does not continue the cache (length {cache.length})")
            cos, sin = self.model.rotary_emb(start_pos, start_pos + T, x.device, x.dtype)
        else:
            cos, sin = self.model.rotary_emb.at(positions, x.dtype, max_position)   # [T, hd] rows by position
        for layer in self.model.layers:
            x = layer(x, cos, sin, start_pos, cache)
        if positions is not None:
            return self.lm_head(self.model.norm(x[0, logits_rows] if logits_rows is not None else x))
        if cache is not None:
            cache.length = start_pos + T
        x = self.model.norm(x[:, -logits_to_keep:] if logits_to_keep else x)
        return self.lm_head(x)

    def new_cache(self, batch_size: int = 1, max_len: int | None = None) -> KVCache:
        """A contiguous KV cache for this model on its device and dtype."""
        from workbench.model.kv_cache import KVCache  # lazy: kv_cache imports this module (a cycle)

        p = self.lm_head.weight
        return KVCache(self.config, batch_size, max_len or self.config.max_position_embeddings,
                       device=p.device, dtype=p.dtype)

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device


def init_weights(model: CausalLM, seed: int | None = 0, std: float = 0.02) -> CausalLM:
    """GPT-2 style init: N(0, std), residual output projections scaled by 1/sqrt(2L)."""
    gen = torch.Generator(device="cpu")
    if seed is not None:
        gen.manual_seed(seed)
    resid_std = std / math.sqrt(2 * model.config.num_hidden_layers)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                s = resid_std if name.endswith(("o_proj.weight", "down_proj.weight")) else std
                if p.device.type == "cpu":
                    p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32) * s)
                else:  # fill on the device: a CPU round trip of 8B weights would take minutes
                    _fill_on_device(p, s, seed, name)
    return model


def _fill_on_device(p: torch.Tensor, std: float, seed: int | None, name: str) -> None:
    """N(0, std) in place on ``p``'s device from a generator of that device seeded by ``seed``
    and the parameter's name, so two loads with the same seed give the same weights whatever the
    device's global RNG did in between (``seed=None``: the global RNG).  These weights are not
    the CPU path's for the same seed (another generator); a meta tensor has no data to fill."""
    if seed is None or p.device.type == "meta":
        p.normal_(0.0, std)
        return
    g = torch.Generator(device=p.device)
    g.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (1 << 63))
    p.normal_(0.0, std, generator=g)
