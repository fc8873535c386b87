"""Configuration, zone arithmetic and byte accounting of the three-zone (hot / warm / cold) KV cache.

Pure Python (plus small boolean masks in torch): which token is in which zone for a query at
absolute position ``p``, and how many bytes each zone keeps resident in fast memory.  The
cache (:mod:`workbench.kv.tiers`) and the evaluation (:mod:`workbench.bench.tier_eval`) both use
these functions, so the masks attention applies and the bytes we report cannot disagree.

Zones, for a query at position ``p`` (the cache then holds ``S = p + 1`` tokens)::

    positions  0 .. sink-1 | sink ................................................ | p-window+1 .. p
    zone       hot (sink)  | cold: whole chunks of C tokens | warm                  | hot (recent window)
                             chunk i = [sink + i*C, sink + (i+1)*C), cold once its end
                             <= p + 1 - window - warm_tokens

* **hot** - attention-sink tokens and the last ``window`` tokens: keys and values in full precision.
* **warm** - keys as ``rank`` PCA coefficients (``k ~ mean + U c``), values in full precision
  (``value_format="full"``) or int8 with one fp16 scale per token and head (``"int8"``).
* **cold** - one mean key and one mean value per chunk of ``chunk`` tokens.  Because chunks
  become cold only when whole, the warm zone holds between ``warm_tokens`` and
  ``warm_tokens + chunk - 1`` tokens once the sequence is long enough.  ``warm_tokens=None``
  means no cold zone (everything older than the window stays warm).

Byte accounting, per token, per layer, per KV head, with ``E = element_bytes`` (the storage
dtype being modelled, 2 for bf16/fp16 serving; the computation itself runs in the model's dtype)::

    hot   2 * hd * E                          (K and V)
    warm  rank * E + hd * E                   (coefficients + V)          value_format="full"
          rank * E + hd * 1 + 2               (coefficients + int8 V + fp16 scale)   "int8"
    cold  2 * hd * E / chunk                  (one K and one V per chunk; the count is chunk, implicit)
          0                                   cold_mode="drop" (evicted: the StreamingLLM control)
    basis (hd + hd * rank) * E  once per layer and KV head (mean + components), while a token is warm

The full-precision copy of every non-hot token lives in a slower *offload tier* (host memory or
disk in a real system) and is not counted as resident; routing fetches from it (see
:func:`fetch_bytes_per_token`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from workbench.errors import ConfigError

VALUE_FORMATS = ("full", "int8")
COLD_MODES = ("mean", "drop")
KEY_SPACES = ("post_rope", "pre_rope")
INT8_SCALE_BYTES = 2  # one fp16 scale per token and KV head


def _check_int(name: str, value, minimum: int, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        none = " or None" if allow_none else ""
        raise ConfigError(f"TierConfig field '{name}' must be an integer >= {minimum}{none}, got {value!r}")


@dataclass(frozen=True)
class TierConfig:
    """Every threshold of the tiered cache (token counts, not fractions).

    >>> TierConfig(window=128, rank=8, warm_tokens=256, chunk=16, budget=64).name
    'w128-s4-r8-warm256-c16-b16-bud64-vfull'
    """

    window: int = 128            # recent tokens kept hot (>= 1: the current token is always hot)
    sink: int = 4                # first tokens kept hot (attention sinks)
    rank: int = 8                # PCA rank of warm keys (<= head_dim; checked against the basis)
    warm_tokens: int | None = None  # warm tokens before tokens turn cold; None = no cold zone
    chunk: int = 16              # tokens per cold chunk
    block: int = 16              # routing block size (tokens); a multiple of chunk with a cold zone
    budget: int | None = None    # tokens fetched exactly per step, layer and KV head; None = no routing
    value_format: str = "full"   # warm values: "full" or "int8" (per-token, per-head scale)
    key_space: str = "post_rope"  # PCA of keys after RoPE (what attention sees) or before it
    element_bytes: int = 2       # bytes per stored element for the accounting (2 = bf16)
    cold_mode: str = "mean"      # "mean": one summary K/V per chunk; "drop": evict (control baseline)

    def __post_init__(self) -> None:
        _check_int("window", self.window, 1)
        _check_int("sink", self.sink, 0)
        _check_int("rank", self.rank, 1)
        _check_int("warm_tokens", self.warm_tokens, 0, allow_none=True)
        _check_int("chunk", self.chunk, 1)
        _check_int("block", self.block, 1)
        _check_int("budget", self.budget, 0, allow_none=True)
        _check_int("element_bytes", self.element_bytes, 1)
        if self.value_format not in VALUE_FORMATS:
            raise ConfigError(f"TierConfig field 'value_format' must be one of {VALUE_FORMATS}, "
                              f"got {self.value_format!r}")
        if self.key_space not in KEY_SPACES:
            raise ConfigError(f"TierConfig field 'key_space' must be one of {KEY_SPACES}, got {self.key_space!r}")
        if self.cold_mode not in COLD_MODES:
            raise ConfigError(f"TierConfig field 'cold_mode' must be one of {COLD_MODES}, got {self.cold_mode!r}")
        if self.has_cold and self.cold_mode == "mean" and self.block % self.chunk:
            raise ConfigError(f"TierConfig field 'block' ({self.block}) must be a multiple of 'chunk' "
                              f"({self.chunk}) when there is a cold zone, so routing fetches whole chunks")
        if self.budget is not None and self.budget % self.block:
            raise ConfigError(f"TierConfig field 'budget' ({self.budget}) must be a multiple of 'block' "
                              f"({self.block}): routing fetches whole blocks")

    @property
    def has_cold(self) -> bool:
        return self.warm_tokens is not None

    @property
    def has_warm(self) -> bool:
        """Can any token be warm?  With ``warm_tokens=0`` the tokens of a chunk that is not yet
        complete still wait in the warm zone, unless chunks are single tokens."""
        return not (self.warm_tokens == 0 and self.chunk == 1)

    @property
    def name(self) -> str:
        warm = "all" if self.warm_tokens is None else str(self.warm_tokens)
        bud = "none" if self.budget is None else str(self.budget)
        pre = "-pre" if self.key_space == "pre_rope" else ""
        drop = "-drop" if self.cold_mode == "drop" and self.has_cold else ""
        return (f"w{self.window}-s{self.sink}-r{self.rank}-warm{warm}-c{self.chunk}-b{self.block}"
                f"-bud{bud}-v{self.value_format}{pre}{drop}")

    def replace(self, **changes) -> TierConfig:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)


# ---- zones -------------------------------------------------------------------------------

@dataclass(frozen=True)
class ZoneCounts:
    """Tokens per zone for one sequence of ``length`` tokens (as seen by its last query)."""

    length: int
    hot: int
    warm: int
    cold_tokens: int
    cold_chunks: int


def zone_counts(length: int, cfg: TierConfig) -> ZoneCounts:
    """Zone sizes when the cache holds ``length`` tokens (query at position ``length - 1``)."""
    if length < 0:
        raise ValueError(f"length must be >= 0, got {length}")
    sink_hot = min(cfg.sink, length)
    recent = max(0, length - max(cfg.sink, length - cfg.window))
    hot = sink_hot + recent
    chunks = 0
    if cfg.has_cold:
        cold_limit = length - cfg.window - cfg.warm_tokens      # chunk end must be <= this
        chunks = max(0, (cold_limit - cfg.sink) // cfg.chunk)
    cold = chunks * cfg.chunk
    return ZoneCounts(length, hot, length - hot - cold, cold, chunks)


@dataclass
class ZoneMasks:
    """Boolean masks for queries at positions ``start .. start+T-1`` over keys ``0 .. S-1``.

    ``visible/hot/warm/cold`` are [T, S]; ``chunk_cold`` is [T, n_chunks] for the chunks
    ``[sink + i*chunk, sink + (i+1)*chunk)`` that are complete in the cache.  ``any_warm`` /
    ``any_chunk_cold``: whether ``warm`` / ``chunk_cold`` hold any True, known on the host from
    the positions (asking the device would be a sync per layer); None: ask the masks.
    """

    visible: torch.Tensor
    hot: torch.Tensor
    warm: torch.Tensor
    cold: torch.Tensor
    chunk_cold: torch.Tensor
    any_warm: bool | None = None
    any_chunk_cold: bool | None = None

    @property
    def n_chunks(self) -> int:
        return self.chunk_cold.shape[1]


def _any_warm(start: int, S: int, cfg: TierConfig) -> bool:
    """Whether any query at positions start..S-1 has a warm key, from :func:`zone_counts`' sizes:
    with n tokens, x = n - sink - window tokens are past the hot zone (when positive) and
    ``warm = x`` without a cold zone, else ``x`` below ``warm_tokens`` and ``warm_tokens + (x -
    warm_tokens) % chunk`` from there on: positive whenever x is, except with ``warm_tokens=0``,
    where it is 0 when x is a multiple of ``chunk``."""
    lo = max(start + 1, cfg.sink + cfg.window + 1)       # the first length with x > 0
    if lo > S:
        return False
    if not cfg.has_cold or cfg.warm_tokens > 0:
        return True
    if cfg.chunk == 1:
        return False
    return S > lo or (S - cfg.sink - cfg.window) % cfg.chunk != 0


def zone_masks(start: int, T: int, cfg: TierConfig, device=None) -> ZoneMasks:
    S = start + T
    p = torch.arange(start, S, device=device)[:, None]          # [T, 1] query positions
    t = torch.arange(S, device=device)[None, :]                 # [1, S] key positions
    visible = t <= p
    hot = visible & ((t < cfg.sink) | (t > p - cfg.window))
    n_chunks = 0
    if cfg.has_cold:
        cold_limit = p + 1 - cfg.window - cfg.warm_tokens       # [T, 1]
        chunk_end = cfg.sink + ((t - cfg.sink) // cfg.chunk + 1) * cfg.chunk
        cold = visible & (t >= cfg.sink) & (chunk_end <= cold_limit)
        n_chunks = max(0, (S - cfg.sink) // cfg.chunk)
        c_end = cfg.sink + (torch.arange(n_chunks, device=device)[None, :] + 1) * cfg.chunk
        chunk_cold = c_end <= cold_limit                         # [T, n_chunks]
    else:
        cold = torch.zeros_like(visible)
        chunk_cold = torch.zeros(T, 0, dtype=torch.bool, device=device)
    warm = visible & ~hot & ~cold
    # host-side (a chunk is cold for some query iff it is for the last one: the limit grows with p)
    any_warm = _any_warm(start, S, cfg)
    any_chunk_cold = bool(n_chunks) and cfg.sink + cfg.chunk <= S - cfg.window - cfg.warm_tokens
    return ZoneMasks(visible, hot, warm, cold, chunk_cold, any_warm, any_chunk_cold)


# ---- bytes -------------------------------------------------------------------------------

def _token_bytes(cfg: TierConfig, head_dim: int) -> dict[str, float]:
    """Resident bytes per token, per layer, per KV head, in each zone."""
    E, hd = cfg.element_bytes, head_dim
    v_warm = hd * E if cfg.value_format == "full" else hd + INT8_SCALE_BYTES
    cold = 2 * hd * E if cfg.cold_mode == "mean" else 0
    return {"hot": 2 * hd * E, "warm": cfg.rank * E + v_warm, "cold_chunk": cold}


def basis_bytes(cfg: TierConfig, num_layers: int, num_kv_heads: int, head_dim: int) -> int:
    """PCA mean + ``rank`` components per layer and KV head (0 when there is no warm zone)."""
    if not cfg.has_warm:
        return 0
    return num_layers * num_kv_heads * (head_dim + head_dim * cfg.rank) * cfg.element_bytes


def zone_bytes(length: int, cfg: TierConfig, num_layers: int, num_kv_heads: int, head_dim: int,
               batch_size: int = 1, basis_element_bytes: int | None = None) -> dict[str, int]:
    """Resident bytes per zone (``hot``, ``warm``, ``cold``, ``basis``) for ``batch_size``
    sequences of ``length`` tokens; the basis once while any token is warm, at
    ``basis_element_bytes`` (default ``cfg.element_bytes``)."""
    z = zone_counts(length, cfg)
    b = _token_bytes(cfg, head_dim)
    n = batch_size * num_layers * num_kv_heads
    basis = 0
    if z.warm > 0:
        basis = basis_bytes(cfg if basis_element_bytes is None else cfg.replace(element_bytes=basis_element_bytes),
                            num_layers, num_kv_heads, head_dim)
    return {"hot": int(n * z.hot * b["hot"]), "warm": int(n * z.warm * b["warm"]),
            "cold": int(n * z.cold_chunks * b["cold_chunk"]), "basis": int(basis)}


def resident_bytes(length: int, cfg: TierConfig, num_layers: int, num_kv_heads: int, head_dim: int,
                   batch_size: int = 1, include_basis: bool = True) -> int:
    """Bytes in fast memory for ``batch_size`` sequences of ``length`` tokens, plus the shared
    PCA basis once while any token is warm."""
    z = zone_bytes(length, cfg, num_layers, num_kv_heads, head_dim, batch_size)
    return z["hot"] + z["warm"] + z["cold"] + (z["basis"] if include_basis else 0)


def full_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, element_bytes: int = 2) -> int:
    """The plain cache: K and V of every token in every layer (``ModelConfig.kv_bytes_per_token``)."""
    return 2 * num_layers * num_kv_heads * head_dim * element_bytes


def fetch_bytes_per_token(cfg: TierConfig, head_dim: int) -> dict[str, int]:
    """Bytes routing moves from the offload tier per fetched token, per layer and KV head:
    a warm token needs its full key (and its value too when the resident value is int8);
    a cold token needs key and value."""
    E = cfg.element_bytes
    return {"warm": head_dim * E * (1 if cfg.value_format == "full" else 2), "cold": 2 * head_dim * E}
