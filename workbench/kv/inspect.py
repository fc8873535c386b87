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

**Tiered mode**: :func:`tier_report` and :func:`tier_frame` live in
:mod:`workbench.kv.tier_inspect` (re-exported here).
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque

from workbench.errors import ConfigError, WorkbenchError
from workbench.kv.tier_inspect import tier_frame, tier_report  # noqa: F401  (re-exported)

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
                  "per_token": lay.bytes_per_token,
                  "in_use": (counts["owned"] + counts["shared"]) * lay.bytes_per_block,
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
    import httpx  # lazy: httpx (~0.4 s) only to read a live server's pool

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

    def __enter__(self) -> KVInspector:
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
        import pandas as pd  # lazy: pandas (~1 s) only for this table

        cols = ["seq_id", "prompt_tokens", "cached_tokens", "reuse_ratio", "miss_reason", "tokens", "committed",
                "num_blocks", "shared_blocks", "restored_blocks", "evictions", "steps", "seconds", "block_table"]
        return pd.DataFrame([{c: r.get(c) for c in cols} for r in self.records], columns=cols)


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
