"""kv-inspect: what is inside the KV cache of a running or finished generation, as plain data.

Every function returns JSON-ready dicts (ints, floats, strings, lists); :mod:`workbench.lab.kv_view`
turns them into text, figures and a live widget.  ::

    llm = LLM(kv=PagedKVConfig(block_size=16))
    insp = KVInspector(llm)                 # listens to the pool: keeps a record per finished request
    llm.generate(prompts, params)
    report(llm, insp)                       # pool, block map, prefix-cache stats, live + finished sequences
    insp.frame()                            # finished requests as a DataFrame

    llm = LLM(tiers=TierConfig(...), tier_basis=basis)
    llm.generate([long_prompt], params)
    tier_report(llm.last_cache)             # zones per layer, key norms per zone, bytes, zone map
    tier_frame(llm.last_cache)

**Paged mode** reads the block manager: ``block_states()`` per physical block (free / owned /
shared / cached), its counters (:class:`~workbench.kv.block_manager.KVStats`), block tables of
the live sequences, the offload tier's counters and the pool's bookkeeping time.  What a request
reused and why it missed are known when its prompt is allocated: the pool keeps each live
request's :class:`~workbench.kv.block_manager.Allocation` (and the blocks its admission
restored from the offload tier or evicted) in ``pool.admissions``, which :class:`KVInspector`
copies at the ``"begin"`` event.

**A running server** (``workbench serve``) answers ``GET /v1/workbench/kv`` (:data:`KV_POOL_PATH`)
with the live pool of its batched engine: :func:`pool_report_from_thread` reads it while the
engine thread keeps changing it (retried until a read is unchanged and self-consistent), with
each live request's reuse from the pool's ``admissions``; :func:`fetch_pool_report` GETs it
(``workbench kv-inspect --url http://HOST:PORT`` prints it as the local report).  The server
keeps no finished-request records, so its ``"finished"`` is empty.

**Tiered mode** reads a :class:`~workbench.kv.tiers.TieredKVCache` at its current length ``n``,
i.e. as its last query (position ``n - 1``) sees it.  Per layer and sequence (batch rows share
the zone arithmetic of :mod:`~workbench.kv.tier_config`):

* ``hot`` / ``warm`` / ``cold``: tokens per zone (``hot + warm + cold == n``);
* ``dropped``: cold tokens with ``cold_mode="drop"`` (evicted: neither attended nor fetchable);
* ``offloaded``: tokens whose full-precision K/V lives *only* in the offload tier, i.e. every
  token that is not hot and not dropped (``warm + cold`` with ``cold_mode="mean"``);
* ``fetched``: offloaded tokens that routing fetched back exactly for the last query, per KV
  head (routing picks blocks per head; the table shows the mean and max over heads).

Key L2 norms per zone, from the cache's own tensors: full-precision keys of hot tokens, PCA
reconstructions of warm keys (with the full keys' norm and the relative reconstruction error
next to them), and the chunk-mean keys of cold chunks - each over tokens (or chunks), KV heads
and batch rows.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque

import torch

from workbench.errors import WorkbenchError
from workbench.kv.tier_config import zone_masks

PAGED_STATES = ("free", "owned", "shared", "cached")
TIER_ZONES = ("hot", "warm", "cold", "fetched", "dropped")
# One character per state: compact block maps in records and in text reports.
CHARS = {"free": ".", "owned": "o", "shared": "S", "cached": "c",
         "hot": "H", "warm": "w", "cold": "C", "fetched": "F", "dropped": "x"}


# ---- paged pool ---------------------------------------------------------------------------------
def live_sequences(manager) -> list[str]:
    """Ids of the sequences holding blocks now."""
    return manager.seq_ids()


def sequence_record(manager, seq_id: str, alloc: dict | None = None) -> dict:
    """One live sequence: tokens with KV slots, committed tokens, block table, and (when known
    from ``alloc``) prompt tokens, reused tokens and the miss reason."""
    table = manager.block_table(seq_id)
    rec = {"seq_id": seq_id, "tokens": manager.num_tokens(seq_id), "committed": manager.num_committed(seq_id),
           "num_blocks": len(table), "block_table": table,
           "shared_blocks": sum(manager.blocks[b].ref_count > 1 for b in table)}
    rec.update({k: None if alloc is None else alloc[k]    # unknown without an inspector's allocation record
                for k in ("prompt_tokens", "cached_tokens", "reuse_ratio", "miss_reason", "restored_blocks",
                          "evictions")})
    return rec


def pool_report(pool, allocations: dict | None = None, finished=None) -> dict:
    """Everything about a :class:`~workbench.kv.paged.PagedKVPool` now (JSON-ready).

    ``allocations``: seq id -> what its allocation did (kept by :class:`KVInspector`; without
    it the live sequences' reuse is unknown and reported as None).  ``finished``: records of
    finished requests to include as ``"finished"``.
    """
    m, lay = pool.manager, pool.layout
    states = m.block_states()
    counts = {s: states.count(s) for s in PAGED_STATES}
    owners: dict[int, list[str]] = {}
    seqs = []
    for sid in live_sequences(m):
        seqs.append(sequence_record(m, sid, (allocations or {}).get(sid)))
        for b in seqs[-1]["block_table"]:
            owners.setdefault(b, []).append(sid)
    st = m.stats
    off = pool.offload
    return {
        "mode": "paged",
        "num_blocks": m.num_blocks, "block_size": m.block_size, "blocks": counts,
        "bytes": {"pool_tensors": pool.nbytes(), "per_block": lay.bytes_per_block,
                  "per_token": lay.bytes_per_token, "in_use": (counts["owned"] + counts["shared"]) * lay.bytes_per_block,
                  "cached": counts["cached"] * lay.bytes_per_block, "dtype_bytes": lay.dtype_bytes},
        "layout": dataclasses.asdict(lay),
        "block_states": states,
        "block_owners": {str(b): o for b, o in sorted(owners.items())},
        "prefix_cache": {"enabled": m.enable_prefix_caching, "eviction": m.eviction,
                         "hit_rate": st.hit_rate, "hit_tokens": st.hit_tokens, "prompt_tokens": st.prompt_tokens,
                         "requests": st.requests, "full_hits": st.full_hits, "partial_hits": st.partial_hits,
                         "miss_reasons": dict(st.misses), "evictions": st.evictions, "cow_copies": st.cow_copies,
                         "restored_blocks": st.restored_blocks, "indexed_blocks": len(m.prefix_cache.index)},
        "offload": None if off is None else {
            "kind": off.kind, "capacity_blocks": off.capacity_blocks, "blocks_held": len(off),
            "bytes_held": off.nbytes(), "stats": off.stats.as_dict()},
        "manager_seconds": pool.manager_seconds,
        "sequences": seqs,
        "finished": list(finished) if finished is not None else [],
    }


def allocation_record(admission: dict) -> dict:
    """What admitting one request did, JSON-ready: an entry of ``pool.admissions`` (its
    :class:`~workbench.kv.block_manager.Allocation`, blocks restored from the offload tier,
    cached blocks evicted to make room) as the fields :func:`sequence_record` reports."""
    a = admission["allocation"]
    return {"prompt_tokens": a.prompt_tokens, "cached_tokens": a.num_cached_tokens,
            "reuse_ratio": a.num_cached_tokens / a.prompt_tokens if a.prompt_tokens else None,
            "miss_reason": None if a.miss_reason is None else a.miss_reason.value,
            "restored_blocks": admission["restored_blocks"], "evictions": admission["evictions"]}


def live_allocations(pool) -> dict[str, dict]:
    """seq id -> :func:`allocation_record` for every live sequence, from the pool's own
    ``admissions`` (no :class:`KVInspector` needed: the pool keeps them until a request ends)."""
    return {sid: allocation_record(adm) for sid, adm in dict(getattr(pool, "admissions", None) or {}).items()}


# ---- a pool that another thread changes (a server's engine thread) ------------------------------
# The errors a reader can meet when the engine thread changes the pool under it: a dict that
# changes size while walked (RuntimeError), a sequence freed between listing it and reading it
# (the block manager's WorkbenchError), a list or dict entry gone (IndexError, KeyError).
_TORN_READ = (RuntimeError, KeyError, IndexError, WorkbenchError)


def _fingerprint(pool) -> tuple:
    """Everything a step, an admission or a release changes in the pool's bookkeeping: equal
    fingerprints before and after a read mean that nothing changed while it was read."""
    m = pool.manager
    st = m.stats
    return (id(m), m.block_states(), st.requests, st.evictions, st.cow_copies, st.restored_blocks,
            [(sid, m.num_tokens(sid), m.num_committed(sid)) for sid in m.seq_ids()])


def _consistent(rep: dict) -> bool:
    """Whether a report's parts agree as the block manager's invariants say: a block is owned
    by exactly one live sequence's table, shared by several, free or cached by none; a table
    has one block per ``block_size`` tokens.  A read made in the middle of an allocation or a
    release (reference counts changed, tables not yet, or the reverse) fails this."""
    owners, want = rep["block_owners"], {"free": 0, "cached": 0, "owned": 1}
    for i, state in enumerate(rep["block_states"]):
        n = len(owners.get(str(i), ()))
        if (n < 2) if state == "shared" else n != want[state]:
            return False
    return all(r["num_blocks"] == -(-r["tokens"] // rep["block_size"]) for r in rep["sequences"])


def pool_report_from_thread(pool, attempts: int = 8, pause_s: float = 0.002) -> dict:
    """:func:`pool_report` of a pool that another thread keeps changing - a server's engine
    thread, which takes no lock around a step - with each live sequence's reuse from
    :func:`live_allocations`.

    A plain read from here could fail (a dict changing size while walked, a sequence freed
    between listing it and reading its table), mix the pool before and after one step, or catch
    it in the middle of one block-manager call (the reader can be given the GIL there).  Each
    attempt reads a fingerprint of the pool (block states, counters, live sequences and their
    lengths), the report, then the fingerprint again, and keeps the report when the two agree -
    nothing changed while it was read - and its parts agree with each other (:func:`_consistent`:
    not read mid-call).  A failed, changed or inconsistent read is retried, ``attempts`` times
    at most, ``pause_s * attempt`` seconds apart; when no read was both, the last one that did
    not fail is returned with ``snapshot.stable`` False.  The report gains ``"snapshot"``:
    ``stable``, ``attempts`` (reads made) and ``seconds`` (spent reading).  Raises
    WorkbenchError when every read failed.
    """
    if not isinstance(attempts, int) or attempts < 1:
        raise WorkbenchError(f"pool_report_from_thread: attempts must be an integer >= 1, got {attempts!r}")
    t0 = time.perf_counter()
    rep, stable, last_error = None, False, None
    for attempt in range(1, attempts + 1):
        try:
            before = _fingerprint(pool)
            got = pool_report(pool, live_allocations(pool))
            stable = before == _fingerprint(pool) and _consistent(got)
        except _TORN_READ as e:
            last_error = f"{type(e).__name__}: {e}"
        else:
            rep = got
            if stable:
                break
        if attempt < attempts:
            time.sleep(pause_s * attempt)
    if rep is None:
        raise WorkbenchError(f"KV pool: all {attempts} reads failed while the engine thread changed the pool "
                             f"(last: {last_error}); try again")
    rep["snapshot"] = {"stable": stable, "attempts": attempt, "seconds": time.perf_counter() - t0}
    return rep


# ---- a running `workbench serve` ----------------------------------------------------------------
# The server's read-only route for its live pool (workbench.serve.app).  Under /v1 so that the
# server's API key guards it like the completions: the report names live requests and its
# prefix-cache counters tell whether others sent a given prefix.  "workbench" in the path: no
# OpenAI-compatible server has it.
KV_POOL_PATH = "/v1/workbench/kv"
KV_POOL_OBJECT = "workbench.kv_pool"     # the report's "object": how a client knows what answered


def _server_base(url: str) -> str:
    """http://HOST:PORT from what a user may pass: with or without ``http://``, a trailing
    ``/``, the OpenAI base URL (``.../v1``) or the endpoint itself."""
    from workbench.errors import ConfigError

    if not isinstance(url, str) or not url.strip():
        raise ConfigError(f"--url {url!r}: give the server's address, e.g. http://127.0.0.1:8000")
    base = url.strip()
    if "://" not in base:
        base = "http://" + base
    if not base.startswith(("http://", "https://")):
        raise ConfigError(f"--url {url}: only http:// and https:// servers can be asked")
    base = base.rstrip("/")
    for tail in (KV_POOL_PATH, "/v1"):
        if base.endswith(tail):
            base = base[:-len(tail)]
    return base


def fetch_pool_report(url: str, timeout: float = 10.0, api_key: str | None = None) -> dict:
    """GET the live KV pool report of a running ``workbench serve`` at ``url`` (``http://HOST:PORT``;
    ``.../v1`` and a missing ``http://`` are accepted) from :data:`KV_POOL_PATH`.

    Returns the server's :func:`pool_report` (``mode`` "paged", block counts and states, prefix
    cache counters, live sequences) plus ``object`` (:data:`KV_POOL_OBJECT`), ``server`` (served
    model, engine thread and queue, and how the snapshot was taken: see
    :func:`pool_report_from_thread`).  ``api_key``: sent as ``Authorization: Bearer`` (a server
    started with ``--api-key`` needs it).  Raises WorkbenchError naming the URL when the server
    cannot be reached or does not answer within ``timeout`` seconds, answers an HTTP error, or
    is not a workbench server (anything but its report).
    """
    import httpx

    endpoint = _server_base(url) + KV_POOL_PATH
    where = f"--url {url}: GET {endpoint}"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.get(endpoint, headers=headers, timeout=timeout)
    except httpx.TimeoutException:
        raise WorkbenchError(f"{where}: no answer within {timeout:g} s") from None
    except httpx.HTTPError as e:
        raise WorkbenchError(f"{where}: cannot reach the server ({type(e).__name__}: {e}); is `workbench serve` "
                             "running there?") from None
    if r.status_code != 200:
        try:
            said = r.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            said = r.text.strip()[:200] or r.reason_phrase
        hint = {401: "; the server wants its API key: set WORKBENCH_API_KEY (kv-inspect) or pass api_key",
                404: "; not a workbench server, or one older than this endpoint",
                405: "; not a workbench server, or one older than this endpoint"}.get(r.status_code, "")
        raise WorkbenchError(f"{where}: HTTP {r.status_code} ({said}){hint}")
    try:
        body = r.json()
    except ValueError:
        body = None
    if not isinstance(body, dict) or body.get("object") != KV_POOL_OBJECT or body.get("mode") != "paged":
        kind = r.headers.get("content-type", "no content type")
        raise WorkbenchError(f"{where}: the answer ({kind}) is not a workbench KV pool report; is this a "
                             "`workbench serve` server?")
    return body


class KVInspector:
    """Subscribes to a paged pool's listeners; keeps what each request's allocation did while it
    runs and a record of it when it ends (the last ``history`` requests).  ::

        insp = KVInspector(llm)          # or KVInspector(llm.kv_pool)
        ...generate...
        insp.records[-1]                 # block table, tokens, reuse, miss reason of the last request
        insp.report(); insp.frame(); insp.detach()

    ``restored_blocks`` and ``evictions`` of a record count what admitting that request did.
    With ``block_maps=True`` each record also keeps the pool's block states at the moment the
    request ended (before its blocks were released), one character per block (:data:`CHARS`;
    :func:`workbench.lab.kv_view.text_block_map` lays it out).
    """

    def __init__(self, llm_or_pool, history: int = 256, block_maps: bool = True) -> None:
        pool = getattr(llm_or_pool, "kv_pool", llm_or_pool)
        if pool is None or not hasattr(pool, "listeners"):
            raise WorkbenchError("KVInspector needs a paged engine: LLM(kv=PagedKVConfig(...)) "
                                 "(this engine has no KV pool; use tier_report(llm.last_cache) for a tiered one)")
        self.pool, self.block_maps = pool, block_maps
        self.records: deque[dict] = deque(maxlen=history)
        self.allocations: dict[str, dict] = {}      # live seq id -> what its allocation did
        self._begin_time: dict[str, float] = {}
        self._steps: dict[str, int] = {}
        pool.listeners.append(self._on_event)

    def detach(self) -> None:
        if self._on_event in self.pool.listeners:
            self.pool.listeners.remove(self._on_event)

    def __enter__(self) -> "KVInspector":
        return self

    def __exit__(self, *exc) -> None:
        self.detach()

    def _on_event(self, event: str, seq_id: str) -> None:
        m = self.pool.manager
        if event == "begin":
            self.allocations[seq_id] = allocation_record(self.pool.admissions[seq_id])
            self._begin_time[seq_id] = time.perf_counter()
            self._steps[seq_id] = 0
        elif event == "step":
            self._steps[seq_id] = self._steps.get(seq_id, 0) + 1
        elif event == "end":
            rec = sequence_record(m, seq_id, self.allocations.pop(seq_id, None))
            rec["steps"] = self._steps.pop(seq_id, 0)
            t0 = self._begin_time.pop(seq_id, None)
            rec["seconds"] = None if t0 is None else time.perf_counter() - t0
            if self.block_maps:
                rec["block_map"] = "".join(CHARS[x] for x in m.block_states())
            self.records.append(rec)

    def report(self) -> dict:
        return pool_report(self.pool, self.allocations, self.records)

    def frame(self):
        """Finished requests, one row each (block tables as lists)."""
        import pandas as pd

        cols = ["seq_id", "prompt_tokens", "cached_tokens", "reuse_ratio", "miss_reason", "tokens", "committed",
                "num_blocks", "shared_blocks", "restored_blocks", "evictions", "steps", "seconds", "block_table"]
        return pd.DataFrame([{c: r.get(c) for c in cols} for r in self.records], columns=cols)


# ---- tiered cache -------------------------------------------------------------------------------
def _norm_stats(k: torch.Tensor) -> dict:
    """Mean / max L2 norm over the last dim of k [..., hd] (None when empty)."""
    if k.numel() == 0:
        return {"mean": None, "max": None, "n": 0}
    n = k.float().norm(dim=-1)
    return {"mean": float(n.mean()), "max": float(n.max()), "n": int(n.numel())}


def _fetched_tokens(cache, layer: int, n: int, routable: torch.Tensor) -> torch.Tensor | None:
    """[B, nkv, n] bool: offloaded tokens routing fetched for the query at n-1, or None when no
    routing ran.  Routing blocks of ``block`` tokens start at ``sink``; once a query has any
    warm or cold token, every later call routes, so the last selection is the last query's."""
    cfg = cache.cfg
    sel = cache.last_selection.get(layer)
    if sel is None or n <= cfg.sink:
        return None
    if sel.shape[-1] != -(-(n - cfg.sink) // cfg.block):
        return None                                 # a selection for another length: not this query's
    tok = sel[:, :, -1].repeat_interleave(cfg.block, dim=-1)[..., :n - cfg.sink]   # [B, nkv, n - sink]
    tok = torch.nn.functional.pad(tok, (cfg.sink, 0), value=False)
    return tok & routable.to(tok.device)


@torch.no_grad()
def tier_report(cache, zone_map: bool = True) -> dict:
    """Zones, key norms, bytes and the per-position zone map of a TieredKVCache (JSON-ready;
    definitions in the module docstring)."""
    cfg, mc, n = cache.cfg, cache.model_cfg, cache.length
    z = cache.zone_counts()
    drop = cfg.cold_mode == "drop"
    rep = {"mode": "tiered", "config": dataclasses.asdict(cfg), "config_name": cfg.name, "length": n,
           "batch_size": cache.batch_size, "num_layers": mc.num_hidden_layers, "num_kv_heads": mc.num_key_value_heads,
           "zones": {"hot": z.hot, "warm": z.warm, "cold": z.cold_tokens, "cold_chunks": z.cold_chunks,
                     "dropped": z.cold_tokens if drop else 0,
                     "offloaded": n - z.hot - (z.cold_tokens if drop else 0)},
           "bytes": {"resident": cache.resident_bytes(), "full": cache.full_resident_bytes(),
                     "basis": cache.basis_bytes() if z.warm else 0, "element_bytes": cfg.element_bytes,
                     "fetched_last_step": float(cache.fetched_bytes_by_pos[n - 1]) if n else 0.0,
                     "fetched_tokens_last_step": float(cache.fetched_tokens_by_pos[n - 1]) if n else 0.0}}
    rep["bytes"]["reduction"] = rep["bytes"]["full"] / rep["bytes"]["resident"] if rep["bytes"]["resident"] else None
    layers, zmap, fheads = [], [], []
    if n:
        m = zone_masks(n - 1, 1, cfg)
        hot, warm, cold = m.hot[0], m.warm[0], m.cold[0]            # [n] bool, for the last query
        routable = warm | (cold if not drop else torch.zeros_like(cold))
        chunk_cold = m.chunk_cold[0]
    for layer in range(mc.num_hidden_layers):
        row = {"layer": layer, "hot": z.hot, "warm": z.warm, "cold": z.cold_tokens, "cold_chunks": z.cold_chunks,
               "dropped": rep["zones"]["dropped"], "offloaded": rep["zones"]["offloaded"]}
        if not n:
            layers.append(row)
            continue
        K = cache.k[layer][:, :, :n]                                # [B, nkv, n, hd]
        norms = {"hot": _norm_stats(K[:, :, hot])}
        if z.warm:
            norms["warm"] = _norm_stats(cache.k_hat[layer][:, :, :n][:, :, warm])
            norms["warm_exact"] = _norm_stats(K[:, :, warm])
            kw, kh = K[:, :, warm].float(), cache.k_hat[layer][:, :, :n][:, :, warm].float()
            rel = (kw - kh).norm(dim=-1) / kw.norm(dim=-1).clamp_min(1e-12)
            norms["warm_rel_error"] = float(rel.mean())
        else:
            norms["warm"] = norms["warm_exact"] = _norm_stats(K[:, :, :0])
            norms["warm_rel_error"] = None
        nC = int(chunk_cold.sum())
        if nC and not drop:
            lo = cfg.sink
            chunks = K[:, :, lo:lo + nC * cfg.chunk].reshape(*K.shape[:2], nC, cfg.chunk, K.shape[-1]).mean(3)
            norms["cold"] = _norm_stats(chunks)
        else:
            norms["cold"] = _norm_stats(K[:, :, :0])
        f = _fetched_tokens(cache, layer, n, routable)
        per_head = [0] * mc.num_key_value_heads if f is None else f.sum(-1).sum(0).tolist()   # summed over batch
        row.update({"fetched": sum(per_head) / len(per_head) / cache.batch_size,
                    "fetched_max_head": max(per_head) / cache.batch_size if per_head else 0,
                    "fetched_by_head": per_head, "key_norms": norms})
        layers.append(row)
        if zone_map:
            names = ["hot" if h else "dropped" if (c and drop) else "cold" if c else "warm"
                     for h, c in zip(hot.tolist(), cold.tolist())]
            heads = [0] * n if f is None else f[0].sum(0).tolist()  # batch row 0: KV heads fetching each token
            zmap.append(["fetched" if k else s for s, k in zip(names, heads)])
            fheads.append(heads)
    rep["layers"] = layers
    if zone_map:
        rep["zone_map"] = zmap            # [layer][position] -> zone name (fetched by >= 1 KV head: "fetched")
        rep["fetched_heads"] = fheads     # [layer][position] -> KV heads that fetched it (batch row 0)
    return rep


def tier_frame(cache_or_report):
    """Per-layer table of a tier report: zone counts, fetched tokens, key norms per zone."""
    import pandas as pd

    rep = cache_or_report if isinstance(cache_or_report, dict) else tier_report(cache_or_report, zone_map=False)
    rows = []
    for r in rep["layers"]:
        row = {k: r[k] for k in ("layer", "hot", "warm", "cold", "cold_chunks", "dropped", "offloaded")}
        row["fetched"] = r.get("fetched", 0)
        for zone in ("hot", "warm", "cold"):
            s = r.get("key_norms", {}).get(zone, {})
            row[f"|k| {zone} mean"], row[f"|k| {zone} max"] = s.get("mean"), s.get("max")
        row["warm rel err"] = r.get("key_norms", {}).get("warm_rel_error")
        rows.append(row)
    return pd.DataFrame(rows).set_index("layer")


# ---- any engine ---------------------------------------------------------------------------------
def report(llm, inspector: KVInspector | None = None) -> dict:
    """The report for the engine's KV mode: paged (pool), tiered (live and last caches), or
    contiguous (the reference: nothing paged or tiered to inspect, only sizes)."""
    if llm.kv_pool is not None:
        if inspector is not None and inspector.pool is llm.kv_pool:
            return inspector.report()
        return pool_report(llm.kv_pool)
    if llm.tiers is not None:
        return {"mode": "tiered", "config": dataclasses.asdict(llm.tiers), "config_name": llm.tiers.name,
                "active": {rid: tier_report(c) for rid, c in llm.active_caches.items()},
                "last": tier_report(llm.last_cache) if llm.last_cache is not None else None}
    cfg = llm.model.config
    elt = llm.model.lm_head.weight.element_size()
    per_token = cfg.kv_bytes_per_token(elt)
    return {"mode": "contiguous",
            "message": "contiguous reference cache: one private [layers, 2, tokens, kv_heads, head_dim] tensor per "
                       "request, freed when it ends; nothing paged or tiered to inspect (use LLM(kv=PagedKVConfig()) "
                       "or LLM(tiers=TierConfig(...), tier_basis=...))",
            "kv_bytes_per_token": per_token, "max_model_len": llm.max_model_len,
            "bytes_full_context": per_token * llm.max_model_len, "element_bytes": elt}
