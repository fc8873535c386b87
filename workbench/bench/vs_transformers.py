"""The workbench engine against Hugging Face ``transformers.generate``, same process, same run.

Every side gets the same weights, the same prompts (token ids), greedy decoding and the same
number of new tokens (EOS ignored), after a warm-up; repeats are interleaved (each side in
turn, the order rotated) so that drift in machine speed hits all.  The sides are engine
configurations (:data:`CONFIGS`: the reference configuration, the bare loop, static / compiled
/ graphed decode, optionally llama.cpp) and transformers.  Each token's time is taken when its id
reaches the host (for transformers through a streamer, which receives ``next_tokens.cpu()``),
so TTFT and decode tokens/s are measured the same way on both sides.  Greedy token agreement
is reported next to the speed: a faster engine that emits different tokens is not a win.

This module runs the bench (:func:`run_bench`, the interleaved repeats) and keeps every name callers
use; the parts live in :mod:`.vs_configs` (:class:`BenchConfig`, the configurations and their
parsing), :mod:`.vs_sides` (the prompts, each side built and run once), :mod:`.vs_results` (the
rows, verdicts, perplexity of the quantized rows, the result a partial save writes), :mod:`.vs_types`
(:class:`BenchResult`, what :func:`run_bench` returns) and :mod:`.vs_format` (:func:`format_bench`).
"""

from __future__ import annotations

import os
import platform
import sys
from dataclasses import asdict

import torch

from workbench.bench.vs_configs import (
    CONFIGS,
    DEFAULT_PROMPT_TOKENS,
    DEFAULT_QUANT,
    ENGINE_OPTIONS,
    LLAMACPP,
    SINGLE_STREAM,
    BenchConfig,
    parse_batches,
    parse_configs,
    parse_quant,
)
from workbench.bench.vs_format import format_bench
from workbench.bench.vs_results import PAGED_PAIRS, _batch_rows, _result, bench_quality
from workbench.bench.vs_sides import _run_hf, _sides, bench_prompts, hf_model_like
from workbench.bench.vs_types import BenchResult
from workbench.engine.llm import LLM
from workbench.errors import WorkbenchError

__all__ = ["CONFIGS", "DEFAULT_PROMPT_TOKENS", "DEFAULT_QUANT", "ENGINE_OPTIONS", "LLAMACPP", "PAGED_PAIRS",
           "SINGLE_STREAM", "BenchConfig", "BenchResult", "bench_prompts", "bench_quality", "cpu_name",
           "device_name", "format_bench", "hf_model_like", "parse_batches", "parse_configs", "parse_quant", "run_bench"]


def cpu_name() -> str:
    """The CPU's model name (from /proc/cpuinfo on Linux) and its core count."""
    name = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{name}, {os.cpu_count()} cores"


def device_name(device) -> str:
    """The GPU's name on CUDA, else :func:`cpu_name`."""
    device = torch.device(device)
    return torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()


def run_bench(cfg: BenchConfig, progress: bool = True) -> BenchResult:
    """Returns a :class:`BenchResult` (its JSON: :meth:`BenchResult.as_dict`; ``result["key"]`` reads
    that too): per configuration median TTFT (ms) and decode tokens/s, their ratios to transformers
    with verdicts, greedy token agreement with the reference (and the logit margin at the first
    divergence), the environment, and every raw measurement.

    With several batch sizes (``cfg.batch``, e.g. ``"1,8"``) every side runs each size: that many
    prompts submitted together (transformers: one batched ``generate``; the reference
    configuration, one request at a time, runs them one after another).  The top-level rows are the
    smallest batch; ``batches`` holds every size's rows, and ``paged_vs_contiguous`` the paged
    pool's static steps against the contiguous ones at each size (``paged+compile`` vs ``compile``,
    ``paged+graphs`` vs ``cuda-graphs``) with a verdict.

    After every group of prompts that every side has run, the result so far (without ``raw``, as
    ``workbench bench --json`` prints it) goes to :func:`workbench.measure.gpu_results.save_partial`
    (a no-op unless ``$WORKBENCH_PARTIAL_OUT`` is set): the statistics, ratios and verdicts of the
    runs done, token agreement on the prompts run so far, no perplexity (measured after the runs)."""
    import transformers
    from tqdm.auto import tqdm

    from workbench.measure.gpu_results import save_partial
    from workbench.measure.probe import noise_probe

    names = parse_configs(cfg.configs)
    batches = parse_batches(cfg.batch)
    torch.manual_seed(cfg.seed)
    llm = LLM(cfg.model, device=cfg.device, dtype=cfg.dtype, threads=cfg.threads)
    threads = torch.get_num_threads()   # the engine's choice; process-wide, so transformers runs with it too
    probe = noise_probe()               # the noise floor of this run's verdicts
    if cfg.backend:
        from workbench.transforms.backends import apply_backends, parse_backend_spec
        apply_backends(llm.model, parse_backend_spec(cfg.backend))
    hf = hf_model_like(llm, cfg.model)
    pool = bench_prompts(llm, max(cfg.num_prompts, batches[-1]), cfg.prompt_tokens, cfg.seed)
    ours, info = _sides(cfg, llm, names, batches[-1])
    sides = {**ours, "transformers": lambda ps: _run_hf(hf, ps, cfg.max_tokens)}
    for b in batches:                    # also where compile / capture happen (every batch bucket used)
        for _ in range(cfg.warmup):
            for name, fn in sides.items():
                if b == 1 or name not in SINGLE_STREAM:
                    fn(pool[:b])
    steps = sum(cfg.repeats * cfg.num_prompts * sum(b == 1 or n not in SINGLE_STREAM for n in sides) for b in batches)
    bar = tqdm(total=steps, desc="bench", unit="run", disable=not progress)
    head = {"model": cfg.model or "bundled", "device": str(llm.device), "device_name": device_name(llm.device),
            "dtype": str(llm.model.lm_head.weight.dtype).removeprefix("torch."), "threads": threads,
            "threads_policy": llm.thread_choice.as_dict(), "noise": probe.as_dict(),
            "torch": torch.__version__, "transformers": transformers.__version__, "config": asdict(cfg)}
    per_batch = {}
    for b in batches:
        groups = [[pool[(i + j) % len(pool)] for j in range(b)] for i in range(cfg.num_prompts)]
        run = {n: fn for n, fn in sides.items() if b == 1 or n not in SINGLE_STREAM}

        def save(raw, tokens, done, b=b, groups=groups):
            """The result so far (this batch size's groups measured until now, the sizes before it whole;
            no perplexity yet), for a time cap that stops the run (scripts/device_check.sh)."""
            try:
                part = {**per_batch, b: _batch_rows(llm, raw, tokens, groups[:done], info, ours)}
                res = _result(head, batches, part, {}, cfg.max_rel_ppl, llm, info["skipped"])
                save_partial({k: v for k, v in res.as_dict().items() if k != "raw"})
            except Exception as e:  # noqa: BLE001 - saving what there is must never stop the measuring
                print(f"bench: could not save the partial result: {type(e).__name__}: {e}", file=sys.stderr)

        raw, tokens = _measure(run, groups, cfg.repeats, threads, bar, on_group=save)
        per_batch[b] = _batch_rows(llm, raw, tokens, groups, info, ours)
    bar.close()
    quality = bench_quality(llm, info["models"], cfg.quality_windows)
    return _result(head, batches, per_batch, quality, cfg.max_rel_ppl, llm, info["skipped"])


def _measure(sides: dict, groups: list, repeats: int, threads: int, bar, on_group=None) -> tuple[dict, dict]:
    """Every side on every group of prompts, ``repeats`` times, interleaved (the order rotated after
    each group, so no side always follows the same one): raw rows and the first repeat's tokens.
    ``on_group(raw, tokens, groups_with_tokens)`` after each group every side has run."""
    raw = {k: [] for k in sides}
    tokens = {k: [] for k in sides}
    order = list(sides)
    for r in range(repeats):
        for i, group in enumerate(groups):
            for side in order:
                if torch.get_num_threads() != threads:
                    raise WorkbenchError(f"bench: torch threads changed from {threads} to "
                                         f"{torch.get_num_threads()} during the run")
                toks, ttft, dtps = sides[side](group)
                raw[side].append({"repeat": r, "prompt": i, "ttft_ms": ttft * 1e3, "decode_tokens_per_s": dtps})
                if r == 0:
                    tokens[side] += toks
                bar.update()
            order = order[1:] + order[:1]
            if on_group is not None:
                on_group(raw, tokens, i + 1 if r == 0 else len(groups))
    return raw, tokens
