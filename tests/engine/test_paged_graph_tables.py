"""A CUDA graph captured by ``PagedDecoder`` reads the block tables it was captured on,
``[bs, max_blocks]`` (``StaticStep.capture`` runs ``_step(*_step_args(bs))``), so once graphs exist
every step writes them at that width - also with the eager ``attention_decode``, whose steps are
otherwise trimmed to the longest row (``LLM(kv=PagedKVConfig(), cuda_graphs=True)`` without Triton
backends, ``workbench serve --cuda-graphs``).  Before that rule, rows past the first attended over
another row's blocks after capture.

No GPU is needed to check it: a CUDA graph replays the kernels recorded on the tensors it was
captured with, so a stand-in whose ``replay()`` runs the step on ``_step_args(bs)`` - exactly the
arguments ``capture`` passes - reads what the real graph reads."""

from __future__ import annotations

import copy

import torch

from workbench.kv.paged import PagedKVConfig, PagedKVPool
from workbench.transforms.paged_graphs import PagedDecoder


class _Replay:
    """What ``torch.cuda.CUDAGraph.replay`` does for the captured step: the same kernels over
    the same (captured) argument tensors, writing the same static output."""

    def __init__(self, dec: PagedDecoder, bs: int) -> None:
        self.dec, self.bs = dec, bs
        self.out = dec._step(*dec._step_args(bs)).clone()

    def replay(self) -> None:
        self.out.copy_(self.dec._step(*self.dec._step_args(self.bs)))


@torch.inference_mode()
def test_a_replayed_graph_reads_the_block_tables_decode_wrote(random_llm):
    model = copy.deepcopy(random_llm.model)
    cfg, w = model.config, model.lm_head.weight
    pool = PagedKVPool(cfg, PagedKVConfig(block_size=4, num_blocks=32), w.device, w.dtype, 0, scratch_blocks=1)
    gen = torch.Generator().manual_seed(0)
    for t in pool.k_cache + pool.v_cache:             # every block different: which blocks a row reads matters
        t[:pool.num_blocks].copy_(torch.randn(t[:pool.num_blocks].shape, generator=gen))
    dec = PagedDecoder(model, pool, max_blocks=8, buckets=(1, 2, 4))
    assert dec.trim_width, "eager attention_decode: the tables are trimmed to the longest row"

    tokens, positions, tables = [5, 7, 9], [5, 9, 2], [[0, 1], [2, 3, 4], [5]]
    want = dec.decode(tokens, positions, tables).clone()      # the eager static step (no graph)

    # stand-ins for capture(): one "graph" per bucket over the buffers capture() hands the step
    for bs in dec.buckets:
        g = _Replay(dec, bs)
        dec.graphs[bs] = (g, g.out)
    got = dec.decode(tokens, positions, tables)
    assert torch.allclose(got, want, atol=1e-5), (
        f"rows read other rows' blocks after capture: max |diff| per row {(got - want).abs().amax(-1).tolist()}")


class _FakeCudaTransport:
    kind = "cuda"

    def __init__(self) -> None:
        self.joins = 0

    def join(self) -> None:
        self.joins += 1


@torch.inference_mode()
def test_a_replay_first_joins_the_weight_copies_an_eager_step_submitted(random_llm):
    """With stream_weights, the eager prefill's last layers submit the next step's first copies on
    the copy stream; a replay runs no hooks, so the decoder must join that stream first."""
    model = copy.deepcopy(random_llm.model)
    cfg, w = model.config, model.lm_head.weight
    pool = PagedKVPool(cfg, PagedKVConfig(block_size=4, num_blocks=8), w.device, w.dtype, 0, scratch_blocks=1)
    dec = PagedDecoder(model, pool, max_blocks=2, buckets=(1,))
    tr = _FakeCudaTransport()
    seen = []

    class G:
        def replay(self):
            seen.append(tr.joins)

    dec.graphs[1] = (G(), torch.zeros(1, cfg.vocab_size))
    model._wb_stream = type("Stream", (), {"transport": tr})()
    dec.decode([3], [1], [[0]])
    assert seen == [1], "the replay ran before the copy stream was joined"


def test_inputs_on_cuda_go_through_pinned_buffers_with_non_blocking_copies(monkeypatch):
    """InputCopies' CUDA branch on a CPU: each source is staged in a (reused, grown) host buffer and
    copied with non_blocking=True; the previous step's copies are waited for before the host
    buffers are rewritten."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from fake_cuda import install
    from workbench.transforms.static_step import InputCopies

    calls = install(monkeypatch)
    cp = InputCopies(torch.device("cuda"))
    cp.device = torch.device("cpu")
    allocs = []
    monkeypatch.setattr(cp, "_pinned", lambda shape, dtype: allocs.append(shape) or torch.empty(shape, dtype=dtype))

    class Copies(TorchDispatchMode):
        seen: list = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket.__name__ == "copy_":
                Copies.seen.append(bool(args[2] if len(args) > 2 else (kwargs or {}).get("non_blocking", False)))
            return func(*args, **(kwargs or {}))

    a, t = torch.zeros(3, 4, dtype=torch.long), torch.zeros(4, 8, dtype=torch.int32)
    with Copies():
        cp((a, torch.arange(12).view(3, 4)), (t[:, :2], torch.ones(4, 2, dtype=torch.int32)))
        cp((a, torch.arange(12).view(3, 4) + 1), (t[:, :5], torch.full((4, 5), 2, dtype=torch.int32)))
    assert torch.equal(a, torch.arange(12).view(3, 4) + 1) and int(t[:, :5].min()) == 2
    assert Copies.seen == [False, True] * 4          # host fill, then the non-blocking device copy
    assert allocs == [(12,), (8,), (20,)]            # the tables' buffer grew once, the ids' was reused
    assert [c[0] for c in calls] == ["event_sync"]   # the second step waited for the first's copies


def test_graphed_decoder_fills_its_inputs_with_one_copy(random_llm):
    from torch.utils._python_dispatch import TorchDispatchMode

    from workbench.transforms.cuda_graphs import GraphedDecoder

    model = copy.deepcopy(random_llm.model)
    dec = GraphedDecoder(model, max_len=16, buckets=(4,))

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += func.overloadpacket.__name__ == "copy_"
            return func(*args, **(kwargs or {}))

    with Count():
        dec._set_inputs(4, [5, 6, None], [3, 1, 0])
    assert Count.n == 1
    c = dec.static[4]
    assert c.ids.view(-1).tolist() == [5, 6, 0, 0] and c.positions.tolist() == [3, 1, 0, 0]
    assert c.slots.tolist() == [3, 16 + 1, 4 * 16, 4 * 16]
