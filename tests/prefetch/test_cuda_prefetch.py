"""The CUDA transport and weight streaming on a GPU (skipped without CUDA; run by
scripts/device_check.sh): pinned host -> HBM on a side stream, ordering by events, and streamed
weights inside captured CUDA graphs give the all-resident model's greedy tokens."""

from __future__ import annotations

import pytest
import torch

from workbench.engine.core import LLMEngine
from workbench.engine.sampling import SamplingParams
from workbench.errors import ConfigError
from workbench.prefetch.prefetcher import Prefetcher
from workbench.prefetch.cuda_transport import CudaTransport
from workbench.prefetch.weights import WeightStreamConfig
from workbench.sched.config import SchedulerConfig

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
PROMPTS = ["The list type is", "def f(x):", "Dictionaries are"]
GREEDY = SamplingParams(temperature=0, max_tokens=16)


def test_cuda_transport_needs_cuda():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ConfigError, match="CUDA"):
        CudaTransport()


@cuda
def test_cuda_transport_round_trip_and_ordering():
    pf = Prefetcher(CudaTransport())
    data = [torch.randn(1 << 18) for _ in range(4)]
    for i, t in enumerate(data):
        pf.put(i, t)
    bufs = [pf.transport.buffer(t.numel() * 4) for t in data]
    for i in range(4):
        pf.submit(i, bufs[i])
    for i in range(4):
        pf.wait(i)
        got = bufs[i].view(torch.float32) * 1.0          # on the compute stream, after the wait
        assert torch.equal(got.cpu(), data[i])
    torch.cuda.synchronize()
    st = pf.stats()
    assert st["uses"] == 4 and st["bytes"] == sum(t.numel() * 4 for t in data)
    assert st["achieved_gbps"] > 0


@cuda
@pytest.mark.parametrize("cuda_graphs", [False, True])
def test_streamed_weights_match_all_resident(cuda_graphs):
    kw = dict(kv="contiguous", scheduler=SchedulerConfig(max_num_seqs=4), dtype=torch.float32, device="cuda")
    ref = [o.token_ids for o in LLMEngine(**kw, cuda_graphs=cuda_graphs).generate(PROMPTS, GREEDY)]
    for d in (0, 1, 2):
        eng = LLMEngine(**kw, cuda_graphs=cuda_graphs,
                        stream_weights=WeightStreamConfig(resident_layers=3, distance=d, transport="cuda"))
        try:
            assert [o.token_ids for o in eng.generate(PROMPTS, GREEDY)] == ref, f"distance {d}"
            torch.cuda.synchronize()
            st = eng.stats()["prefetch"]["weights"]
            assert st["uses"] > 0
        finally:
            eng.weight_streamer.remove()
