"""kv-inspect: reports of the paged pool and of the tiered cache, the inspector's per-request
records, and the block-map views (figures checked as data: no browser)."""

from __future__ import annotations

import json
import math

import pytest
import torch

import workbench
from workbench import SamplingParams
from workbench.kv import PagedKVConfig, TierConfig, fit_pca_from_model
from workbench.kv.inspect import KVInspector, pool_report, report, tier_frame, tier_report
from workbench.kv.tier_config import resident_bytes, zone_counts
from workbench.lab.kv_view import (KVBlockMapView, block_map_figure, format_report, text_block_map, zone_runs)
from workbench.model.decoder import CausalLM

torch.set_num_threads(1)

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
SYSTEM = list(range(100, 130))                                  # 30 shared tokens
PROMPTS = [SYSTEM + [7, 8, 9], SYSTEM + [11, 12], SYSTEM + [7, 8, 9], list(range(200, 210)), SYSTEM[:5]]


def _paged(llm, **kw):
    kw.setdefault("block_size", 4)
    return workbench.LLM(llm.model, tokenizer=llm.tokenizer, kv=PagedKVConfig(**kw), max_model_len=llm.max_model_len)


def _flat(z):
    return [v for row in z for v in row if v is not None]


# ---- paged --------------------------------------------------------------------------------------
def test_pool_report_counts_hit_rate_and_finished_records(random_llm):
    llm = _paged(random_llm, num_blocks=40)
    insp = KVInspector(llm)
    outs = [llm.generate([p], GREEDY)[0] for p in PROMPTS]
    rep = json.loads(json.dumps(report(llm, insp)))                   # JSON-ready
    m = llm.kv_pool.manager
    assert sum(rep["blocks"].values()) == rep["num_blocks"] == 40 == len(rep["block_states"])
    assert rep["blocks"] == {s: m.block_states().count(s) for s in ("free", "owned", "shared", "cached")}
    assert rep["blocks"]["owned"] == rep["blocks"]["shared"] == 0 and not rep["sequences"]
    pc = rep["prefix_cache"]
    assert pc["hit_rate"] == m.stats.hit_rate and pc["hit_tokens"] == m.stats.hit_tokens > 0
    assert pc["prompt_tokens"] == sum(len(p) for p in PROMPTS)
    assert sum(pc["miss_reasons"].values()) == sum(o.prefix_miss_reason is not None for o in outs)
    assert rep["bytes"]["pool_tensors"] == llm.kv_pool.nbytes() == 40 * rep["bytes"]["per_block"]
    assert rep["manager_seconds"] > 0 and rep["offload"] is None
    fin = rep["finished"]
    assert [r["seq_id"] for r in fin] == [o.request_id for o in outs]
    for r, o in zip(fin, outs):
        assert r["cached_tokens"] == o.num_cached_tokens and r["miss_reason"] == o.prefix_miss_reason
        assert r["prompt_tokens"] == len(o.prompt_token_ids)
        assert r["reuse_ratio"] == pytest.approx(o.num_cached_tokens / len(o.prompt_token_ids))
        assert r["num_blocks"] == len(r["block_table"]) == math.ceil(r["tokens"] / 4)
        assert r["tokens"] == r["committed"] == len(o.prompt_token_ids) + len(o.token_ids) - 1   # last token: no KV
        assert r["steps"] == len(o.token_ids) and len(r["block_map"]) == 40
    assert sum(r["cached_tokens"] for r in fin) == pc["hit_tokens"]
    assert fin[2]["block_table"][:7] == fin[0]["block_table"][:7]       # the shared prefix: same physical blocks
    df = insp.frame()
    assert len(df) == len(PROMPTS) and df["cached_tokens"].sum() == pc["hit_tokens"]
    assert "hit rate" in format_report(rep) and "no_shared_prefix" in format_report(rep)
    insp.detach()
    assert insp._on_event not in llm.kv_pool.listeners


def test_live_sequence_history_bound_and_pool_reset(random_llm):
    llm = _paged(random_llm, num_blocks=40)
    insp = KVInspector(llm, history=2)
    llm.generate([PROMPTS[0]], GREEDY)
    it = llm.stream(PROMPTS[2], GREEDY)
    next(it)
    rep = insp.report()
    (live,) = rep["sequences"]
    assert live["cached_tokens"] == 32 and live["miss_reason"] is None       # a full hit: 8 blocks of 4
    assert rep["blocks"]["owned"] == live["num_blocks"]
    assert set(rep["block_owners"]) == {str(b) for b in live["block_table"]}
    assert pool_report(llm.kv_pool)["sequences"][0]["cached_tokens"] is None  # without the inspector: unknown
    it.close()
    llm.kv_pool.reset()                                                        # a new manager: counters from zero
    llm.generate([PROMPTS[3]], GREEDY)
    llm.generate([PROMPTS[3]], GREEDY)
    assert len(insp.records) == 2                                              # bounded history
    assert [r["cached_tokens"] for r in insp.records] == [0, 8]
    assert insp.records[0]["miss_reason"] == "no_shared_prefix" and insp.records[1]["miss_reason"] is None


def test_offload_restores_are_attributed_to_the_request(random_llm):
    llm = _paged(random_llm, num_blocks=12, offload="host")
    insp = KVInspector(llm)
    a, b = list(range(10, 41)), list(range(60, 91))
    for p in (a, b, a):
        llm.generate([p], GREEDY)
    rep = insp.report()
    assert [r["restored_blocks"] for r in rep["finished"]] == [0, 0, rep["prefix_cache"]["restored_blocks"]]
    assert rep["finished"][2]["cached_tokens"] == 28 and rep["finished"][1]["evictions"] > 0
    off = rep["offload"]
    assert off["kind"] == "host" and off["stats"]["gets"] == rep["prefix_cache"]["restored_blocks"] > 0
    assert off["bytes_held"] == off["blocks_held"] * rep["bytes"]["per_block"]
    assert "offload tier (host)" in format_report(rep)


def test_inspector_needs_a_pool(random_llm):
    with pytest.raises(workbench.WorkbenchError, match="paged engine"):
        KVInspector(random_llm)
    rep = report(random_llm)
    assert rep["mode"] == "contiguous" and "nothing paged or tiered" in rep["message"]
    assert rep["kv_bytes_per_token"] == random_llm.model.config.kv_bytes_per_token(4)
    assert "contiguous" in format_report(rep)


# ---- views of the pool --------------------------------------------------------------------------
def test_static_block_map_has_one_cell_per_block(random_llm):
    llm = _paged(random_llm, num_blocks=37)
    view = KVBlockMapView(cols=8).attach(llm)
    llm.generate([PROMPTS[0]], GREEDY)
    it = llm.stream(PROMPTS[2], GREEDY)
    next(it)
    fig = view.static_figure()
    states = llm.kv_pool.manager.block_states()
    names = ["free", "owned", "shared", "cached"]
    z = fig.data[0].z
    assert len(z) == 5 and all(len(row) == 8 for row in z)                   # 37 blocks, 8 per row
    assert _flat(z) == [names.index(s) for s in states]
    assert list(fig.data[0].colorbar.ticktext) == names
    text = [t for row in fig.data[0].text for t in row if t]
    owned = states.index("owned")
    assert f"block {owned}: owned" in text[owned] and "req-" in text[owned]
    it.close()
    assert text_block_map(["free", "owned", "shared", "cached"] * 3, width=8) == " 0  .oSc.oSc\n 8  .oSc"
    assert _flat(block_map_figure(".oSc.", cols=2).data[0].z) == [0, 1, 2, 3, 0]   # an inspector record's block map
    view.detach()
    assert not llm.kv_pool.listeners


def test_interleaved_run_shares_blocks_and_keeps_greedy_tokens(random_llm):
    pytest.importorskip("anywidget")
    llm = _paged(random_llm, num_blocks=40)
    ref = [o.token_ids
           for o in _paged(random_llm, num_blocks=40, enable_prefix_caching=False).generate(PROMPTS[:3], GREEDY)]
    insp = KVInspector(llm)
    view = KVBlockMapView(max_hz=60)
    view.attach(llm)
    view._build()                               # the widget, without displaying it
    outs = view.run(llm, PROMPTS[:3], GREEDY, display=False, interleave=True)
    assert [o.token_ids for o in outs] == ref
    assert "S" in insp.records[0]["block_map"]  # while request 0 ended, the others shared its prefix
    assert view.updates > 0 and view.events > 0
    assert llm.kv_pool.manager.num_used_blocks == 0
    assert _flat(view.fig.data[0].z) == [["free", "owned", "shared", "cached"].index(s)
                                         for s in llm.kv_pool.manager.block_states()]


# ---- tiered -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiered_setup(random_llm):
    model = CausalLM(random_llm.model.config)
    model.load_state_dict(random_llm.model.state_dict())          # tiered attention is applied in place
    model.eval()
    calib = [torch.randint(5, 900, (96,), generator=torch.Generator().manual_seed(s)).tolist() for s in (1, 2)]
    basis = fit_pca_from_model(model, calib)
    return model, basis


def _tiered(random_llm, tiered_setup, cfg):
    model, basis = tiered_setup
    llm = workbench.LLM(model, tokenizer=random_llm.tokenizer, tiers=cfg, tier_basis=basis)
    prompt = torch.randint(5, 900, (90,), generator=torch.Generator().manual_seed(9)).tolist()
    llm.generate([prompt], GREEDY)
    return llm


@pytest.mark.parametrize("cold_mode", ["mean", "drop"])
def test_tier_report_zones_add_up_and_match_the_config(random_llm, tiered_setup, cold_mode):
    cfg = TierConfig(window=16, sink=2, rank=4, warm_tokens=16, chunk=4, block=8, budget=16, cold_mode=cold_mode)
    llm = _tiered(random_llm, tiered_setup, cfg)
    cache = llm.last_cache
    n = cache.length
    assert n == 90 + GREEDY.max_tokens - 1
    rep = json.loads(json.dumps(tier_report(cache)))
    z = zone_counts(n, cfg)
    mc = cache.model_cfg
    drop = cold_mode == "drop"
    assert len(rep["layers"]) == mc.num_hidden_layers
    for r in rep["layers"]:
        assert r["hot"] + r["warm"] + r["cold"] == n
        assert (r["hot"], r["warm"], r["cold"], r["cold_chunks"]) == (z.hot, z.warm, z.cold_tokens, z.cold_chunks)
        assert r["dropped"] == (z.cold_tokens if drop else 0)
        assert r["offloaded"] == z.warm + (0 if drop else z.cold_tokens)
        assert len(r["fetched_by_head"]) == mc.num_key_value_heads
        assert max(r["fetched_by_head"]) <= cfg.budget and r["fetched"] > 0
        assert r["key_norms"]["hot"]["n"] == z.hot * mc.num_key_value_heads
        assert (r["key_norms"]["cold"]["n"] == 0) if drop else (r["key_norms"]["cold"]["n"] == z.cold_chunks * 2)
        assert 0 < r["key_norms"]["warm_rel_error"] < 1
    assert z.warm > 0 and z.cold_chunks > 0
    # fetched tokens summed over layers and heads == what the cache counted for the last query
    assert sum(sum(r["fetched_by_head"]) for r in rep["layers"]) == cache.fetched_tokens_by_pos[n - 1]
    assert rep["bytes"]["fetched_last_step"] == float(cache.fetched_bytes_by_pos[n - 1]) > 0
    assert rep["bytes"]["resident"] == resident_bytes(n, cfg, mc.num_hidden_layers, mc.num_key_value_heads, mc.head_dim)
    assert rep["bytes"]["full"] == n * mc.kv_bytes_per_token(cfg.element_bytes)
    # the zone map: one name per position and layer; counts agree with the table
    for names, r, heads in zip(rep["zone_map"], rep["layers"], rep["fetched_heads"]):
        assert len(names) == n and names.count("hot") == z.hot
        assert names.count("dropped") == r["dropped"] and ("cold" not in names) == drop
        assert names.count("warm") + names.count("cold") + names.count("fetched") == r["offloaded"]
        assert sum(heads) == sum(r["fetched_by_head"])
    # hot-key norms by hand, layer 0
    k = cache.k[0][0, :, :n]
    hot = [i for i, s in enumerate(rep["zone_map"][0]) if s == "hot"]
    assert rep["layers"][0]["key_norms"]["hot"]["max"] == pytest.approx(float(k[:, hot].norm(dim=-1).max()), rel=1e-5)
    df = tier_frame(rep)
    assert len(df) == mc.num_hidden_layers and (df["hot"] + df["warm"] + df["cold"] == n).all()
    whole = report(llm)
    assert whole["mode"] == "tiered" and whole["last"]["length"] == n and not whole["active"]
    assert "zone map" in format_report(whole)


def test_tier_block_map_figure_rows_are_layers(random_llm, tiered_setup):
    cfg = TierConfig(window=16, sink=2, rank=4, warm_tokens=16, chunk=4, block=8, budget=16)
    llm = _tiered(random_llm, tiered_setup, cfg)
    n = llm.last_cache.length
    view = KVBlockMapView().attach(llm)
    fig = view.static_figure()
    rep = tier_report(llm.last_cache)
    names = ["hot", "warm", "cold", "fetched", "dropped"]
    assert [list(r) for r in fig.data[0].z] == [[names.index(s) for s in row] for row in rep["zone_map"]]
    assert len(fig.data[0].z[0]) == n and list(fig.data[0].y) == [f"layer {i}" for i in range(len(rep["zone_map"]))]
    coarse = KVBlockMapView(cell_tokens=8).attach(llm).static_figure()
    assert len(coarse.data[0].z[0]) == math.ceil(n / 8)
    assert zone_runs(["hot", "hot", "warm", "hot"]) == [("hot", 0, 2), ("warm", 2, 3), ("hot", 3, 4)]
    fig2 = block_map_figure([["hot", "warm"], ["cold", "fetched"]])
    assert _flat(fig2.data[0].z) == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="contiguous"):
        KVBlockMapView().attach(random_llm)


# ---- what the figures say (labels, titles) and when the live view redraws ------------------------
def test_block_map_rows_and_axis_say_what_they_are():
    from workbench.lab.kv_view import wrapped_row_labels, x_axis_title

    assert wrapped_row_labels(164, 32) == ["blocks 0-31", "blocks 32-63", "blocks 64-95", "blocks 96-127",
                                           "blocks 128-159", "blocks 160-163"]
    assert wrapped_row_labels(33, 32) == ["blocks 0-31", "block 32"] and wrapped_row_labels(0, 8) == []
    fig = block_map_figure(".oSc" * 10, cols=32)                  # an inspector record: 40 blocks, 2 rows
    assert list(fig.data[0].y) == ["blocks 0-31", "blocks 32-39"]
    assert fig.layout.xaxis.title.text == "block (column within the row)" == x_axis_title(["free"], two_d=False)
    assert fig.data[0].colorbar.title.text == "block state"
    steps = block_map_figure([["free", "owned"], ["shared", "cached"]], names=["free", "owned", "shared", "cached"])
    assert steps.layout.xaxis.title.text == "block id" and steps.layout.xaxis.dtick == 1
    zones = block_map_figure([["hot", "warm"], ["cold", "fetched"]])
    assert zones.layout.xaxis.title.text.startswith("token position") and zones.data[0].colorbar.title.text == "zone"


def test_live_view_redraws_only_when_the_pool_changed(random_llm):
    pytest.importorskip("anywidget")
    llm = _paged(random_llm, num_blocks=24)
    view = KVBlockMapView(max_hz=60, cols=10).attach(llm)          # 24 blocks: the last row has 6 padding cells
    view._build()
    assert {"wb-live", "wb-live-block-map"} <= set(view.widget._dom_classes)
    assert view.fig in view.widget.children                        # the browser test reads the plot inside it
    assert view.refresh() is False and view.skipped == 1 and view.updates == 0   # nothing ran: nothing to draw
    llm.generate([PROMPTS[0]], GREEDY)
    assert view.refresh() is True and view.updates >= 1
    from plotly.serializers import _py_to_js                         # what the widget sends to the browser
    sent = _py_to_js(view.fig.data[0].z, None)
    json.dumps(sent, allow_nan=False)                               # padding is null, not NaN (invalid JSON)
    assert _flat(sent) == [["free", "owned", "shared", "cached"].index(b) for b in llm.kv_pool.manager.block_states()]
    drawn = view.updates
    assert view.refresh() is False and view.updates == drawn       # the same pool: no redraw
    assert "pool events" in view.label.value and f"{view.updates} redraws" in view.label.value
    slow = KVBlockMapView(max_hz=0.01).attach(llm)                  # one look per 100 s: the first event's only
    slow._build()
    llm.generate([PROMPTS[3], PROMPTS[1]], GREEDY)
    assert slow.events > 10 and slow.updates + slow.skipped == 1
    slow.detach()
    view.detach()


def test_tier_live_view_redraws_when_the_zones_change(random_llm, tiered_setup):
    pytest.importorskip("anywidget")
    cfg = TierConfig(window=16, sink=2, rank=4, warm_tokens=16, chunk=4, block=8, budget=16)
    llm = _tiered(random_llm, tiered_setup, cfg)
    view = KVBlockMapView(max_hz=60).attach(llm)
    view._build()
    key = view.state_key()
    assert key[0] is llm.last_cache and key[1] == llm.last_cache.length
    assert view.refresh() is False and view.skipped == 1           # built from this state: nothing new
    prompt = torch.randint(5, 900, (40,), generator=torch.Generator().manual_seed(4)).tolist()
    out = view.run(llm, prompt, GREEDY, display=False)
    assert view.updates >= 1 and view.state_key()[0] is not key[0]
    n = llm.last_cache.length
    assert len(view.fig.data[0].z[0]) == n and list(view.fig.data[0].x) == list(range(n))
    assert _flat(view.fig.data[0].z) == _flat(view.static_figure().data[0].z)
    assert len(out.token_ids) == GREEDY.max_tokens
    label = view.label.value
    assert "pool events" not in label and f"zones per layer for the newest query ({n} tokens)" in label
