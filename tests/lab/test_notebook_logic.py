"""The experiment logic the notebooks 01, 02 and 04 call, tested on small shapes.

* 01 (fused kernels): ``workbench.bench.kernel_models`` (traffic and FLOP models, the scattered
  block table, the tolerance check, greedy agreement); its views, ``workbench.lab.kernels_view``,
  in test_kernels_view.py;
* 02 (KV tiers): ``workbench.bench.kv_experiments`` (offload experiment, control-vs-cold verdicts,
  ``tier_config_of``, explained variance) and ``workbench.lab.kv_lab`` (PCA and KL figures);
* 04 (scheduler): ``workbench.bench.sched_experiments`` (``summary_row``, the preemption
  experiment, the load ramp with the SLO guard; its dashboard, ``workbench.lab.sched_lab``, in
  test_sched_views.py).
"""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
import torch

from workbench.bench import kernel_models as km
from workbench.bench import kv_experiments as kx
from workbench.bench import sched_experiments as sx

pytest.importorskip("plotly")

SMALL = dict(rows=8, hidden=16, inter=24, rope_tokens=5, rope_heads=(4, 2, 8), attn_heads=(4, 2, 8),
             prefill=(2, 10), decode=(3, 20), page=4)


# ---- 01: fused kernels ------------------------------------------------------------------------------

def _eager_bytes(t: pd.DataFrame) -> int:
    return int(t[["bytes read", "bytes written"]].sum().sum())


@pytest.mark.parametrize("M,N", [(1, 1), (7, 33), (64, 256)])
def test_add_rmsnorm_traffic_float32_by_hand(M, N):
    t = km.add_rmsnorm_traffic(M, N, 4)
    # float32: no casts; h (12), pow (8), mean (4), xf*rstd (8), weight (8) bytes per element; 24 per row; 4 per column
    assert not t["eager op"].isin(["x.float()", ".to(dtype)"]).any()
    assert _eager_bytes(t) == 40 * M * N + 24 * M + 4 * N
    assert km.fused_add_rmsnorm_bytes(M, N, 4) == 16 * M * N + 4 * N


def test_add_rmsnorm_traffic_low_precision_adds_casts_and_gains_more():
    t32, t16 = km.add_rmsnorm_traffic(64, 256, 4), km.add_rmsnorm_traffic(64, 256, 2)
    assert len(t16) == len(t32) + 2 and {"x.float()", ".to(dtype)"} <= set(t16["eager op"])
    _, _, gain32 = km.add_rmsnorm_prediction(4096, 4096, 4, 1e9)
    _, _, gain16 = km.add_rmsnorm_prediction(4096, 4096, 2, 1e9)
    assert gain32 == pytest.approx(40 / 16, rel=1e-3) and gain16 == pytest.approx(42 / 8, rel=1e-3)
    with pytest.raises(ValueError):
        km.add_rmsnorm_traffic(0, 4, 4)


def test_add_rmsnorm_prediction_is_bytes_over_bandwidth():
    traffic, pred, gain = km.add_rmsnorm_prediction(16, 32, 2, bandwidth=2e9)
    assert pred.loc["eager torch", "bytes"] == _eager_bytes(traffic)
    assert pred.loc["fused kernel", "kernels"] == 1 and pred.loc["eager torch", "kernels"] == len(traffic)
    assert pred.loc["eager torch", "predicted ms"] == pytest.approx(1e3 * pred.loc["eager torch", "bytes"] / 2e9)
    ratio = pred.loc["eager torch", "predicted ms"] / pred.loc["fused kernel", "predicted ms"]
    assert ratio == pytest.approx(gain) and gain > 1


def test_kernel_flops_and_bytes_and_roofline_frame():
    from workbench_kernels.flash_prefill import prefill_cost

    rows = [
        {"op": "rmsnorm", "provider": "eager", "metric": "GB/s", "bytes": 1000, "flops": None, "ms_median": 1.0,
         "status": "ok"},
        {"op": "swiglu", "provider": "triton", "metric": "GB/s", "bytes": 500, "flops": None, "ms_median": 2.0,
         "status": "ok"},
        {"op": "paged_decode", "provider": "eager", "metric": "GB/s", "bytes": 800, "flops": None, "ms_median": 1.0,
         "status": "ok"},
        {"op": "flash_prefill", "provider": "eager", "metric": "TFLOP/s", "bytes": None, "flops": 12345,
         "ms_median": 0.5, "status": "ok"},
        {"op": "rope", "provider": "triton", "metric": "GB/s", "bytes": 10, "flops": None, "ms_median": 1.0,
         "status": "error"},
    ]
    kdf = km.roofline_frame(rows, SMALL, torch.float32).set_index("op")
    assert "rope" not in kdf.index                                       # failed rows are left out
    assert kdf.loc["rmsnorm", "flops"] == 4 * 8 * 16
    assert kdf.loc["swiglu", "flops"] == 6 * 8 * 24
    assert kdf.loc["paged_decode", "flops"] == 4 * 8 * 4 * 3 * 20         # 4 · hd · nh · B · S
    assert kdf.loc["flash_prefill", "flops"] == 12345
    assert kdf.loc["flash_prefill", "bytes"] == prefill_cost([10, 10], [10, 10], 4, 2, 8, 4)[1]
    assert kdf.loc["flash_prefill", "bytes"] * 2 == km.kernel_bytes(dict(rows[3]), SMALL, torch.float64)
    assert np.allclose(kdf["intensity"], kdf["flops"] / kdf["bytes"])
    assert kdf.loc["swiglu", "flop_per_s"] == pytest.approx(6 * 8 * 24 / 2e-3)
    rope = km.kernel_flops({"op": "rope", "metric": "GB/s"}, SMALL)
    assert rope == 3 * 5 * (4 + 2) * 8


@pytest.mark.parametrize("lens,page", [([1, 20, 37], 16), ([4, 4], 4), ([9], 2)])
def test_scattered_block_table_covers_the_pool_once(lens, page):
    table, n = km.scattered_block_table(lens, page, generator=torch.Generator().manual_seed(0))
    need = [-(-L // page) for L in lens]
    assert n == sum(need) and table.dtype == torch.int32 and table.shape == (len(lens), max(need))
    used = torch.cat([table[b, :k] for b, k in enumerate(need)])
    assert sorted(used.tolist()) == list(range(n))                       # every block once
    assert all((table[b, k:] == 0).all() for b, k in enumerate(need))    # padding
    slots = [int(table[b, p // page]) * page + p % page for b, L in enumerate(lens) for p in range(L)]
    assert len(set(slots)) == len(slots) and max(slots) < n * page         # no two tokens share a slot
    again, _ = km.scattered_block_table(lens, page, generator=torch.Generator().manual_seed(0))
    assert torch.equal(table, again)
    with pytest.raises(ValueError):
        km.scattered_block_table([0, 3], page)


def test_scattered_block_table_feeds_paged_decode_ref():
    """Tokens written through the table are read back in order by the paged-decode reference:
    it equals attention over the contiguous K / V."""
    import workbench_kernels.paged_decode as kd

    g = torch.Generator().manual_seed(1)
    lens, page, nh, nkv, hd = [3, 9], 4, 4, 2, 8
    table, n = km.scattered_block_table(lens, page, generator=g)
    kc, vc = torch.zeros(n, page, nkv, hd), torch.zeros(n, page, nkv, hd)
    ks = [torch.randn(L, nkv, hd, generator=g) for L in lens]
    vs = [torch.randn(L, nkv, hd, generator=g) for L in lens]
    for b, L in enumerate(lens):
        for p in range(L):
            kc[table[b, p // page], p % page], vc[table[b, p // page], p % page] = ks[b][p], vs[b][p]
    q = torch.randn(len(lens), nh, hd, generator=g)
    out = kd.paged_decode_ref(q, kc, vc, table, torch.tensor(lens, dtype=torch.int32))
    for b in range(len(lens)):
        k, v = ks[b].repeat_interleave(nh // nkv, 1), vs[b].repeat_interleave(nh // nkv, 1)    # [L, nh, hd]
        att = torch.softmax(torch.einsum("hd,lhd->hl", q[b], k) / math.sqrt(hd), -1)
        assert torch.allclose(out[b].float(), torch.einsum("hl,lhd->hd", att, v), atol=1e-5)


def test_check_close_float32_and_low_precision():
    x = torch.randn(5, 7, generator=torch.Generator().manual_seed(2))
    assert km.check_close(x.clone(), x, x, "same") == 0.0
    with pytest.raises(AssertionError, match="far"):
        km.check_close(x + 1e-2, x, x, "far")
    ref32 = x * 1.001
    bf = ref32.to(torch.bfloat16)
    assert km.check_close(bf, bf.clone(), ref32, "bf16") >= 0.0        # ours rounds once, as torch here


def test_token_agreement():
    assert km.token_agreement([[1, 2, 3], [4]], [[1, 2, 3], [4]]) == 1.0
    assert km.token_agreement([[1, 2, 3], [4]], [[1, 9, 3], [5]]) == 0.5
    assert km.token_agreement([[1, 2]], [[1]]) == 0.5                  # a missing token disagrees
    with pytest.raises(ValueError):
        km.token_agreement([[]], [[]])


def test_greedy_tokens_static_decode_agrees(random_llm):
    ids = [list(range(5, 17)), list(range(40, 47))]
    ref = km.greedy_tokens(random_llm.model, ids, 5, tokenizer=random_llm.tokenizer)
    assert [len(t) for t in ref] == [5, 5]
    assert km.greedy_tokens(random_llm.model, ids, 5, tokenizer=random_llm.tokenizer) == ref
    static = km.greedy_tokens(random_llm.model, ids[:1], 5, tokenizer=random_llm.tokenizer, static_decode=True)
    assert km.token_agreement(ref[:1], static) == 1.0


# ---- 02: KV tiers -----------------------------------------------------------------------------------

def _sweep_rows():
    from workbench.bench.tier_eval import grid_configs
    from workbench.kv import TierConfig

    base = TierConfig(window=8, sink=2, rank=4, chunk=4, block=4)
    return (grid_configs(base, warm_tokens=[8, None], budget=[None, 8])
            + grid_configs(base, warm_tokens=[8], budget=[None], cold_mode=["drop"]))


def test_tier_config_of_round_trips_through_pandas():
    from workbench.kv import TierConfig

    configs = _sweep_rows()
    df = pd.DataFrame([{**c, "name": TierConfig(**c).name} for c in configs])
    assert df["warm_tokens"].dtype.kind == "f"            # pandas turned None into NaN: the case to undo
    for (_, row), c in zip(df.iterrows(), configs):
        cfg = kx.tier_config_of(row)
        assert cfg == TierConfig(**c) and cfg.name == row["name"]
        assert all(type(getattr(cfg, f.name)) in (int, str, type(None)) for f in dataclasses.fields(cfg))


@pytest.mark.parametrize("control,se_c,tiered,se_t,expected", [
    (0.010, 0.002, 0.011, 0.002, "within noise"), (0.010, 0.001, 0.030, 0.001, "lower"),
    (0.050, 0.001, 0.030, 0.001, "higher"), (0.001, 0.0, 0.0, 0.0, "higher")])
def test_control_verdict(control, se_c, tiered, se_t, expected):
    assert kx.control_verdict(control, se_c, tiered, se_t) == expected


def test_control_table_pairs_each_control_with_its_mean_cold_twin():
    sweep_df = pd.DataFrame([
        {"name": "a", "cold_mode": "mean", "reduction": 2.0, "rel_ppl": 0.010, "rel_ppl_se": 0.001, "kl": 0.02,
         "top1": 0.9},
        {"name": "b", "cold_mode": "mean", "reduction": 3.0, "rel_ppl": 0.020, "rel_ppl_se": 0.001, "kl": 0.04,
         "top1": 0.8},
        {"name": "a-drop", "cold_mode": "drop", "reduction": 2.5, "rel_ppl": 0.011, "rel_ppl_se": 0.001, "kl": 0.04,
         "top1": 0.85},
        {"name": "b-drop", "cold_mode": "drop", "reduction": 3.5, "rel_ppl": 0.050, "rel_ppl_se": 0.001, "kl": 0.2,
         "top1": 0.7},
    ])
    t = kx.control_table(sweep_df)
    assert list(t.index) == ["a-drop", "b-drop"]
    assert t.loc["a-drop", "mean-cold reduction"] == 2.0 and t.loc["b-drop", "mean-cold kl"] == 0.04
    assert t.loc["a-drop", "perplexity: control is"] == "within noise"
    assert t.loc["b-drop", "perplexity: control is"] == "higher"
    assert t["KL: control / mean-cold"].tolist() == pytest.approx([2.0, 5.0])
    with pytest.raises(KeyError):
        kx.control_table(sweep_df[sweep_df["name"] != "b"])
    assert kx.control_table(sweep_df[sweep_df["cold_mode"] == "mean"]).empty


def test_offload_experiment_restores_evicted_blocks(random_llm):
    pa, pb = list(range(100, 124)), list(range(300, 324))
    res = kx.offload_experiment(random_llm, pa, pb, block_size=4, repeats=2, max_tokens=4)
    table, tokens = res["table"], res["tokens"]
    assert res["pool_blocks"] == -(-(24 + 4) // 4) + 1
    assert list(table.index) == ["none", "host", "disk"]
    assert all(len(runs) == 2 and runs[0] == runs[1] for runs in tokens.values())
    ref = tokens[None][0][0]
    assert all(first == again == ref for first, again in (runs[0] for runs in tokens.values()))
    assert table.loc["none", "A again: miss reason"] == "evicted" and table.loc["none", "blocks restored"] == 0
    assert (table.loc[["host", "disk"], "blocks restored"] > 0).all()
    assert (table.loc[["host", "disk"], "A again: reused tokens"] > table.loc["none", "A again: reused tokens"]).all()
    assert (table.loc[["host", "disk"], "restored KiB"] > 0).all() and table.loc["none", "spilled KiB"] == 0
    assert all(len(v) == 2 for v in res["again_ttft"].values())
    cmps = kx.offload_comparisons(res["again_ttft"])
    assert set(cmps) == {"host", "disk"} and all(isinstance(c.verdict, str) for c in cmps.values())


def test_explained_variance_and_pca_figure(random_llm):
    from workbench.kv import fit_pca_from_model
    from workbench.lab.kv_lab import kl_figure, pca_figure

    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 500, (48,), generator=g).tolist() for _ in range(2)]
    bases = {ks: fit_pca_from_model(random_llm.model, seqs, key_space=ks) for ks in ("post_rope", "pre_rope")}
    ev = kx.explained_variance_frame(bases)
    assert set(ev["key_space"]) == {"post_rope", "pre_rope"}
    assert ev.groupby(["key_space", "layer", "kv_head"])["explained"].apply(lambda s: s.is_monotonic_increasing).all()
    assert (ev["explained"] <= 1 + 1e-5).all()
    fig = pca_figure(bases, ev, rank=2)
    cfg = random_llm.model.config
    heat = [t for t in fig.data if t.type == "heatmap"]
    assert [t.type for t in fig.data].count("scatter") == 2 and len(heat) == 2
    assert np.asarray(heat[0].z).shape == (cfg.num_hidden_layers, cfg.num_key_value_heads)
    assert np.allclose(heat[1].z, bases["pre_rope"].explained(2).numpy())
    with pytest.raises(KeyError):
        pca_figure({"post_rope": bases["post_rope"]}, ev)
    part = pd.DataFrame({"name": ["x"], "reduction": [2.0], "kl": [0.1]})
    assert [t.marker.symbol for t in kl_figure(part, part).data] == ["circle", "diamond-open"]   # control: hollow


# ---- 04: the scheduler ------------------------------------------------------------------------------

def test_summary_row_percentiles_and_busy_steps():
    outs = [SimpleNamespace(metrics=SimpleNamespace(ttft=t / 1e3, time_in_queue=q / 1e3, itl=[g / 1e3 for g in itl]))
            for t, q, itl in ((10, 1, [5, 7]), (20, 2, [6]), (30, 3, []))]
    steps = pd.DataFrame({"num_seqs": [0, 2, 3, 1, 0]})
    row = sx.summary_row(SimpleNamespace(outputs=outs, steps=steps, tokens_per_s=42.0), window_ms=5.0, rate=2.0)
    assert list(row)[:2] == ["window_ms", "rate"] and set(sx.SUMMARY_COLUMNS) <= set(row)
    assert row["TTFT p50 ms"] == pytest.approx(20) and row["TTFT p95 ms"] == pytest.approx(29)
    assert row["queue p95 ms"] == pytest.approx(2.9)
    assert row["ITL p95 ms"] == pytest.approx(np.percentile([5, 7, 6], 95))
    assert row["steps"] == 3 and row["mean batch"] == pytest.approx(2.0) and row["tokens/s"] == 42.0
    with pytest.raises(ValueError):
        sx.summary_row(SimpleNamespace(outputs=[], steps=steps, tokens_per_s=0.0))


def test_preemption_experiment_preempts_and_keeps_tokens(random_llm):
    from workbench import SamplingParams

    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(5, 500, (16,), generator=g).tolist() for _ in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    # the notebook's scenario scaled down: 4 low-priority requests of 6 blocks fill a 24-block pool
    pre = sx.preemption_experiment(random_llm, prompts, params, block_size=4, num_blocks=24, max_num_batched_tokens=64)
    assert set(pre["tokens"]) == {"recompute", "swap"}
    for mode, toks in pre["tokens"].items():
        assert toks == pre["alone"], mode
        assert pre["used_blocks"][mode] == 0 and len(pre["steps"][mode]) > 0
    table = pd.DataFrame(pre["rows"])
    assert len(table) == 12 and (table.groupby("mode")["preemptions"].sum() > 0).all()
    assert (table[table["preemptions"] > 0]["priority"] == 0).all()     # only low-priority requests are preempted
    with pytest.raises(ValueError):
        sx.preemption_experiment(random_llm, prompts[:2], params, low=2)


def test_ramp_stages():
    warm, peak, stages = sx.ramp_stages(10.0)
    assert (warm, peak) == (3.0, 25.0)
    assert [s[2] for s in stages] == ["warm", "ramp", "peak", "cool-down"] and stages[-1][1] == 0.0
    assert sx.ramp_stages(1000.0)[1] == 200.0                            # the peak is capped
    with pytest.raises(ValueError):
        sx.ramp_stages(0.0)


def test_load_ramp_runs_both_sides_and_returns_the_pool(random_llm):
    lab = sx
    warm, _, stages = lab.ramp_stages(8.0, durations=(0.4, 0.2, 0.4, 0.2))
    ramp = lab.load_ramp(random_llm, stages, warm, max_tokens=4, guard_config={"min_samples": 4, "window": 8})
    table = ramp["load_table"]
    assert set(table.index.get_level_values(0)) == {"no guard", "SLO guard"}
    assert ("no guard", "all") in table.index and list(table.columns) == lab.LOAD_TABLE_COLUMNS
    assert table.loc[("no guard", "all"), "requests"] > 0 and table.loc[("no guard", "all"), "rejected"] == 0
    for res in (ramp["plain"], ramp["guarded"]):
        assert res.frame()["status"].isin(["ok", "rejected", "error", "cancelled"]).all()
    assert ramp["target"].engine.pool.manager.num_used_blocks == 0 and ramp["dashboard"] is None
    assert ramp["guard"].snapshot()["state"] in ("closed", "open", "half_open", "half-open")
