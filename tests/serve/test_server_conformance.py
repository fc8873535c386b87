"""What real OpenAI clients send, answered as they expect: ``echo`` + ``logprobs`` (lm-eval's
loglikelihood requests), prompt batches (lm-eval with ``batch_size`` > 1), ``n`` > 1 samples
sharing the prompt's KV blocks, chat ``logprobs`` / ``top_logprobs``,
``stream_options.continuous_usage_stats`` (guidellm, aiperf), and the checkpoint's own chat
template.  Every figure is checked against the engine itself (``LLM.generate`` with the same
sampling parameters and ``prompt_logprobs`` / ``logprobs``), and the wire shape through the
official ``openai`` client's types.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from workbench import SamplingParams  # noqa: E402
from workbench.kv.paged import PagedKVConfig  # noqa: E402
from workbench.sched import SchedulerConfig  # noqa: E402
from workbench.engine import LLMEngine  # noqa: E402
from workbench.serve import ServerConfig, start_server  # noqa: E402
from workbench.serve.chat_template import ChatTemplate, TemplateError  # noqa: E402
from workbench.serve.requests import MAX_LOGPROBS, MAX_N, render_chat  # noqa: E402

PROMPT = "The list type"
IDS = [464, 1351, 2099, 318]
TOL = 1e-4


@pytest.fixture(scope="module")
def srv(bundled_llm):
    eng = LLMEngine(bundled_llm, kv=PagedKVConfig(block_size=4, num_blocks=256),
                    scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256))
    with start_server(eng, ServerConfig(port=0, model_name="wb")) as handle:
        yield handle


@pytest.fixture(scope="module")
def http(srv):
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0, timeout=60)


def run(llm, prompt, **kw):
    """The engine's own answer for one prompt (reference configuration)."""
    return llm.generate(prompt, SamplingParams(**kw))[0]


def ok(r) -> dict:
    assert r.status_code == 200, r.text
    return r.json()


def sse_chunks(http, path: str, body: dict) -> list[dict]:
    with http.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]


# ---- echo + logprobs --------------------------------------------------------------------------
@pytest.mark.parametrize("prompt", [PROMPT, IDS])
def test_echo_logprobs_equal_the_engines(http, bundled_llm, prompt):
    """lm-eval's loglikelihood request (echo, logprobs, one token): every prompt token's
    log-probability and top-k, then the generated token's, as the engine computes them."""
    body = ok(http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1, "temperature": 0, "echo": True,
                                                 "logprobs": 2}))
    ref = run(bundled_llm, prompt, temperature=0, max_tokens=1, logprobs=2, prompt_logprobs=2)
    ids = ref.prompt_token_ids
    (choice,) = body["choices"]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(ids) + 1
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None   # nothing precedes the first
    entries = ref.prompt_logprobs[1:] + ref.logprobs
    for got, top, e in zip(lp["token_logprobs"][1:], lp["top_logprobs"][1:], entries):
        assert abs(got - e["logprob"]) < TOL
        assert len(top) in (2, 3) and abs(max(top.values()) - max(e["top"].values())) < TOL
        assert top[bundled_llm.tokenizer.token_to_str(e["token_id"])] == pytest.approx(e["logprob"], abs=TOL)
    text = PROMPT if isinstance(prompt, str) else bundled_llm.tokenizer.decode(IDS)
    assert choice["text"] == text + ref.text
    assert body["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 1, "total_tokens": len(ids) + 1}
    offsets = lp["text_offset"]
    assert offsets == sorted(offsets) and offsets[-1] == len(text)    # the generated token starts after the prompt


@pytest.mark.parametrize("prompt", ["héllo → wörld 日本語 🙂 ok", [0, 621, 641, 665]])
def test_text_offsets_index_the_text(http, bundled_llm, prompt):
    """Each token starts at its offset: tokens that split a UTF-8 character start at that
    character; a special token (BOS) that the text skips adds nothing."""
    body = ok(http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 3, "temperature": 0, "echo": True,
                                                 "logprobs": 0, "ignore_eos": True}))
    (choice,) = body["choices"]
    text, lp = choice["text"], choice["logprobs"]
    tok = bundled_llm.tokenizer
    ids = bundled_llm.encode(prompt)[1] if isinstance(prompt, str) else prompt
    assert lp["text_offset"] == sorted(lp["text_offset"]) and max(lp["text_offset"]) < len(text)
    checked = 0
    for t, off in zip(lp["tokens"], lp["text_offset"]):
        if "\ufffd" not in t and t != "<|endoftext|>":
            assert text[off:off + len(t)] == t, (t, off, text)
            checked += 1
    assert checked >= len(ids) // 2
    if not isinstance(prompt, str):
        assert text.startswith(tok.decode(prompt)) and lp["text_offset"][:2] == [0, 0]


def test_echo_with_max_tokens_zero_returns_the_prompt_alone(http, bundled_llm):
    body = ok(http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 0, "echo": True, "logprobs": 0}))
    ref = run(bundled_llm, PROMPT, temperature=0, max_tokens=1, prompt_logprobs=0)
    (choice,) = body["choices"]
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
    assert len(choice["logprobs"]["tokens"]) == len(ref.prompt_token_ids)
    # to 1e-4, not by rounding to 4 decimals: a value near a rounding boundary flips on a 1e-6
    # float difference (the server's process may reduce in another thread order)
    assert choice["logprobs"]["token_logprobs"][1:] == \
        pytest.approx([e["logprob"] for e in ref.prompt_logprobs[1:]], abs=1e-4)
    assert body["usage"]["completion_tokens"] == 0


def test_echo_without_logprobs_and_max_tokens_zero_needs_echo(http, bundled_llm):
    body = ok(http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 3, "temperature": 0, "echo": True}))
    assert body["choices"][0]["text"] == PROMPT + run(bundled_llm, PROMPT, temperature=0, max_tokens=3).text
    assert body["choices"][0]["logprobs"] is None
    r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def test_streamed_echo_logprobs(http, bundled_llm):
    chunks = sse_chunks(http, "/v1/completions", {"prompt": PROMPT, "max_tokens": 3, "temperature": 0, "echo": True,
                                                  "logprobs": 1, "ignore_eos": True})
    ref = run(bundled_llm, PROMPT, temperature=0, max_tokens=3, logprobs=1, prompt_logprobs=1, ignore_eos=True)
    first, *tokens, last = chunks
    assert first["choices"][0]["text"] == PROMPT
    assert len(first["choices"][0]["logprobs"]["tokens"]) == len(ref.prompt_token_ids)
    assert "".join(c["choices"][0]["text"] for c in tokens) == ref.text
    got = [c["choices"][0]["logprobs"]["token_logprobs"][0] for c in tokens]
    assert all(abs(g - e["logprob"]) < TOL for g, e in zip(got, ref.logprobs)) and len(got) == 3
    offsets = [c["choices"][0]["logprobs"]["text_offset"][0] for c in tokens]
    assert offsets[0] == len(PROMPT) and offsets == sorted(offsets)
    assert last["choices"][0]["finish_reason"] == "length"


# ---- prompt batches and n -------------------------------------------------------------------------
def test_prompt_batches_answer_in_order(http, bundled_llm):
    prompts = [PROMPT, IDS, "A tuple is", [464, 1351]]
    body = ok(http.post("/v1/completions", json={"prompt": prompts, "max_tokens": 4, "temperature": 0}))
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    refs = [run(bundled_llm, p, temperature=0, max_tokens=4) for p in prompts]
    assert [c["text"] for c in body["choices"]] == [r.text for r in refs]
    assert body["usage"]["prompt_tokens"] == sum(len(r.prompt_token_ids) for r in refs)
    assert body["usage"]["completion_tokens"] == sum(len(r.token_ids) for r in refs)


def test_a_bad_prompt_in_a_batch_names_its_index(http):
    r = http.post("/v1/completions", json={"prompt": [PROMPT, [1, -5]], "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt[1]", r.text
    r = http.post("/v1/completions", json={"prompt": [PROMPT, ""], "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt[1]", r.text


def test_n_samples_equal_single_requests_seeded_seed_plus_j(http, bundled_llm):
    body = ok(http.post("/v1/completions", json={"prompt": [PROMPT, IDS], "n": 3, "max_tokens": 6, "temperature": 1.0,
                                                 "seed": 11, "ignore_eos": True}))
    assert [c["index"] for c in body["choices"]] == list(range(6))
    for i, p in enumerate([PROMPT, IDS]):
        for j in range(3):
            ref = run(bundled_llm, p, temperature=1.0, seed=11 + j, max_tokens=6, ignore_eos=True)
            assert body["choices"][i * 3 + j]["text"] == ref.text, (i, j)
    texts = [c["text"] for c in body["choices"][:3]]
    assert len(set(texts)) > 1                  # seeds 11, 12, 13 do not all agree (else the seeding is broken)
    assert body["usage"]["prompt_tokens"] == len(run(bundled_llm, PROMPT, max_tokens=1).prompt_token_ids) + len(IDS)


def test_n_samples_compute_the_prompt_once(srv, http, bundled_llm):
    """The n samples of a prompt are engine forks: the prompt's tokens are prefilled once (not n
    times) and the samples share its blocks."""
    prompt = [464 + i for i in range(37)]       # 9 full blocks of 4 and one partial: copy-on-write
    eng = srv.engine.engine
    mark = eng.step_records[-1].step if eng.step_records else -1
    cows = eng.pool.manager.stats.cow_copies
    body = ok(http.post("/v1/completions", json={"prompt": prompt, "n": 4, "max_tokens": 5, "temperature": 0,
                                                 "ignore_eos": True}))
    greedy = run(bundled_llm, prompt, temperature=0, max_tokens=5, ignore_eos=True).text
    assert [c["text"] for c in body["choices"]] == [greedy] * 4
    prefill = sum(r.prefill_tokens for r in eng.step_records if r.step > mark)
    assert prefill == len(prompt), prefill
    assert eng.pool.manager.stats.cow_copies - cows == 3        # each fork copied the shared partial block


def test_continuous_usage_needs_include_usage_and_echo_counts_no_token(http):
    """As vLLM: continuous_usage_stats without include_usage adds nothing; the echoed prompt's
    chunk counts no completion token yet."""
    chunks = sse_chunks(http, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "stream_options": {
        "continuous_usage_stats": True}})
    assert all("usage" not in c for c in chunks)
    chunks = sse_chunks(http, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "echo": True, "stream_options": {
        "include_usage": True, "continuous_usage_stats": True}})
    assert chunks[0]["choices"][0]["text"] == PROMPT and chunks[0]["usage"]["completion_tokens"] == 0
    assert chunks[1]["usage"]["completion_tokens"] == 1


def test_streamed_n_and_continuous_usage(http, bundled_llm):
    body = {"messages": [{"role": "user", "content": "What is a list?"}], "max_tokens": 3, "n": 2,
            "temperature": 0, "ignore_eos": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    chunks = sse_chunks(http, "/v1/chat/completions", body)
    prompt_tokens = len(bundled_llm.encode(render_chat([("user", "What is a list?")]))[1])
    assert all(c["usage"] is not None for c in chunks)
    per_choice: dict[int, list[str]] = {0: [], 1: []}
    for c in chunks[:-1]:
        (ch,) = c["choices"]
        per_choice[ch["index"]].append(ch["delta"].get("content") or "")
        assert c["usage"]["prompt_tokens"] == prompt_tokens
    ref = run(bundled_llm, render_chat([("user", "What is a list?")]), temperature=0, max_tokens=3, ignore_eos=True)
    assert "".join(per_choice[0]) == "".join(per_choice[1]) == ref.text
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == {
        "prompt_tokens": prompt_tokens, "completion_tokens": 6, "total_tokens": prompt_tokens + 6}
    counts = [c["usage"]["completion_tokens"] for c in chunks[:-1] if c["choices"][0]["index"] == 0]
    assert counts == sorted(counts) and counts[-1] == 3


# ---- chat logprobs ------------------------------------------------------------------------------
def test_chat_logprobs_equal_the_engines(client, bundled_llm):
    r = client.chat.completions.create(model="wb", messages=[{"role": "user", "content": "Hello"}], max_tokens=3,
                                       temperature=0, logprobs=True, top_logprobs=3)
    ref = run(bundled_llm, render_chat([("user", "Hello")]), temperature=0, max_tokens=3, logprobs=3)
    content = r.choices[0].logprobs.content
    assert [c.logprob for c in content] == pytest.approx([e["logprob"] for e in ref.logprobs], abs=TOL)
    tok = bundled_llm.tokenizer
    assert "".join(c.token for c in content) == ref.text == r.choices[0].message.content
    assert b"".join(bytes(c.bytes) for c in content) == ref.text.encode()
    for c, e in zip(content, ref.logprobs):
        assert len(c.top_logprobs) == 3
        assert [t.logprob for t in c.top_logprobs] == pytest.approx(sorted(e["top"].values(), reverse=True), abs=TOL)
        assert c.top_logprobs[0].token == tok.token_to_str(max(e["top"], key=e["top"].get))


def test_chat_logprobs_false_or_absent_gives_none(client):
    r = client.chat.completions.create(model="wb", messages=[{"role": "user", "content": "Hi"}], max_tokens=1)
    assert r.choices[0].logprobs is None


# ---- the openai client's types -------------------------------------------------------------------
def test_openai_client_reads_batches_n_echo_logprobs(client, bundled_llm):
    r = client.completions.create(model="wb", prompt=[PROMPT, "A tuple is"], n=2, max_tokens=2, temperature=0,
                                  echo=True, logprobs=1)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    for c, p in zip(r.choices, [PROMPT, PROMPT, "A tuple is", "A tuple is"]):
        assert c.text.startswith(p) and c.logprobs.token_logprobs[0] is None
        assert len(c.logprobs.tokens) == len(c.logprobs.top_logprobs) == len(c.logprobs.text_offset)
    assert r.choices[0].text == r.choices[1].text                       # greedy: both samples agree


# ---- still refused, clearly -------------------------------------------------------------------------
@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": PROMPT, "n": MAX_N + 1}, "n"),
    ("/v1/completions", {"prompt": PROMPT, "n": 2, "best_of": 3}, "best_of"),
    ("/v1/completions", {"prompt": PROMPT, "logprobs": MAX_LOGPROBS + 1}, "logprobs"),
    ("/v1/completions", {"prompt": PROMPT, "echo": "yes"}, "echo"),
    ("/v1/completions", {"prompt": PROMPT, "suffix": "x"}, "suffix"),
    ("/v1/completions", {"prompt": [PROMPT] * 200, "n": 2}, "n"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True,
                              "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stream": True,
                              "stream_options": {"continuous_usage_stats": "yes"}},
     "stream_options.continuous_usage_stats"),
])
def test_refused_with_the_field_named(http, path, body, param):
    r = http.post(path, json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_max_logprobs_is_the_engines():
    from workbench.engine.sampling import MAX_LOGPROBS as ENGINE_MAX

    assert MAX_LOGPROBS == ENGINE_MAX


# ---- the checkpoint's chat template ----------------------------------------------------------------
TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' and not loop.first %}"
            "{{ raise_exception('the system message must come first') }}{% endif %}"
            "<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n"
            "{% endif %}")


def test_chat_template_from_a_folder(tmp_path):
    assert ChatTemplate.from_folder(tmp_path) is None
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": {"content": "<s>"},
                                                                 "chat_template": TEMPLATE}))
    t = ChatTemplate.from_folder(tmp_path)
    assert t.render([{"role": "user", "content": "Hi"}]) == "<s><|user|>\nHi\n<|assistant|>\n"
    with pytest.raises(TemplateError, match="must come first"):
        t.render([{"role": "user", "content": "a"}, {"role": "system", "content": "b"}])
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    assert ChatTemplate.from_folder(tmp_path).render([{"role": "user", "content": "Hi"}]) == "[Hi]"   # the file wins
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}")
    with pytest.raises(TemplateError, match="does not parse"):
        ChatTemplate.from_folder(tmp_path)


def test_chat_template_features_transformers_templates_use():
    """``{% generation %}`` (assistant masks), ``tojson`` with its keywords, text parts as a list."""
    t = ChatTemplate("{% for m in messages %}{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}"
                     "{% endgeneration %}{% elif m['content'] is string %}{{ m['content'] }}{% else %}"
                     "{% for p in m['content'] %}<{{ p['text'] }}>{% endfor %}{% endif %}|{% endfor %}"
                     "{{ {'b': 1, 'a': [1, 2]} | tojson(separators=(',', ':'), sort_keys=true) }}", {}, "t")
    msgs = [{"role": "user", "content": [{"type": "text", "text": "x"}, {"type": "text", "text": "y"}]},
            {"role": "assistant", "content": "ok"}]
    assert t.render(msgs) == '<x><y>|ok|{"a":[1,2],"b":1}'


def test_text_parts_render_joined_in_the_plain_template(http, bundled_llm):
    msgs = [{"role": "user", "content": [{"type": "text", "text": "What is "}, {"type": "text", "text": "a list?"}]}]
    body = ok(http.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 3, "temperature": 0}))
    ref = run(bundled_llm, render_chat([("user", "What is a list?")]), temperature=0, max_tokens=3)
    assert body["choices"][0]["message"]["content"] == ref.text


def test_server_applies_the_checkpoints_template(srv, http, bundled_llm):
    state = srv.app.state.server
    saved = state.chat_template
    state.chat_template = ChatTemplate(TEMPLATE, {"bos_token": "<|endoftext|>"}, "test template")
    try:
        msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a list?"}]
        body = ok(http.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 4, "temperature": 0}))
        rendered = "<|endoftext|><|system|>\nBe brief.\n<|user|>\nWhat is a list?\n<|assistant|>\n"
        ids = bundled_llm.tokenizer.encode(rendered, add_special_tokens=False)    # the template wrote the BOS
        assert body["usage"]["prompt_tokens"] == len(ids)
        assert body["choices"][0]["message"]["content"] == run(bundled_llm, ids, temperature=0, max_tokens=4).text
        r = http.post("/v1/chat/completions", json={"messages": msgs[::-1], "max_tokens": 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
        assert "must come first" in r.json()["error"]["message"]
    finally:
        state.chat_template = saved


# ---- one request cannot end the others ------------------------------------------------------------
def test_vanishing_temperature_or_top_p_among_streams(srv, bundled_llm):
    """Once, a request with temperature ~1e-38 or top_p ~1e-46 failed sampling inside the batched
    step and every stream in flight ended with "engine error".  Now each is greedy and every
    stream finishes with its exact tokens."""
    import concurrent.futures as cf

    prompts = ["The list type", "A tuple is", "Dictionaries are", "The for statement"]
    odd = [{"temperature": 1e-38}, {"top_p": 1e-46, "temperature": 1.0, "seed": 5},
           {"temperature": 0}, {"temperature": 1e-38, "top_p": 1e-46}]

    def one(p, extra):
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            return sse_chunks(c, "/v1/completions", {"prompt": p, "max_tokens": 8, "ignore_eos": True, **extra})

    with cf.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(one, prompts, odd))
    for p, chunks in zip(prompts, results):
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        text = "".join(c["choices"][0]["text"] for c in chunks)
        assert text == run(bundled_llm, p, temperature=0, max_tokens=8, ignore_eos=True).text, p
