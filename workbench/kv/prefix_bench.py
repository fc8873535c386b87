"""Measure what the cross-request prefix cache buys and what it costs, side by side in one run.

Two workloads, each run with the prefix cache on and off on the *same* model in the same
process, runs interleaved (off, on, on, off, ...) so machine drift hits both:

* **shared prefix**: N requests that share a long system prompt and differ in a short
  question (the source articles' "50 prompts with a common opening"). Reported: TTFT median
  and jitter (std) on vs off, their ratio, the hit rate the block manager reports, and miss
  reasons;
* **no sharing**: N requests with unrelated prompts, where the cache can only cost
  (hashing, bookkeeping). Reported: output tokens/s on vs off and the relative cost.

Each request is submitted on its own (``generate([prompt])``), so TTFT is that request's
prefill plus its first decode step, without queueing behind the others.  Greedy outputs are
compared on vs off: the prefix cache is exact, so they must be identical.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

from ..engine import LLM
from ..errors import ConfigError
from ..sampling import SamplingParams
from .paged import PagedKVConfig


@dataclass
class PrefixBenchConfig:
    num_requests: int = 50
    system_tokens: int = 900        # length of the shared system prompt, in tokens
    max_tokens: int = 16            # new tokens per request
    block_size: int = 16
    unique_prompt_tokens: int = 256  # prompt length in the no-sharing workload
    rounds: int = 2                 # on/off alternations per workload
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("num_requests", "system_tokens", "max_tokens", "block_size", "unique_prompt_tokens", "rounds"):
            if getattr(self, name) < 1:
                raise ConfigError(f"PrefixBenchConfig.{name} must be >= 1, got {getattr(self, name)}")


QUESTIONS = ["What does this module do?", "How do I open a file?", "Which exceptions can be raised?",
             "What is the default value?", "Is this thread safe?", "How do I install it?",
             "What changed in this version?", "Give an example.", "What are the arguments?",
             "Where is this documented?"]


def shared_prefix_prompts(tokenizer, cfg: PrefixBenchConfig) -> tuple[str, list[str]]:
    """A system prompt of about ``system_tokens`` tokens of held-out text, and N prompts that
    append a short numbered question to it."""
    from ..data import heldout_documents

    doc = max(heldout_documents(), key=lambda d: len(d["text"]))["text"]
    ids = tokenizer.encode(doc, add_special_tokens=False)[: cfg.system_tokens]
    system = tokenizer.decode(ids)
    prompts = [f"{system}\n\nQuestion {i + 1}: {QUESTIONS[i % len(QUESTIONS)]}\nAnswer:" for i in range(cfg.num_requests)]
    return system, prompts


def unique_prompts(tokenizer, cfg: PrefixBenchConfig) -> list[list[int]]:
    from ..data import heldout_token_windows

    return heldout_token_windows(tokenizer, cfg.num_requests, cfg.unique_prompt_tokens, seed=cfg.seed + 1)


def _run(llm: LLM, prompts, params) -> dict:
    t0 = time.perf_counter()
    m0 = llm.kv_pool.manager_seconds
    outs = [llm.generate([p], params)[0] for p in prompts]
    wall = time.perf_counter() - t0
    manager_s = llm.kv_pool.manager_seconds - m0
    ttft = [o.metrics.ttft * 1e3 for o in outs]
    n_out = sum(len(o.token_ids) for o in outs)
    return {"outs": outs, "ttft_ms": ttft, "wall_s": wall, "tokens_per_s": n_out / wall,
            "manager_share": manager_s / wall,
            "cached_tokens": [o.num_cached_tokens for o in outs],
            "miss_reasons": [o.prefix_miss_reason for o in outs]}


def run_prefix_bench(model=None, cfg: PrefixBenchConfig | None = None, device=None, dtype=None,
                     progress: bool = True) -> dict:
    """Both workloads, cache on vs off.  ``model``: a path / preset / None (bundled) or a loaded
    :class:`~workbench.engine.LLM` (its model and tokenizer are reused).  Returns a JSON-ready
    dict (see the module docstring)."""
    from tqdm.auto import tqdm

    cfg = cfg or PrefixBenchConfig()
    base = model if isinstance(model, LLM) else LLM(model, device=device, dtype=dtype)
    if base.tokenizer is None:
        raise ConfigError("prefix bench needs a model with a tokenizer (the prompts are text)")
    system, shared = shared_prefix_prompts(base.tokenizer, cfg)
    unique = unique_prompts(base.tokenizer, cfg)
    longest = max(len(base.tokenizer.encode(p)) for p in shared) + cfg.max_tokens
    blocks = -(-longest // cfg.block_size) * 4 + 8   # the shared prefix + a few requests' worth
    engines = {}
    for on in (False, True):
        kv = PagedKVConfig(block_size=cfg.block_size, num_blocks=blocks, enable_prefix_caching=on)
        engines[on] = LLM(base.model, tokenizer=base.tokenizer, kv=kv, max_model_len=base.max_model_len)
    params = SamplingParams(temperature=0, max_tokens=cfg.max_tokens, ignore_eos=True)

    runs = {("shared", on): [] for on in (False, True)} | {("unique", on): [] for on in (False, True)}
    order = [False, True, True, False] * cfg.rounds
    bar = tqdm(total=2 * len(order[: 2 * cfg.rounds]), desc="prefix bench", disable=not progress)
    for workload, prompts in (("shared", shared), ("unique", unique)):
        _run(engines[False], prompts[:2], params)          # warm-up
        for on in order[: 2 * cfg.rounds]:
            engines[on].kv_pool.reset()   # each round starts cold: its first request misses
            runs[(workload, on)].append(_run(engines[on], prompts, params))
            if on and workload == "shared":
                shared_stats = engines[on].kv_pool.manager.stats.as_dict()
            bar.update()
    bar.close()

    def ttft_stats(rs):
        all_ttft = [t for r in rs for t in r["ttft_ms"]]
        warm = [t for r in rs for t in r["ttft_ms"][1:]]   # without each round's first (cold) request
        return {"ttft_ms_p50": statistics.median(all_ttft), "ttft_ms_std": statistics.pstdev(all_ttft),
                "ttft_ms_p95": sorted(all_ttft)[int(0.95 * (len(all_ttft) - 1))],
                "ttft_ms_std_after_first": statistics.pstdev(warm)}

    off, on = ttft_stats(runs[("shared", False)]), ttft_stats(runs[("shared", True)])
    hit = runs[("shared", True)][-1]
    prompt_tokens = sum(len(o.prompt_token_ids) for o in hit["outs"])
    reasons: dict[str, int] = {}
    for r in hit["miss_reasons"]:
        reasons[str(r)] = reasons.get(str(r), 0) + 1
    same = all(a.token_ids == b.token_ids for a, b in zip(runs[("shared", False)][0]["outs"], hit["outs"]))
    tps_off = statistics.median(r["tokens_per_s"] for r in runs[("unique", False)])
    tps_on = statistics.median(r["tokens_per_s"] for r in runs[("unique", True)])
    # Wall-clock throughput differences of a few percent drown in machine noise; the share of
    # time spent inside the block manager is measured directly and is what the cache adds.
    share_off = statistics.median(r["manager_share"] for r in runs[("unique", False)])
    share_on = statistics.median(r["manager_share"] for r in runs[("unique", True)])
    same_unique = all(a.token_ids == b.token_ids for a, b in
                      zip(runs[("unique", False)][0]["outs"], runs[("unique", True)][0]["outs"]))
    return {
        "config": cfg.__dict__, "system_prompt_tokens": len(base.tokenizer.encode(system)),
        "device": str(base.device), "pool_blocks": blocks,
        "shared_prefix": {"off": off, "on": on, "ttft_p50_reduction": off["ttft_ms_p50"] / on["ttft_ms_p50"],
                          "jitter_off_ms": off["ttft_ms_std"], "jitter_on_ms": on["ttft_ms_std"],
                          "hit_tokens": sum(hit["cached_tokens"]), "prompt_tokens": prompt_tokens,
                          "hit_rate": sum(hit["cached_tokens"]) / prompt_tokens,
                          "miss_reasons": reasons, "identical_greedy_tokens": same},
        "no_sharing": {"tokens_per_s_off": tps_off, "tokens_per_s_on": tps_on,
                       "relative_cost": 1 - tps_on / tps_off,
                       "tokens_per_s_runs_off": [r["tokens_per_s"] for r in runs[("unique", False)]],
                       "tokens_per_s_runs_on": [r["tokens_per_s"] for r in runs[("unique", True)]],
                       "manager_share_off": share_off, "manager_share_on": share_on,
                       "bookkeeping_cost": share_on - share_off, "identical_greedy_tokens": same_unique},
        "block_manager_stats_shared": shared_stats,
    }


def format_prefix_bench(res: dict) -> str:
    s, u = res["shared_prefix"], res["no_sharing"]
    return "\n".join([
        f"shared prefix: {res['config']['num_requests']} requests, system prompt {res['system_prompt_tokens']} tokens, "
        f"block size {res['config']['block_size']}, device {res['device']}",
        f"{'prefix cache':<14}{'TTFT p50 ms':>13}{'TTFT p95 ms':>13}{'TTFT std ms':>13}{'std w/o 1st':>13}",
        *[f"{name:<14}{s[name]['ttft_ms_p50']:>13.2f}{s[name]['ttft_ms_p95']:>13.2f}{s[name]['ttft_ms_std']:>13.2f}"
          f"{s[name]['ttft_ms_std_after_first']:>13.2f}" for name in ("off", "on")],
        f"TTFT p50 reduction {s['ttft_p50_reduction']:.1f}x; hit rate {s['hit_rate']:.1%} "
        f"({s['hit_tokens']}/{s['prompt_tokens']} prompt tokens); miss reasons {s['miss_reasons']}; "
        f"identical greedy tokens: {s['identical_greedy_tokens']}",
        f"no sharing: {u['tokens_per_s_off']:.1f} tok/s off vs {u['tokens_per_s_on']:.1f} on "
        f"(wall-clock difference {u['relative_cost']:+.1%}, noisy); time in the block manager "
        f"{u['manager_share_off']:.2%} off vs {u['manager_share_on']:.2%} on -> bookkeeping cost "
        f"{u['bookkeeping_cost']:+.2%}; identical greedy tokens: {u['identical_greedy_tokens']}",
    ])
