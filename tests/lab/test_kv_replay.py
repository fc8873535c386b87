"""Notebook 02's replays (workbench.lab.kv_replay, KVBlockMapView's recording) and the tier
sweep's configuration picker (workbench.lab.kv_lab.add_config_picker), checked as data: every pool
state the view saw is a frame, frames differ where the pool did, the replay has plotly's controls,
the picker's buttons move the ring and rewrite the text."""

from __future__ import annotations

import pandas as pd
import pytest
import torch

pytest.importorskip("plotly")

import workbench  # noqa: E402
from workbench import SamplingParams  # noqa: E402
from workbench.kv import PagedKVConfig, TierConfig, fit_pca_from_model  # noqa: E402
from workbench.kv.inspect import CHARS, KVInspector, tier_report  # noqa: E402
from workbench.lab.kv_lab import add_config_picker, pareto_figure, short_labels  # noqa: E402
from workbench.lab.kv_replay import (_zone_cells, pool_replay_figure, record_frames,  # noqa: E402
                                     zone_replay_figure, zone_state)
from workbench.lab.kv_view import KVBlockMapView  # noqa: E402
from workbench.lab.replay import Frame, has_replay  # noqa: E402
from workbench.model.decoder import CausalLM  # noqa: E402

torch.set_num_threads(1)

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
SYSTEM = list(range(100, 130))                                  # 30 shared tokens
PROMPTS = [SYSTEM + [7, 8, 9], SYSTEM + [11, 12], list(range(200, 210))]
NAMES = ["free", "owned", "shared", "cached"]


def _paged(llm, **kw):
    return workbench.LLM(llm.model, tokenizer=llm.tokenizer, max_model_len=llm.max_model_len,
                         kv=PagedKVConfig(block_size=4, **kw))


def _flat(z):
    return [v for row in z for v in row if v is not None]


def test_the_view_records_every_pool_state_and_replays_them(random_llm):
    llm = _paged(random_llm, num_blocks=40)
    view = KVBlockMapView(cols=8)
    outs = view.run(llm, PROMPTS, GREEDY, display=False, interleave=True)     # not displayed: still recorded
    frames = view.recorder.frames
    labels = [f.label for f in frames]
    assert labels[:3] == ["req-0 begins", "req-1 begins", "req-2 begins"]
    assert any("released" in x for x in labels) and labels[-1].endswith("every request done")
    # every frame is a state the pool was in: the last one is the pool now, all of them differ from their neighbour
    assert frames[-1].data[0]["states"] == "".join(CHARS[s] for s in llm.kv_pool.manager.block_states())
    assert all(a.data != b.data for a, b in zip(frames, frames[1:]))
    # every event but the ends (told before the blocks go back), and a last look: unchanged looks not kept
    assert view.record_events == view.events - len(PROMPTS) + 1 > len(frames)
    assert "S" in frames[1].data[0]["states"]                              # req-1 shares req-0's prefix blocks
    reqs = dict(frames[-1].data[0]["requests"])
    assert [reqs[o.request_id][1] for o in outs] == [o.num_cached_tokens for o in outs]
    assert reqs["req-0"][2] == "no_shared_prefix" and reqs["req-1"][1] > 0
    assert "µs per pool event" in view.record_cost()

    fig = view.replay()
    js = fig.to_plotly_json()
    assert has_replay(js) and len(fig.frames) == len(frames)
    assert [t.type for t in fig.data] == ["heatmap", "bar", "bar"]
    z0, zn = fig.frames[0].data[0].z, fig.frames[-1].data[0].z
    assert _flat(zn) == [NAMES.index(s) for s in llm.kv_pool.manager.block_states()]
    assert _flat(z0) != _flat(zn)                                           # scrubbing changes the map
    hits = fig.frames[-1].data[1].y
    assert list(hits) == [o.num_cached_tokens for o in outs]
    assert list(fig.frames[0].data[1].y)[1:] == [None, None]               # later requests not admitted yet
    assert "req-0 begins" in fig.layout.sliders[0].steps[0].label
    assert "µs per pool event" in " ".join(a.text for a in fig.layout.annotations)


def test_recording_off_records_nothing(random_llm):
    llm = _paged(random_llm, num_blocks=40)
    view = KVBlockMapView(record=False)
    view.run(llm, PROMPTS[:1], GREEDY, display=False)
    assert view.recorder is None and view.record_cost() == "nothing recorded"
    with pytest.raises(ValueError, match="nothing recorded"):
        view.replay()


def test_record_frames_replays_an_inspectors_requests(random_llm):
    llm = _paged(random_llm, num_blocks=40)
    with KVInspector(llm) as insp:
        outs = [llm.generate([p], GREEDY)[0] for p in PROMPTS]
    frames = record_frames(insp.records)
    assert [f.label for f in frames] == [f"{o.request_id} ends" for o in outs]
    assert [len(f.data[0]["requests"]) for f in frames] == [1, 2, 3]
    assert [f.t_ms for f in frames] == sorted(f.t_ms for f in frames)
    fig = pool_replay_figure(frames)
    assert len(fig.frames) == 3 and list(fig.frames[-1].data[1].y) == [o.num_cached_tokens for o in outs]
    assert list(fig.frames[-1].data[2].text)[0] == "no_shared_prefix"     # the miss reason, on its bar
    titles = [f.layout.title.text for f in fig.frames]
    assert "req-0 ends" in titles[0] and "prompt tokens reused" in titles[-1]
    with pytest.raises(ValueError, match="block maps"):
        record_frames([{k: v for k, v in insp.records[0].items() if k != "block_map"}])
    with pytest.raises(ValueError, match="no frames"):
        pool_replay_figure([])


@pytest.fixture(scope="module")
def tiered_llm(random_llm):
    model = CausalLM(random_llm.model.config)
    model.load_state_dict(random_llm.model.state_dict())          # tiered attention is applied in place
    model.eval()
    calib = [torch.randint(5, 900, (96,), generator=torch.Generator().manual_seed(s)).tolist() for s in (1, 2)]
    cfg = TierConfig(window=16, sink=2, rank=4, warm_tokens=16, chunk=4, block=8, budget=16)
    return workbench.LLM(model, tokenizer=random_llm.tokenizer, tiers=cfg, tier_basis=fit_pca_from_model(model, calib))


def test_the_tiered_view_records_the_zones_of_every_token(tiered_llm):
    prompt = torch.randint(5, 900, (90,), generator=torch.Generator().manual_seed(9)).tolist()
    view = KVBlockMapView()
    view.run(tiered_llm, prompt, GREEDY, display=False)
    frames = view.recorder.frames
    lengths = [f.data[0]["length"] for f in frames]
    assert lengths == list(range(90, 90 + GREEDY.max_tokens)) and "µs per token" in view.record_cost()
    assert len(frames[0].data[0]["zones"]) == tiered_llm.model.config.num_hidden_layers
    # the cheap recording says what the full report says about the cache now
    assert frames[-1].data[0] == zone_state(tier_report(tiered_llm.last_cache))
    fig = view.replay()
    assert has_replay(fig.to_plotly_json()) and len(fig.frames) == len(frames)
    first, last = fig.frames[0].data[0], fig.frames[-1].data[0]
    assert len(last.x) > len(first.x) or list(last.z[0]) != list(first.z[0])    # the zones moved
    assert "tokens: hot" in fig.frames[-1].layout.title.text


def test_zone_cells_show_the_most_frequent_zone_or_fetched():
    assert _zone_cells("HHHw" + "wwCC" + "CFCC", 4) == ["hot", "warm", "fetched"]
    assert _zone_cells("HHH", 2) == ["hot", "hot"]
    frames = [Frame(float(i), [{"zones": ("C" * 100 + "H" * (10 + i),), "length": 110 + i,
                                "counts": (("cold", 100), ("hot", 10 + i))}], f"t{i}") for i in range(3)]
    fig = zone_replay_figure(frames, max_cols=20)                      # 112 positions in <= 20 cells: 6 a cell
    assert len(fig.frames[-1].data[0].z[0]) == 19 and fig.frames[-1].data[0].x[1] == 6
    many = zone_replay_figure(frames * 5)                               # 15 frames: the step labels hide ...
    assert many.layout.sliders[0].currentvalue.font.color == "#333"     # ... the current one stays readable


# ---- the configuration picker -----------------------------------------------------------------------
def _sweep():
    return pd.DataFrame({      # the front: rows 1, 0, 2, 3 (by reduction); row 4 is dominated by row 0
        "name": ["w64-r8-warm64-bud64", "w64-r8-warmall-bud64", "w64-r4-warm64-bud64", "w64-r8-warm64-bud64-drop",
                 "w64-r8-warm64-budnone"],
        "reduction": [5.4, 1.5, 5.6, 7.6, 5.4], "rel_ppl": [0.011, 0.005, 0.012, 0.02, 0.015],
        "rel_ppl_se": [0.007] * 5, "kl": [0.01, 0.007, 0.0095, 0.05, 0.02], "top1": [0.94, 0.95, 0.94, 0.9, 0.93],
        "bytes_per_token": [568.0, 2048.0, 548.0, 404.0, 568.0], "full_bytes_per_token": [3072.0] * 5,
        "cold_mode": ["mean", "mean", "mean", "drop", "mean"], "error": [None] * 5})


def test_short_labels_keep_what_differs():
    assert short_labels(["w64-r8-warm64", "w64-r4-warm64", "w64-r8-warmall-drop"]) == ["r8-warm64", "r4-warm64",
                                                                                      "r8-warmall-drop"]
    assert short_labels(["a-b", "a-b"]) == ["base", "base"]


def test_pareto_points_carry_labels():
    fig = pareto_figure(_sweep())
    front = fig.data[-1]
    assert front.mode == "lines+markers+text" and front.texttemplate == "%{customdata}"
    assert list(front.customdata) == [short_labels(list(_sweep()["name"]))[i] for i in (1, 0, 2, 3)]


def test_the_picker_moves_the_ring_and_rewrites_the_text():
    df = _sweep()
    fig = add_config_picker(pareto_figure(df), df, selected="w64-r4-warm64-bud64")
    ring = fig.data[-1]
    assert ring.name.startswith("picked") and list(ring.x) == [5.6] and list(ring.y) == pytest.approx([1.2])
    menu = fig.layout.updatemenus[0]
    names = [b.args[0]["text"][0][0] for b in menu.buttons]
    assert names == list(df.sort_values("reduction", ascending=False)["name"])     # every configuration, once
    assert menu.active == names.index("w64-r4-warm64-bud64")
    note = next(i for i, a in enumerate(fig.layout.annotations) if "KV memory" in a.text)
    assert "0.54 KiB per token" in fig.layout.annotations[note].text and "+1.20%" in fig.layout.annotations[note].text
    for b in menu.buttons:
        data, layout, traces = b.args
        assert b.method == "update" and list(traces) == [len(fig.data) - 1]             # restyles the ring only
        row = df.set_index("name").loc[data["text"][0][0]]
        assert data["x"] == [[row["reduction"]]] and data["y"][0][0] == pytest.approx(100 * row["rel_ppl"])
        text = layout[f"annotations[{note}].text"]
        assert f"{row['reduction']:.2f}x less KV memory" in text and f"{row['rel_ppl']:+.2%}" in text
    by_name = {b.args[0]["text"][0][0]: b for b in menu.buttons}
    assert by_name["w64-r8-warm64-bud64-drop"].label.startswith("★")
    drop_text = by_name["w64-r8-warm64-bud64-drop"].args[1][f"annotations[{note}].text"]
    assert "(sliding-window control, on the Pareto front)" in drop_text
    assert not by_name["w64-r8-warm64-budnone"].label.startswith("★")
    assert "not on the Pareto front" in by_name["w64-r8-warm64-budnone"].args[1][f"annotations[{note}].text"]
    assert add_config_picker(pareto_figure(df), df).layout.updatemenus[0].active == 0      # default: first front member


def test_the_offload_experiment_tells_a_progress_bar_what_runs(random_llm):
    from workbench.bench.kv_experiments import offload_experiment

    class Bar:
        total, started, done = None, [], 0

        def start(self, name):
            self.started.append(name)

        def advance(self):
            self.done += 1

    bar = Bar()
    a, b = list(range(10, 50)), list(range(60, 100))
    offload_experiment(random_llm, a, b, block_size=4, kinds=(None, "host"), repeats=2, max_tokens=2, bar=bar)
    assert bar.total == 4 == bar.done == len(bar.started)
    assert bar.started[:2] == ["round 1/2: offload none (A, B, A again)", "round 1/2: offload host (A, B, A again)"]
    assert bar.started[2] == "round 2/2: offload host (A, B, A again)"          # reversed every other round


def test_a_view_on_a_long_run_keeps_a_bounded_recording(random_llm, monkeypatch):
    import workbench.lab.kv_view as kv_view

    monkeypatch.setattr(kv_view, "MAX_RECORDED", 6)
    llm = _paged(random_llm, num_blocks=40)
    view = KVBlockMapView()
    view.run(llm, PROMPTS * 2, GREEDY, display=False)                  # one after another: many states
    frames = view.recorder.frames
    assert 3 <= len(frames) <= 6 and frames[0].label == "req-0 begins"  # thinned, the first one kept
    assert [f.t_ms for f in frames] == sorted(f.t_ms for f in frames)
