"""The reference engine: determinism, streaming, sampling, stop conditions, metrics, errors."""

from __future__ import annotations

import math

import pytest
import torch

import workbench
from workbench import SamplingParams, WorkbenchError
from workbench.engine.sampling import sample

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
PROMPT = "The list data type has some more methods."


def test_greedy_is_deterministic_and_matches_uncached_argmax(random_llm):
    a, b = random_llm.generate([PROMPT, PROMPT], GREEDY)
    assert a.token_ids == b.token_ids and len(a.token_ids) == 24
    # Reference: recompute every step from scratch without the KV cache.
    ids = list(a.prompt_token_ids)
    with torch.no_grad():
        for tok in a.token_ids[:8]:
            logits = random_llm.model(torch.tensor([ids]))[0, -1]
            assert int(logits.argmax()) == tok
            ids.append(tok)


def test_stream_matches_generate_and_text_is_consistent(random_llm):
    out = random_llm.generate(PROMPT, GREEDY)[0]
    events = list(random_llm.stream(PROMPT, GREEDY))
    assert [e.token_id for e in events] == out.token_ids
    assert "".join(e.text for e in events) == out.text == random_llm.tokenizer.decode(out.token_ids)
    assert [e.index for e in events] == list(range(len(events)))
    assert events[-1].finished and events[-1].finish_reason == "length"
    assert not any(e.finished for e in events[:-1])
    times = [e.time for e in events]
    assert times == sorted(times) and all(e.since_arrival > 0 for e in events)


def test_seeded_sampling_is_reproducible(random_llm):
    p = SamplingParams(temperature=1.0, top_p=0.95, top_k=50, max_tokens=20, seed=7, ignore_eos=True)
    a = random_llm.generate(PROMPT, p)[0].token_ids
    b = random_llm.generate(PROMPT, p)[0].token_ids
    c = random_llm.generate(PROMPT, SamplingParams(temperature=1.0, max_tokens=20, seed=8, ignore_eos=True))[0]
    assert a == b
    assert a != c.token_ids


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.7, top_k=1, max_tokens=12, ignore_eos=True),
                                    SamplingParams(temperature=0.7, top_p=1e-6, max_tokens=12, ignore_eos=True)])
def test_top_k_1_and_tiny_top_p_equal_greedy(random_llm, params):
    greedy = random_llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    assert random_llm.generate(PROMPT, params)[0].token_ids == greedy.token_ids


def test_top_p_keeps_the_smallest_set_reaching_the_mass():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.2]))
    gen = torch.Generator().manual_seed(0)
    drawn = {int(sample(logits, SamplingParams(top_p=0.6), gen)) for _ in range(300)}
    assert drawn == {0, 1}
    drawn = {int(sample(logits, SamplingParams(top_p=0.5), gen)) for _ in range(100)}
    assert drawn == {0}
    drawn = {int(sample(logits, SamplingParams(top_k=2), gen)) for _ in range(300)}
    assert drawn == {0, 1}


def test_stop_string_truncates_text_and_stream(random_llm):
    full = random_llm.generate(PROMPT, GREEDY)[0]
    text = full.text
    stop = text[len(text) // 2: len(text) // 2 + 3]
    assert stop.strip(), f"pick a visible stop string from {text!r}"
    cut = text.index(stop)
    p = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop, "\x00never"])
    out = random_llm.generate(PROMPT, p)[0]
    assert out.text == text[:cut]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert "".join(e.text for e in random_llm.stream(PROMPT, p)) == text[:cut]
    p.include_stop_str_in_output = True
    assert random_llm.generate(PROMPT, p)[0].text == text[:cut + len(stop)]


def test_eos_ends_the_request(random_llm):
    full = random_llm.generate(PROMPT, GREEDY)[0]
    eos = full.token_ids[3]
    saved = random_llm.eos_token_ids
    random_llm.eos_token_ids = {eos}
    try:
        out = random_llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=24))[0]
        first = full.token_ids.index(eos)
        assert out.token_ids == full.token_ids[:first + 1]
        assert out.finish_reason == "stop" and out.stop_reason == eos
        ignored = random_llm.generate(PROMPT, GREEDY)[0]
        assert ignored.token_ids == full.token_ids
    finally:
        random_llm.eos_token_ids = saved


def test_context_limit_ends_with_length(random_llm):
    n = random_llm.max_model_len
    prompt = list(range(1, n - 3))
    out = random_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))[0]
    assert len(out.token_ids) == 4 and out.finish_reason == "length"


def test_metrics_are_consistent(random_llm):
    outs = random_llm.generate([PROMPT, "Another prompt"], GREEDY)
    for o in outs:
        m = o.metrics
        assert m.output_tokens == len(o.token_ids) == 24
        assert len(m.itl) == 23 and all(g >= 0 for g in m.itl)
        assert math.isclose(m.tpot, sum(m.itl) / len(m.itl), rel_tol=1e-9)
        assert 0 < m.ttft <= m.e2e
        assert m.decode_tokens_per_s == pytest.approx(1 / m.tpot)
    # Both arrive at the call: the second waited for the first.
    assert outs[1].metrics.time_in_queue >= outs[0].metrics.e2e * 0.99
    df = workbench.summarize(outs)
    assert {"p50", "p95", "p99", "jitter", "mean", "n"} <= set(df.columns)
    assert df.loc["itl_ms", "n"] == 46 and df.loc["ttft_ms", "n"] == 2
    assert df.loc["itl_ms", "p50"] <= df.loc["itl_ms", "p99"]
    # jitter (workbench.engine.metrics.jitter) is the sample std (n - 1): over every gap for ITL,
    # over the requests for TTFT (two requests: |a - b| / sqrt(2); the population std would give / 2)
    gaps = torch.tensor([g * 1e3 for o in outs for g in o.metrics.itl], dtype=torch.float64)
    assert df.loc["itl_ms", "jitter"] == pytest.approx(gaps.std(correction=1).item())
    a, b = (o.metrics.ttft * 1e3 for o in outs)
    assert df.loc["ttft_ms", "jitter"] == pytest.approx(abs(a - b) / math.sqrt(2))
    frame = random_llm.requests_frame(outs)
    assert list(frame["output_tokens"]) == [24, 24]


def test_token_id_prompts_and_presets():
    llm = workbench.LLM("preset:tiny", device="cpu")
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0]
    assert len(out.token_ids) == 5 and out.text is None
    with pytest.raises(WorkbenchError, match="token ids"):
        llm.generate("text needs a tokenizer", SamplingParams())


@pytest.mark.parametrize("kwargs, field", [({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"),
                                           ({"top_k": -3}, "top_k"), ({"max_tokens": 0}, "max_tokens"),
                                           ({"stop": [""]}, "stop")])
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(WorkbenchError, match=f"SamplingParams.{field}"):
        SamplingParams(**kwargs)


def test_bad_prompts_are_reported(random_llm):
    with pytest.raises(WorkbenchError, match="context"):
        random_llm.generate([list(range(1, 400))], GREEDY)
    with pytest.raises(WorkbenchError, match="outside the vocabulary"):
        random_llm.generate([[1, 10 ** 6]], GREEDY)
    with pytest.raises(WorkbenchError, match="empty"):
        random_llm.generate([[]], GREEDY)
    with pytest.raises(WorkbenchError, match="2 prompts but 1"):
        random_llm.generate(["a", "b"], [GREEDY])


def test_bundled_model_beats_unigram_on_heldout_text(bundled_llm):
    """The shipped weights are trained: held-out perplexity far below a unigram model's."""
    import json

    from workbench.data import heldout_documents

    stats = json.loads((workbench.BUNDLED_MODEL / "training_stats.json").read_text())
    ids = bundled_llm.tokenizer.encode(heldout_documents()[0]["text"])[:513]
    with torch.no_grad():
        logits = bundled_llm.model(torch.tensor([ids[:-1]]))[0]
    ppl = math.exp(torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:])).item())
    assert ppl < 0.25 * stats["unigram_perplexity"], (ppl, stats["unigram_perplexity"])


def test_missing_or_broken_tokenizer_is_reported(tmp_path):
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(workbench.BUNDLED_MODEL, folder, ignore=shutil.ignore_patterns("tokenizer*.json"))
    with pytest.raises(workbench.WorkbenchError, match=r"tokenizer\.json not found"):
        workbench.LLM(str(folder), device="cpu")
    (folder / "tokenizer.model").write_bytes(b"\x00")
    with pytest.raises(workbench.WorkbenchError, match="SentencePiece"):
        workbench.LLM(str(folder), device="cpu")
    (folder / "tokenizer.json").write_text("{not json")
    with pytest.raises(workbench.WorkbenchError, match="cannot read tokenizer"):
        workbench.LLM(str(folder), device="cpu")
    # Without a tokenizer the model itself still loads, and token-id prompts work via an explicit one.
    assert workbench.load_model(str(folder), device="cpu").config.vocab_size == 8192
