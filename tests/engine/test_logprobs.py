"""Log-probabilities from the engine: of each generated token and of every prompt token, equal
to a plain forward's log-softmax, in every mode (reference, chunked paged batches, prefix cache
on: prompt-logprob requests compute their prompt in full)."""

from __future__ import annotations

import pytest
import torch

from workbench import LLMEngine, SamplingParams, SchedulerConfig
from workbench.errors import ConfigError
from workbench.kv.paged import PagedKVConfig

PROMPT = "The list data type has some more methods. Here are all of the methods of list objects"


def _plain(llm, ids):
    with torch.inference_mode():
        return torch.log_softmax(llm.model(torch.tensor([ids]))[0].float(), -1)


@pytest.mark.parametrize("mode", ["reference", "paged-chunked", "tiny-budget"])
def test_prompt_and_output_logprobs_equal_a_plain_forward(random_llm, mode):
    ids = random_llm.encode(PROMPT)[1]
    eng = {"reference": lambda: random_llm.engine,
           "paged-chunked": lambda: LLMEngine(random_llm, kv=PagedKVConfig(block_size=4),
                                              scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8)),
           "tiny-budget": lambda: LLMEngine(random_llm, kv=PagedKVConfig(block_size=4),
                                            scheduler=SchedulerConfig(max_num_seqs=2,
                                                                      max_num_batched_tokens=3))}[mode]()
    params = SamplingParams(temperature=0, max_tokens=5, logprobs=3, prompt_logprobs=2, ignore_eos=True)
    warm, out = eng.generate([ids, ids], [params, params])       # the second would hit the first's blocks
    assert out.num_cached_tokens == 0 and (out.prefix_miss_reason in ("full_prompt", "disabled"))
    ref = _plain(random_llm, ids + out.token_ids)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    for p in range(1, len(ids)):
        e = out.prompt_logprobs[p]
        assert e["token_id"] == ids[p] and abs(e["logprob"] - ref[p - 1, ids[p]].item()) < 1e-4
        assert len(e["top"]) == 2 and max(e["top"].values()) == pytest.approx(ref[p - 1].max().item(), abs=1e-4)
    assert [e["token_id"] for e in out.logprobs] == out.token_ids
    for j, e in enumerate(out.logprobs):
        row = ref[len(ids) - 1 + j]
        assert abs(e["logprob"] - row[e["token_id"]].item()) < 1e-4 and len(e["top"]) == 3
        assert e["logprob"] == pytest.approx(max(e["top"].values()), abs=1e-6), "greedy: the top token"


def test_logprobs_ride_on_stream_events(random_llm):
    ev = [e for e in random_llm.stream(PROMPT, SamplingParams(temperature=0, max_tokens=3, logprobs=1))]
    assert all(e.logprobs is not None and len(e.logprobs["top"]) == 1 for e in ev)


def test_bad_logprob_counts_and_static_prompt_logprobs_are_refused(random_llm):
    with pytest.raises(ConfigError, match="logprobs"):
        SamplingParams(logprobs=21)
    with pytest.raises(ConfigError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)
    static = LLMEngine(random_llm, kv="contiguous", static_decode=True,
                       scheduler=SchedulerConfig(max_num_seqs=1))
    with pytest.raises(ConfigError, match="static contiguous decode buffers.*paged pool"):
        static.add_request(PROMPT, SamplingParams(prompt_logprobs=1))
    assert not static.seqs
