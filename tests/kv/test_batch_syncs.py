"""A packed step over the paged pool indexes with host-known rows, never with a boolean mask (a
``nonzero`` and a device->host sync per layer per group on a GPU)."""

from __future__ import annotations

import types

import torch

from fake_cuda import CountSyncs
from workbench.kv.batch import PagedBatchCache
from workbench.kv.paged import PagedKVConfig, PagedKVPool
from workbench.model.config import ModelConfig

CFG = ModelConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, max_position_embeddings=64)


def test_a_mixed_step_attends_without_boolean_indexing():
    pool = PagedKVPool(CFG, PagedKVConfig(block_size=4, num_blocks=16, enable_prefix_caching=False),
                       torch.device("cpu"), torch.float32, 0)
    m = pool.manager
    m.allocate("a", list(range(6)))
    m.allocate("b", list(range(9)))
    m.allocate("c", list(range(3)))
    items = [("a", 5, 1), ("b", 0, 9), ("c", 0, 3)]        # one decode row, two prefill chunks
    n = 13
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, n, 8, generator=gen)
    k, v = (torch.randn(1, 2, n, 8, generator=gen) for _ in range(2))
    attn = types.SimpleNamespace(layer_idx=0)
    ref = PagedBatchCache(pool, items, rows=n, batch_invariant=True)
    with CountSyncs() as c:
        cache = PagedBatchCache(pool, items, rows=n, batch_invariant=True)
        out = cache.attend(attn, q, k, v)
        for g in cache.groups:
            rows = g.kernel_args()[0]
    assert c.n == 0, c.ops
    assert out.shape == (1, 4, n, 8) and torch.isfinite(out).all()
    assert rows.tolist() == [1 + i for i in range(9)] + [10, 11, 12]          # the prefill group's rows, in order
    torch.testing.assert_close(ref.attend(attn, q, k, v, written=True), out)
