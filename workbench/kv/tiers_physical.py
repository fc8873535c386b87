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
from dataclasses import dataclass

import torch

from workbench.errors import ConfigError
from workbench.kv.pca import PCABasis
from workbench.kv.tier_attention import (attend_zones, chunk_means, dequantise, int8_values, key_coefficients,
                                         reconstruct_keys)
from workbench.kv.tier_config import TierConfig, full_bytes_per_token, zone_bytes, zone_counts, zone_masks
from workbench.kv.tiers import check_tier_setup
from workbench.measure.memory import storage_bytes
from workbench.measure.timing import ElapsedTotal
from workbench.model.config import ModelConfig
from workbench.model.decoder import RotaryEmbedding
from workbench.prefetch.prefetcher import Prefetcher

PREDICTORS = ("none", "step", "layer", "both")
OFFLOADS = ("host", "disk")
_uids = itertools.count()


@dataclass(frozen=True)
class TierStore:
    """Where the full K/V of warm and cold tokens lives, and how routed blocks come back.

    ``offload``: ``"host"`` (RAM on a CPU; pinned host memory over PCIe on CUDA) or ``"disk"``
    (an ``O_DIRECT`` file; CPU only).  ``predict``: see the module docstring.  ``path``: the
    disk file (default: a temporary file)."""

    offload: str = "host"
    predict: str = "step"
    path: str | None = None

    def __post_init__(self) -> None:
        if self.offload not in OFFLOADS:
            raise ConfigError(f"TierStore field 'offload' must be one of {OFFLOADS}, got {self.offload!r}")
        if self.predict not in PREDICTORS:
            raise ConfigError(f"TierStore field 'predict' must be one of {PREDICTORS}, got {self.predict!r}")

    @property
    def name(self) -> str:
        return f"store={self.offload} predict={self.predict}"

    def make_prefetcher(self, device=None) -> Prefetcher:
        from workbench.prefetch.transports import make_transport

        dev = torch.device(device) if device is not None else torch.device("cpu")
        if dev.type == "cuda":
            if self.offload == "disk":
                raise ConfigError("TierStore field 'offload' = 'disk' is for a CPU; on CUDA the offload tier "
                                  "is pinned host memory (offload='host')")
            return Prefetcher(make_transport("cuda", dev), name="kv tiers")
        kw = {"path": self.path} if self.offload == "disk" and self.path else {}
        return Prefetcher(make_transport(self.offload, dev, **kw), name="kv tiers")


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


class PhysicalTieredKVCache:
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

    # ---- routed blocks ------------------------------------------------------------------------
    def _fetch(self, layer: int, fetched, m, views: dict, start: int, used: dict) -> None:
        """Fill the dense K (and V where needed) of every routed block not in hand."""
        cfg, h0 = self.cfg, views["h0"]
        need = fetched[0, :, 0].any(dim=1)                       # [nkv, S]
        need[:, h0:] = False
        need[:, :cfg.sink] = False
        last = fetched[0, :, 0, -1]                              # the last query: the next step's best guess
        nkv = need.shape[0]
        # what the host decides on, in one device -> host copy a layer (not a sync per routed block)
        host = torch.cat([need, last, m.cold.any(0)[None]]).cpu().numpy()
        need_h, last_h, cold_h = host[:nkv], host[nkv:2 * nkv], host[2 * nkv]
        heads, pos = need_h.nonzero()
        if not len(heads):
            return
        pairs = sorted(set(zip(heads.tolist(), ((pos - cfg.sink) // cfg.block).tolist())))
        last_pairs = {(h, b) for h, b in pairs if last_h[h, cfg.sink + b * cfg.block:
                                                         cfg.sink + (b + 1) * cfg.block].any()}
        hd = views["K"].shape[-1]
        for h, blk in pairs:
            lo = cfg.sink + blk * cfg.block
            hi = lo + cfg.block
            parts = ["k"]
            if cfg.value_format == "int8" or cold_h[lo:hi].any():
                parts.append("v")
            for part in parts:
                rec = self._staged(layer, h, blk, part, (cfg.block, hd))
                (views["K"] if part == "k" else views["V"])[0, h, lo:hi] = rec
                used[(h, blk, part)] = (h, blk) in last_pairs

    def _staged(self, layer: int, h: int, blk: int, part: str, shape) -> torch.Tensor:
        key, st, pf = (self.uid, layer, h, blk, part), self.staged[layer], self.prefetcher
        label = f"L{layer} h{h} b{blk} {part}"
        buf = st.get((h, blk, part))
        if buf is not None:
            if key in pf.pending:
                pf.wait(key, label=label)        # predicted by the previous layer: a hit if the copy is done
            else:
                pf.reuse(label)                  # kept from this layer's last step
            return buf
        buf = st[(h, blk, part)] = self._buffer(shape)
        pf.wait(key, self._as_bytes(buf), label=label)     # a demand fetch: stall for all of it
        return buf

    def _after_routing(self, layer: int, used: dict) -> None:
        """Staging after a layer's use, as the predictor says: "step" keeps what the call's last
        query used (a prefill's other queries say little about the next token); "layer" starts
        the next layer's copies of everything this call used."""
        predict, pf = self.store.predict, self.prefetcher
        st = self.staged[layer]
        keep_step = predict in ("step", "both")
        for hb in list(st):
            if not (keep_step and used.get(hb, False)):
                pf.cancel((self.uid, layer, *hb), label=f"L{layer} h{hb[0]} b{hb[1]} {hb[2]} wasted")
                del st[hb]
        if predict in ("layer", "both") and used:
            nxt = (layer + 1) % len(self.staged)
            shape = (self.cfg.block, self.model_cfg.head_dim)
            for hb in sorted(used):
                key = (self.uid, nxt, *hb)
                if hb not in self.staged[nxt] and key in pf:
                    buf = self.staged[nxt][hb] = self._buffer(shape)
                    pf.submit(key, self._as_bytes(buf))

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
                    self.warm_vq[layer] = cat(self.warm_vq[layer] if old_n else None, nq[0] if nq else None)[:, :, keep].clone()
                    self.warm_vs[layer] = cat(self.warm_vs[layer] if old_n else None, nq[1] if nq else None)[:, :, keep].clone()
        if "cold" in views:
            c0, c1 = views["cold"]
            if c1 > c0:
                self.cold_k[layer] = views["Kc"][:, :, :c1].clone()
                self.cold_v[layer] = views["Vc"][:, :, :c1].clone()
        self._offload_blocks(layer, K, V, start, S)
        self._len[layer] = S

    def _offload_blocks(self, layer: int, K, V, start: int, S: int) -> None:
        """Write the blocks completed by this call (all their tokens are in hand) and park the
        summaries of their chunks that are not cold yet."""
        cfg = self.cfg
        first = max(0, (start - cfg.sink) // cfg.block) if start > cfg.sink else 0
        last = (S - cfg.sink) // cfg.block if S > cfg.sink else 0           # blocks [0, last) complete
        items = []                      # written in one batch (CUDA: one pinned buffer, one copy)
        for blk in range(first, last):
            lo = cfg.sink + blk * cfg.block
            if lo + cfg.block <= start:
                continue                                                    # written by an earlier call
            for h in range(K.shape[1]):
                for part, X in (("k", K), ("v", V)):
                    key = (self.uid, layer, h, blk, part)
                    items.append((key, X[0, h, lo:lo + cfg.block].contiguous()))
            if cfg.has_cold and cfg.cold_mode == "mean":
                cold_now = zone_counts(S, cfg).cold_chunks
                for j in range((lo - cfg.sink) // cfg.chunk, (lo - cfg.sink + cfg.block) // cfg.chunk):
                    if j >= cold_now:
                        c = slice(cfg.sink + j * cfg.chunk, cfg.sink + (j + 1) * cfg.chunk)
                        rec = torch.stack([chunk_means(K[:, :, c], cfg.chunk)[0, :, 0],
                                           chunk_means(V[:, :, c], cfg.chunk)[0, :, 0]])
                        items.append(((self.uid, layer, "sum", j), rec))
        self._put_many(items)

    # ---- the offload tier -----------------------------------------------------------------------
    def _buffer(self, shape) -> torch.Tensor:
        n = 1
        for s in shape:
            n *= s
        raw = self.prefetcher.transport.buffer(n * torch.empty((), dtype=self.dtype).element_size())
        return raw.view(self.dtype).view(*shape)

    @staticmethod
    def _as_bytes(buf: torch.Tensor) -> torch.Tensor:
        return buf.reshape(-1).view(torch.uint8)

    def _read(self, key, shape, label: str) -> torch.Tensor:
        """A cold chunk's parked summary, read back when the chunk turns cold: a synchronous read
        of the transport, counted apart from routing (``summary_reads``, ``summary_read_s``)."""
        buf = self._buffer(shape)
        with self._summary_clock.region():
            job = self.prefetcher.transport.read(key, self._as_bytes(buf))
        self.summary_reads += 1
        self.summary_read_bytes += job.nbytes
        return buf

    @property
    def summary_read_s(self) -> float:
        return self._summary_clock.seconds

    def _put(self, key, data: torch.Tensor) -> None:
        self._put_many([(key, data)])

    def _put_many(self, items) -> None:
        if not items:
            return
        self.prefetcher.put_many(items)
        for key, data in items:
            self._keys.add(key)
            self._offloaded += data.numel() * data.element_size()

    def _drop(self, key) -> None:
        tr = self.prefetcher.transport
        if key in self._keys:
            self._offloaded -= tr.nbytes_of(key)
        tr.drop(key)
        self._keys.discard(key)

    def finish(self) -> None:
        """The sequence ended but the cache is kept for inspection: predicted copies still on
        their way are cancelled and the staging buffers freed; the zones and the offload records
        stay (:meth:`release` drops those)."""
        pf = self.prefetcher
        for layer, st in enumerate(self.staged):
            for hb in list(st):
                pf.cancel((self.uid, layer, *hb))
            st.clear()

    def release(self) -> None:
        """Drop this cache's records from the offload tier and its staging (the sequence ended)."""
        if self._released:
            return
        pf = self.prefetcher
        self.finish()
        for key in list(self._keys):
            pf.transport.drop(key)
        self._keys.clear()
        self._offloaded = 0
        if self._own_pf:
            pf.close()
        self._released = True

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
