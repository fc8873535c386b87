"""The offload side of :class:`~workbench.kv.tiers_physical.PhysicalTieredKVCache`: complete
blocks written to the offload tier, routed blocks fetched back into staging buffers through the
prefetcher as the predictor says (``TierStore.predict``; see :mod:`workbench.kv.tiers_physical`),
cold chunks' parked summaries read back, and the records dropped when the sequence ends.

:class:`OffloadedBlocks` is a base of the cache: its methods read the attributes the cache's
``__init__`` sets (``cfg``, ``model_cfg``, ``store``, ``prefetcher``, ``uid``, ``dtype``,
``staged``, ``_keys``, ``_offloaded``, ``_summary_clock``, ``summary_reads``,
``summary_read_bytes``, ``_own_pf``, ``_released``).
"""

from __future__ import annotations

import torch

from workbench.kv.tier_attention import chunk_means
from workbench.kv.tier_config import zone_counts


class OffloadedBlocks:
    """Routed-block fetches, block offload and the offload tier of one physical tiered cache."""

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
