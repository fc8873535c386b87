"""lm-eval (EleutherAI's lm-evaluation-harness) runs unmodified against ``workbench serve``.

The server runs in-process on a free port with the bundled model and an API key; lm-eval
talks to it over HTTP exactly as it talks to vLLM, with its OpenAI-API model types:

- ``local-completions``: a loglikelihood task (multiple choice) and a generate_until task on
  the small task files under ``tests/data/lm_eval/`` (a JSON-lines dataset read with the
  ``json`` builder: no hub), the tokenizer from the model folder ``data/reference-model``.
  lm-eval tokenizes itself and sends token-id prompts in batches of 4; a loglikelihood request
  is ``echo: true, logprobs: 1, max_tokens: 1`` and lm-eval sums ``token_logprobs[ctxlen:-1]``.
  Those sums must equal the engine's own prompt log-probabilities (``SamplingParams.
  prompt_logprobs``) on the same token ids within 1e-4, and the greedy generations the engine's
  own greedy text for the same ids, stop strings and length.
- ``local-chat-completions``: a generate_until task sent as chat messages
  (``apply_chat_template``): lm-eval gets non-empty text, the engine's greedy text for the
  conversation as the server renders it.

Skipped when lm-eval is not installed (``pip install -e ".[real-clients]" -c
constraints/real-clients.txt``).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
pytest.importorskip("lm_eval", reason="lm-eval is not installed (the real-clients extra)")
for _mod in ("requests", "aiohttp", "tenacity"):    # lm_eval[api]: what its API model types need
    pytest.importorskip(_mod, reason=f"{_mod} is not installed (lm_eval[api], the real-clients extra)")
httpx = pytest.importorskip("httpx")

from workbench import SamplingParams  # noqa: E402
from workbench.serve import ServerConfig, start_server  # noqa: E402
from workbench.serve.requests import render_chat  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TASKS = ROOT / "tests" / "data" / "lm_eval"
MODEL_DIR = ROOT / "data" / "reference-model"
NAME = "workbench-reference"      # the served model name lm-eval asks for
KEY = "lm-eval-test-key"          # lm-eval sends "Authorization: Bearer $OPENAI_API_KEY"
BATCH = 4                         # prompts per completions request (a prompt array of token-id lists)
TOL = 1e-4


@pytest.fixture(scope="module")
def srv(bundled_llm):
    with start_server(bundled_llm, ServerConfig(port=0, model_name=NAME, api_key=KEY)) as handle:
        yield handle


@pytest.fixture(scope="module")
def lm_eval_env():
    """What lm-eval reads from the environment, for this module: the API key, no hub, and the
    task files' relative data paths resolved from the repository root."""
    mp = pytest.MonkeyPatch()
    mp.setenv("OPENAI_API_KEY", KEY)
    mp.setenv("HF_HUB_OFFLINE", "1")
    mp.setenv("HF_DATASETS_OFFLINE", "1")
    mp.setenv("TOKENIZERS_PARALLELISM", "false")
    mp.chdir(ROOT)
    yield
    mp.undo()


def _evaluate(model, tasks: list[str], **kw) -> dict:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    tm = TaskManager(include_path=str(TASKS), include_defaults=False)   # only our tasks: no index of ~10k
    res = simple_evaluate(model=model, tasks=tasks, task_manager=tm, log_samples=True, bootstrap_iters=0,
                          random_seed=0, numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0, **kw)
    assert res is not None
    return res


@pytest.fixture(scope="module")
def completions_run(srv, lm_eval_env):
    """lm-eval's ``local-completions`` model on both tasks: (the LM object, its results)."""
    from lm_eval.api.registry import get_model

    lm = get_model("local-completions")(
        model=NAME, base_url=f"{srv.base_url}/completions", tokenizer=str(MODEL_DIR),
        tokenizer_backend="huggingface", tokenized_requests=True, add_bos_token=True,
        max_length=srv.app.state.server.info["max_model_len"], batch_size=BATCH, max_retries=1)
    return lm, _evaluate(lm, ["workbench_mc", "workbench_gen"])


@pytest.fixture(scope="module")
def chat_run(srv, lm_eval_env):
    return _evaluate("local-chat-completions", ["workbench_chat"], apply_chat_template=True,
                     model_args={"model": NAME, "base_url": f"{srv.base_url}/chat/completions", "max_retries": 1})


def _docs() -> list[dict]:
    return [json.loads(line) for line in (TASKS / "workbench_tiny.jsonl").read_text().splitlines() if line.strip()]


def test_the_server_serves_the_name_lm_eval_asks_for(srv):
    with httpx.Client(base_url=srv.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=30) as c:
        assert [m["id"] for m in c.get("/v1/models").json()["data"]] == [NAME]


def test_loglikelihoods_equal_the_engine_prompt_logprobs(completions_run, bundled_llm):
    lm, res = completions_run
    samples = res["samples"]["workbench_mc"]
    assert len(samples) == len(_docs())
    checked, worst = 0, 0.0
    for s in samples:
        assert len(s["arguments"]) == len(s["resps"]) == len(s["filtered_resps"]) == len(s["doc"]["choices"])
        for (context, continuation), resp, filtered in zip(s["arguments"], s["resps"], s["filtered_resps"]):
            got_ll, got_greedy = resp[0]
            assert (got_ll, got_greedy) == tuple(filtered)
            ctx, cont = lm._encode_pair(context, continuation)      # the ids lm-eval sent, as it made them
            assert ctx and cont
            ids = ctx + cont
            out = bundled_llm.generate(ids, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1))[0]
            assert out.prompt_token_ids == ids and len(out.prompt_logprobs) == len(ids)
            entries = out.prompt_logprobs[len(ctx):]
            assert [e["token_id"] for e in entries] == cont
            want = math.fsum(e["logprob"] for e in entries)
            assert math.isfinite(got_ll) and abs(got_ll - want) < TOL, (
                f"doc {s['doc_id']} {continuation!r}: lm-eval {got_ll!r} != engine {want!r} "
                f"({len(cont)} continuation tokens after {len(ctx)})")
            worst = max(worst, abs(got_ll - want))
            greedy = all(e["logprob"] >= max(e["top"].values()) - 1e-6 for e in entries)
            assert got_greedy == greedy, f"doc {s['doc_id']} {continuation!r}: is_greedy"
            checked += 1
    assert checked == sum(len(d["choices"]) for d in _docs())
    print(f"lm-eval loglikelihoods: {checked} checked, largest |lm-eval - engine| = {worst:.2e}")
    # The bundled model knows its Python docs: the true continuation is the likeliest every time.
    assert res["results"]["workbench_mc"]["acc,none"] == 1.0


def test_generate_until_is_the_engine_greedy_text(completions_run, bundled_llm):
    lm, res = completions_run
    samples = res["samples"]["workbench_gen"]
    assert len(samples) == len(_docs())
    texts = []
    for s in samples:
        (context, gen_kwargs), = s["arguments"]
        ids = lm.tok_encode(context, add_special_tokens=lm.add_bos_token)    # what lm-eval sent
        stop = list(gen_kwargs["until"]) + [lm.eos_string]
        want = bundled_llm.generate(ids, SamplingParams(temperature=0, max_tokens=gen_kwargs["max_gen_toks"],
                                                        stop=stop))[0].text
        got = s["resps"][0][0]
        assert got == want, f"doc {s['doc_id']} {context!r}: lm-eval got {got!r}, the engine says {want!r}"
        assert s["filtered_resps"][0] == got
        texts.append(got)
    assert sum(bool(t.strip()) for t in texts) >= len(texts) - 1, texts   # the task's prompts were picked so


def test_chat_completions_generate_until(chat_run, bundled_llm):
    samples = chat_run["samples"]["workbench_chat"]
    docs = {str(i): d for i, d in enumerate(_docs())}
    assert len(samples) == len(docs)
    for s in samples:
        (_, gen_kwargs), = s["arguments"]
        got = s["resps"][0][0]
        assert isinstance(got, str) and got.strip(), f"doc {s['doc_id']}: empty chat text {got!r}"
        prompt = render_chat([{"role": "user", "content": docs[str(s["doc_id"])]["prompt"]}])
        want = bundled_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=gen_kwargs["max_gen_toks"],
                                                           stop=list(gen_kwargs["until"])))[0].text
        assert got == want, f"doc {s['doc_id']}: chat text {got!r}, the engine's greedy text {want!r}"
