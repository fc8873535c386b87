"""The experiments of notebook 02 (KV tiers) that are measurements, not views.

* :func:`offload_experiment`: prompt A, an unrelated prompt B that evicts A's cached blocks,
  then A again, on a pool that holds one request, with no offload tier and with each offload
  tier; bytes and copy times from the tier's own counters, TTFTs of A's second run;
* :func:`offload_comparisons`: the verdicts "recompute vs restore" on those TTFTs;
* :func:`control_table` (with :func:`control_verdict`): each sliding-window control
  (``cold_mode="drop"``) of a tier sweep next to the same shape with mean cold chunks, the
  perplexity difference judged against twice its standard error;
* :func:`tier_config_of`: the :class:`~workbench.kv.TierConfig` of a sweep row;
* :func:`explained_variance_frame`: the explained variance of PCA bases of keys, one row per
  (key space, layer, KV head, rank).

The figures are in :mod:`workbench.lab.kv_lab`; pandas is imported when used.
"""

from __future__ import annotations

import dataclasses
import math

from workbench.kv.tier_config import TierConfig

OFFLOAD_KINDS = (None, "host", "disk")


def offload_experiment(llm, prompt_a: list[int], prompt_b: list[int], block_size: int = 16,
                       kinds=OFFLOAD_KINDS, repeats: int = 3, max_tokens: int = 8, bar=None) -> dict:
    """Run A, B, A again on a pool of ``ceil((len(A) + max_tokens) / block_size) + 1`` blocks (room
    for one request, so B evicts A's cached blocks), once per offload ``kind`` (``None``: no
    offload tier) and round, the kinds interleaved and their order reversed every other round.
    Every engine is a fresh ``LLM`` on ``llm``'s model; greedy decoding of ``max_tokens`` tokens.

    Returns a dict:

    * ``table``: one row per kind (index ``offload``: ``none`` / ``host`` / ``disk``) from the first
      round: A's second run's reused tokens and miss reason, A's first TTFT, evictions and
      restored blocks, spilled / restored KiB and ms (the tier's counters), and the median TTFT
      of A's second run over every round (``A again TTFT ms (median)``);
    * ``tokens``: kind -> one ``(A first, A again)`` pair of token-id lists per round;
    * ``again_ttft``: kind -> A's second-run TTFT in ms, one per round;
    * ``pool_blocks``: the pool size used.

    Nothing is asserted here: whether the restored K/V gives the same tokens is for the caller.
    ``bar``: a progress bar (:class:`workbench.lab.progress.Progress`: ``total``, ``start(name)``,
    ``advance()``); its total is set to the runs here (kinds x repeats)."""
    import pandas as pd

    from workbench.engine.llm import LLM
    from workbench.engine.sampling import SamplingParams
    from workbench.kv import PagedKVConfig

    if repeats < 1:
        raise ValueError(f"offload_experiment: repeats must be >= 1, got {repeats}")
    pool_blocks = -(-(len(prompt_a) + max_tokens) // block_size) + 1
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    rows, tokens, again_ttft = {}, {k: [] for k in kinds}, {k: [] for k in kinds}
    if bar is not None:
        bar.total = repeats * len(kinds)
    for r in range(repeats):
        for kind in (kinds if r % 2 == 0 else kinds[::-1]):
            if bar is not None:
                bar.start(f"round {r + 1}/{repeats}: offload {kind or 'none'} (A, B, A again)")
            eng = LLM(llm.model, tokenizer=llm.tokenizer, max_model_len=llm.max_model_len,
                      kv=PagedKVConfig(block_size=block_size, num_blocks=pool_blocks, offload=kind))
            first, _, again = (eng.generate([p], params)[0] for p in (prompt_a, prompt_b, prompt_a))
            eng.kv_pool.manager.check_invariants()
            again_ttft[kind].append(again.metrics.ttft * 1e3)
            tokens[kind].append((first.token_ids, again.token_ids))
            st = eng.kv_pool.offload.stats if kind else None
            if kind == "disk":
                eng.kv_pool.offload.close()            # the temporary file goes now, not at garbage collection
            if bar is not None:
                bar.advance()
            if r > 0:
                continue
            stats = eng.kv_pool.manager.stats
            rows[kind] = {
                "offload": kind or "none", "A again: reused tokens": again.num_cached_tokens,
                "A again: miss reason": again.prefix_miss_reason or "(full hit)",
                "A first TTFT ms": first.metrics.ttft * 1e3,
                "evictions": stats.evictions, "blocks restored": stats.restored_blocks,
                "spilled KiB": st.bytes_out / 2**10 if st else 0, "spill ms": st.seconds_out * 1e3 if st else 0,
                "restored KiB": st.bytes_in / 2**10 if st else 0, "restore ms": st.seconds_in * 1e3 if st else 0}
    table = pd.DataFrame([rows[k] for k in kinds]).set_index("offload")
    table["A again TTFT ms (median)"] = [pd.Series(again_ttft[k]).median() for k in kinds]
    return {"table": table, "tokens": tokens, "again_ttft": again_ttft, "pool_blocks": pool_blocks}


def offload_comparisons(again_ttft: dict, kinds=("host", "disk")) -> dict:
    """One :class:`~workbench.measure.compare.Comparison` per offload kind: A's second-run TTFTs
    without an offload tier (recompute, ``again_ttft[None]``) vs restored from that kind."""
    from workbench.measure.compare import compare_samples

    return {kind: compare_samples(again_ttft[None], again_ttft[kind], names=("recompute", f"restore from {kind}"),
                                  metric=f"A again TTFT, no offload vs {kind}", unit="ms")
            for kind in kinds}


def control_verdict(control_rel_ppl: float, control_se: float, tiered_rel_ppl: float, tiered_se: float) -> str:
    """How the control's perplexity change compares with the tiered one's: ``within noise``
    when the difference is below twice the standard error of the difference
    (``2·hypot(se_control, se_tiered)``), else ``lower`` or ``higher``."""
    diff, noise = control_rel_ppl - tiered_rel_ppl, 2 * math.hypot(control_se, tiered_se)
    return "within noise" if abs(diff) < noise else ("lower" if diff < 0 else "higher")


def control_table(sweep_df) -> pandas.DataFrame:  # noqa: F821
    """Each sliding-window control of a tier sweep (rows with ``cold_mode == "drop"``) next to the
    same shape with mean cold chunks (the row named as the control without its ``-drop``
    suffix): both sides' reduction, perplexity change, KL and top-1, the perplexity verdict of
    :func:`control_verdict` and the ratio of their KLs.  Indexed by the control's name.  A
    control without its mean-cold twin in ``sweep_df`` raises ``KeyError``."""
    import pandas as pd

    tiered = sweep_df[sweep_df["cold_mode"] == "mean"].set_index("name")
    rows = []
    for _, d in sweep_df[sweep_df["cold_mode"] == "drop"].iterrows():
        t = tiered.loc[d["name"].removesuffix("-drop")]
        rows.append({"control (drop)": d["name"], "reduction": d["reduction"], "rel_ppl": d["rel_ppl"], "kl": d["kl"],
                     "top1": d["top1"], "mean-cold reduction": t["reduction"], "mean-cold rel_ppl": t["rel_ppl"],
                     "mean-cold kl": t["kl"], "mean-cold top1": t["top1"],
                     "perplexity: control is": control_verdict(d["rel_ppl"], d["rel_ppl_se"], t["rel_ppl"],
                                                               t["rel_ppl_se"]),
                     "KL: control / mean-cold": d["kl"] / t["kl"]})
    columns = ["control (drop)", "reduction", "rel_ppl", "kl", "top1", "mean-cold reduction", "mean-cold rel_ppl",
               "mean-cold kl", "mean-cold top1", "perplexity: control is", "KL: control / mean-cold"]
    return pd.DataFrame(rows, columns=columns).set_index("control (drop)")


def tier_config_of(row) -> TierConfig:
    """The :class:`~workbench.kv.TierConfig` of a sweep row (a ``pandas.Series`` or a mapping with
    every field).  pandas keeps the optional integer fields as floats (NaN for ``None``) and numpy
    scalars: they are turned back into ``int`` / ``None``."""
    def plain(v):
        v = v.item() if hasattr(v, "item") else v
        return (None if math.isnan(v) else int(v)) if isinstance(v, float) else v

    return TierConfig(**{f.name: plain(row[f.name]) for f in dataclasses.fields(TierConfig)})


def explained_variance_frame(bases: dict) -> pandas.DataFrame:  # noqa: F821
    """The explained-variance tables (``PCABasis.explained_variance_table``) of ``bases``
    (key space -> basis) stacked, with a ``key_space`` column."""
    import pandas as pd

    return pd.concat([b.explained_variance_table().assign(key_space=ks) for ks, b in bases.items()])
