"""The engine on paged KV storage: exact against the contiguous cache, prefix caching exact,
and every block back in the pool whatever happens to the request."""

from __future__ import annotations

import pytest

import workbench
from workbench import SamplingParams, WorkbenchError
from workbench.kv.paged import PagedKVConfig

GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
SYSTEM = ("The list data type has some more methods. Here are all of the methods of list objects: "
          "append, extend, insert, remove, pop, clear, index, count, sort, reverse and copy. ")
PROMPTS = [SYSTEM + q for q in ("What does pop return?", "How does sort work?", "What does pop return?",
                                "Is copy shallow?")] + ["An unrelated prompt about files.", SYSTEM[:40]]


def _paged(llm, **kw):
    return workbench.LLM(llm.model, tokenizer=llm.tokenizer, kv=PagedKVConfig(**kw), max_model_len=llm.max_model_len)


def _assert_pool_empty(llm):
    m = llm.kv_pool.manager
    assert m.num_used_blocks == 0, m.block_states()
    m.check_invariants()


@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_paged_greedy_equals_contiguous(random_llm, block_size):
    paged = _paged(random_llm, block_size=block_size, enable_prefix_caching=False)
    ref = [o.token_ids for o in random_llm.generate(PROMPTS, GREEDY)]
    assert [o.token_ids for o in paged.generate(PROMPTS, GREEDY)] == ref
    _assert_pool_empty(paged)


@pytest.mark.parametrize("block_size", [2, 16])
def test_prefix_cache_is_exact_and_hits(random_llm, block_size):
    off = _paged(random_llm, block_size=block_size, enable_prefix_caching=False)
    on = _paged(random_llm, block_size=block_size, enable_prefix_caching=True)
    ref = off.generate(PROMPTS, GREEDY)
    got = on.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    assert [o.text for o in got] == [o.text for o in ref]
    assert got[0].num_cached_tokens == 0 and got[0].prefix_miss_reason is not None
    for o in got[1:4]:   # the shared system prompt is served from the cache
        assert o.num_cached_tokens >= (len(random_llm.encode(SYSTEM)[1]) // block_size - 1) * block_size > 0
        assert o.num_cached_tokens % block_size == 0 and o.num_cached_tokens < len(o.prompt_token_ids)
    assert got[2].num_cached_tokens >= got[1].num_cached_tokens  # identical prompt: everything but the tail
    assert all(o.num_cached_tokens == 0 for o in ref)
    _assert_pool_empty(on)


def test_sampled_outputs_identical_with_prefix_cache(random_llm):
    p = SamplingParams(temperature=0.9, top_p=0.9, seed=5, max_tokens=12, ignore_eos=True)
    off = _paged(random_llm, block_size=4, enable_prefix_caching=False)
    on = _paged(random_llm, block_size=4, enable_prefix_caching=True)
    assert [o.token_ids for o in on.generate(PROMPTS, p)] == [o.token_ids for o in off.generate(PROMPTS, p)]


def test_blocks_return_when_a_stream_is_abandoned_or_fails(random_llm):
    llm = _paged(random_llm, block_size=4, enable_prefix_caching=True)
    it = llm.stream(PROMPTS[0], GREEDY)
    next(it)
    next(it)
    assert llm.kv_pool.manager.num_used_blocks > 0
    it.close()                               # the caller stops listening
    _assert_pool_empty(llm)
    # A pool too small for the generation: the request ends with a clear reason, the others
    # are served, and nothing leaked.
    tiny = _paged(random_llm, block_size=4, num_blocks=3, enable_prefix_caching=False)
    long_gen = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    big, ok = tiny.generate([list(range(1, 10)), [1, 2]], [long_gen, SamplingParams(temperature=0, max_tokens=3)])
    assert big.finish_reason == "rejected" and "KV pool has 3" in big.error and not big.token_ids
    assert ok.finish_reason == "length" and len(ok.token_ids) == 3
    _assert_pool_empty(tiny)
    (long_prompt,) = tiny.generate([list(range(1, 40))], GREEDY)
    assert long_prompt.finish_reason == "rejected" and "KV pool" in long_prompt.error
    _assert_pool_empty(tiny)


def test_pool_sizing_by_bytes(random_llm):
    cfg = random_llm.model.config
    per_block = 2 * cfg.num_hidden_layers * 8 * cfg.num_key_value_heads * cfg.head_dim * 4  # fp32, block 8
    llm = _paged(random_llm, block_size=8, kv_cache_bytes=10 * per_block + 5)
    assert llm.kv_pool.num_blocks == 10 and llm.kv_pool.nbytes() == 10 * per_block
    with pytest.raises(WorkbenchError, match="kv_cache_bytes"):
        _paged(random_llm, block_size=8, kv_cache_bytes=per_block - 1)


def test_bundled_model_prefix_cache_exact(bundled_llm):
    off = _paged(bundled_llm, block_size=16, enable_prefix_caching=False)
    on = _paged(bundled_llm, block_size=16, enable_prefix_caching=True)
    p = SamplingParams(temperature=0, max_tokens=16)
    assert [o.token_ids for o in on.generate(PROMPTS, p)] == [o.token_ids for o in off.generate(PROMPTS, p)] \
        == [o.token_ids for o in bundled_llm.generate(PROMPTS, p)]
