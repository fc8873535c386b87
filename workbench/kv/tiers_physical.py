"""The physical hot / warm / cold cache: only the resident zones stay in fast memory.

::

    store = TierStore(offload="host", predict="step")          # or offload="disk" (O_DIRECT file)
    cache = PhysicalTieredKVCache(model.config, TierConfig(...), basis, store=store, max_len=N)
    model(ids, cache=cache)                                       # always the tiered policy
    cache.memory()            # measured bytes per zone (storage nbytes, deduplicated) next to the formula
    cache.prefetcher.stats()  # routed blocks: prefetch_hit_rate, stall_s, bytes moved, reused, wasted

What each layer keeps resident (exact-size tensors, reallocated as the zones move)::

    hot    sink K/V [1, nkv, sink, hd] and recent K/V [1, nkv, <= window, hd]   (the cache dtype)
    warm   coefficients [1, nkv, n, rank] and V [1, nkv, n, hd] (or int8 V + fp16 scale)
    cold   one mean K and V per chunk [1, nkv, chunks, hd]
    basis  PCA mean and components, float32, shared by every cache of one basis

Everything else lives in the **offload tier**, written through a transport
(:mod:`workbench.prefetch.transports`) the moment a routing block is complete, while all its
tokens are still hot: one record per (layer, KV head, block) for keys and one for values, and
one record per cold chunk for its summary (parked until the chunk turns cold, then read back).

**Routing fetches.**  Per layer and step, :func:`workbench.kv.tier_attention.route` picks the
blocks whose predicted attention mass is largest (from the *resident* compressed keys); their
exact keys (and values, for cold tokens or int8 values) must be in fast memory before the exact
scores are taken.  A block already in a staging buffer is a hit; otherwise the consumer stalls
and fetches it (a demand fetch: a miss costs time, never correctness).  What fills staging
ahead of use is the predictor (``TierStore.predict``):

    none    nothing: every routed block is a demand fetch, staging freed after each layer
    step    keep each layer's routed blocks staged for the same layer's next step
            (routing changes slowly from one token to the next); staging: every layer's
    layer   when layer l has routed, start fetching the same blocks of layer l + 1 (and from the
            last layer, layer 0 of the next step); staging: about two layers'
    both    step + layer

Bit-for-bit the accounted :class:`~workbench.kv.tiers.TieredKVCache`: both call the same
arithmetic (:mod:`workbench.kv.tier_attention`) on the same values.  Attention builds *dense
views* of the S positions of one layer (exact K/V where in hand or fetched, reconstructed warm
keys, dequantised warm values, zeros elsewhere): a transient working set of one layer at a time
that a fused kernel would avoid (reported by :meth:`PhysicalTieredKVCache.memory`).

Limits: one sequence per cache (``batch_size=1``: the engine makes one per request);
``block`` at most ``window`` (a block is written to the offload tier while all its tokens are
still hot), and ``chunk`` too when cold chunks keep summaries; offload to disk on a CPU only.
Blocks are written whether or not anything will read them back (no routing, dropped tokens);
the disk transport rounds each record up to 4 KiB, so the file is larger than ``offloaded``.
Not thread-safe: ``memory()`` reads what ``attend`` changes (the engine calls both on its thread).
"""

from __future__ import annotations

import itertools

import torch

from workbench.errors import ConfigError
from workbench.kv.pca import PCABasis
from workbench.kv.tier_attention import (attend_zones, chunk_means, dequantise, int8_values, key_coefficients,
                                         reconstruct_keys)
from workbench.kv.tier_blocks import OffloadedBlocks
from workbench.kv.tier_config import TierConfig, full_bytes_per_token, zone_bytes, zone_counts, zone_masks
from workbench.kv.tier_store import OFFLOADS, PREDICTORS, TierStore  # noqa: F401 (callers import them here)
from workbench.kv.tiers import check_tier_setup
from workbench.measure.memory import storage_bytes
from workbench.measure.timing import ElapsedTotal
from workbench.model.config import ModelConfig
from workbench.model.decoder import RotaryEmbedding
from workbench.prefetch.prefetcher import Prefetcher

_uids = itertools.count()


def _basis_tensors(basis: PCABasis, rank: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """mean [L, nkv, hd] and components [L, nkv, hd, rank] as contiguous float32 tensors, made
    once per (basis, rank, device) and shared by every cache that uses them."""
    store = basis.__dict__.setdefault("_wb_tensors", {})
    key = (rank, str(torch.device(device) if device is not None else torch.device("cpu")))
    if key not in store:
        store[key] = (basis.mean.to(device, torch.float32).contiguous().clone(),
                      basis.components[..., :rank].to(device, torch.float32).contiguous().clone())
    return store[key]


def _hot_lo(n: int, cfg: TierConfig) -> int:
    """First position of the recent window when the cache holds n tokens (n if all are sinks)."""
    return max(cfg.sink, n - cfg.window) if n > cfg.sink else n


def _warm_lo(n: int, cfg: TierConfig) -> int:
    return cfg.sink + zone_counts(n, cfg).cold_chunks * cfg.chunk


class PhysicalTieredKVCache(OffloadedBlocks):
    """The model's cache interface (``attend``, ``length``) over resident zones and an offload
    tier; see the module docstring.  ``prefetcher``: a shared one (an engine's), else one is
    made from ``store`` and closed by :meth:`release`."""

    physical = True

    def __init__(self, model_cfg: ModelConfig, cfg: TierConfig, basis: PCABasis | None = None,
                 store: TierStore | None = None, prefetcher: Prefetcher | None = None, batch_size: int = 1,
                 max_len: int | None = None, device=None, dtype: torch.dtype = torch.float32) -> None:
        check_tier_setup("PhysicalTieredKVCache", model_cfg, cfg, basis)
        if batch_size != 1:
            raise ConfigError(f"PhysicalTieredKVCache holds one sequence (batch_size=1), got batch_size={batch_size}")
        parked = cfg.has_cold and cfg.cold_mode == "mean"        # chunk summaries computed while hot
        for field in ("block", "chunk") if parked else ("block",):
            if getattr(cfg, field) > cfg.window:
                raise ConfigError(f"TierConfig field '{field}' ({getattr(cfg, field)}) must be <= 'window' "
                                  f"({cfg.window}) for the physical cache: a block goes to the offload tier "
                                  f"while all its tokens are still hot")
        self.model_cfg, self.cfg, self.basis = model_cfg, cfg, basis
        self.store = store or TierStore()
        self.max_len = max_len or model_cfg.max_position_embeddings
        self.batch_size, self.dtype = 1, dtype
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self._own_pf = prefetcher is None
        self.prefetcher = prefetcher or self.store.make_prefetcher(self.device)
        self.uid = next(_uids)
        L = model_cfg.num_hidden_layers
        self.length = 0
        self._len = [0] * L
        empty = lambda: [None] * L  # noqa: E731
        self.sink_k, self.sink_v, self.hot_k, self.hot_v = empty(), empty(), empty(), empty()
        self.coef, self.warm_v, self.warm_vq, self.warm_vs = empty(), empty(), empty(), empty()
        self.cold_k, self.cold_v = empty(), empty()
        if cfg.has_warm:
            self.mean, self.U = _basis_tensors(basis, cfg.rank, self.device)
            self.rope = RotaryEmbedding(model_cfg) if cfg.key_space == "pre_rope" else None
        self.staged: list[dict] = [{} for _ in range(L)]      # layer -> {(head, block, part): buffer}
        self._keys: set = set()                                # this cache's records in the offload tier
        self._offloaded = 0                                    # ... and their bytes
        self.routed_bytes = 0.0       # what routing needed from the offload tier (the accounted figure)
        self.fetched_bytes_by_pos = torch.zeros(self.max_len, dtype=torch.float64)
        self.last_selection: dict[int, torch.Tensor] = {}
        self.decode_steps = 0
        self.summary_reads = self.summary_read_bytes = 0   # parked cold summaries read back (not routing)
        # their time: host wall time on a CPU; on CUDA (a read enqueues the copy and the compute
        # stream's wait) the stream's time, from CUDA events
        tr = self.prefetcher.transport
        self._summary_clock = ElapsedTotal(tr.device if tr.kind == "cuda" else self.device)
        self.working_bytes = 0        # the last call's dense views (one layer, transient)
        self._released = False

    # ---- the attention interface (workbench.model.kv_cache) -----------------------------------
    def attend(self, attn, q, k, v, start: int, written: bool = False) -> torch.Tensor:
        """Write k/v [1, nkv, T, hd] at [start, start+T) and attend with the tiered policy (this
        cache has no exact path: the full K/V of old tokens are not in fast memory)."""
        layer, cfg = attn.layer_idx, self.cfg
        T = k.shape[2]
        S = start + T
        if self._released:
            raise RuntimeError("PhysicalTieredKVCache: used after release()")
        if start != self._len[layer]:
            raise ValueError(f"layer {layer}: write at {start} does not continue the cache ({self._len[layer]} tokens)")
        if S > self.max_len:
            raise ValueError(f"KV cache overflow: {S} tokens > capacity {self.max_len}")
        if layer == 0 and T == 1:
            self.decode_steps += 1
        v_ = self._views(layer, k, v, start, S)
        m = zone_masks(start, T, cfg, device=q.device)
        used: dict = {}        # (head, block, part) -> needed by the call's last query

        def on_route(sel, per_q):
            self.last_selection[layer] = sel
            pq = per_q.cpu()                                     # one device -> host copy a layer
            self.fetched_bytes_by_pos[start:S] += pq
            self.routed_bytes += float(pq.numpy().sum())         # host arithmetic: no second sync

        def fetch(fetched):
            self._fetch(layer, fetched, m, v_, start, used)

        out = attend_zones(cfg, q, start, m, v_["K"], v_["V"], v_["k_hat"], v_["v_warm"], v_["Kc"], v_["Vc"],
                           fetch=fetch, on_route=on_route)
        self._after_routing(layer, used)
        self._commit(layer, v_, start, S)
        return out

    # ---- dense views of one layer -------------------------------------------------------------
    def _views(self, layer: int, k, v, start: int, S: int) -> dict:
        cfg, dt, dev = self.cfg, self.dtype, self.device
        _, nkv, T, hd = k.shape
        h0, w0 = _hot_lo(start, cfg), _warm_lo(start, cfg)
        K = torch.zeros(1, nkv, S, hd, dtype=dt, device=dev)
        V = torch.zeros_like(K)
        ns = min(cfg.sink, start)
        if ns:
            K[:, :, :ns], V[:, :, :ns] = self.sink_k[layer], self.sink_v[layer]
        if start > h0:
            K[:, :, h0:start], V[:, :, h0:start] = self.hot_k[layer], self.hot_v[layer]
        K[:, :, start:S], V[:, :, start:S] = k.to(dt), v.to(dt)
        views = {"K": K, "V": V, "k_hat": None, "v_warm": V, "Kc": None, "Vc": None, "h0": h0, "w0": w0}
        a, b = max(cfg.sink, h0), max(max(cfg.sink, h0), _hot_lo(S, cfg))   # tokens turning warm now
        if cfg.has_warm:
            k_hat = torch.zeros_like(K)
            if h0 > w0:
                k_hat[:, :, w0:h0] = self._reconstruct(self.coef[layer], layer, w0, h0)
                if cfg.value_format == "full":
                    V[:, :, w0:h0] = self.warm_v[layer]
            new_coef = None
            if b > a:
                rope = self.rope(a, b, dev, torch.float32) if self.rope is not None else None
                new_coef = key_coefficients(K[:, :, a:b], self.mean[layer], self.U[layer], rope, dtype=dt)
                k_hat[:, :, a:b] = reconstruct_keys(new_coef, self.mean[layer], self.U[layer], rope, dt)
            views.update(k_hat=k_hat, new_coef=new_coef)
            if cfg.value_format == "int8":
                v_hat = torch.zeros_like(K)
                if h0 > w0:
                    v_hat[:, :, w0:h0] = dequantise(self.warm_vq[layer], self.warm_vs[layer], dt)
                new_q = None
                if b > a:
                    new_q = int8_values(V[:, :, a:b])
                    v_hat[:, :, a:b] = new_q[2]
                views.update(v_warm=v_hat, new_q=new_q)
        views["turning_warm"] = (a, b)
        n_chunks = max(0, (S - cfg.sink) // cfg.chunk)
        if cfg.has_cold and cfg.cold_mode == "mean" and n_chunks:
            c0, c1 = zone_counts(start, cfg).cold_chunks, zone_counts(S, cfg).cold_chunks
            Kc = torch.zeros(1, nkv, n_chunks, hd, dtype=dt, device=dev)
            Vc = torch.zeros_like(Kc)
            if c0:
                Kc[:, :, :c0], Vc[:, :, :c0] = self.cold_k[layer], self.cold_v[layer]
            for j in range(c0, c1):                     # chunks turning cold in this call
                lo = cfg.sink + j * cfg.chunk
                if lo >= h0:                            # all its tokens are in hand
                    Kc[:, :, j:j + 1] = chunk_means(K[:, :, lo:lo + cfg.chunk], cfg.chunk)
                    Vc[:, :, j:j + 1] = chunk_means(V[:, :, lo:lo + cfg.chunk], cfg.chunk)
                    if (self.uid, layer, "sum", j) in self._keys:
                        self._drop((self.uid, layer, "sum", j))      # parked earlier, not needed
                else:                                   # parked in the offload tier when its block was written
                    rec = self._read((self.uid, layer, "sum", j), (2, nkv, hd), f"L{layer} chunk {j} summary")
                    Kc[0, :, j], Vc[0, :, j] = rec[0], rec[1]
                    self._drop((self.uid, layer, "sum", j))
            views.update(Kc=Kc, Vc=Vc, cold=(c0, c1))
        self.working_bytes = storage_bytes([x for x in views.values() if isinstance(x, torch.Tensor)])
        return views

    def _reconstruct(self, coef, layer: int, lo: int, hi: int):
        rope = self.rope(lo, hi, self.device, torch.float32) if self.rope is not None else None
        return reconstruct_keys(coef, self.mean[layer], self.U[layer], rope, self.dtype)

    # ---- after attention: move the zones forward ----------------------------------------------
    def _commit(self, layer: int, views: dict, start: int, S: int) -> None:
        cfg = self.cfg
        K, V = views["K"], views["V"]
        h0n, w0, w0n = _hot_lo(S, cfg), views["w0"], _warm_lo(S, cfg)
        if start < cfg.sink:
            self.sink_k[layer] = K[:, :, :min(cfg.sink, S)].clone()
            self.sink_v[layer] = V[:, :, :min(cfg.sink, S)].clone()
        self.hot_k[layer], self.hot_v[layer] = K[:, :, h0n:S].clone(), V[:, :, h0n:S].clone()
        h0 = views["h0"]
        a, b = views["turning_warm"]
        if cfg.has_warm:
            cat = lambda old, new: torch.cat([x for x in (old, new) if x is not None], dim=2)  # noqa: E731
            old_n = max(0, min(h0, h0n) - w0)
            keep = slice(w0n - w0, None)
            if old_n + (b - a) > 0:
                self.coef[layer] = cat(self.coef[layer] if old_n else None, views["new_coef"])[:, :, keep].clone()
                if cfg.value_format == "full":
                    self.warm_v[layer] = V[:, :, w0n:h0n].clone()
                else:
                    nq = views["new_q"]
                    self.warm_vq[layer] = cat(self.warm_vq[layer] if old_n else None,
                                              nq[0] if nq else None)[:, :, keep].clone()
                    self.warm_vs[layer] = cat(self.warm_vs[layer] if old_n else None,
                                              nq[1] if nq else None)[:, :, keep].clone()
        if "cold" in views:
            c0, c1 = views["cold"]
            if c1 > c0:
                self.cold_k[layer] = views["Kc"][:, :, :c1].clone()
                self.cold_v[layer] = views["Vc"][:, :, :c1].clone()
        self._offload_blocks(layer, K, V, start, S)
        self._len[layer] = S

    # ---- memory: measured next to the formula -------------------------------------------------
    def zone_tensors(self) -> dict[str, list]:
        z = {"hot": self.sink_k + self.sink_v + self.hot_k + self.hot_v,
             "warm": self.coef + self.warm_v + self.warm_vq + self.warm_vs,
             "cold": self.cold_k + self.cold_v,
             "basis": ([self.mean, self.U] if self.cfg.has_warm and any(c is not None and c.shape[2] for c in self.coef)
                       else []),
             "staging": [b for st in self.staged for b in st.values()]}
        return z

    def memory(self, seen: set | None = None) -> dict:
        """Measured bytes per zone (storage nbytes, each storage once across ``seen``) next to the
        formula of :func:`~workbench.kv.tier_config.zone_bytes` at this cache's element size
        (the basis at float32, as it is kept), the full cache's bytes, and the offload tier's."""
        seen = set() if seen is None else seen
        measured = {z: storage_bytes(ts, seen) for z, ts in self.zone_tensors().items()}
        c, n = self.model_cfg, self.length
        E = torch.empty((), dtype=self.dtype).element_size()
        formula = zone_bytes(n, self.cfg.replace(element_bytes=E), c.num_hidden_layers, c.num_key_value_heads,
                             c.head_dim, basis_element_bytes=4)
        offloaded = self._offloaded
        kv = ("hot", "warm", "cold", "basis")
        return {"dtype": str(self.dtype).replace("torch.", ""), "length": n, "measured": measured,
                "formula": formula, "resident_kv": sum(measured[z] for z in kv),
                "formula_kv": sum(formula[z] for z in kv),
                "full": n * full_bytes_per_token(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, E),
                "offloaded": offloaded, "working_one_layer": self.working_bytes}

    # ---- the accounted cache's reading interface --------------------------------------------
    def zone_counts(self, length: int | None = None):
        return zone_counts(self.length if length is None else length, self.cfg)

    def resident_bytes(self, length: int | None = None, include_basis: bool = True) -> int:
        mem = self.memory()
        return mem["resident_kv"] - (0 if include_basis else mem["measured"]["basis"])
