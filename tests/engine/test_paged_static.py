"""Static decode steps over the paged pool (``kv=PagedKVConfig(...)`` with ``static_decode`` /
``compile``; ``cuda_graphs`` on a GPU in the device check): greedy tokens equal the eager pool's
with every layer the pool carries - the prefix cache, offload + lookahead, chunked prefill,
priorities and preemption (recompute and swap), forks (n > 1), logprobs, quantized layers,
streamed weights - every block comes back, and a padding row never touches a sequence's KV.

Most cases run the static step eagerly (``static_decode=True``: the same inputs, tables and
attention as the compiled step, without the compile time); ``compile=True`` runs twice, on the
whole stack and on a sliding-window model."""

from __future__ import annotations

import pytest
import torch

import workbench
from workbench import LLMEngine, SamplingParams, SchedulerConfig
from workbench.errors import ConfigError, WorkbenchError
from workbench.kv.paged import PagedKVConfig, PagedKVPool
from workbench.model.config import ModelConfig
from workbench.model.decoder import CausalLM, init_weights
from workbench.transforms.paged_graphs import PagedDecoder

SYSTEM = "You are a helpful assistant for the Python documentation. Answer briefly. "
PROMPTS = [SYSTEM + q for q in ("What is a list?", "How do I open a file?", "What does yield do?",
                                "Explain decorators.", "What is a module?", "How do exceptions work?")]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _engine(llm, kv=None, fast="static_decode", **sched):
    cfg = {"max_num_seqs": 4, "max_num_batched_tokens": 256, **sched}
    opts = {fast: True} if fast else {}
    return LLMEngine(llm, kv=kv or PagedKVConfig(block_size=8), scheduler=SchedulerConfig(**cfg), **opts)


def _tokens(eng, prompts=PROMPTS, params=GREEDY, priorities=None):
    outs = eng.generate(prompts, params, priorities=priorities)
    assert all(o.finish_reason == "length" for o in outs), [o.error for o in outs]
    return [o.token_ids for o in outs]


def _pool_back(eng):
    m = eng.pool.manager
    assert m.num_used_blocks == 0, m.block_states()
    m.check_invariants()


@pytest.fixture(scope="module")
def eager(bundled_llm):
    """Greedy tokens of PROMPTS on the eager pool (the same scheduler), the comparison for every case."""
    return _tokens(_engine(bundled_llm, fast=None))


def test_static_steps_over_the_pool_give_the_eager_pools_tokens(bundled_llm, eager):
    eng = _engine(bundled_llm)
    assert type(eng.runner).__name__ == "PagedStaticRunner" and "static-decode" in eng.describe()
    assert eng.pool.scratch_block == eng.pool.num_blocks          # one block past the manager's
    assert _tokens(eng) == eager
    assert eng.runner.static_steps > 0 and eng.runner.eager_steps > 0     # decode-only steps static, prefills eager
    assert eng.pool.manager.stats.hit_tokens > 0, "the shared system prompt was reused"
    _pool_back(eng)


def test_padding_rows_write_only_the_scratch_block(bundled_llm):
    """Three sequences in the bucket of 4: the fourth row's K/V lands in the scratch block, and no
    block of the pool that a sequence owns is written by it."""
    eng = _engine(bundled_llm, kv=PagedKVConfig(block_size=8, enable_prefix_caching=False))
    pool = eng.pool
    for t in pool.k_cache:
        t[pool.scratch_block].fill_(7.0)
    eng.generate(PROMPTS[:3], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert any((t[pool.scratch_block] != 7.0).any() for t in pool.k_cache), "padding rows wrote somewhere else"
    assert not any((t[:pool.scratch_block] == 7.0).any() for t in pool.k_cache)
    _pool_back(eng)


def test_offload_and_lookahead(bundled_llm, eager):
    """A pool too small to keep every prefix: evicted blocks go to host memory and come back,
    staged by the lookahead, under static decode steps."""
    kv = PagedKVConfig(block_size=4, num_blocks=24, offload="host", offload_blocks=64, lookahead=4)
    eng = _engine(bundled_llm, kv=kv, max_num_batched_tokens=64)
    assert _tokens(eng, PROMPTS[:1]) == eager[:1]
    filler = [[int(t) for t in torch.randint(5, 900, (60,), generator=torch.Generator().manual_seed(s))]
              for s in range(3)]
    eng.generate(filler, SamplingParams(temperature=0, max_tokens=2))     # evicts the system prompt's blocks
    assert _tokens(eng) == eager
    st = eng.pool.manager.stats
    assert st.evictions > 0 and st.restored_blocks > 0
    assert eng.pool.prefetch_stats()["uses"] > 0
    _pool_back(eng)
    eng.pool.close()


def test_chunked_prefill_and_one_token_chunks(bundled_llm, eager):
    """A 9-token budget: prompts in chunks of 9 and fewer, decode tokens beside them, and chunks of
    one token (which the static step runs, as a decode row)."""
    eng = _engine(bundled_llm, max_num_batched_tokens=9)
    seen = []
    real = eng.runner.decoder.decode

    def spy(tokens, positions, tables):
        seen.append(len(tokens))
        return real(tokens, positions, tables)

    eng.runner.decoder.decode = spy
    assert _tokens(eng) == eager
    assert seen and max(seen) > 1
    assert any(r.prefill_tokens and r.decode_tokens for r in eng.step_records), "no step mixed both"
    _pool_back(eng)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_priorities_and_preemption(bundled_llm, eager, mode):
    """A pool of 14 blocks of 4 for 6 sequences (56 slots, too few for all): sequences are preempted
    (recompute or swap), priority 1 first, and every request still gives its tokens."""
    kv = PagedKVConfig(block_size=4, num_blocks=14)
    eng = _engine(bundled_llm, kv=kv, preemption_mode=mode, max_num_seqs=6, max_num_batched_tokens=64)
    outs = eng.generate(PROMPTS, GREEDY, priorities=[0, 0, 0, 1, 1, 1])
    assert [o.token_ids for o in outs] == eager
    assert eng.scheduler.num_preemptions > 0 and sum(o.num_preemptions for o in outs) > 0
    assert not eng.runner.swap_space
    _pool_back(eng)


def test_forks_share_the_prompt_and_copy_on_write(bundled_llm):
    """n > 1: forks of one prompt share its blocks; each greedy sample equals the prompt alone."""
    eng = _engine(bundled_llm, kv=PagedKVConfig(block_size=8, num_blocks=64))
    alone = _tokens(eng, [PROMPTS[0]])[0]
    parent = eng.add_request(PROMPTS[0], GREEDY)
    rids = [parent] + [eng.add_request(PROMPTS[0], GREEDY, fork_of=parent) for _ in range(3)]
    while eng.has_unfinished():
        eng.step()
        eng.pool.manager.check_invariants()
    outs = [eng.release(r) for r in rids]
    assert [o.token_ids for o in outs] == [alone] * 4
    assert all(o.num_cached_tokens == len(o.prompt_token_ids) for o in outs[1:])
    _pool_back(eng)


def test_logprobs_and_prompt_logprobs(bundled_llm):
    """Output logprobs come from the static step's rows, prompt logprobs from the eager prefill:
    both equal a plain forward's log-softmax."""
    eng = _engine(bundled_llm, max_num_batched_tokens=16)
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=2, prompt_logprobs=1, ignore_eos=True)
    out = eng.generate([PROMPTS[1]], params)[0]
    ids = out.prompt_token_ids
    with torch.inference_mode():
        ref = torch.log_softmax(bundled_llm.model(torch.tensor([ids + out.token_ids]))[0].float(), -1)
    for p in range(1, len(ids)):
        assert abs(out.prompt_logprobs[p]["logprob"] - ref[p - 1, ids[p]].item()) < 1e-4
    for j, e in enumerate(out.logprobs):
        assert e["token_id"] == out.token_ids[j]
        assert abs(e["logprob"] - ref[len(ids) - 1 + j, e["token_id"]].item()) < 1e-4


def test_quantized_layers_and_streamed_weights(bundled_llm):
    """Quantized linear layers (W8A16) and streamed decoder layers compute inside the static step:
    the same tokens as the same model on the eager pool."""
    from workbench.prefetch.weights import WeightStreamConfig

    q = workbench.LLM(quant="w8a16", threads=1)
    assert _tokens(_engine(q, fast="static_decode")) == _tokens(_engine(q, fast=None))
    s = workbench.LLM(threads=1)
    eng = LLMEngine(s, kv=PagedKVConfig(block_size=8), static_decode=True,
                    stream_weights=WeightStreamConfig(resident_layers=2, distance=1, transport="host"),
                    scheduler=SchedulerConfig(max_num_seqs=4))
    assert _tokens(eng) == _tokens(_engine(bundled_llm, fast=None))
    assert eng.weight_streamer.stats()["fetches"] > 0


def test_compiled_stack_agrees_with_the_eager_pool(bundled_llm, eager):
    """``compile=True`` over the pool with the prefix cache, a host offload tier, chunked prefill
    and priorities, in one engine: every token equals the eager pool's, or the first divergence
    is a near-tie of the reference's logits."""
    from workbench.measure.agreement import divergence_margin

    kv = PagedKVConfig(block_size=8, num_blocks=48, offload="host", lookahead=2)
    eng = _engine(bundled_llm, kv=kv, fast="compile", max_num_batched_tokens=32)
    got = _tokens(eng, priorities=[0, 1, 0, 1, 0, 1])
    assert eng.runner.decoder.compiled and "compile" in eng.describe()
    for prompt, a, b in zip(PROMPTS, eager, got):
        if a != b:
            d = divergence_margin(bundled_llm.model, bundled_llm.encode(prompt)[1], a, b)
            assert d["top2_gap"] < 1e-3, d
    _pool_back(eng)
    eng.pool.close()


def test_sliding_window_model(bundled_tokenizer):
    """A Mistral-style sliding window: the static step masks keys outside the window."""
    cfg = ModelConfig(vocab_size=bundled_tokenizer.vocab_size, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=128, tie_word_embeddings=True, eos_token_id=0, sliding_window=12)
    llm = workbench.LLM(init_weights(CausalLM(cfg), seed=5).eval(), tokenizer=bundled_tokenizer)
    prompts = ["The list data type has some more methods of list objects", "A function is"]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    want = [o.token_ids for o in llm.generate(prompts, params)]           # the reference configuration
    for fast in ("static_decode", "compile"):
        assert _tokens(_engine(llm, fast=fast), prompts, params) == want, fast


def test_decoder_refuses_what_it_cannot_run(random_llm):
    model = random_llm.model
    pool = PagedKVPool(model.config, PagedKVConfig(block_size=4, num_blocks=8), model.device,
                       model.lm_head.weight.dtype, 32)
    with pytest.raises(ConfigError, match="scratch block"):
        PagedDecoder(model, pool, max_blocks=8)
    pool = PagedKVPool(model.config, PagedKVConfig(block_size=4, num_blocks=8), model.device,
                       model.lm_head.weight.dtype, 32, scratch_blocks=1)
    dec = PagedDecoder(model, pool, max_blocks=2, buckets=(1, 2))
    with pytest.raises(WorkbenchError, match="reserve its slot"):
        dec.decode([5], [4], [[0]])                       # position 4 is in a second block it does not have
    with pytest.raises(WorkbenchError, match="past the decoder"):
        dec.decode([5], [8], [[0, 1, 2]])
    with pytest.raises(WorkbenchError, match="largest bucket"):
        dec.decode([1, 2, 3], [0, 0, 0], [[0], [1], [2]])
    with pytest.raises(ConfigError, match="block tables"):
        dec.decode([1], [0, 1], [[0]])
