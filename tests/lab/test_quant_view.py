"""The quantization views, from small real inputs: a tiny random model's activation maps and
its perplexity under two recipes, scheme errors on its calibration rows, and the packed CPU
ops' timing (headless, nothing displayed)."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest

pytest.importorskip("plotly")

import torch  # noqa: E402

from workbench.lab.quant_view import (kernel_speed_figure, outlier_heatmap, perplexity_figure,  # noqa: E402
                                      scheme_error_figure)
from workbench.model.config import ModelConfig  # noqa: E402
from workbench.model.decoder import CausalLM, init_weights  # noqa: E402
from workbench.quant.apply import quantize_model  # noqa: E402
from workbench.quant.calib import collect_linear_inputs  # noqa: E402
from workbench.quant.outliers import activation_map, scheme_errors, weight_map  # noqa: E402


@pytest.fixture(scope="module")
def tiny():
    cfg = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    model = init_weights(CausalLM(cfg), seed=0).eval()
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 128, (48,), generator=g).tolist() for _ in range(4)]
    stats = collect_linear_inputs(model, seqs[:2], keep_rows=64)
    return model, seqs, stats


def test_outlier_heatmap_marks_the_top_channels(tiny):
    model, _, stats = tiny
    labels, m = activation_map(stats, "down_proj")
    fig = outlier_heatmap(labels, m, "down_proj input", top=3)
    heat, top = fig.data
    assert heat.type == "heatmap" and top.type == "scatter"
    assert list(heat.y) == ["L0", "L1", "L2"] and np.asarray(heat.z).shape == (3, 96)
    assert np.allclose(np.asarray(heat.z), np.log10(m.numpy()))
    assert len(top.x) == 9 and list(top.y) == ["L0"] * 3 + ["L1"] * 3 + ["L2"] * 3
    for i in range(3):                                  # the markers sit on each row's 3 largest channels
        assert set(top.x[3 * i:3 * i + 3]) == set(m[i].topk(3).indices.tolist())
    wl, wm = weight_map(model, "q_proj")
    lin = outlier_heatmap(wl, wm, "q_proj weight", log=False, value="max |W|")
    assert np.allclose(np.asarray(lin.data[0].z), wm.numpy()) and "max |W|" in lin.data[0].colorbar.title.text
    with pytest.raises(ValueError, match="labels"):
        outlier_heatmap(labels[:2], m, "bad")


def test_scheme_error_figure_stacks_outliers_and_rest(tiny):
    model, _, stats = tiny
    name = "model.layers.1.mlp.down_proj"
    rows = scheme_errors(model.get_submodule(name).weight, stats[name].rows, top=4)
    fig = scheme_error_figure(rows)
    out, rest, total = fig.data
    assert [out.name, rest.name] == ["outlier channels", "other channels"] and fig.layout.barmode == "stack"
    assert list(out.x) == [r["scheme"] for r in rows]
    for o, r_, row in zip(out.y, rest.y, rows):
        assert o + r_ == pytest.approx(row["rel_error"]) and o == pytest.approx(row["rel_error"] * row["outlier_share"])
    # two layers: a (layer, scheme) axis
    other = "model.layers.2.mlp.down_proj"
    both = ([dict(r, layer=name) for r in rows] +
            [dict(r, layer=other) for r in scheme_errors(model.get_submodule(other).weight, stats[other].rows)])
    two = scheme_error_figure(both)
    assert len(two.data[0].x) == 2 and len(two.data[0].x[0]) == len(both)
    assert "no rows" in scheme_error_figure([]).layout.annotations[0].text


def _nll(model, seqs) -> list[float]:
    out = []
    with torch.no_grad():
        for s in seqs:
            ids = torch.tensor(s)[None]
            lp = torch.log_softmax(model(ids)[0].float(), -1)
            out.append(-float(lp[:-1].gather(1, ids[0, 1:, None]).mean()))
    return out


def test_perplexity_figure_with_and_without_standard_errors(tiny):
    model, seqs, _ = tiny
    base = _nll(model, seqs[2:])
    rows = []
    for spec in ("w8a16", "w4a16:g32", "w4a16:pt"):
        q = quantize_model(copy.deepcopy(model), spec)
        d = [a - b for a, b in zip(_nll(q, seqs[2:]), base)]          # per-sequence log ppl ratio
        mean = sum(d) / len(d)
        se = math.sqrt(sum((x - mean) ** 2 for x in d) / (len(d) - 1) / len(d))
        rows.append({"recipe": spec, "ppl": math.exp(sum(base) / len(base) + mean), "rel_ppl": math.expm1(mean),
                     "rel_ppl_se": se})
    fig = perplexity_figure(rows)
    bar = fig.data[0]
    assert list(bar.x) == ["w8a16", "w4a16:g32", "w4a16:pt"]
    assert list(bar.y) == pytest.approx([100 * r["rel_ppl"] for r in rows])
    assert list(bar.error_y.array) == pytest.approx([100 * r["rel_ppl_se"] for r in rows])
    rows[1]["rel_ppl_se"] = float("nan")                                # a missing se: no bar for that row
    del rows[2]["rel_ppl_se"]
    part = perplexity_figure(rows).data[0].error_y.array
    assert part[0] == pytest.approx(100 * rows[0]["rel_ppl_se"]) and part[1] is None and part[2] is None
    for r in rows:
        r.pop("rel_ppl_se", None)
    assert perplexity_figure(rows).data[0].error_y.array is None
    assert "no rows" in perplexity_figure([{"recipe": "x"}]).layout.annotations[0].text


def test_kernel_speed_figure_one_line_per_kernel():
    from workbench.quant.cpu_ops import cpu_op_timing

    rows = []
    for m in (1, 4):
        t = cpu_op_timing(out=256, inp=256, m=m, repeats=2, rounds=1)
        ms = {r["side"]: r["ms_median"] for r in t["rows"]}
        rows += [{"m": m, "kernel": side, "speedup": ms["dense fp32"] / v, "source": "CPU"}
                 for side, v in ms.items() if side != "dense fp32"]
    fig = kernel_speed_figure(rows)
    kernels = list(dict.fromkeys(r["kernel"] for r in rows))
    assert [t.name for t in fig.data] == [f"{k} (CPU)" for k in kernels]
    for tr, k in zip(fig.data, kernels):
        assert list(tr.x) == [1, 4] and tr.line.dash == "solid"
        assert list(tr.y) == pytest.approx([r["speedup"] for r in rows if r["kernel"] == k])
    assert fig.layout.xaxis.type == "log" and len({tr.line.color for tr in fig.data}) == len(kernels)
