"""init_weights off the CPU: seeded by the ``seed`` argument, not by the device's global RNG."""

from __future__ import annotations

import torch

import workbench.model.decoder as decoder
from workbench.model.config import ModelConfig
from workbench.model.decoder import CausalLM, init_weights

CFG = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=8, max_position_embeddings=16)


def test_device_fill_is_seeded_by_seed_and_name():
    """The device branch's fill, run on a CPU tensor: the global RNG does not matter."""
    a, b, c = (torch.empty(64) for _ in range(3))
    torch.manual_seed(1)
    decoder._fill_on_device(a, 0.02, 7, "model.layers.0.mlp.up_proj.weight")
    torch.manual_seed(2)
    decoder._fill_on_device(b, 0.02, 7, "model.layers.0.mlp.up_proj.weight")
    decoder._fill_on_device(c, 0.02, 7, "model.layers.1.mlp.up_proj.weight")
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert 0.005 < a.std().item() < 0.05


def test_weights_off_the_cpu_go_through_the_seeded_fill(monkeypatch):
    seen = []
    monkeypatch.setattr(decoder, "_fill_on_device", lambda p, s, seed, name: seen.append((p.device.type, seed, name)))
    with torch.device("meta"):
        model = CausalLM(CFG)
    init_weights(model, seed=5)
    assert seen and all(d == "meta" and seed == 5 for d, seed, _ in seen)
    assert len({name for *_, name in seen}) == len(seen)


def test_same_seed_same_weights_on_the_cpu():
    a, b = init_weights(CausalLM(CFG), seed=3), init_weights(CausalLM(CFG), seed=3)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
