"""Samples of one prompt with prompt logprobs cost one prompt, whatever ``max_num_seqs`` leaves room
for, and a step that mixes a long prompt chunk with short ones does not pay for padding.

Before: a fork released for lack of room in ``max_num_seqs`` recomputed its whole prompt with
every row's logits (no prefix-cache reuse), so two 1,000-token prompts with ``n`` 16 under
``max_num_seqs`` 8 computed 24,000 prompt tokens in 39 steps, and a small request queued behind
them waited ~26 s.  Now a released fork takes its parent's prompt logprobs (known by then) and
rebuilds only KV, from the prefix cache."""

from __future__ import annotations

import pytest
import torch

from workbench.engine import LLMEngine
from workbench.engine.sampling import SamplingParams
from workbench.kv.paged import PagedKVConfig
from workbench.sched import SchedulerConfig

PROMPT = [(i * 7) % 1000 + 10 for i in range(300)]


def _run(llm, n: int, max_num_seqs: int, extra: bool = False, max_tokens: int = 3):
    eng = LLMEngine(llm, kv=PagedKVConfig(block_size=16, num_blocks=256),
                    scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=128))
    for j in range(n):
        eng.add_request(PROMPT, SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=2, prompt_logprobs=5),
                        request_id=f"s{j}", **({"fork_of": "s0"} if j else {}))
    outs = {}
    while eng.has_unfinished():
        for ev in eng.step():
            if ev.finished:
                outs[ev.request_id] = eng.seqs[ev.request_id].output
            if extra and ev.request_id == "s0" and ev.token_id >= 0 and "small" not in eng.seqs:
                # after the parent's first token: the forks without room are queued by now
                eng.add_request(PROMPT[:5], SamplingParams(temperature=0, max_tokens=2), request_id="small")
                eng.small_added_after = eng.step_records[-1].step
    return eng, outs


def test_released_forks_share_the_prompt_logprobs(bundled_llm):
    eng, outs = _run(bundled_llm, n=8, max_num_seqs=3)
    prefill = sum(r.prefill_tokens for r in eng.step_records)
    # the parent's 300 tokens, then each of the 5 released forks rebuilds only its partly filled last block
    # (300 = 18 full blocks of 16 + 12) from the prefix cache; before, each recomputed all 300
    assert prefill <= len(PROMPT) + 5 * 16, prefill
    ref = outs["s0"].prompt_logprobs
    assert ref[0] is None and all(e is not None for e in ref[1:])
    for j in range(1, 8):
        o = outs[f"s{j}"]
        assert o.prompt_logprobs == ref                           # equal values ...
        assert o.prompt_logprobs[1] is not ref[1]                 # ... in the fork's own dicts
        assert o.prompt_logprobs[1]["top"] is not ref[1]["top"]
        assert o.token_ids == outs["s0"].token_ids   # greedy: the same tokens


def test_released_forks_match_each_prompt_computed_alone(bundled_llm):
    """What a released fork reports equals what a request computes alone (batch invariance)."""
    _, shared = _run(bundled_llm, n=4, max_num_seqs=2)
    _, alone = _run(bundled_llm, n=1, max_num_seqs=2)   # (1 takes the unbatched runner)
    assert shared["s3"].prompt_logprobs == alone["s0"].prompt_logprobs
    assert shared["s3"].token_ids == alone["s0"].token_ids


def test_a_small_request_is_not_queued_behind_every_sample(bundled_llm):
    """The small request, queued behind 16 one-token samples of a 300-token prompt with prompt
    logprobs (the amplification request's shape), has its first token within a handful of steps
    (it waited behind 12 prompt recomputations with every row's logits: 31 steps)."""
    eng, outs = _run(bundled_llm, n=16, max_num_seqs=4, extra=True, max_tokens=1)
    arrived = eng.small_added_after
    steps = [r.step for r in eng.step_records if "small" in r.request_ids]
    assert steps and steps[0] - arrived <= 6, [(r.step, r.request_ids) for r in eng.step_records]
    assert outs["small"].finish_reason == "length"


def test_prompt_logprobs_survive_a_recompute_preemption(bundled_llm):
    """A request preempted by recompute after its prompt logprobs are known rebuilds its KV from the
    prefix cache (not every row's logits again) and reports what it reports alone."""
    def engine():
        return LLMEngine(bundled_llm, kv=PagedKVConfig(block_size=16, num_blocks=22),
                         scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=512))

    params = SamplingParams(temperature=0, max_tokens=20, prompt_logprobs=3)
    alone = engine()
    alone.add_request(PROMPT, params, request_id="low")
    while alone.has_unfinished():
        alone.step()
    eng = engine()
    eng.add_request(PROMPT, params, request_id="low", priority=0)
    while not eng.seqs["low"].num_generated:
        eng.step()
    assert eng.seqs["low"].prompt_logprobs_done
    eng.add_request(PROMPT[::-1][:100], SamplingParams(temperature=0, max_tokens=2), request_id="high", priority=5)
    while eng.has_unfinished():
        eng.step()
    low = eng.seqs["low"]
    assert low.num_preemptions >= 1
    recomputed = [r.request_tokens[r.request_ids.index("low")] for r in eng.step_records
                  if "low" in r.request_ids and r.request_prefill[r.request_ids.index("low")]]
    assert recomputed[0] == len(PROMPT) and max(recomputed[1:]) < len(PROMPT) - 100, recomputed
    assert low.output.prompt_logprobs == alone.seqs["low"].output.prompt_logprobs
    assert low.output.token_ids == alone.seqs["low"].output.token_ids


@pytest.mark.parametrize("window", [None, 64])
def test_unpadded_fp64_attention_equals_the_padded_one(bundled_llm, window):
    """The batch-invariant path attends per sequence when padding would dominate (a long prompt chunk
    beside short ones): its output rounds to exactly the padded path's."""
    from workbench.kv import batch as B

    torch.manual_seed(0)
    nh, nkv, hd, S = 8, 4, 32, 200
    q = torch.randn(1, nh, 150, hd, dtype=torch.float64).float()
    k = torch.randn(1, nkv, S, hd)
    v = torch.randn(1, nkv, S, hd)
    start = S - 150
    q_pos = torch.arange(start, S)[:, None]
    k_pos = torch.arange(S)[None]
    mask = k_pos <= q_pos
    if window is not None:
        mask &= k_pos > q_pos - window
    one = B.attention_fp64(q, k, v, mask[None, None]).float()
    # the same sequence padded as in a group with a longer one: 50 more keys and 30 more query rows, masked
    qp = torch.cat([q, torch.randn(1, nh, 30, hd)], 2)
    kp, vp = torch.cat([k, torch.randn(1, nkv, 50, hd)], 2), torch.cat([v, torch.randn(1, nkv, 50, hd)], 2)
    maskp = torch.zeros(180, S + 50, dtype=torch.bool)
    maskp[:150, :S] = mask
    maskp[150:, 0] = True
    padded = B.attention_fp64(qp, kp, vp, maskp[None, None]).float()[:, :, :150]
    assert torch.equal(one, padded)
