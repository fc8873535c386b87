"""The physical tiered KV cache on real decode steps: quality, measured bytes, routing traffic.

::

    row = physical_eval(model, cfg, basis, split["evaluation"][:2], eval_tokens=64)
    predictor_comparison(model, cfg, basis, docs)        # predict none / step / layer / both (+ disk)
    tier_bench(model, tokenizer)                         # all of it, and the long-context projection

What :func:`physical_eval` runs, per evaluation window of N tokens (the evaluation half of
:func:`~workbench.bench.tier_eval.heldout_split`, as ``scripts/kv_tier_sweep.py``)::

    prefill    tokens 0 .. N-E-2 in ONE call through a fresh PhysicalTieredKVCache
               (inside tiered_attention(model)); then prefetcher.reset_stats()
    decode     tokens N-E-1 .. N-2, ONE per call: E real decode steps whose logits predict
               tokens N-E .. N-1 (the scored positions, as evaluate_config scores them)
    after      each step: cache.memory() - measured resident bytes per zone, the formula, staging
    check      the accounted TieredKVCache with the same calls: max |logit diff|, greedy agreement

Bytes are at the cache's dtype (float32 on a CPU): ``measured_bytes_per_token`` = mean over the
scored positions p of measured resident_kv(p+1) / (p+1) (PCA basis included);
``reduction_measured`` = full / measured; ``reduction_with_staging`` adds the staging buffers.
Routing counters are the prefetcher's own (decode steps only), per decode step;
``routed_bytes_per_step`` is what routing *needed* from the offload tier (the accounted
figure, rescaled from ``cfg.element_bytes`` to the cache dtype), next to
``bytes_moved_per_step`` (what the transport copied: demand fetches, predictions, wasted ones
and the cold summaries read back).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from workbench.bench.tier_eval import heldout_split, reference_logits
from workbench.bench.tier_projection import claim_8k_64k, long_context_projection, measure_components
from workbench.errors import ConfigError
from workbench.kv.pca import fit_pca_from_model
from workbench.kv.tier_config import TierConfig
from workbench.kv.tiers import TieredKVCache, tiered_attention
from workbench.kv.tiers_physical import PREDICTORS, PhysicalTieredKVCache, TierStore
from workbench.measure.gpu_results import save_partial
from workbench.measure.timing import sync

DEFAULT = TierConfig(window=32, rank=8, warm_tokens=64, chunk=16, block=16, budget=64, key_space="pre_rope")
CONFIGS = {"default": DEFAULT, "no-routing": DEFAULT.replace(budget=None),
           "int8": DEFAULT.replace(value_format="int8")}
_COUNTERS = ("uses", "hits", "demand", "predicted", "fetches", "reused", "wasted", "wasted_bytes", "bytes")


def named_config(spec: str) -> TierConfig:
    """A name of :data:`CONFIGS`, or ``field=value,...`` over the default config."""
    if spec in CONFIGS:
        return CONFIGS[spec]
    if "=" not in spec:
        raise ConfigError(f"unknown tier config {spec!r}; use one of {', '.join(CONFIGS)} or "
                          "field=value,... over 'default' (e.g. window=64,budget=None)")
    fields = {}
    for item in spec.split(","):
        key, _, val = item.partition("=")
        key = key.strip()
        if key not in TierConfig.__dataclass_fields__:
            raise ConfigError(f"tier config {spec!r}: TierConfig has no field {key!r}")
        val = val.strip()
        fields[key] = None if val == "None" else int(val) if val.lstrip("-").isdigit() else val
    return DEFAULT.replace(**fields)


def _check_windows(sequences, eval_tokens: int) -> None:
    if not sequences:
        raise ConfigError("physical_eval: no evaluation sequences")
    n = min(len(s) for s in sequences)
    if not 1 <= eval_tokens <= n - 2:
        raise ConfigError(f"eval_tokens must be in [1, {n - 2}] for {n}-token windows (at least one "
                          f"prefill token), got {eval_tokens}")


@torch.no_grad()
def _run(model, cache, ids, P: int, E: int, on_step=None) -> torch.Tensor:
    """Prefill ids[:P] in one call, reset the prefetcher's counters (physical cache), then decode
    P .. P+E-1 one token per call; the decode logits [E, V]."""
    with tiered_attention(model):
        model(ids[:, :P], cache=cache, logits_to_keep=1)
        if on_step is not None:
            on_step(None)
        out = []
        for p in range(P, P + E):
            out.append(model(ids[:, p:p + 1], start_pos=p, cache=cache)[0, -1].float())
            if on_step is not None:
                on_step(p)
    return torch.stack(out)


@dataclass
class _Tally:
    """What :func:`physical_eval` sums over its documents: the scores, the byte series per decode
    step (measured resident, formula, full, staging, resident with staging, one layer's working
    set), the prefetcher's counters and the check against the accounted cache."""

    nll_t: float = 0.0
    nll_f: float = 0.0
    kl: float = 0.0
    agree: float = 0.0
    dnll: list = field(default_factory=list)
    bpt: list = field(default_factory=list)
    fpt: list = field(default_factory=list)
    full_pt: list = field(default_factory=list)
    stag: list = field(default_factory=list)
    with_stag: list = field(default_factory=list)
    work: list = field(default_factory=list)
    totals: dict = field(default_factory=lambda: dict.fromkeys(_COUNTERS, 0))
    stall: float = 0.0
    routed: float = 0.0
    routed_acc: float = 0.0
    offloaded: list = field(default_factory=list)
    steps: int = 0
    max_diff: float = 0.0
    greedy_same: bool = True
    components: dict | None = None
    decode_s: float = 0.0


def _physical_pass(model, cfg: TierConfig, basis, store: TierStore, ids, P: int, E: int, t: _Tally) -> torch.Tensor:
    """One document through a fresh :class:`PhysicalTieredKVCache`: the prefill, then ``E`` decode
    steps, each followed by ``cache.memory()`` into ``t``'s byte series; the prefetcher's counters,
    the routed bytes and the decode time (without the ``memory()`` calls) into ``t``.  The decode
    logits [E, V]."""
    dev, dt = model.device, model.lm_head.weight.dtype
    cache = PhysicalTieredKVCache(model.config, cfg, basis, store=store, max_len=ids.shape[1], device=dev, dtype=dt)
    try:
        mark = {}

        def on_step(p):
            if p is None:
                # the prefill's work is done before the decode counters and clock start: its
                # copies' events are resolved into the stats being dropped, its tail is not
                # charged to the first decode step (a CUDA call returns before the GPU is done)
                sync(dev)
                cache.prefetcher.reset_stats()
                mark["routed"], mark["t"] = cache.routed_bytes, time.perf_counter()
                return
            t_mem = time.perf_counter()
            m = cache.memory()
            mark["memory_s"] = mark.get("memory_s", 0.0) + time.perf_counter() - t_mem   # not decode time
            t.bpt.append(m["resident_kv"] / (p + 1))
            t.fpt.append(m["formula_kv"] / (p + 1))
            t.full_pt.append(m["full"] / (p + 1))
            t.stag.append(m["measured"]["staging"])
            t.with_stag.append((m["resident_kv"] + m["measured"]["staging"]) / (p + 1))
            t.work.append(m["working_one_layer"])

        logits = _run(model, cache, ids, P, E, on_step)
        sync(dev)                                   # the last decode step's tail belongs to decode
        t.decode_s += time.perf_counter() - mark["t"] - mark.get("memory_s", 0.0)
        st = cache.prefetcher.stats()
        for k in _COUNTERS:
            t.totals[k] += st[k] or 0
        t.stall += st["stall_s"]
        t.routed += cache.routed_bytes - mark["routed"]
        t.steps += E
        t.offloaded.append(cache.memory()["offloaded"])
        t.components = measure_components(cache)
    finally:
        cache.release()
    return logits


def _accounted_check(model, cfg: TierConfig, basis, ids, P: int, E: int, logits, t: _Tally) -> None:
    """The accounted :class:`TieredKVCache` on the same calls as the physical pass (its decode
    ``logits``): the largest |logit difference|, greedy agreement and the routed bytes it
    accounts, into ``t``."""
    acc = TieredKVCache(model.config, cfg, basis, max_len=ids.shape[1], device=model.device,
                        dtype=model.lm_head.weight.dtype)
    acc_logits = _run(model, acc, ids, P, E)
    t.max_diff = max(t.max_diff, float((acc_logits - logits).abs().max()))
    t.greedy_same &= bool((acc_logits.argmax(-1) == logits.argmax(-1)).all())
    t.routed_acc += float(acc.fetched_bytes_by_pos[P:P + E].sum())
    del acc


def _score(logits, ref, ids, P: int, E: int, t: _Tally) -> None:
    """The tiered decode ``logits`` against the full cache's (``ref``) on the scored positions:
    both NLLs, the per-token NLL difference, KL(full || tiered) and top-1 agreement, into ``t``."""
    targets = ids[0, P + 1:P + 1 + E]
    lp_t, lp_f = torch.log_softmax(logits, -1), torch.log_softmax(ref[P:P + E].float(), -1)
    tok_t, tok_f = -lp_t.gather(1, targets[:, None])[:, 0], -lp_f.gather(1, targets[:, None])[:, 0]
    t.nll_t, t.nll_f = t.nll_t + float(tok_t.sum()), t.nll_f + float(tok_f.sum())
    t.dnll.append((tok_t - tok_f).double().cpu())
    t.kl += float((lp_f.exp() * (lp_f - lp_t)).sum())
    t.agree += float((lp_t.argmax(-1) == lp_f.argmax(-1)).sum())


def _physical_row(cfg: TierConfig, store: TierStore, dt, docs: int, eval_tokens: int, check_accounted: bool,
                  t: _Tally, t0: float) -> dict:
    """:func:`physical_eval`'s result from its tally: per decode step, per token and the ratios
    (the keys the module docstring describes)."""
    es = torch.empty((), dtype=dt).element_size()
    n = t.steps
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    ppl, ppl_full = math.exp(t.nll_t / n), math.exp(t.nll_f / n)
    d = torch.cat(t.dnll)
    se = float(d.std() / math.sqrt(d.numel())) if d.numel() > 1 else float("nan")
    rescale = es / cfg.element_bytes        # routed bytes are counted at cfg.element_bytes
    meas, form, full = mean(t.bpt), mean(t.fpt), mean(t.full_pt)
    totals = t.totals
    return {"kind": "measurement", "config": cfg.name, "store": store.name, "offload": store.offload,
            "predict": store.predict, "docs": docs, "eval_tokens": eval_tokens, "scored_tokens": n,
            "decode_steps": n, "dtype": str(dt).replace("torch.", ""), "element_bytes": es,
            "ppl": ppl, "ppl_full": ppl_full, "rel_ppl": ppl / ppl_full - 1, "rel_ppl_se": (ppl / ppl_full) * se,
            "kl": t.kl / n, "top1": t.agree / n,
            "measured_bytes_per_token": meas, "formula_bytes_per_token": form, "measured_vs_formula": meas / form,
            "measured_vs_formula_max_dev": max(abs(b / f - 1) for b, f in zip(t.bpt, t.fpt)),
            "full_bytes_per_token": full, "reduction_measured": full / meas,
            "staging_bytes_mean": mean(t.stag), "staging_bytes_max": max(t.stag),
            "reduction_with_staging": full / mean(t.with_stag), "working_one_layer_max": max(t.work),
            "prefetch_hit_rate": totals["hits"] / totals["uses"] if totals["uses"] else None,
            "stall_ms_per_step": 1e3 * t.stall / n, "bytes_moved_per_step": totals["bytes"] / n,
            "routed_bytes_per_step": t.routed * rescale / n,
            "wasted_bytes_per_step": totals["wasted_bytes"] / n, **totals,
            "offloaded_bytes": mean(t.offloaded), "decode_ms_per_step": 1e3 * t.decode_s / n,
            "max_abs_diff_vs_accounted": t.max_diff if check_accounted else None,
            "greedy_identical": t.greedy_same if check_accounted else None,
            "routed_bytes_per_step_accounted": t.routed_acc * rescale / n if check_accounted else None,
            "components": t.components, "seconds": time.perf_counter() - t0}


def physical_eval(model, cfg: TierConfig, basis, sequences, eval_tokens: int = 256, store: TierStore | None = None,
                  reference=None, check_accounted: bool = True, bar=None) -> dict:
    """Quality, measured bytes and routing traffic of ``cfg`` on real decode steps through a
    :class:`PhysicalTieredKVCache` (see the module docstring); one dict of plain data.  ``bar``:
    a progress bar (:class:`workbench.lab.progress.Progress`: ``total``, ``start(name)``,
    ``advance()``); its total is set to the passes here (per document: physical, then accounted)."""
    store = store or TierStore()
    _check_windows(sequences, eval_tokens)
    if reference is None:
        reference = reference_logits(model, sequences)
    t = _Tally()
    t0 = time.perf_counter()
    passes = 2 if check_accounted else 1
    if bar is not None:
        bar.total = passes * len(sequences)
    for d, (seq, ref) in enumerate(zip(sequences, reference)):
        N, E = len(seq), eval_tokens
        if bar is not None:
            bar.start(f"document {d + 1}/{len(sequences)}: physical cache, {E} decode steps of one token")
        P = N - E - 1
        ids = torch.as_tensor(list(seq), dtype=torch.long, device=model.device)[None]
        logits = _physical_pass(model, cfg, basis, store, ids, P, E, t)
        if bar is not None:
            bar.advance()
        if check_accounted:
            if bar is not None:
                bar.start(f"document {d + 1}/{len(sequences)}: the accounted cache on the same calls")
            _accounted_check(model, cfg, basis, ids, P, E, logits, t)
            if bar is not None:
                bar.advance()
        _score(logits, ref, ids, P, E, t)
    return _physical_row(cfg, store, model.lm_head.weight.dtype, len(sequences), eval_tokens, check_accounted, t, t0)


PREDICTOR_FIELDS = ("prefetch_hit_rate", "stall_ms_per_step", "bytes_moved_per_step", "routed_bytes_per_step",
                    "wasted", "wasted_bytes_per_step", "demand", "predicted", "reused", "staging_bytes_mean",
                    "staging_bytes_max", "reduction_with_staging", "decode_ms_per_step")


def predictor_comparison(model, cfg: TierConfig, basis, sequences, eval_tokens: int = 256, reference=None,
                         offload: str = "host", predictors=PREDICTORS, disk: bool = True, check_accounted=False,
                         known: dict | None = None, progress=None) -> dict:
    """The same config and documents with each predictor (``TierStore.predict``) over ``offload``,
    plus one run with the other offload tier (the disk transport: O_DIRECT file) at the first
    predictor that keeps staging ("step" if present).  A transport that fails is a row with
    ``error`` set.  ``known``: ``physical_eval`` results already run on the same config and
    documents, by (offload, predict), reused instead of run again."""
    if reference is None:
        reference = reference_logits(model, sequences)
    rows = []
    runs = [TierStore(offload=offload, predict=p) for p in predictors]
    if disk:
        other = "disk" if offload == "host" else "host"
        runs.append(TierStore(offload=other, predict="step" if "step" in predictors else predictors[0]))
    for store in runs:
        row = {"offload": store.offload, "predict": store.predict, "error": None}
        try:
            r = (known or {}).get((store.offload, store.predict))
            if r is None:
                r = physical_eval(model, cfg, basis, sequences, eval_tokens, store, reference, check_accounted)
            row.update({k: r[k] for k in PREDICTOR_FIELDS}, seconds=r["seconds"], top1=r["top1"],
                       rel_ppl=r["rel_ppl"], greedy_identical=r["greedy_identical"])
        except (OSError, RuntimeError, ConfigError) as e:
            if store.offload == offload:
                raise                                 # only the other transport may be unavailable here
            row["error"] = f"{type(e).__name__}: {e}"
        rows.append(row)
        if progress:
            progress(f"predictor {store.name}: " + (row["error"] or f"{row['stall_ms_per_step']:.2f} ms stall/step"))
    same = {r["rel_ppl"] for r in rows if r["error"] is None}
    return {"config": cfg.name, "docs": len(sequences), "eval_tokens": eval_tokens, "rows": rows,
            "same_quality": len(same) <= 1}


def tier_bench(model, tokenizer, docs: int = 2, eval_tokens: int = 64, configs=None, offload: str = "host",
               predict: str = "step", calibration_docs: int = 2, context: int | None = None, compare: bool = True,
               check_accounted: bool = True, presets=("llama-3.2-1b", "llama-3-8b", "llama-2-7b"),
               lengths=(8192, 32768, 65536), progress=None) -> dict:
    """Everything ``workbench tier-bench`` prints: one :func:`physical_eval` row per config, the
    predictor comparison on the first config, its long-context projection and the claim's verdict."""
    t0 = time.perf_counter()
    say = progress or (lambda msg: None)
    configs = [CONFIGS["default"], CONFIGS["no-routing"], CONFIGS["int8"]] if configs is None else list(configs)
    if not configs:
        raise ConfigError("tier_bench: no configs")
    store = TierStore(offload=offload, predict=predict)
    if docs < 1 or calibration_docs < 1:
        raise ConfigError(f"docs and calibration docs must be >= 1, got {docs} and {calibration_docs}")
    context = context or model.config.max_position_embeddings
    split = heldout_split(tokenizer, context=context)
    evaluation = split["evaluation"][:docs]
    if len(evaluation) < docs or len(split["calibration"]) < calibration_docs:
        raise ConfigError(f"the held-out split has {len(split['evaluation'])} evaluation and "
                          f"{len(split['calibration'])} calibration documents of >= {context} tokens")
    _check_windows(evaluation, eval_tokens)
    spaces = sorted({c.key_space for c in configs if c.has_warm})
    say(f"PCA bases ({', '.join(spaces) or 'none'}) on {calibration_docs} calibration docs")
    bases = {ks: fit_pca_from_model(model, split["calibration"][:calibration_docs], key_space=ks,
                                    source="heldout_split calibration") for ks in spaces}
    reference = reference_logits(model, evaluation)
    c = model.config
    head = {"model": {"layers": c.num_hidden_layers, "kv_heads": c.num_key_value_heads, "head_dim": c.head_dim,
                      "context": context, "device": str(model.device)},
            "docs": split["evaluation_docs"][:docs], "calibration_docs": split["calibration_docs"][:calibration_docs],
            "eval_tokens": eval_tokens, "threads": torch.get_num_threads(), "store": store.name}
    rows = []
    for cfg in configs:
        r = physical_eval(model, cfg, bases.get(cfg.key_space), evaluation, eval_tokens, store, reference,
                          check_accounted)
        rows.append(r)
        save_partial({**head, "rows": rows})            # the device check keeps it if its time cap stops the run
        say(f"{cfg.name}: rel ppl {100 * r['rel_ppl']:+.2f}%, {r['reduction_measured']:.2f}x ({r['seconds']:.0f} s)")
    first, base = configs[0], bases.get(configs[0].key_space)
    preds = (predictor_comparison(model, first, base, evaluation, eval_tokens, reference, offload,
                                  known={(offload, predict): rows[0]}, progress=say) if compare else None)
    save_partial({**head, "rows": rows, "predictors": preds})
    claim = None
    try:
        projection = long_context_projection(rows[0], first, presets=presets, lengths=lengths)
    except ConfigError as e:                          # a zone the config needs was empty when measured
        projection = {"kind": "projection", "error": str(e)}
    if "rows" in projection and "llama-2-7b" in presets and {8192, 65536} <= set(lengths):
        claim = claim_8k_64k(projection, measured=rows[0])
    return {"model": {"layers": c.num_hidden_layers, "kv_heads": c.num_key_value_heads, "head_dim": c.head_dim,
                      "context": context, "dtype": rows[0]["dtype"], "device": str(model.device)},
            "docs": split["evaluation_docs"][:docs], "calibration_docs": split["calibration_docs"][:calibration_docs],
            "eval_tokens": eval_tokens, "threads": torch.get_num_threads(), "store": store.name, "rows": rows,
            "predictors": preds, "projection": projection, "claim": claim, "seconds": time.perf_counter() - t0}
