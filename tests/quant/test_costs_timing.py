"""quant.costs timing: on CUDA a layer call is timed as calls replayed in a CUDA graph (one call
alone is host launch + sync time at the bundled model's sizes); on a CPU, call by call."""

from __future__ import annotations

import types

import torch

import workbench.quant.costs as costs


def test_a_cuda_layer_is_timed_by_graph_replays(monkeypatch):
    seen = {}

    def fake_replays(fn, device, *, calls, repeats, warmup=1):
        seen.update(device=device, calls=calls, repeats=repeats)
        return [0.004, 0.002, 0.003]

    monkeypatch.setattr(costs.timing, "time_replays", fake_replays)
    x = types.SimpleNamespace(device=torch.device("cuda", 0))
    assert costs._time_call(lambda x: None, x, repeats=30) == 0.003
    assert seen == {"device": torch.device("cuda", 0), "calls": 30, "repeats": 3}


def test_a_cpu_layer_is_timed_call_by_call(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("no graphs on a CPU")

    monkeypatch.setattr(costs.timing, "time_replays", boom)
    lin = torch.nn.Linear(16, 16)
    ms = costs._time_call(lin, torch.randn(1, 16), repeats=5)
    assert 0 < ms < 100
