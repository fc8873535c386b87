"""A paged pool is freed with its engine, without waiting for Python's cyclic collector.

The pool's own helpers (``pool.blocks``, the KV lookahead, the block manager's eviction callback,
a step's attention groups) pointed back at it; those cycles kept every KV tensor alive after the
engine was dropped until a full collection ran, which on a GPU held gigabytes of HBM while the next
engine of a notebook or a sweep allocated its own."""

from __future__ import annotations

import gc
import weakref

import pytest

import workbench
from workbench.engine import LLMEngine
from workbench.kv import PagedKVConfig
from workbench.sched import SchedulerConfig


@pytest.fixture(scope="module")
def llm():
    return workbench.LLM(threads=1)


@pytest.mark.parametrize("kw", [{}, {"kv": PagedKVConfig(enable_prefix_caching=True, offload="host", lookahead=2)},
                                {"kv": PagedKVConfig(enable_prefix_caching=False)}],
                         ids=["default", "prefix+offload+lookahead", "no-prefix"])
def test_the_pool_dies_with_its_engine(llm, kw):
    eng = LLMEngine(llm, scheduler=SchedulerConfig(max_num_seqs=4), **kw)
    outs = eng.generate(["The list type", "A tuple is", "The list type has"],
                        workbench.SamplingParams(temperature=0, max_tokens=6))
    assert all(len(o.token_ids) == 6 for o in outs)
    pool = weakref.ref(eng.runner.pool)
    tensor = weakref.ref(eng.runner.pool.k_cache[0])
    gc.collect()
    gc.disable()
    try:
        del eng
        assert pool() is None, ("the pool outlived its engine: "
                                f"referrers {[type(r).__name__ for r in gc.get_referrers(pool())]}")
        assert tensor() is None
    finally:
        gc.enable()
