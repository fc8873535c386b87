"""Batch invariance of the batched engine on the real bundled model: the same greedy tokens
alone, in a batch, with chunked prefill, after preemption (recompute and swap), and the same
as the reference engine.  Plus the async wrapper: streaming, abort, nothing leaked."""

from __future__ import annotations

import asyncio

import pytest

from workbench import SamplingParams
from workbench.kv.paged import PagedKVConfig
from workbench.sched import SchedulerConfig
from workbench.engine import AsyncEngine, LLMEngine

PROMPTS = ["The list data type has some more methods.", "To create a new virtual environment,",
           "The :mod:`logging` module", "A function is", "When an exception is raised, the",
           "Python's for statement iterates over the items of any sequence"]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(bundled_llm):
    return [bundled_llm.generate(p, GREEDY)[0].token_ids for p in PROMPTS]


def engine(llm, **sched):
    kv = sched.pop("kv", None)
    return LLMEngine(llm, scheduler=SchedulerConfig(**sched), kv=kv)


def test_alone_and_batched_equal_the_reference_engine(bundled_llm, reference):
    eng = engine(bundled_llm, max_num_seqs=8, max_num_batched_tokens=256)
    alone = [eng.generate([p], GREEDY)[0].token_ids for p in PROMPTS]
    batched = [o.token_ids for o in eng.generate(PROMPTS, GREEDY)]
    assert alone == batched == reference
    assert max(r.num_seqs for r in eng.step_records) == len(PROMPTS)   # they really ran together
    assert eng.pool.manager.num_used_blocks == 0


def test_chunked_prefill_is_invariant(bundled_llm, reference):
    eng = engine(bundled_llm, max_num_seqs=8, max_num_batched_tokens=5, chunked_prefill=True)
    assert [o.token_ids for o in eng.generate(PROMPTS, GREEDY)] == reference
    assert any(0 < r.prefill_tokens and r.decode_tokens for r in eng.step_records)   # mixed steps


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_is_invariant(bundled_llm, reference, mode):
    kv = PagedKVConfig(block_size=4, num_blocks=14, enable_prefix_caching=True)   # 56 slots: too few for all
    eng = engine(bundled_llm, max_num_seqs=6, max_num_batched_tokens=64, preemption_mode=mode, kv=kv)
    outs = eng.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == reference
    assert eng.scheduler.num_preemptions > 0 and sum(o.num_preemptions for o in outs) > 0
    assert eng.pool.manager.num_used_blocks == 0 and not eng.runner.swap_space


def test_seeded_sampling_is_invariant(bundled_llm):
    params = [SamplingParams(temperature=0.9, top_p=0.9, seed=i, max_tokens=10, ignore_eos=True)
              for i in range(len(PROMPTS))]
    eng = engine(bundled_llm, max_num_seqs=8, max_num_batched_tokens=7)
    alone = [eng.generate([p], sp)[0].token_ids for p, sp in zip(PROMPTS, params)]
    assert [o.token_ids for o in eng.generate(PROMPTS, params)] == alone


def test_texts_stops_and_metrics(bundled_llm):
    eng = engine(bundled_llm, max_num_seqs=4)
    ref = bundled_llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=20))[0]
    stop = ref.text[5:8]
    out = eng.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=20, stop=[stop]))[0]
    assert out.text == ref.text[:ref.text.index(stop)] and out.finish_reason == "stop"
    m = out.metrics
    assert m.ttft > 0 and m.first_scheduled_time is not None and m.e2e >= m.ttft


def test_async_engine_streams_and_aborts(bundled_llm, reference):
    eng = engine(bundled_llm, max_num_seqs=4)

    async def main():
        with AsyncEngine(eng) as ae:
            async def collect(p):
                return [ev.token_id async for ev in ae.stream(p, GREEDY)]
            got = await asyncio.gather(*[collect(p) for p in PROMPTS])
            agen = ae.stream(PROMPTS[0], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
            async for ev in agen:
                if ev.index == 2:
                    break
            await agen.aclose()                         # the consumer leaves: the request is aborted
            for _ in range(100):
                if not eng.has_unfinished():
                    break
                await asyncio.sleep(0.02)
            return got
    got = asyncio.run(main())
    assert got == reference
    assert eng.pool.manager.num_used_blocks == 0 and not eng.seqs


def test_swap_in_with_nothing_left_to_restore(bundled_llm):
    """When the prefix cache already covers every saved token, a swap-in restores an empty range:
    its slot index must still be an integer tensor (an empty float tensor cannot index)."""
    import torch

    from workbench.sched.scheduler import SwapIn

    eng = engine(bundled_llm, max_num_seqs=2)
    rid = eng.add_request([5, 6, 7], SamplingParams(temperature=0.0, max_tokens=2))
    eng.step()
    seq = eng.seqs[rid]
    layers = len(eng.pool.k_cache)
    eng.runner.swap_space[rid] = torch.zeros(layers, 2, 3, eng.runner.nkv, eng.runner.hd)
    before = [k.clone() for k in eng.pool.k_cache]
    eng.runner.swap_in(SwapIn(seq, 3, 3))                       # nothing to copy back
    assert all(torch.equal(a, b) for a, b in zip(before, eng.pool.k_cache))
    assert rid not in eng.runner.swap_space
