"""KV lookahead: restore offloaded prefix blocks from disk ahead of admission, or at it.

The workload: ``n_prefixes`` distinct long shared prefixes (system prompts), each request one of
them plus a short unique suffix, cycled (prefix 0, 1, 2, 3, 0, 1, ...).  The KV pool holds
``max_num_seqs`` running requests and little more, so by the time a prefix comes back its
blocks have been evicted to the **disk** offload tier (``O_DIRECT``: real disk reads) and the
admission restores them.  All requests arrive together and queue (``max_num_seqs`` small), so
a lookahead has steps to act: with ``PagedKVConfig(lookahead=K)`` each step stages the
offloaded prefix blocks of the next K waiting requests while the model computes, and the
restore at admission takes them from staging buffers; with ``lookahead=0`` every restore reads
the disk at admission, on the critical path.

Admission is first come, first served by default (``prefix_aware=False``): prefix-aware
admission would group requests whose prefix the pool still holds, and restore less.

Each round runs every lookahead setting on a fresh engine over the same model (order reversed
every other round), each after a warm-up that computes every prefix once (so they sit in the
pool or on disk) and resets the counters.  Reported per setting: TTFT p50 / p95 (median over
rounds, and every round), restore time on the critical path vs hidden and the hidden share,
prefetch hit rate, bytes read, and whether the greedy tokens of every request are identical
across settings and rounds (the restore is exact, so they must be).
"""

from __future__ import annotations

import statistics
import time

import torch

from workbench.errors import ConfigError


def _percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    k = (len(s) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def _load(model):
    """An LLM (or anything with ``.loaded``) as it is; else load ``model`` (None: the bundled one) in float32."""
    if model is not None and hasattr(model, "loaded"):
        return model
    from workbench.engine.llm import LLM

    return LLM(model, device="cpu", dtype=torch.float32)


def _run(llm, prompts, warm, k: int, cfg: dict) -> dict:
    from workbench.engine.core import LLMEngine
    from workbench.engine.sampling import SamplingParams
    from workbench.kv.paged import PagedKVConfig
    from workbench.sched.config import SchedulerConfig

    params = SamplingParams(temperature=0, max_tokens=cfg["max_tokens"], ignore_eos=True)
    kv = PagedKVConfig(block_size=cfg["block_size"], num_blocks=cfg["pool_blocks"], offload=cfg["offload"],
                       lookahead=k)
    sch = SchedulerConfig(max_num_seqs=cfg["max_num_seqs"], prefix_aware=cfg["prefix_aware"], aging_s=None)
    eng = LLMEngine(llm, kv=kv, scheduler=sch)
    pool = eng.pool
    try:
        for p in warm:                                      # every prefix computed once, then evicted
            eng.generate([p], params)
        pool.kv_prefetch.reset_stats()
        restored0 = pool.manager.stats.restored_blocks
        t0 = time.perf_counter()
        outs = eng.generate(prompts, params)                # all arrive together and queue
        wall = time.perf_counter() - t0
        pool.manager.check_invariants()
        if pool.manager.num_used_blocks:
            raise AssertionError(f"{pool.manager.num_used_blocks} KV blocks still in use after the run")
        st = pool.prefetch_stats()
        ttft = [o.metrics.ttft * 1e3 for o in outs]
        return {"lookahead": k, "ttft_p50_ms": _percentile(ttft, 0.5), "ttft_p95_ms": _percentile(ttft, 0.95),
                "wall_s": wall, "restored_blocks": pool.manager.stats.restored_blocks - restored0,
                "restore_s_on_critical_path": st["restore_s_on_critical_path"],
                "restore_s_hidden": st["restore_s_hidden"], "restore_hidden_share": st["restore_hidden_share"],
                "restore_wall_s": st["restore_wall_s"], "prefetch_hit_rate": st["prefetch_hit_rate"],
                "uses": st["uses"], "hits": st["hits"], "demand": st["demand"], "bytes": st["bytes"],
                "achieved_gbps": st["achieved_gbps"], "wasted_prefetches": st["wasted_prefetches"],
                "lookahead_s": st["lookahead_s"], "read_mode": pool.offload.transport.describe().get("read_mode"),
                "tokens": [o.token_ids for o in outs]}
    finally:
        pool.close()


def kv_lookahead_experiment(model=None, n_requests: int = 16, shared_prefix_tokens: int = 320, n_prefixes: int = 4,
                            suffix_tokens: int = 8, max_tokens: int = 2, block_size: int = 16, max_num_seqs: int = 2,
                            lookahead=(0, 4), repeats: int = 4, prefix_aware: bool = False, offload: str = "disk",
                            threads: int | None = 1, seed: int = 0, bar=None) -> dict:
    """Run the workload of the module docstring once per ``lookahead`` setting per round.

    ``model``: None (the bundled model, float32), a model folder / preset, or a loaded ``LLM``
    (used as it is).  ``threads``: torch threads during the runs (1 leaves a core to the disk
    worker on a 2-core machine; None keeps the current setting).  The defaults are the smoke
    size (a few seconds on 2 cores); raise ``n_requests`` and ``repeats`` for tighter numbers.

    Returns ``{"config", "modes", "runs", "tokens_identical", "comparisons"}``: ``modes`` maps
    each lookahead to its medians over rounds (TTFT p50 / p95 and their per-round values) and
    its restore counters summed over rounds (``restore_hidden_share`` = hidden / (hidden +
    on the critical path)); ``runs`` has one row per run; ``comparisons`` (two settings only)
    the verdicts on TTFT p50 / p95 (:func:`~workbench.measure.compare.compare_samples`).
    ``bar``: a progress bar (``total``, ``start(name)``, ``advance()``), told of every run."""
    for name, v in (("n_requests", n_requests), ("shared_prefix_tokens", shared_prefix_tokens),
                    ("n_prefixes", n_prefixes), ("suffix_tokens", suffix_tokens), ("max_tokens", max_tokens),
                    ("block_size", block_size), ("max_num_seqs", max_num_seqs), ("repeats", repeats)):
        if not isinstance(v, int) or v < 1:
            raise ConfigError(f"kv_lookahead_experiment: {name} must be an integer >= 1, got {v!r}")
    settings = tuple(lookahead)
    if not settings or len(set(settings)) != len(settings):
        raise ConfigError(f"kv_lookahead_experiment: lookahead must list distinct settings, got {lookahead!r}")
    if shared_prefix_tokens < 2 * block_size:
        raise ConfigError(f"kv_lookahead_experiment: shared_prefix_tokens={shared_prefix_tokens} leaves fewer than "
                          f"two full blocks of {block_size} to offload")
    llm = _load(model)
    vocab = llm.loaded.model.config.vocab_size
    g = torch.Generator().manual_seed(seed)
    rand = lambda n: torch.randint(1, vocab, (n,), generator=g).tolist()  # noqa: E731 - 0 is the bundled EOS
    prefixes = [rand(shared_prefix_tokens) for _ in range(n_prefixes)]
    warm = [p + rand(suffix_tokens) for p in prefixes]
    prompts = [prefixes[i % n_prefixes] + rand(suffix_tokens) for i in range(n_requests)]
    per_request = -(-(shared_prefix_tokens + suffix_tokens + max_tokens) // block_size)
    cfg = {"n_requests": n_requests, "shared_prefix_tokens": shared_prefix_tokens, "n_prefixes": n_prefixes,
           "suffix_tokens": suffix_tokens, "max_tokens": max_tokens, "block_size": block_size,
           "max_num_seqs": max_num_seqs, "pool_blocks": max_num_seqs * per_request + 2, "offload": offload,
           "prefix_aware": prefix_aware, "repeats": repeats, "seed": seed}
    old_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    cfg["threads"] = torch.get_num_threads()
    runs = []
    try:
        if bar is not None:
            bar.total = repeats * len(settings)
        for r in range(repeats):
            for k in (settings if r % 2 == 0 else settings[::-1]):
                if bar is not None:
                    bar.start(f"round {r + 1}/{repeats}: lookahead={k}, {n_requests} requests")
                runs.append({"round": r, **_run(llm, prompts, warm, k, cfg)})
                if bar is not None:
                    bar.advance()
    finally:
        torch.set_num_threads(old_threads)
    ref = runs[0]["tokens"]
    mismatched = sorted({i for run in runs for i, t in enumerate(run["tokens"]) if t != ref[i]})
    modes = {}
    for k in settings:
        rs = [run for run in runs if run["lookahead"] == k]
        crit = sum(run["restore_s_on_critical_path"] for run in rs)
        hidden = sum(run["restore_s_hidden"] for run in rs)
        uses, hits = sum(run["uses"] for run in rs), sum(run["hits"] for run in rs)
        modes[k] = {"ttft_p50_ms": statistics.median(run["ttft_p50_ms"] for run in rs),
                    "ttft_p95_ms": statistics.median(run["ttft_p95_ms"] for run in rs),
                    "ttft_p50_ms_runs": [run["ttft_p50_ms"] for run in rs],
                    "ttft_p95_ms_runs": [run["ttft_p95_ms"] for run in rs],
                    "wall_s_runs": [run["wall_s"] for run in rs],
                    "restore_s_on_critical_path": crit, "restore_s_hidden": hidden,
                    "restore_hidden_share": hidden / (crit + hidden) if crit + hidden > 0 else None,
                    "restore_wall_s": sum(run["restore_wall_s"] for run in rs),
                    "prefetch_hit_rate": hits / uses if uses else None, "uses": uses, "hits": hits,
                    "demand": sum(run["demand"] for run in rs), "bytes": sum(run["bytes"] for run in rs),
                    "restored_blocks": sum(run["restored_blocks"] for run in rs),
                    "wasted_prefetches": sum(run["wasted_prefetches"] for run in rs),
                    "lookahead_s": sum(run["lookahead_s"] for run in rs)}
    comparisons = {}
    if len(settings) == 2 and repeats >= 1:
        from workbench.measure.compare import compare_samples

        a, b = settings
        for metric in ("ttft_p50_ms", "ttft_p95_ms"):
            c = compare_samples(modes[a][f"{metric}_runs"], modes[b][f"{metric}_runs"],
                                names=(f"lookahead={a}", f"lookahead={b}"), metric=metric, unit="ms")
            comparisons[metric] = c.as_dict()
    for run in runs:
        run.pop("tokens")
    cfg["read_mode"] = runs[0]["read_mode"]
    return {"config": cfg, "modes": modes, "runs": runs, "tokens_identical": not mismatched,
            "mismatched_requests": mismatched, "comparisons": comparisons}
