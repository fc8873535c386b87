"""Sweep the three-zone KV cache on the bundled model: memory vs perplexity, KL, top-1.

    PYTHONPATH=. .venv/bin/python scripts/kv_tier_sweep.py          # ~5-10 min on 2 CPU cores

No command line: edit the parameters below (or call ``main(...)`` from Python).  What it does:

1. split the held-out corpus by whole documents (workbench.bench.tier_eval.heldout_split):
   calibration documents fit the PCA bases (post- and pre-RoPE), evaluation documents are scored;
2. print the explained key variance per rank (mean over layers and KV heads);
3. check on the real model that one-pass evaluation equals step-by-step decoding;
4. evaluate every configuration of GRID (StreamingLLM-style eviction controls included) against
   the full cache on the last EVAL_TOKENS positions of each 1,024-token window;
5. print the table, the Pareto front and the best configs within MAX_REL_PPL, and write
   runs/kv_tiers/<UTC time>/{sweep.csv, explained_variance.csv, pareto.html, summary.json}.
"""

from __future__ import annotations

import json
import sys
import time
from datetime import datetime, UTC
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import workbench as wb  # noqa: E402
from workbench.kv.pca import fit_pca_from_model  # noqa: E402
from workbench.kv.tier_config import TierConfig  # noqa: E402
from workbench.bench.tier_eval import best_under, check_sequential, heldout_split, pareto_front, sweep  # noqa: E402
from workbench.lab.kv_view import pareto_figure  # noqa: E402

# ---- parameters -----------------------------------------------------------------------------
DEVICE = "cpu"
THREADS = 2
N_EVAL_DOCS = 8          # evaluation documents (of 8 in the split)
EVAL_TOKENS = 256        # scored targets per document: the last 256 of 1,024 (context 767..1023)
MAX_REL_PPL = 0.02       # the quality threshold of the claim (<= 2 % perplexity increase)
PRE = dict(key_space="pre_rope")


def grid() -> list[TierConfig]:
    T = TierConfig
    drop = [T(window=w, warm_tokens=0, chunk=1, cold_mode="drop") for w in (16, 32, 64, 128)]
    warm_only = [T(window=32, rank=r, key_space=ks) for r in (4, 8) for ks in ("post_rope", "pre_rope")]
    three_zone = [T(window=32, rank=r, warm_tokens=wt, chunk=16, block=16, budget=b, **PRE)
                  for r in (4, 8) for wt in (64, 256) for b in (None, 64)]
    others = [T(window=16, rank=8, warm_tokens=128, budget=64, **PRE),
              T(window=64, rank=8, warm_tokens=128, budget=64, **PRE),
              T(window=32, rank=8, warm_tokens=64, budget=64, value_format="int8", **PRE),
              T(window=32, rank=8, warm_tokens=64, budget=64),                         # post-RoPE basis
              T(window=32, rank=8, warm_tokens=64, chunk=8, block=16, budget=64, **PRE),
              T(window=32, rank=8, warm_tokens=64, budget=128, **PRE),
              T(window=32, rank=8, warm_tokens=0, chunk=16, budget=64, **PRE),               # cold only
              T(window=32, rank=4, warm_tokens=32, budget=32, **PRE),
              T(window=16, rank=4, warm_tokens=64, budget=64, **PRE),
              T(window=16, rank=8, warm_tokens=64, budget=32, value_format="int8", **PRE)]
    return drop + warm_only + three_zone + others


def main(device: str = DEVICE, threads: int = THREADS, n_eval_docs: int = N_EVAL_DOCS,
         eval_tokens: int = EVAL_TOKENS, max_rel_ppl: float = MAX_REL_PPL, configs=None, out_dir=None) -> dict:
    import pandas as pd

    t_start = time.perf_counter()
    torch.set_num_threads(threads)
    model = wb.load_model(device=device).eval()
    tok = wb.Tokenizer(wb.BUNDLED_MODEL)
    split = heldout_split(tok, context=model.config.max_position_embeddings)
    evaluation = split["evaluation"][:n_eval_docs]
    print(f"model: bundled reference ({model.config.num_hidden_layers} layers, {model.config.num_key_value_heads} "
          f"KV heads, head_dim {model.config.head_dim}) on {device}, {threads} threads")
    print(f"calibration docs: {split['calibration_docs']}")
    print(f"evaluation docs:  {split['evaluation_docs'][:n_eval_docs]}  (first {len(evaluation[0])} tokens each, "
          f"last {eval_tokens} scored)")

    t = time.perf_counter()
    bases = {ks: fit_pca_from_model(model, split["calibration"], key_space=ks, source="heldout_split calibration")
             for ks in ("post_rope", "pre_rope")}
    t_pca = time.perf_counter() - t
    ev = pd.concat([b.explained_variance_table().assign(key_space=ks) for ks, b in bases.items()])
    summary_ev = ev.groupby(["key_space", "rank"])["explained"].mean().unstack(0)
    print(f"\nPCA on {bases['post_rope'].num_tokens} calibration tokens ({t_pca:.1f} s); explained key variance "
          "(mean over layers and KV heads):")
    print(summary_ev.loc[[1, 2, 4, 8, 16, 24]].round(3).to_string())

    check_cfg = TierConfig(window=32, rank=4, warm_tokens=64, budget=64, value_format="int8", key_space="pre_rope")
    seq_err = check_sequential(model, check_cfg, bases["pre_rope"], evaluation[0], tail=16)
    print(f"\none pass vs step-by-step decoding ({check_cfg.name}, last 16 tokens): max |dlogit| = {seq_err:.2e}")

    configs = grid() if configs is None else configs
    print(f"\nsweeping {len(configs)} configurations ...")
    t = time.perf_counter()
    df = sweep(model, bases, evaluation, configs, eval_tokens=eval_tokens,
               progress=lambda i, r: print(f"  [{i + 1}/{len(configs)}] {r['name']}: "
                                           + (f"error {r['error']}" if r["error"] else
                                              f"{r['reduction']:.2f}x, ppl {100 * r['rel_ppl']:+.2f}%, "
                                              f"KL {r['kl']:.4f}, top1 {r['top1']:.3f} ({r['seconds']:.0f} s)"),
                                           flush=True))
    t_sweep = time.perf_counter() - t
    cols = ["name", "bytes_per_token", "reduction", "reduction_at_end", "ppl", "rel_ppl", "rel_ppl_se", "kl", "top1",
            "fetched_frac", "error"]
    pd.set_option("display.width", 200)
    print(f"\nfull cache: {df['full_bytes_per_token'].dropna().iloc[0]:.0f} B/token (bf16 accounting), "
          f"ppl {df['ppl_full'].dropna().iloc[0]:.3f} on {int(df['scored_tokens'].dropna().iloc[0])} scored tokens")
    print(df[cols].to_string(float_format=lambda x: f"{x:.4g}"))
    front = pareto_front(df)
    best = best_under(df, max_rel_ppl)
    print("\nPareto front (reduction vs rel. perplexity):")
    print(front[cols[:-1]].to_string(float_format=lambda x: f"{x:.4g}"))
    print(f"\nbest within +{100 * max_rel_ppl:g}% perplexity:")
    print(best[cols[:-1]].head(5).to_string(float_format=lambda x: f"{x:.4g}"))
    t_total = time.perf_counter() - t_start
    print(f"\nrun time: {t_total:.0f} s (sweep {t_sweep:.0f} s)")

    out = Path(out_dir or ROOT / "runs" / "kv_tiers" / datetime.now(UTC).strftime("%Y%m%d-%H%M%S"))
    out.mkdir(parents=True, exist_ok=True)
    df.to_csv(out / "sweep.csv", index=False)
    ev.to_csv(out / "explained_variance.csv", index=False)
    try:
        pareto_figure(df, max_rel_ppl=max_rel_ppl).write_html(out / "pareto.html", include_plotlyjs="cdn")
    except ImportError:
        print("plotly not installed: no figure written")
    summary = {"best": best.head(1).to_dict("records"), "sequential_check_max_abs": seq_err,
               "seconds": t_total, "device": device, "threads": threads, "eval_docs": n_eval_docs,
               "eval_tokens": eval_tokens}
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    print(f"results: {out}")
    return {"table": df, "front": front, "best": best, "summary": summary}


if __name__ == "__main__":
    main()
