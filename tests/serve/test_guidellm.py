"""guidellm (the vLLM project's load generator) runs unmodified against ``workbench serve``.

The server runs in-process on a free port with the bundled model and an API key; guidellm's
own command line (``python -m guidellm run``, a subprocess, as a person runs it) sends a short
synthetic constant-rate load: 2 requests/s for 4 s, 24-token prompts made by its synthetic
text generator (Faker) and measured with the tokenizer of ``data/reference-model`` (so nothing
comes from the hub), 12 output tokens each.  guidellm streams (``stream_options``:
``include_usage`` and vLLM's ``continuous_usage_stats``) and asks for exactly that many tokens
(``ignore_eos``), to ``/v1/chat/completions`` (its default) and to ``/v1/completions``.

It must end with no errored request, every completed one having the 12 tokens asked for; its
summary tables are printed (``pytest -s`` or ``-rA`` shows them).  Bounded: about 20 s a run.

Skipped when guidellm is not installed (``pip install -e ".[real-clients]" -c
constraints/real-clients.txt``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
pytest.importorskip("guidellm", reason="guidellm is not installed (the real-clients extra)")

from workbench.serve import ServerConfig, start_server  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
MODEL_DIR = ROOT / "data" / "reference-model"
NAME = "workbench-reference"
KEY = "guidellm-test-key"
RATE = 2              # requests per second, constant
SECONDS = 4           # guidellm's max_duration constraint
PROMPT_TOKENS = 24
OUTPUT_TOKENS = 12
RUN_TIMEOUT = 120     # the whole guidellm process (normally ~20 s: start-up, 4 s of load, a short drain)


@pytest.fixture(scope="module")
def srv(bundled_llm):
    with start_server(bundled_llm, ServerConfig(port=0, model_name=NAME, api_key=KEY)) as handle:
        yield handle


def _guidellm(srv, tmp_path: Path, request_format: str) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "benchmarks.json"
    cmd = [sys.executable, "-m", "guidellm", "run",
           "--backend", f"kind=openai_http,target={srv.base_url},api_key={KEY},request_format={request_format}",
           "--profile", f"kind=constant,rate={RATE}",
           "--constraint", f"kind=max_duration,seconds={SECONDS}",
           "--tokenizer", f"kind=huggingface_auto,model={MODEL_DIR}",
           "--data", f"kind=synthetic_text,prompt_tokens={PROMPT_TOKENS},output_tokens={OUTPUT_TOKENS}",
           "--output", f"kind=json,path={out}",
           "--disable-console-interactive"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("GUIDELLM__")}
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               GUIDELLM__MAX_WORKER_PROCESSES="1",   # one worker process is plenty for 2 requests/s on 2 cores
               COLUMNS="200", PYTHONUNBUFFERED="1")
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT)
    print(f"$ guidellm run ... request_format={request_format}  (exit {proc.returncode})")
    print(proc.stdout[-20000:])
    if proc.returncode != 0:
        print(proc.stderr[-8000:])
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc, json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.parametrize("request_format", ["/v1/chat/completions", "/v1/completions"])
def test_guidellm_constant_rate_has_no_errors(srv, tmp_path, request_format):
    proc, report = _guidellm(srv, tmp_path, request_format)
    assert "Run Summary Info" in proc.stdout                       # its table was printed
    (bench,) = report["benchmarks"]
    totals = bench["metrics"]["request_totals"]
    assert totals["errored"] == 0, [r["info"]["error"] for r in bench["requests"]["errored"]]
    # 2/s for 4 s sends 8-9 requests; the last one or two may still run when the time is up
    # (guidellm counts those "incomplete", not errored); at least half must have completed.
    assert totals["successful"] >= RATE * SECONDS // 2, totals
    done = bench["requests"]["successful"]
    assert done and all(r["output"] for r in done)
    assert {r["output_metrics"]["text_tokens"] for r in done} == {OUTPUT_TOKENS}   # ignore_eos + usage honoured
    assert all(r["input_metrics"]["text_tokens"] > 0 for r in done)                 # the server's prompt_tokens
    assert {json.loads(r["request_args"])["body"]["model"] for r in done} == {NAME}  # from GET /v1/models
    # Streaming: a first token before the last, for every request; one chunk per token, some of
    # which may carry no text yet (a UTF-8 character or stop string pending; guidellm samples).
    for r in done:
        t = r["info"]["timings"]
        assert t["first_token_iteration"] is not None and t["first_token_iteration"] <= t["last_token_iteration"]
        assert 1 <= t["token_iterations"] <= OUTPUT_TOKENS
