"""What one request adds to memory and how soon it gives it back: the paged pool vs a contiguous
cache per request, measured on real allocations.

::

    row = request_memory(engine, prompt_ids, SamplingParams(max_tokens=16, ignore_eos=True))
    row["kv_bytes"], row["release_s"], row["rss_delta_peak"]

Per request (driven alone, step by step, on an idle :class:`~workbench.engine.core.LLMEngine`):

* ``kv_bytes`` -- the KV bytes the request holds at its peak.  Contiguous: the storages of its
  cache's tensors (:func:`workbench.measure.memory.storage_bytes`; the runner allocates
  ``prompt + max_tokens`` positions when the request is first scheduled).  Paged: the blocks its
  block table holds x the layout's bytes per block (:mod:`workbench.kv.layout`); the pool's
  tensors themselves are allocated once, when the engine is built (``pool_bytes``), so a request
  adds nothing to the process -- it takes blocks from the free list.
* ``release_s`` -- from the request's end (``RequestMetrics.finished_time``, when its last token
  was taken; for an abort, the call to ``engine.abort``) to the moment its KV was free: contiguous, when the
  cache object was destroyed (a ``weakref.finalize`` on it: its tensors' storages go with it);
  paged, when the pool's ``"end"`` event fired (just before the block manager returns the blocks)
  -- checked afterwards: the blocks are back on the free list when the step returns.
  ``release_bound_s`` is the conservative bound: finish to the end of the step that freed it.
* ``free_verified_s`` -- from the request's end as the client sees it (its finish timestamp; for a
  request the client stops, the moment it calls ``engine.abort``) to the first moment the KV is
  *verified* free, polled every 0.2 ms for up to ``wait_s`` after the request ends: paged, the pool's
  used-block count back to its level before the request (the blocks are on the free list);
  contiguous, the cache's finalizer has run (its tensors' storages went back to torch's CPU
  allocator, which hands them to ``free``).  An upper bound on the release time; None when the KV
  was not free within ``wait_s``.
* ``rss_*`` -- the process's resident set (``/proc/self/statm``) before the request, at its peak
  (read after every step) and right after the release: what the OS sees, allocator caching
  included (None where /proc is missing).  This is *host* memory: with a CUDA engine the KV
  lives in device memory and RSS does not move.
* ``device_*`` -- CUDA engines only (None elsewhere): ``torch.cuda.memory_allocated`` of the
  engine's device before the request, at its peak (read after every step) and right after the
  release, and the deltas.  A freed tensor goes back to PyTorch's caching allocator, not to the
  driver: ``memory_allocated`` drops at the release, ``device_reserved_after``
  (``torch.cuda.memory_reserved``) shows what the allocator still keeps.

``abort_after``: end the request after that many tokens (``engine.abort``, as a client that stops
reading does), so a request that ends before its ``max_tokens`` shows what each layout reserved.
"""

from __future__ import annotations

import os
import time
import weakref

import torch

from workbench.measure.memory import storage_bytes

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_bytes() -> int | None:
    """The process's resident set size in bytes (Linux ``/proc/self/statm``), or None."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return None


def device_bytes(engine) -> int | None:
    """``torch.cuda.memory_allocated`` of a CUDA engine's device (bytes in live tensors); None
    for an engine on any other device."""
    dev = getattr(engine, "device", None)
    if dev is None or torch.device(dev).type != "cuda":
        return None
    return int(torch.cuda.memory_allocated(dev))


def _device_reserved(engine) -> int | None:
    dev = getattr(engine, "device", None)
    if dev is None or torch.device(dev).type != "cuda":
        return None
    return int(torch.cuda.memory_reserved(dev))


def _cache_bytes(cache) -> int:
    return storage_bytes(list(getattr(cache, "k", [])) + list(getattr(cache, "v", [])))


def request_memory(engine, prompt, params, abort_after: int | None = None, wait_s: float = 2.0) -> dict:
    """One request alone on ``engine`` (contiguous or paged KV); see the module docstring."""
    if engine.kv_mode not in ("paged", "contiguous"):
        raise ValueError(f"request_memory: paged or contiguous KV, not {engine.kv_mode}")
    paged = engine.kv_mode == "paged"
    pool = engine.pool
    base_used = pool.manager.num_used_blocks
    released: dict[str, float] = {}
    rid_box: list[str] = []

    def on_pool(event: str, seq_id: str) -> None:
        if event == "end" and rid_box and seq_id == rid_box[0]:
            released.setdefault("end_event", time.perf_counter())

    pool.listeners.append(on_pool)
    try:
        rss0 = rss_bytes()
        dev0 = dev_peak = device_bytes(engine)
        rid = engine.add_request(prompt, params)
        rid_box.append(rid)
        seq = engine.seqs[rid]
        peak_kv, peak_rss, watched, step_end, t_abort = 0, rss0, False, None, None
        while not seq.finished:
            engine.step()
            if not seq.finished and abort_after is not None and len(seq.output.token_ids) >= abort_after:
                t_abort = time.perf_counter()
                engine.abort(rid, "stopped by the client")
                engine.drain_events()               # the abort's event (nothing else is queued)
            step_end = time.perf_counter()
            if seq.finished:
                break
            if paged:
                kv = len(pool.manager.block_table(rid)) * pool.layout.bytes_per_block
            else:
                cache = engine.runner.caches.get(rid)
                kv = _cache_bytes(cache) if cache is not None else 0
                if cache is not None and not watched:
                    weakref.finalize(cache, lambda: released.setdefault("finalized", time.perf_counter()))
                    watched = True
                del cache
            peak_kv = max(peak_kv, kv)
            r = rss_bytes()
            peak_rss = max(peak_rss, r) if r is not None and peak_rss is not None else peak_rss
            d = device_bytes(engine)
            dev_peak = max(dev_peak, d) if d is not None and dev_peak is not None else dev_peak

        def is_free() -> bool:
            return pool.manager.num_used_blocks == base_used if paged else "finalized" in released

        deadline = time.perf_counter() + wait_s
        while not is_free() and time.perf_counter() < deadline:
            time.sleep(0.0002)
        t_verified = time.perf_counter() if is_free() else None
        rss_after = rss_bytes()
        dev_after, dev_reserved = device_bytes(engine), _device_reserved(engine)
        out = engine.release(rid)
    finally:
        pool.listeners.remove(on_pool)
    m = out.metrics
    t_end = m.finished_time if t_abort is None else min(t_abort, m.finished_time)   # an abort frees, then stamps
    freed_blocks = pool.manager.num_used_blocks == base_used
    if paged:
        t_free = released.get("end_event") if freed_blocks else None
    else:
        t_free = released.get("finalized")
    return {"layout": engine.kv_mode, "prompt_tokens": m.prompt_tokens, "output_tokens": m.output_tokens,
            "max_tokens": params.max_tokens, "finish_reason": out.finish_reason, "kv_bytes": peak_kv,
            "kv_tokens_reserved": (peak_kv // pool.layout.bytes_per_token) if pool.layout.bytes_per_token else None,
            "pool_bytes": pool.nbytes() if paged else 0,
            "release_s": None if t_free is None else t_free - t_end,
            "release_bound_s": None if step_end is None else step_end - t_end,
            "free_verified_s": None if t_verified is None else t_verified - t_end,
            "released": t_free is not None, "rss_before": rss0, "rss_peak": peak_rss, "rss_after": rss_after,
            "rss_delta_peak": None if rss0 is None or peak_rss is None else peak_rss - rss0,
            "rss_delta_after": None if rss0 is None or rss_after is None else rss_after - rss0,
            "device_before": dev0, "device_peak": dev_peak, "device_after": dev_after,
            "device_delta_peak": None if dev0 is None or dev_peak is None else dev_peak - dev0,
            "device_delta_after": None if dev0 is None or dev_after is None else dev_after - dev0,
            "device_reserved_after": dev_reserved,
            "e2e_s": m.e2e}


__all__ = ["request_memory", "rss_bytes", "device_bytes"]
