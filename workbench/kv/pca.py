"""PCA bases for warm-zone keys: collect keys on calibration text, fit, report, save, load.

A visible, reusable step::

    keys = collect_keys(model, calibration_sequences)              # per layer [nkv, N, hd]
    basis = fit_pca_basis(keys, source="heldout calibration split")
    basis.explained_variance_table()                              # DataFrame: layer, kv_head, rank, explained
    basis.save("runs/pca_basis.safetensors"); PCABasis.load(...)

Keys are recorded by a cache object with the model's ``update`` interface (:class:`KeyRecorder`),
so ``workbench/model/decoder.py`` is untouched.  **Calibration text must not be evaluation text**:
pass any list of token-id sequences; :func:`workbench.bench.tier_eval.heldout_split` gives the
split we use (whole held-out documents for calibration, *other* whole documents for evaluation).

Post- vs pre-RoPE.  RoPE rotates each pair of key dimensions by an angle proportional to the
token's position, so the same "content" direction is smeared over a plane as position varies:
post-RoPE keys (what ``q . k`` actually sees) need more components for the same explained
variance than pre-RoPE keys.  PCA of post-RoPE keys (``key_space="post_rope"``, the default)
reconstructs exactly the vectors attention uses and costs nothing extra at attention time.  A
pre-RoPE basis (``key_space="pre_rope"``) is typically lower-rank, but every reconstructed key
must be rotated again to its position (``k = R_t (mean + U c)``) before the dot product - cheap
in a kernel (RoPE is elementwise), but one more step on the decode path.  Both are supported;
the basis records which one it is and the cache refuses a mismatch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from workbench.model.config import ModelConfig
from workbench.errors import ConfigError, WorkbenchError
from workbench.model.kv_cache import KVCache
from workbench.model.decoder import CausalLM, RotaryEmbedding, rotate_half

KEY_SPACES = ("post_rope", "pre_rope")


def unrotate(k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Inverse of ``apply_rope``: rotate by -angle.  k [B, nkv, T, hd]; cos/sin [T, hd]."""
    return k * cos - rotate_half(k) * sin


class KeyRecorder(KVCache):
    """A contiguous :class:`KVCache` that also keeps a copy of every key written to it.

    ``keys[layer]`` is a list of [B, nkv, T, hd] tensors (post-RoPE, as the model writes
    them; converted to pre-RoPE when ``key_space="pre_rope"``).
    """

    def __init__(self, cfg: ModelConfig, max_len: int, key_space: str = "post_rope", device=None,
                 dtype=torch.float32) -> None:
        super().__init__(cfg, 1, max_len, device=device, dtype=dtype)
        if key_space not in KEY_SPACES:
            raise ConfigError(f"key_space must be one of {KEY_SPACES}, got {key_space!r}")
        self.key_space = key_space
        self.rope = RotaryEmbedding(cfg) if key_space == "pre_rope" else None
        self.keys: list[list[torch.Tensor]] = [[] for _ in range(cfg.num_hidden_layers)]

    def update(self, layer, k, v, start):
        rec = k
        if self.rope is not None:
            cos, sin = self.rope(start, start + k.shape[2], k.device, torch.float32)
            rec = unrotate(k.float(), cos, sin)
        self.keys[layer].append(rec.detach().float().cpu())
        return super().update(layer, k, v, start)


@torch.no_grad()
def collect_keys(model: CausalLM, sequences, key_space: str = "post_rope",
                 max_len: int | None = None) -> list[torch.Tensor]:
    """Run ``model`` over each token-id sequence; return per-layer keys [nkv, N, hd] (float32).

    Sequences longer than the context (``max_len``, default the model's
    ``max_position_embeddings``) are cut to it.  N is the total number of tokens.
    """
    cfg = model.config
    max_len = max_len or cfg.max_position_embeddings
    per_layer: list[list[torch.Tensor]] = [[] for _ in range(cfg.num_hidden_layers)]
    n = 0
    for i, seq in enumerate(sequences):
        ids = torch.as_tensor(list(seq)[:max_len], dtype=torch.long, device=model.device)
        if ids.numel() == 0:
            raise WorkbenchError(f"collect_keys: calibration sequence {i} is empty")
        rec = KeyRecorder(cfg, ids.numel(), key_space, device=model.device, dtype=model.lm_head.weight.dtype)
        model(ids[None], cache=rec)
        for layer in range(cfg.num_hidden_layers):
            per_layer[layer].extend(rec.keys[layer])
        n += ids.numel()
    if n == 0:
        raise WorkbenchError("collect_keys: no calibration sequences given")
    # [B=1, nkv, T, hd] pieces -> [nkv, N, hd]
    return [torch.cat([k[0] for k in ks], dim=1) for ks in per_layer]


@dataclass
class PCABasis:
    """Per-layer, per-KV-head PCA of keys, components sorted by decreasing variance.

    mean [L, nkv, hd]; components [L, nkv, hd, R] (orthonormal columns); variance [L, nkv, R]
    (eigenvalues of the key covariance); total_variance [L, nkv] (trace, so the explained
    fraction of rank r is ``variance[..., :r].sum(-1) / total_variance``).
    """

    mean: torch.Tensor
    components: torch.Tensor
    variance: torch.Tensor
    total_variance: torch.Tensor
    key_space: str = "post_rope"
    num_tokens: int = 0
    source: str = ""

    @property
    def num_layers(self) -> int:
        return self.mean.shape[0]

    @property
    def num_kv_heads(self) -> int:
        return self.mean.shape[1]

    @property
    def head_dim(self) -> int:
        return self.mean.shape[2]

    @property
    def max_rank(self) -> int:
        return self.components.shape[3]

    def explained(self, rank: int) -> torch.Tensor:
        """[L, nkv] fraction of key variance captured by the top ``rank`` components."""
        return self.variance[..., :rank].sum(-1) / self.total_variance.clamp_min(1e-30)

    def explained_variance_table(self):
        """One row per (layer, kv_head, rank): explained fraction of variance (cumulative)."""
        import pandas as pd  # lazy: pandas (~1 s) only for this table

        cum = self.variance.cumsum(-1) / self.total_variance.clamp_min(1e-30)[..., None]
        rows = [{"layer": layer, "kv_head": h, "rank": r + 1, "explained": float(cum[layer, h, r])}
                for layer in range(self.num_layers) for h in range(self.num_kv_heads)
                for r in range(self.max_rank)]
        return pd.DataFrame(rows)

    def check_model(self, cfg: ModelConfig) -> None:
        want = (cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim)
        got = (self.num_layers, self.num_kv_heads, self.head_dim)
        if want != got:
            raise ConfigError(f"PCA basis shape (layers, kv_heads, head_dim) = {got} does not match the "
                              f"model's {want}; fit the basis on this model with fit_pca_from_model(model, ...)")

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tensors = {"mean": self.mean, "components": self.components, "variance": self.variance,
                   "total_variance": self.total_variance}
        meta = {"key_space": self.key_space, "num_tokens": str(self.num_tokens), "source": self.source,
                "format": "workbench.kv.pca/1"}
        save_file({k: v.contiguous().float().cpu() for k, v in tensors.items()}, str(path), metadata=meta)
        return path

    @classmethod
    def load(cls, path: str | Path) -> PCABasis:
        path = Path(path)
        if not path.is_file():
            raise WorkbenchError(f"{path}: PCA basis file not found (write one with PCABasis.save)")
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
                t = {k: f.get_tensor(k) for k in f.keys()}
        except Exception as e:  # the Rust reader raises plain exceptions
            raise WorkbenchError(f"{path}: not a readable safetensors file ({e})") from None
        missing = {"mean", "components", "variance", "total_variance"} - set(t)
        if missing:
            raise WorkbenchError(f"{path}: not a PCA basis, missing tensors {sorted(missing)}")
        return cls(t["mean"], t["components"], t["variance"], t["total_variance"],
                   key_space=meta.get("key_space", "post_rope"), num_tokens=int(meta.get("num_tokens", 0)),
                   source=meta.get("source", ""))

    def describe(self) -> str:
        ex = {r: float(self.explained(r).mean()) for r in (1, 2, 4, 8, 16) if r <= self.max_rank}
        return json.dumps({"key_space": self.key_space, "tokens": self.num_tokens,
                           "mean explained by rank": {k: round(v, 4) for k, v in ex.items()}})


def fit_pca_basis(keys: list[torch.Tensor], max_rank: int | None = None, key_space: str = "post_rope",
                  source: str = "") -> PCABasis:
    """Fit mean + top components per layer and KV head from per-layer keys [nkv, N, hd].

    Covariance in float64, eigendecomposition with ``torch.linalg.eigh`` (hd x hd per head:
    cheaper than an SVD of the N x hd data and just as exact at these sizes).
    """
    if not keys:
        raise WorkbenchError("fit_pca_basis: no keys given (collect them with collect_keys)")
    nkv, n, hd = keys[0].shape
    if n < 2:
        raise WorkbenchError(f"fit_pca_basis: need at least 2 key vectors per head, got {n}")
    R = hd if max_rank is None else max_rank
    if not 1 <= R <= hd:
        raise ConfigError(f"fit_pca_basis: max_rank must be in [1, head_dim={hd}], got {max_rank}")
    means, comps, vars_, totals = [], [], [], []
    for layer, k in enumerate(keys):
        if k.shape != (nkv, n, hd):
            raise WorkbenchError(f"fit_pca_basis: layer {layer} keys have shape {tuple(k.shape)}, "
                                 f"expected {(nkv, n, hd)}")
        x = k.double()
        mu = x.mean(1, keepdim=True)                               # [nkv, 1, hd]
        xc = x - mu
        cov = xc.transpose(1, 2) @ xc / (n - 1)                    # [nkv, hd, hd]
        evals, evecs = torch.linalg.eigh(cov)                      # ascending
        evals, evecs = evals.flip(-1).clamp_min(0), evecs.flip(-1)
        means.append(mu[:, 0])
        comps.append(evecs[..., :R])
        vars_.append(evals[..., :R])
        totals.append(cov.diagonal(dim1=-2, dim2=-1).sum(-1))
    stack = lambda xs: torch.stack(xs).float()  # noqa: E731
    return PCABasis(stack(means), stack(comps), stack(vars_), stack(totals), key_space=key_space,
                    num_tokens=n, source=source)


def fit_pca_from_model(model: CausalLM, sequences, key_space: str = "post_rope", max_rank: int | None = None,
                       source: str = "") -> PCABasis:
    """``collect_keys`` + ``fit_pca_basis`` in one call."""
    return fit_pca_basis(collect_keys(model, sequences, key_space=key_space), max_rank=max_rank,
                         key_space=key_space, source=source)
