"""Measure what the cross-request prefix cache buys and what it costs, side by side in one run.

Two workloads, each run with the prefix cache on and off on the *same* model in the same
process, request by request (off, on, then on, off, ...) so machine drift hits both:

* **shared prefix**: N requests that share a long system prompt and differ in a short
  question (the source articles' "50 prompts with a common opening"). Reported: TTFT median
  and jitter (``workbench.engine.metrics.jitter``: sample std) on vs off, their ratio, the hit
  rate the block manager reports, and miss reasons;
* **no sharing**: N requests with unrelated prompts, where the cache can only cost
  (hashing, bookkeeping). Reported: output tokens/s on vs off and the relative cost.

Each request is submitted on its own (``generate([prompt])``), so TTFT is that request's
prefill plus its first decode step, without queueing behind the others.  Greedy outputs are
compared on vs off: the prefix cache is exact, so they must be identical.
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass

from workbench.engine.llm import LLM
from workbench.engine.metrics import jitter
from workbench.errors import ConfigError
from workbench.measure.compare import compare_samples
from workbench.engine.sampling import SamplingParams
from workbench.kv.paged import PagedKVConfig


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
    from workbench.data import heldout_documents

    doc = max(heldout_documents(), key=lambda d: len(d["text"]))["text"]
    ids = tokenizer.encode(doc, add_special_tokens=False)[: cfg.system_tokens]
    system = tokenizer.decode(ids)
    prompts = [f"{system}\n\nQuestion {i + 1}: "
               f"{QUESTIONS[i % len(QUESTIONS)]}\nAnswer:" for i in range(cfg.num_requests)]
    return system, prompts


def unique_prompts(tokenizer, cfg: PrefixBenchConfig) -> list[list[int]]:
    from workbench.data import heldout_token_windows

    return heldout_token_windows(tokenizer, cfg.num_requests, cfg.unique_prompt_tokens, seed=cfg.seed + 1)


def _run_pair(engines: dict, prompts, params, first: bool) -> dict:
    """Every prompt on both engines, request by request, the order alternating (``first``
    first, then the other; then the reverse ...), so the two sides' requests are neighbours in
    time and machine drift hits both alike.  Returns per side what :func:`_summarize` needs."""
    sides = (first, not first)
    raw = {on: {"outs": [], "seconds": [], "manager_s": 0.0} for on in sides}
    m0 = {on: engines[on].kv_pool.manager_seconds for on in sides}
    for i, p in enumerate(prompts):
        for on in (sides if i % 2 == 0 else sides[::-1]):
            t0 = time.perf_counter()
            out = engines[on].generate([p], params)[0]
            raw[on]["seconds"].append(time.perf_counter() - t0)
            raw[on]["outs"].append(out)
    for on in sides:
        raw[on]["manager_s"] = engines[on].kv_pool.manager_seconds - m0[on]
    return {on: _summarize(r) for on, r in raw.items()}


def _summarize(r: dict) -> dict:
    outs, wall = r["outs"], sum(r["seconds"])
    n_out = sum(len(o.token_ids) for o in outs)
    return {"outs": outs, "ttft_ms": [o.metrics.ttft * 1e3 for o in outs], "wall_s": wall,
            "tokens_per_s": n_out / wall,
            "request_tokens_per_s": [len(o.token_ids) / t for o, t in zip(outs, r["seconds"])],
            "manager_share": r["manager_s"] / wall,
            "cached_tokens": [o.num_cached_tokens for o in outs],
            "miss_reasons": [o.prefix_miss_reason for o in outs]}


def run_prefix_bench(model=None, cfg: PrefixBenchConfig | None = None, device=None, dtype=None,
                     progress: bool = True, bar=None) -> dict:
    """Both workloads, cache on vs off.  ``model``: a path / preset / None (bundled) or a loaded
    :class:`~workbench.engine.llm.LLM` (its model and tokenizer are reused).  Returns a JSON-ready
    dict (see the module docstring).  After each round the result so far (a workload's section once
    it has a round) goes to :func:`workbench.measure.gpu_results.save_partial` (a no-op unless
    ``$WORKBENCH_PARTIAL_OUT`` is set).  ``bar``: a notebook's progress bar
    (:class:`workbench.lab.progress.Progress`, or anything with ``total``, ``start(name)`` and
    ``advance()``): its total is set to the rounds here, and it names each one as it starts."""
    from tqdm.auto import tqdm

    cfg = cfg or PrefixBenchConfig()
    base = model if isinstance(model, LLM) else LLM(model, device=device, dtype=dtype)
    if base.tokenizer is None:
        raise ConfigError("prefix bench needs a model with a tokenizer (the prompts are text)")
    system, shared = shared_prefix_prompts(base.tokenizer, cfg)
    unique = unique_prompts(base.tokenizer, cfg)
    longest = max(len(base.tokenizer.encode(p)) for p in shared) + cfg.max_tokens
    blocks = -(-longest // cfg.block_size) * 4 + 8   # the shared prefix + a few requests' worth
    from workbench.measure.gpu_results import save_partial
    from workbench.measure.probe import noise_probe

    probe = noise_probe()            # the noise floor of the verdicts below
    engines = {}
    for on in (False, True):
        kv = PagedKVConfig(block_size=cfg.block_size, num_blocks=blocks, enable_prefix_caching=on)
        engines[on] = LLM(base.model, tokenizer=base.tokenizer, kv=kv, max_model_len=base.max_model_len)
    params = SamplingParams(temperature=0, max_tokens=cfg.max_tokens, ignore_eos=True)

    runs = {("shared", on): [] for on in (False, True)} | {("unique", on): [] for on in (False, True)}
    head = {"config": cfg.__dict__, "system_prompt_tokens": len(base.tokenizer.encode(system)),
            "device": str(base.device), "pool_blocks": blocks, "noise": probe.as_dict()}
    shared_stats = None
    bar = bar or tqdm(total=2 * cfg.rounds, desc="prefix bench", disable=not progress)
    if hasattr(bar, "start"):
        bar.total = 2 * cfg.rounds
    for workload, prompts in (("shared", shared), ("unique", unique)):
        for on in (False, True):                            # warm-up
            engines[on].generate([prompts[0]], params)
        for r in range(cfg.rounds):
            if hasattr(bar, "start"):
                bar.start(f"{'shared prefix' if workload == 'shared' else 'no sharing'}, round {r + 1}/{cfg.rounds}: "
                          f"{len(prompts)} requests, cache off and on")
            for on in (False, True):
                engines[on].kv_pool.reset()   # each round starts cold: its first request misses
            for on, res in _run_pair(engines, prompts, params, first=r % 2 == 1).items():
                runs[(workload, on)].append(res)
            if workload == "shared":
                shared_stats = engines[True].kv_pool.manager.stats.as_dict()
            try:                              # the rounds so far, for a time cap that stops the run
                save_partial(_result(head, runs, shared_stats))
            except Exception as e:  # noqa: BLE001 - saving what there is must never stop the measuring
                print(f"prefix-bench: could not save the partial result: {type(e).__name__}: {e}", file=sys.stderr)
            bar.advance() if hasattr(bar, "advance") else bar.update()
    bar.close()
    return _result(head, runs, shared_stats)


def _result(head: dict, runs: dict, shared_stats: dict | None) -> dict:
    """The benchmark's result from the rounds run so far (``runs``: (workload, on) -> one summary per
    round): a workload's section once it has a round."""
    out = dict(head)

    def ttft_stats(rs):
        all_ttft = [t for r in rs for t in r["ttft_ms"]]
        warm = [t for r in rs for t in r["ttft_ms"][1:]]   # without each round's first (cold) request
        return {"ttft_ms_p50": statistics.median(all_ttft), "ttft_ms_std": jitter(all_ttft),
                "ttft_ms_p95": sorted(all_ttft)[int(0.95 * (len(all_ttft) - 1))],
                "ttft_ms_std_after_first": jitter(warm)}

    names = ("prefix cache off", "prefix cache on")
    if runs[("shared", True)]:
        off, on = ttft_stats(runs[("shared", False)]), ttft_stats(runs[("shared", True)])
        hit = runs[("shared", True)][-1]
        prompt_tokens = sum(len(o.prompt_token_ids) for o in hit["outs"])
        reasons: dict[str, int] = {}
        for r in hit["miss_reasons"]:
            reasons[str(r)] = reasons.get(str(r), 0) + 1
        same = all(a.token_ids == b.token_ids for a, b in zip(runs[("shared", False)][0]["outs"], hit["outs"]))
        # The verdict: each request after a round's first (which cannot hit) off vs on, neighbours in time
        warm = {on: [t for r in runs[("shared", on)] for t in r["ttft_ms"][1:]] for on in (False, True)}
        ttft_cmp = (compare_samples(warm[False], warm[True], names=names, metric="TTFT of requests after the first",
                                    unit="ms") if warm[False] else None)
        out["shared_prefix"] = {
            "off": off, "on": on, "ttft_p50_reduction": off["ttft_ms_p50"] / on["ttft_ms_p50"],
            "ttft_verdict": ttft_cmp.verdict if ttft_cmp else "needs 2+ requests",
            "ttft_winner": ttft_cmp.winner if ttft_cmp else None,
            "ttft_comparison": ttft_cmp.as_dict() if ttft_cmp else None,
            "jitter_off_ms": off["ttft_ms_std"], "jitter_on_ms": on["ttft_ms_std"],
            "hit_tokens": sum(hit["cached_tokens"]), "prompt_tokens": prompt_tokens,
            "hit_rate": sum(hit["cached_tokens"]) / prompt_tokens,
            "miss_reasons": reasons, "identical_greedy_tokens": same}
    if runs[("unique", True)]:
        tps_off = statistics.median(r["tokens_per_s"] for r in runs[("unique", False)])
        tps_on = statistics.median(r["tokens_per_s"] for r in runs[("unique", True)])
        # Wall-clock throughput differences of a few percent drown in machine noise; the share of
        # time spent inside the block manager is measured directly and is what the cache adds.
        share_off = statistics.median(r["manager_share"] for r in runs[("unique", False)])
        share_on = statistics.median(r["manager_share"] for r in runs[("unique", True)])
        same_unique = all(a.token_ids == b.token_ids for a, b in
                          zip(runs[("unique", False)][0]["outs"], runs[("unique", True)][0]["outs"]))
        # per-request tokens/s without sharing, where only "within noise" is expected
        tps_cmp = compare_samples([t for r in runs[("unique", False)] for t in r["request_tokens_per_s"]],
                                  [t for r in runs[("unique", True)] for t in r["request_tokens_per_s"]], names=names,
                                  metric="tokens/s per request, nothing shared", lower_is_better=False,
                                  better_word="faster")
        out["no_sharing"] = {
            "tokens_per_s_off": tps_off, "tokens_per_s_on": tps_on, "relative_cost": 1 - tps_on / tps_off,
            "tokens_per_s_runs_off": [r["tokens_per_s"] for r in runs[("unique", False)]],
            "tokens_per_s_runs_on": [r["tokens_per_s"] for r in runs[("unique", True)]],
            "manager_share_off": share_off, "manager_share_on": share_on,
            "bookkeeping_cost": share_on - share_off, "identical_greedy_tokens": same_unique,
            "tokens_per_s_verdict": tps_cmp.verdict}
    if shared_stats is not None:
        out["block_manager_stats_shared"] = shared_stats
    return out


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
        f"TTFT after each round's first request, off vs on: {s['ttft_verdict']}",
        f"no sharing: {u['tokens_per_s_off']:.1f} tok/s off vs {u['tokens_per_s_on']:.1f} on "
        f"(wall-clock difference {u['relative_cost']:+.1%}, noisy); time in the block manager "
        f"{u['manager_share_off']:.2%} off vs {u['manager_share_on']:.2%} on -> bookkeeping cost "
        f"{u['bookkeeping_cost']:+.2%}; identical greedy tokens: {u['identical_greedy_tokens']}; "
        f"per-request tokens/s: {u['tokens_per_s_verdict']}",
    ])
