"""request_memory on a CUDA engine reports device memory next to the host's RSS."""

from __future__ import annotations

import types

import torch

import workbench
import workbench.bench.request_memory as rm
from workbench import SamplingParams


def test_device_bytes_reads_the_cuda_allocator_only_for_a_cuda_engine(monkeypatch):
    seen = []
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda dev=None: seen.append(dev) or 123)
    assert rm.device_bytes(types.SimpleNamespace(device=torch.device("cpu"))) is None
    assert rm.device_bytes(types.SimpleNamespace(device=torch.device("cuda", 0))) == 123
    assert seen == [torch.device("cuda", 0)]


def test_device_fields_follow_the_allocator_samples(random_llm, monkeypatch):
    """A CUDA engine's KV does not move RSS: the device_* fields carry the allocator's figures
    (before, the peak over steps, after the release); None on a CPU engine."""
    llm = workbench.LLM(random_llm.model, tokenizer=random_llm.tokenizer, max_model_len=random_llm.max_model_len)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    row = rm.request_memory(llm.engine, list(range(5, 15)), params)
    assert row["device_peak"] is None and row["device_delta_after"] is None
    samples = iter([1000, 5000, 7000, 6000, 6000, 6000, 6000, 6000, 1200])
    monkeypatch.setattr(rm, "device_bytes", lambda engine: next(samples))
    monkeypatch.setattr(rm, "_device_reserved", lambda engine: 9000)
    row = rm.request_memory(llm.engine, list(range(5, 15)), params)
    assert row["device_before"] == 1000 and row["device_peak"] == 7000
    assert row["device_delta_peak"] == 6000 and row["device_reserved_after"] == 9000
    assert row["device_after"] is not None and row["device_delta_after"] == row["device_after"] - 1000
