"""Measure the quantization layer: quality of every recipe on the bundled model, and the
memory and CPU decode speed of the quantized formats at a real model's shape.

::

    quality_rows(["fp32", "bf16", "w8a16", "w4a16:g128", "w4a16:g128:awq"], docs=4)
    preset_rows("llama-3.2-1b", ["fp32", "bf16", "w8a16", "w4a16:g128"], decode_steps=8)
    quant_bench(...)                    # both, plus torch's CPU ops at one layer, as one result dict

**Quality** (:func:`quality_rows`), one row per recipe, all on the same tokens in one run:

* evaluation: the first ``context`` tokens of the evaluation half of the held-out corpus
  (:func:`~workbench.bench.tier_eval.heldout_split`), every next-token prediction scored;
* calibration (AWQ, GPTQ, SmoothQuant): the *other* half, never an evaluation token;
* ``ppl`` = exp(mean NLL); ``rel_ppl`` = ppl / ppl(fp32) - 1; ``rel_ppl_se`` its standard error
  from the paired per-token NLL differences (tokens of one document are correlated: read it as a
  lower bound on the noise); ``kl`` = mean KL(fp32 || recipe) in nats; ``top1`` = share of
  positions whose argmax agrees with fp32;
* ``fp32`` is the reference; ``bf16`` is the whole model cast to bfloat16 (weights and
  activations); the quantized recipes keep fp32 activations (A16 = the model's dtype, fp32 on
  a CPU), and W4A8 / W8A8 round them per token to int8;
* the quantized models compute with the reference backend (dequantize, then matmul: the
  definition), so quality does not depend on which kernel runs.

**Memory and speed** (:func:`preset_rows`): random weights with a preset's shapes (memory and
latency only; no quality), each variant loaded on its own: resident bytes of the linear layers
and of everything (embedding included), and single-sequence decode milliseconds per token on
this CPU, the quantized layers through torch's packed CPU ops (``set_quant_backend("cpu")``;
layers without an op run the reference, and the row says how many).
"""

from __future__ import annotations

import gc
import math
import os
import statistics
import time
import traceback

import torch

from workbench.errors import ConfigError
from workbench.quant.quality import paired_stats, perplexity, token_nll as _nll  # noqa: F401 - perplexity: this module's API too

DEFAULT_RECIPES = ("fp32", "bf16", "w8a16", "w4a16:pt", "w4a16:pc", "w4a16:g32", "w4a16:g64", "w4a16:g128",
                   "w4a16:g128:awq", "w4a16:g128:gptq", "w4a8", "w8a8", "w8a8:smooth=0.5")
PLAIN = ("fp32", "bf16")
# (recipe, baseline) pairs compared token by token (quality_rows' "comparisons")
PAIRS = (("w4a16:pc", "w4a16:pt"), ("w4a16:g128", "w4a16:pc"), ("w4a16:g128:awq", "w4a16:g128"),
         ("w4a16:g128:gptq", "w4a16:g128"), ("w4a16:g128:gptq", "w4a16:g128:awq"), ("w4a8", "w4a16:pc"),
         ("w8a8", "w8a16"), ("w8a8:smooth=0.5", "w8a8"))


def _load(recipe: str, calibration):
    from workbench.model.loader import load_model
    from workbench.quant.apply import quantize_model

    model = load_model(device="cpu").eval()
    if recipe == "bf16":
        model = model.to(torch.bfloat16)
    elif recipe != "fp32":
        quantize_model(model, recipe, calibration=calibration)
    return model


def quality_rows(recipes=DEFAULT_RECIPES, docs: int = 4, calibration_docs: int = 8, context: int = 256,
                 progress=None) -> dict:
    """One row per recipe (see the module docstring); a recipe that fails is a row with its
    ``error`` and the others still run."""
    import workbench
    from workbench.bench.tier_eval import heldout_split
    from workbench.quant.apply import weight_bytes
    from workbench.quant.recipe import QuantRecipe

    tok = workbench.Tokenizer(workbench.BUNDLED_MODEL)
    split = heldout_split(tok, context)
    ev, cal = split["evaluation"][:docs], split["calibration"][:calibration_docs]
    if not ev:
        raise ConfigError(f"quality_rows: no held-out document has {context} tokens")
    t0 = time.perf_counter()
    ref = _load("fp32", None)
    nll_ref, logp_ref = _nll(ref, ev)
    lin_fp32 = plain_linear_bytes(ref)
    del ref
    rows, nlls = [], {}
    for spec in recipes:
        if progress:
            progress(f"quality: {spec}")
        row: dict = {"recipe": spec}
        try:
            name = spec if spec in PLAIN else QuantRecipe.parse(spec).name
            t = time.perf_counter()
            model = _load(spec, cal)
            row["prepare_s"] = time.perf_counter() - t
            nll, logp = _nll(model, ev)
            nlls[spec] = nll
            st = paired_stats(nll, nll_ref)
            kl = sum(float((lr.exp() * (lr - lq)).sum()) for lr, lq in zip(logp_ref, logp)) / st["tokens"]
            top1 = sum(int((lr.argmax(-1) == lq.argmax(-1)).sum()) for lr, lq in zip(logp_ref, logp)) / st["tokens"]
            lin = plain_linear_bytes(model) if spec in PLAIN else weight_bytes(model)["quantized_linears"]
            row.update(name=name, **st, kl=kl, top1=top1, linear_bytes=lin, linear_vs_bf16=lin / (lin_fp32 / 2),
                       calibration=getattr(model, "quant_calibration", None), error=None)
            del model
        except Exception as e:                      # a failed point is recorded, the sweep goes on
            row.update(name=spec, error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc(limit=3))
        gc.collect()
        rows.append(row)
    comparisons = []
    for a, b in PAIRS:                          # paired on the same tokens: far less noise than two rows vs fp32
        if a in nlls and b in nlls:
            st = paired_stats(nlls[a], nlls[b])
            comparisons.append({"recipe": a, "baseline": b, "ppl_ratio": st["ppl"] / math.exp(float(nlls[b].mean())),
                                "rel_ppl": st["rel_ppl"], "rel_ppl_se": st["rel_ppl_se"]})
    return {"context": context, "docs": split["evaluation_docs"][:docs], "calibration_docs": len(cal),
            "ppl_fp32": math.exp(float(nll_ref.mean())), "tokens": int(nll_ref.numel()), "rows": rows,
            "comparisons": comparisons,
            "seconds": time.perf_counter() - t0,
            "activations": "fp32 (this CPU) for A16 recipes; bf16 row: the whole model in bfloat16"}


def plain_linear_bytes(model) -> int:
    """Bytes of the ``nn.Linear`` weights and biases a recipe would quantize (all but the LM head)."""
    return sum(t.numel() * t.element_size() for n, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) and not n.endswith("lm_head")
               for t in (m.weight, m.bias) if t is not None)


def preset_rows(preset: str = "llama-3.2-1b", variants=("fp32", "bf16", "w8a16", "w4a16:g128", "w8a8"),
                decode_steps: int = 8, prompt_len: int = 16, backend: str = "auto", progress=None) -> dict:
    """Resident weight bytes and CPU decode ms/token per variant at ``preset``'s shape (random
    weights), each variant loaded alone (peak memory: one fp32 copy plus its quantized form)."""
    from workbench.model.loader import load_model
    from workbench.quant.apply import quantize_model, set_quant_backend, weight_bytes
    from workbench.quant.costs import decode_step_ms

    rows = []
    for spec in variants:
        if progress:
            progress(f"{preset}: {spec}")
        row: dict = {"variant": spec}
        try:
            t = time.perf_counter()
            model = load_model(f"preset:{preset}", device="cpu", dtype=torch.float32).eval()
            if spec == "bf16":
                model = model.to(torch.bfloat16)
            placement = None
            if spec not in PLAIN:
                quantize_model(model, spec)
                placement = set_quant_backend(model, backend)
            row["load_s"] = time.perf_counter() - t
            wb = weight_bytes(model)
            if spec in PLAIN:
                lin = plain_linear_bytes(model)
                wb = {"quantized_linears": lin, "other": wb["total"] - lin, "total": wb["total"]}
            ms = decode_step_ms(model, steps=decode_steps, prompt_len=prompt_len)
            med = statistics.median(ms)
            extra = (placement or {}).get("extra_bytes", 0)      # the backend's own copies (torch's int4 CPU op)
            row.update(linear_bytes=wb["quantized_linears"], other_bytes=wb["other"], op_copy_bytes=extra,
                       total_bytes=wb["total"] + extra,
                       ms_per_token=med, ms_min=min(ms), ms_max=max(ms), tokens_per_s=1e3 / med,
                       placement=placement, error=None)
            del model
        except Exception as e:
            row.update(error=f"{type(e).__name__}: {e}")
        gc.collect()
        rows.append(row)
    by = {r["variant"]: r for r in rows if not r.get("error")}
    base = by.get("bf16")
    for r in rows:
        if base and not r.get("error"):
            r["linear_vs_bf16"] = r["linear_bytes"] / base["linear_bytes"]
            r["total_vs_bf16"] = r["total_bytes"] / base["total_bytes"]
    return {"preset": preset, "prompt_len": prompt_len, "decode_steps": decode_steps, "backend": backend,
            "threads": torch.get_num_threads(), "cpu_count": os.cpu_count(), "rows": rows,
            "note": "random weights: memory and latency only"}


def _beyond(diff: float, se: float, k: float = 2.0) -> bool:
    return abs(diff) > k * se


def claim_verdicts(quality: dict | None = None, preset: dict | None = None, gpu_rows: list[dict] | None = None,
                   gpu_where: str = "latest committed table") -> list[dict]:
    """The source articles' quantization claims against this run's measurements, one row each:
    ``claim``, ``measured`` (text), ``verdict`` ("supported" / "not supported" / "within noise" /
    "not measured here").  A difference counts only beyond 2 standard errors (quality: the
    paired standard error of the two recipes over the same tokens) or beyond the spread of the timed runs (speed:
    the slower side's best run must exceed the faster side's worst).  ``gpu_where`` says where
    ``gpu_rows`` come from (the latest committed table, or "measured in this run")."""
    out = []
    rows = {r["recipe"]: r for r in (quality or {}).get("rows", []) if not r.get("error")}
    pt, pc = rows.get("w4a16:pt"), rows.get("w4a16:pc")
    claim = ("W4A16 with one scale per output channel recovers most of the INT4 loss "
             "(article: C-Eval 62.3 per-tensor -> 68.7 per-channel, FP16 69.6)")
    if pt and pc:
        # in perplexity units: the loss per-tensor adds (vs fp32) and the part per-channel takes back
        # (paired pc / pt over the same tokens); "most" = over half, beyond 2 se on both ends
        c = next((c for c in (quality or {}).get("comparisons", [])
                  if (c["recipe"], c["baseline"]) == ("w4a16:pc", "w4a16:pt")), None)
        ppl_fp = pt["ppl"] / (1 + pt["rel_ppl"])
        loss, loss_se = pt["ppl"] - ppl_fp, pt["rel_ppl_se"] * ppl_fp
        if c:
            gain, gain_se = -c["rel_ppl"] * pt["ppl"], c["rel_ppl_se"] * pt["ppl"]
        else:
            gain, gain_se = pt["ppl"] - pc["ppl"], math.hypot(pt["rel_ppl_se"], pc["rel_ppl_se"]) * ppl_fp
        recovered = gain / loss if loss > 0 else float("nan")
        if gain - 2 * gain_se > 0.5 * (loss + 2 * loss_se):
            verdict = "supported"
        elif gain + 2 * gain_se < 0.5 * max(loss - 2 * loss_se, 0.0):
            verdict = "not supported"
        else:
            verdict = "within noise"
        out.append({"claim": claim, "verdict": verdict,
                    "measured": f"per-tensor adds {loss:.3f} +-{loss_se:.3f} perplexity to fp32's {ppl_fp:.3f}; "
                                f"per-channel takes back {gain:.3f} +-{gain_se:.3f} (paired over the same tokens): "
                                f"{100 * recovered:.0f}% recovered; supported needs over half beyond 2 se"})
    else:
        out.append({"claim": claim, "verdict": "not measured here", "measured": "needs rows w4a16:pt and w4a16:pc"})
    pairs = {(c["recipe"], c["baseline"]): c for c in (quality or {}).get("comparisons", [])}
    for spec, label, anchor in (("w4a16:g128:awq", "AWQ", "AWQ paper, Llama-2-7B g128: 5.60 vs 5.73"),
                                ("w4a16:g128:gptq", "GPTQ", "GPTQ paper: below RTN at 4 bits")):
        c = pairs.get((spec, "w4a16:g128"))
        if c is None:
            continue
        out.append({"claim": f"{label} beats round-to-nearest at W4 g128 ({anchor} perplexity)",
                    "verdict": "within noise" if not _beyond(c["rel_ppl"], c["rel_ppl_se"]) else
                               "supported" if c["rel_ppl"] < 0 else "not supported",
                    "measured": f"perplexity {label} / RTN - 1 = {100 * c['rel_ppl']:+.2f}% "
                                f"+-{100 * c['rel_ppl_se']:.2f} (paired over the same tokens; rel ppl vs fp32: {label} "
                                f"{100 * rows[spec]['rel_ppl']:+.2f}%, RTN "
                                f"{100 * rows['w4a16:g128']['rel_ppl']:+.2f}%)"})
    prows = {r["variant"]: r for r in (preset or {}).get("rows", []) if not r.get("error")}
    claim = "INT4 weights decode faster than 16-bit (article, A100 at 1K tokens: FP16 320 ms, AWQ 185 ms, INT4 152 ms)"
    w4, b16 = prows.get("w4a16:g128"), prows.get("bf16")
    if w4 and b16 and preset.get("decode_steps", 0) < 5:
        out.append({"claim": claim + " - on this CPU", "verdict": "not measured here",
                    "measured": f"{preset['decode_steps']} decode steps per variant: too few to judge (5 or more)"})
    elif w4 and b16:
        faster = w4["ms_max"] < b16["ms_min"]
        slower = w4["ms_min"] > b16["ms_max"]
        out.append({"claim": claim + " - on this CPU",
                    "verdict": "supported" if faster else "not supported" if slower else "within noise",
                    "measured": f"{preset['preset']} decode: W4A16 {w4['ms_per_token']:.0f} ms/token "
                                f"[{w4['ms_min']:.0f}..{w4['ms_max']:.0f}] vs bf16 {b16['ms_per_token']:.0f} "
                                f"[{b16['ms_min']:.0f}..{b16['ms_max']:.0f}] (torch's packed int4 CPU op, "
                                f"run of each variant's own steps, min..max)"})
    gm = [r for r in (gpu_rows or []) if r.get("m") in (1, "1") and r.get("w4a16_ms_min") is not None
          and r.get("dense_ms_min") is not None]
    if gm:
        per = []
        for r in gm:         # per shape: the slower side's best run beyond the faster side's worst
            w_lo, w_hi, d_lo, d_hi = (float(r[k])
                                      for k in ("w4a16_ms_min", "w4a16_ms_max", "dense_ms_min", "dense_ms_max"))
            per.append(("faster" if w_hi < d_lo else "slower" if w_lo > d_hi else "within noise",
                        f"{r.get('N')}x{r.get('K')}: {float(r['dense_ms']) / float(r['w4a16_ms']):.2f}x"))
        kinds = {k for k, _ in per}
        out.append({"claim": claim + f" - on the GPU ({gpu_where}, m = 1)",
                    "verdict": "supported" if kinds == {"faster"} else "not supported" if kinds == {"slower"}
                    else "within noise" if kinds == {"within noise"} else "mixed",
                    "measured": "W4A16 vs bf16, per shape: " + "; ".join(f"{t} ({k})" for k, t in per)})
    else:
        out.append({"claim": claim + " - on a GPU", "verdict": "not measured here",
                    "measured": "no committed GPU table yet (scripts/device_check.sh, step quant_bench)"})
    return out
