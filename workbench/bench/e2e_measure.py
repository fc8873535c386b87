"""One end-to-end run measured: a replay as a row of metrics, the KV and weight bytes it held, and
quality against the unchanged model.

* :func:`run_row` - TTFT / TPOT / E2E (P50, P95, jitter = :func:`workbench.engine.metrics.jitter`),
  P95 TTFT per kind of request, throughput, prefix hit rate and miss reasons, preemptions;
* :class:`KVSampler` - KV bytes sampled after every engine step: the live contiguous caches'
  storages, the physical tiers' resident zones, the blocks in use; :meth:`KVSampler.held_bytes`;
* :func:`weights_bytes` - resident weight bytes (quantized layers as stored, streamed weights'
  resident set);
* :func:`scored_logprobs` / :func:`numerics_quality` - perplexity change (paired, with its
  standard error), KL and top-1 agreement on held-out windows, plain or through a tiered cache.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from workbench.bench.e2e_workload import KINDS, Workload
from workbench.engine.metrics import jitter
from workbench.kv.tier_config import TierConfig
from workbench.measure.memory import storage_bytes


def _pct(values, q: float):
    v = [x for x in values if x is not None]
    return float(np.percentile(v, q)) if v else None


def rss_bytes() -> int | None:
    """This process's resident set now (Linux /proc; None elsewhere): every engine of the run counts."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


class KVSampler:
    """Measured KV bytes while a replay runs, sampled after every engine step (the step is wrapped
    for the duration): the live contiguous caches' storages, the physical tiers' resident zones
    (:func:`workbench.engine.modes.kv_memory`), and the blocks in use (any mode, full precision)."""

    def __init__(self, engine) -> None:
        self.engine, self.peak, self.peak_used = engine, 0, 0
        step = engine.step

        def sampled_step():
            events = step()
            self.sample()
            return events

        engine.step = sampled_step

    def sample(self) -> None:
        from workbench.engine.modes import kv_memory

        e = self.engine
        self.peak_used = max(self.peak_used, e.pool.manager.num_used_blocks * e.pool.layout.bytes_per_block)
        if e.kv_mode == "tiered":
            mem = kv_memory(e)
            live = mem["resident_kv"] + mem["measured"]["staging"] if mem else 0
        elif e.kv_mode == "contiguous" and not e.static_decode:
            seen: set = set()
            live = sum(storage_bytes([*c.k, *c.v], seen) for c in list(e.active_caches.values()))
        else:
            live = 0
        self.peak = max(self.peak, live)

    def remove(self) -> None:
        del self.engine.step

    def held_bytes(self) -> int:
        """The KV memory this configuration holds: the paged pool's tensors (allocated up front),
        the static decode buffers, or the peak of the per-sequence caches."""
        e = self.engine
        if e.kv_mode == "paged":
            return e.pool.nbytes()
        if e.static_decode:
            kv = e.runner.decoder.kv
            return storage_bytes([*kv.k, *kv.v])
        return self.peak


def run_row(res, workload: Workload) -> dict:
    """One replay as a row of metrics (ms; P50 / P95 over requests, ITL over every gap, jitter =
    :func:`workbench.engine.metrics.jitter`), P95 TTFT per kind of request, throughput, the prefix
    hit rate over prompt tokens, preemptions, mean batch and steps."""
    outs = res.outputs
    m = [o.metrics for o in outs]
    ttft = [x.ttft * 1e3 if x.ttft is not None else None for x in m]
    tpot = [x.tpot * 1e3 if x.tpot is not None else None for x in m]
    e2e = [x.e2e * 1e3 if x.e2e is not None else None for x in m]
    itl = [g * 1e3 for x in m for g in x.itl]
    row = {"requests": len(outs), "finished": sum(o.finish_reason in ("length", "stop") for o in outs),
           "ttft_ms_p50": _pct(ttft, 50), "ttft_ms_p95": _pct(ttft, 95), "tpot_ms_p50": _pct(tpot, 50),
           "tpot_ms_p95": _pct(tpot, 95), "e2e_ms_p50": _pct(e2e, 50), "e2e_ms_p95": _pct(e2e, 95),
           "itl_ms_p95": _pct(itl, 95), "ttft_jitter_ms": jitter(ttft), "tpot_jitter_ms": jitter(tpot),
           "itl_jitter_ms": jitter(itl), "e2e_jitter_ms": jitter(e2e)}
    for kind in KINDS:
        row[f"ttft_ms_p95_{kind}"] = _pct([t for t, i in zip(ttft, workload.info) if i["kind"] == kind], 95)
    prompt = sum(len(o.prompt_token_ids) for o in outs)
    misses: dict[str, int] = {}
    for o in outs:
        if o.prefix_miss_reason is not None:
            misses[o.prefix_miss_reason] = misses.get(o.prefix_miss_reason, 0) + 1
    busy = res.steps[res.steps["num_seqs"] > 0] if res.steps is not None else None
    row.update(tokens_per_s=res.tokens_per_s, requests_per_s=len(outs) / res.wall_s, wall_s=res.wall_s,
               prefix_hit_rate=sum(o.num_cached_tokens for o in outs) / prompt if prompt else 0.0,
               preemptions=int(res.steps["preempted"].sum()) if busy is not None else 0,
               mean_batch=float(busy["num_seqs"].mean()) if busy is not None and len(busy) else None,
               steps=len(busy) if busy is not None else 0, miss_reasons=misses)
    return row


def weights_bytes(engine) -> int:
    """Resident weight bytes: the streamer's resident set when weights stream, else every parameter
    and buffer storage once (quantized layers as stored; :func:`workbench.quant.apply.weight_bytes`)."""
    if engine.weight_streamer is not None:
        return int(engine.weight_streamer.memory()["resident_bytes"])
    from workbench.quant.apply import weight_bytes

    return int(weight_bytes(engine.model)["total"])


def close_engine(engine) -> None:
    engine.pool.close()                            # offload tiers: worker threads, files
    if engine.tier_prefetcher is not None:
        engine.tier_prefetcher.close()


# ---- quality against the unchanged model ----------------------------------------------------------

@torch.inference_mode()
def scored_logprobs(model, seq, n_scored: int, tiers: TierConfig | None = None, basis=None) -> torch.Tensor:
    """Log-probabilities [E, V] (float32) predicting the last ``E = min(n_scored, len - 1)`` tokens
    of ``seq``, teacher-forced: plain causal attention, or through a tiered cache
    (:func:`workbench.bench.tier_eval.tiered_logits`, the accounted cache, bit-identical to the
    physical one the engine runs)."""
    n = len(seq)
    e = min(n_scored, n - 1)
    if tiers is not None:
        from workbench.bench.tier_eval import tiered_logits

        logits = tiered_logits(model, tiers, basis, seq, keep_from=n - e - 1)[0][:-1]
    else:
        ids = torch.as_tensor(list(seq), dtype=torch.long, device=model.lm_head.weight.device)[None]
        logits = model(ids)[0, n - e - 1:n - 1]
    return torch.log_softmax(logits.float(), -1)


def numerics_quality(model, windows, ref_logprobs, n_scored: int, tiers=None, basis=None) -> dict:
    """Perplexity change (paired per-token, with its standard error), mean KL(ref || this) in nats
    and top-1 agreement of ``model`` (optionally through ``tiers``) against ``ref_logprobs``
    (:func:`scored_logprobs` of the unchanged model on the same ``windows``)."""
    from workbench.quant.quality import paired_stats

    nll, nll_ref, kl, agree = [], [], [], []
    for seq, ref in zip(windows, ref_logprobs):
        lp = scored_logprobs(model, seq, n_scored, tiers, basis).to(ref.device)
        tgt = torch.as_tensor(list(seq)[len(seq) - lp.shape[0]:], device=ref.device)
        nll.append(-lp.gather(1, tgt[:, None])[:, 0].double())
        nll_ref.append(-ref.gather(1, tgt[:, None])[:, 0].double())
        kl.append((ref.exp() * (ref - lp)).sum(-1).double())
        agree.append((lp.argmax(-1) == ref.argmax(-1)).double())
    st = paired_stats(torch.cat(nll), torch.cat(nll_ref))
    return {"ppl": st["ppl"], "rel_ppl": st["rel_ppl"], "rel_ppl_se": st["rel_ppl_se"],
            "kl": float(torch.cat(kl).mean()), "top1_agreement": float(torch.cat(agree).mean()), "scored": st["tokens"]}
