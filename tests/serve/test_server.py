"""The OpenAI-compatible server end to end: the bundled model on CPU behind uvicorn on a free
port, driven by the official ``openai`` client and by ``httpx``.

One module-scoped server (API key set, a scripted SLO guard that admits until told otherwise)
serves most tests; small extra servers over the same loaded model cover the engine's queue
limit (429) and a real :class:`~workbench.serve.slo.SLOGuard`.

Where the outcome depends on the order of events across threads (a client leaving while its
request runs or is held, requests batched together, a queue built behind a long request), the
tests order them explicitly - the engine's ``on_step`` hook holds the engine at a known step,
threading events say when the server has done something, the real guard runs on a fake
clock - instead of sleeping or timing out and hoping the machine was fast enough.
"""

from __future__ import annotations

import asyncio
import json
import math
import threading
import time
from contextlib import contextmanager
from types import SimpleNamespace

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from workbench import SamplingParams  # noqa: E402
from workbench.kv.paged import PagedKVConfig  # noqa: E402
from workbench.serve.slo import SLOConfig, SLOGuard  # noqa: E402
from workbench.sched import SchedulerConfig  # noqa: E402
from workbench.engine import LLMEngine  # noqa: E402
from workbench.serve import ServerConfig, start_server  # noqa: E402
from workbench.serve.requests import render_chat  # noqa: E402

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
CAP = 256                 # the server's max_tokens cap
BODY_LIMIT = 32 * 1024    # the server's body limit (bytes)
PROMPT = "The list type"


class ScriptedGuard:
    """A duck-typed SLO guard: admits until ``shed_reason`` is set; remembers what it was told.
    ``config.policy = "queue"`` makes the server hold refused requests (as SLOConfig does)."""

    def __init__(self) -> None:
        self.shed_reason: str | None = None
        self.retry_after = 7.2
        self.config = SimpleNamespace(policy="reject", queue_timeout_s=10.0)
        self.priorities: list[int] = []
        self.ttfts: list[float] = []
        self._asked = threading.Condition()

    def wait_asked(self, n: int, timeout: float = 60.0) -> bool:
        """Wait until admit() has been called ``n`` times in all (a safety timeout: False then)."""
        with self._asked:
            return self._asked.wait_for(lambda: len(self.priorities) >= n, timeout)

    def admit(self, now=None, priority=0):
        with self._asked:
            self.priorities.append(priority)
            self._asked.notify_all()
        if self.shed_reason:
            return SimpleNamespace(admitted=False, reason=self.shed_reason, retry_after=self.retry_after)
        return SimpleNamespace(admitted=True, reason=None, retry_after=None)

    def record(self, ttft_s):
        self.ttfts.append(ttft_s)


@pytest.fixture(scope="module")
def guard():
    return ScriptedGuard()


@pytest.fixture(scope="module")
def srv(bundled_llm, guard):
    eng = LLMEngine(bundled_llm, kv=PagedKVConfig(block_size=16, num_blocks=256),
                    scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256))
    config = ServerConfig(port=0, api_key=KEY, max_tokens_cap=CAP, max_body_bytes=BODY_LIMIT)
    with start_server(eng, config, guard=guard) as handle:
        yield handle


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.base_url, api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def http(srv):
    with httpx.Client(base_url=srv.url, headers=AUTH, timeout=60) as c:
        yield c


def greedy(llm, prompt: str, n: int) -> str:
    return llm.generate(prompt, SamplingParams(temperature=0, max_tokens=n))[0].text


def last_step(handle) -> int:
    recs = handle.engine.engine.step_records
    return recs[-1].step if recs else -1


def steps_since(handle, mark: int) -> list:
    return [r for r in handle.engine.engine.step_records if r.step > mark]


def wait_idle(handle, timeout: float = 20.0) -> dict:
    """Wait until the engine has nothing running or waiting; returns its stats."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = handle.engine.stats()
        if s["running"] == 0 and s["waiting"] == 0 and s["swapped"] == 0 and not handle.engine.engine.seqs:
            return s
        time.sleep(0.02)
    raise AssertionError(f"the engine did not drain within {timeout} s: {handle.engine.stats()}")


def wait_until(cond, timeout: float = 60.0, what: str = "condition") -> None:
    """Poll ``cond`` until it holds; the timeout is a safety net against a hang, not a bound under test."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"{what}: not met within {timeout} s"
        time.sleep(0.01)


@contextmanager
def on_step(aengine, hook):
    """Install ``hook`` as the AsyncEngine's on_step (called on the engine thread after each step;
    the engine waits while it runs) for the block."""
    aengine.on_step = hook
    try:
        yield
    finally:
        aengine.on_step = None


class HoldUntilAborted:
    """After the ``at``-th step that computes anything, the engine waits - its request keeps its
    blocks and gets no more tokens - until ``abort`` is called (the server does when the client
    has gone).  ``reached`` is set when it starts waiting, ``aborted`` when the abort came."""

    def __init__(self, aengine, at: int) -> None:
        self.aengine, self.at, self.steps = aengine, at, 0
        self.reached, self.aborted = threading.Event(), threading.Event()

    def _hook(self, stats) -> None:
        if self.aengine.engine.step_records[-1].num_seqs > 0:
            self.steps += 1
        if self.steps == self.at and not self.reached.is_set():
            self.reached.set()
            self.aborted.wait(60)

    def __enter__(self) -> HoldUntilAborted:
        abort = self.aengine.abort

        def spy(request_id):
            abort(request_id)                 # queued for the engine thread first, then the hold ends
            self.aborted.set()

        self.aengine.abort = spy
        self.aengine.on_step = self._hook
        return self

    def __exit__(self, *exc) -> None:
        self.aengine.on_step = None
        del self.aengine.abort                # the class's method again
        self.aborted.set()                    # never leave the engine held


@contextmanager
def one_step_per_message(aengine):
    """The engine takes one step per message it receives (a new request, an abort) and otherwise
    waits after its step: a long request cannot run to its end while the test builds a queue
    behind it."""
    release = threading.Event()

    def hook(stats):
        with aengine._cv:
            aengine._cv.wait_for(lambda: aengine._inbox or release.is_set(), timeout=60)

    aengine.on_step = hook
    try:
        yield
    finally:
        release.set()
        aengine.on_step = None
        with aengine._cv:
            aengine._cv.notify_all()


# ---- Prometheus text -----------------------------------------------------------------------------
def parse_prometheus(text: str) -> tuple[dict[str, str], dict[tuple[str, tuple], float]]:
    """(metric name -> type, (sample name, sorted labels) -> value); strict about the line shapes."""
    types, samples = {}, {}
    for line in text.splitlines():
        if not line:
            continue
        if line.startswith("# HELP "):
            assert len(line.split(" ", 3)) == 4, line
            continue
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            assert kind in ("counter", "gauge", "histogram", "summary", "untyped"), line
            types[name] = kind
            continue
        assert not line.startswith("#"), line
        head, value = line.rsplit(" ", 1)
        labels: tuple = ()
        if "{" in head:
            name, rest = head.split("{", 1)
            assert rest.endswith("}"), line
            pairs = [p for p in rest[:-1].split(",") if p]
            labels = tuple(sorted((k, v.strip('"')) for k, v in (p.split("=", 1) for p in pairs)))
        else:
            name = head
        samples[(name, labels)] = float(value)
    return types, samples


def scrape(base_url: str):
    r = httpx.get(base_url + "/metrics", timeout=30, headers=AUTH)   # the servers here that have a key have KEY
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
    return parse_prometheus(r.text)


def hist_count(samples, name: str) -> float:
    return samples[(f"{name}_count", ())]


# ---- the official client ---------------------------------------------------------------------------
def test_openai_completion_matches_llm_greedy(client, bundled_llm, srv):
    resp = client.completions.create(model="bundled", prompt=PROMPT, max_tokens=8, temperature=0)
    assert resp.object == "text_completion"
    assert resp.choices[0].text == greedy(bundled_llm, PROMPT, 8)
    assert resp.choices[0].finish_reason in ("length", "stop")
    assert resp.usage.prompt_tokens == len(bundled_llm.tokenizer.encode(PROMPT))
    assert resp.usage.completion_tokens == 8 or resp.choices[0].finish_reason == "stop"


def test_openai_completion_stream(client, bundled_llm):
    stream = client.completions.create(model="bundled", prompt=PROMPT, max_tokens=8, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == greedy(bundled_llm, PROMPT, 8)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 8


def test_openai_chat_matches_llm_greedy(client, bundled_llm):
    messages = [{"role": "system", "content": "You explain Python."}, {"role": "user", "content": "What is a tuple?"}]
    resp = client.chat.completions.create(model="bundled", messages=messages, max_tokens=8, temperature=0)
    expected = greedy(bundled_llm, render_chat([("system", "You explain Python."), ("user", "What is a tuple?")]), 8)
    assert resp.object == "chat.completion"
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content == expected


def test_openai_chat_stream_end_to_end(client, bundled_llm):
    stream = client.chat.completions.create(model="bundled", messages=[{"role": "user", "content": "Hello"}],
                                            max_tokens=8, temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == greedy(bundled_llm, render_chat([("user", "Hello")]), 8)
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")
    assert len({c.id for c in chunks}) == 1


def test_openai_client_errors(client, srv):
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="gpt-4o", prompt=PROMPT, max_tokens=2)
    bad = openai.OpenAI(base_url=srv.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError, match="API key"):
        bad.completions.create(model="bundled", prompt=PROMPT, max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model="bundled", prompt=PROMPT, max_tokens=2, temperature=5)
    assert [m.id for m in client.models.list()] == ["bundled"]


# ---- httpx: wire format ---------------------------------------------------------------------------
def test_sse_format_line_by_line(http, bundled_llm):
    body = {"model": "bundled", "messages": [{"role": "user", "content": "What is a list?"}], "max_tokens": 6,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        rid = r.headers["x-request-id"]
        raw = r.read().decode()
    assert raw.endswith("data: [DONE]\n\n")
    events = raw.split("\n\n")
    assert events[-1] == ""
    events = events[:-1]
    for e in events:                                  # one "data: " line per event, nothing else
        assert e.startswith("data: ") and "\n" not in e, repr(e)
    assert events[-1] == "data: [DONE]"
    objs = [json.loads(e[len("data: "):]) for e in events[:-1]]
    assert all(o["id"] == rid and o["object"] == "chat.completion.chunk" and o["model"] == "bundled" for o in objs)
    assert objs[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    tokens = objs[1:-2]
    assert all(o["choices"][0]["finish_reason"] is None and o["usage"] is None for o in tokens)
    finish, usage = objs[-2], objs[-1]
    assert finish["choices"][0]["delta"] == {} and finish["choices"][0]["finish_reason"] in ("length", "stop")
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == len(tokens)
    assert usage["usage"]["total_tokens"] == usage["usage"]["prompt_tokens"] + len(tokens)
    text = "".join(o["choices"][0]["delta"]["content"] for o in tokens)
    assert text == greedy(bundled_llm, render_chat([("user", "What is a list?")]), 6)


def test_headers_model_info_and_request_id(http, srv):
    r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
    assert r.status_code == 200
    assert r.headers["x-request-id"] == r.json()["id"] and r.json()["id"].startswith("cmpl-")
    info = json.loads(r.headers["x-model-info"])
    pool = srv.engine.engine.pool
    assert info["model"] == "bundled" and info["device"] == "cpu" and info["dtype"] == "float32"
    assert (info["block_size"], info["num_blocks"]) == (pool.block_size, pool.num_blocks) == (16, 256)
    assert info["scheduler"]["max_num_seqs"] == 8 and info["scheduler"]["max_num_batched_tokens"] == 256
    assert "backends" in info or "backends_error" in info
    assert info["slo_guard"]["type"] == "ScriptedGuard"
    # on every response to a client with the key, errors included; never on one without it (the server has a key)
    assert "x-model-info" in httpx.get(srv.url + "/health", headers={"authorization": f"Bearer {KEY}"}).headers
    assert "x-model-info" in http.post("/v1/completions", json={}).headers
    assert "x-model-info" not in httpx.get(srv.url + "/health").headers
    assert "x-model-info" not in httpx.post(srv.base_url + "/completions", json={}).headers   # the 401


def test_models_and_health(http, srv):
    r = http.get("/v1/models")
    assert r.status_code == 200
    data = r.json()
    assert data["object"] == "list" and [m["id"] for m in data["data"]] == ["bundled"]
    assert http.get("/v1/models/bundled").json()["id"] == "bundled"
    assert http.get("/v1/models/other").status_code == 404
    h = httpx.get(srv.url + "/health")              # without the key: alive or not, nothing more
    assert h.status_code == 200 and h.json() == {"status": "ok", "engine_alive": True}
    h = http.get("/health")                          # with it: the engine's state
    assert h.status_code == 200
    assert h.json()["status"] == "ok" and h.json()["engine_alive"] is True
    assert h.json()["kv_total_blocks"] == 256


def test_binds_localhost_by_default(srv):
    assert ServerConfig().host == "127.0.0.1"
    assert srv.host == "127.0.0.1" and srv.url.startswith("http://127.0.0.1:")


ADVERTISED = {
    "workbench_time_to_first_token_seconds": "histogram", "workbench_inter_token_latency_seconds": "histogram",
    "workbench_e2e_request_latency_seconds": "histogram", "workbench_requests_finished_total": "counter",
    "workbench_queue_length": "gauge", "workbench_running_requests": "gauge", "workbench_kv_usage_ratio": "gauge",
    "workbench_kv_used_blocks": "gauge", "workbench_kv_total_blocks": "gauge",
    "workbench_prefix_cache_hit_rate": "gauge", "workbench_preemptions_total": "counter",
    "workbench_rejected_total": "counter", "workbench_generation_tokens_total": "counter",
    "workbench_http_responses_total": "counter", "workbench_slo_guard_enabled": "gauge",
    "workbench_slo_shed_total": "counter",
}


def test_metrics_parse_and_grow(http, srv):
    types, before = scrape(srv.url)
    for name, kind in ADVERTISED.items():
        assert types.get(name) == kind, name
    for name in ("workbench_time_to_first_token_seconds", "workbench_inter_token_latency_seconds"):
        buckets = sorted(((float(dict(lbl)["le"]), v) for (n, lbl), v in before.items() if n == name + "_bucket"))
        assert buckets[-1][0] == math.inf and buckets[-1][1] == hist_count(before, name)
        assert all(a[1] <= b[1] for a, b in zip(buckets, buckets[1:])), "buckets must be cumulative"
    assert before[("workbench_kv_total_blocks", ())] == 256
    r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 5, "ignore_eos": True})
    assert r.status_code == 200
    _, after = scrape(srv.url)
    ttft, itl = "workbench_time_to_first_token_seconds", "workbench_inter_token_latency_seconds"
    assert hist_count(after, ttft) == hist_count(before, ttft) + 1
    assert hist_count(after, itl) == hist_count(before, itl) + 4          # 5 tokens, 4 gaps
    assert after[("workbench_generation_tokens_total", ())] == before[("workbench_generation_tokens_total", ())] + 5
    fin = ("workbench_requests_finished_total", (("finish_reason", "length"),))
    assert after[fin] == before[fin] + 1
    ok = ("workbench_http_responses_total", (("code", "200"), ("path", "/v1/completions")))
    assert after[ok] >= before.get(ok, 0) + 1
    # the engine's gauges are live numbers, not placeholders
    assert after[("workbench_engine_steps_total", ())] > before[("workbench_engine_steps_total", ())]


def test_prefix_hit_rate_reported(http, srv):
    prompt = "The dictionary type maps hashable keys to arbitrary values, " * 4      # several full blocks
    for _ in range(2):
        assert http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1}).status_code == 200
    _, s = scrape(srv.url)
    assert s[("workbench_prefix_cache_hit_rate", ())] > 0
    assert s[("workbench_prefix_cache_hit_rate", ())] == pytest.approx(srv.engine.stats()["prefix_hit_rate"])


# ---- errors ----------------------------------------------------------------------------------------
def err(r, status: int, *words: str) -> dict:
    assert r.status_code == status, r.text
    e = r.json()["error"]
    for w in words:
        assert w in e["message"], (w, e["message"])
    return e


@pytest.mark.parametrize("path,body,param,words", [
    ("/v1/completions", {"max_tokens": 2}, "prompt", ["'prompt'", "required"]),
    ("/v1/completions", {"prompt": PROMPT, "temperature": "hot"}, "temperature", ["'temperature'", "number"]),
    ("/v1/completions", {"prompt": PROMPT, "top_p": 0}, "top_p", ["'top_p'", "out of range"]),
    ("/v1/completions", {"prompt": PROMPT, "bogus": 1}, "bogus", ["'bogus'", "unknown field"]),
    ("/v1/completions", {"prompt": PROMPT, "n": 17}, "n", ["'n'", "out of range"]),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 0}, "max_tokens", ["'max_tokens'"]),
    ("/v1/completions", {"prompt": PROMPT, "stream": "yes"}, "stream", ["'stream'"]),
    ("/v1/chat/completions", {"messages": []}, "messages", ["'messages'", "non-empty"]),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role",
     ["'messages[0].role'", "robot"]),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
     "tools", ["'tools'", "not supported"]),
])
def test_400_names_the_field(http, path, body, param, words):
    e = err(http.post(path, json=body), 400, *words)
    assert e["param"] == param and e["type"] == "invalid_request_error"


def test_400_invalid_json_and_priority_header(http):
    err(http.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"}), 400,
        "not valid JSON")
    err(http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1}, headers={"x-priority": "high"}), 400,
        "x-priority", "not an integer")


def test_400_prompt_longer_than_context(http, bundled_llm):
    ctx = bundled_llm.max_model_len
    e = err(http.post("/v1/completions", json={"prompt": [5] * ctx, "max_tokens": 1}), 400, "'prompt'", str(ctx))
    assert e["code"] == "context_length_exceeded"
    e = err(http.post("/v1/completions", json={"prompt": [5] * (ctx - 4), "max_tokens": 10}), 400,
            "'max_tokens'", "context")
    assert e["code"] == "context_length_exceeded"


def test_400_max_tokens_over_cap(http):
    err(http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": CAP + 1}), 400, "'max_tokens'",
        f"cap of {CAP}")
    err(http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                "max_completion_tokens": CAP + 1}), 400, "'max_completion_tokens'")


def test_413_body_over_limit(http):
    e = err(http.post("/v1/completions", json={"prompt": "x" * (BODY_LIMIT + 10), "max_tokens": 1}), 413,
            str(BODY_LIMIT))
    assert e["code"] == "request_too_large"


def test_401_api_key(srv):
    body = {"prompt": PROMPT, "max_tokens": 1}
    e = err(httpx.post(srv.base_url + "/completions", json=body), 401, "API key")
    assert e["type"] == "authentication_error"
    r = httpx.post(srv.base_url + "/completions", json=body, headers={"Authorization": "Bearer nope"})
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    assert httpx.get(srv.base_url + "/models").status_code == 401
    assert httpx.get(srv.url + "/metrics").status_code == 401          # scrapes need the key (--metrics-public)
    assert httpx.get(srv.url + "/metrics", headers=AUTH).status_code == 200


def test_404_unknown_model(http):
    e = err(http.post("/v1/chat/completions", json={"model": "gpt-4o", "messages": [{"role": "user", "content": "x"}]}),
            404, "'gpt-4o'", "'bundled'")
    assert e["param"] == "model" and e["code"] == "model_not_found"
    assert http.get("/v1/nowhere").status_code == 404


class ProbeGuard:
    """Admits everything as a half-open probe; records (ttft, probe) pairs."""

    def __init__(self) -> None:
        self.records: list[tuple[float, bool]] = []

    def admit(self, now=None, priority=0):
        return SimpleNamespace(admit=True, reason="probe", retry_after=None, probe=True)

    def record(self, ttft_s, now=None, probe=None):
        self.records.append((ttft_s, probe))


def test_429_when_the_engine_queue_is_full(bundled_llm):
    """One running, one waiting (max_queue_len=1): the third request is rejected by the engine.
    Probes that end before their first token (rejected, or the client gave up) reach the
    guard as failed (TTFT = inf).  The engine takes one step per message meanwhile, so the long
    first request is still running when the third arrives, however slow the machine."""
    eng = LLMEngine(bundled_llm, kv=PagedKVConfig(num_blocks=64),
                    scheduler=SchedulerConfig(max_num_seqs=1, max_queue_len=1))
    long = {"prompt": PROMPT, "max_tokens": 400, "ignore_eos": True, "stream": True}

    async def run(url: str):
        async with httpx.AsyncClient(base_url=url, timeout=60) as c:
            async with c.stream("POST", "/v1/completions", json=long) as first:
                assert first.status_code == 200
                second = asyncio.ensure_future(c.post("/v1/completions", json={**long, "stream": False}))
                deadline = time.monotonic() + 20
                while handle.engine.stats()["waiting"] < 1:
                    assert time.monotonic() < deadline, handle.engine.stats()
                    await asyncio.sleep(0.01)
                third = await c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
                streamed = await c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "stream": True})
                second.cancel()
            return third, streamed

    probes = ProbeGuard()
    with start_server(eng, guard=probes) as handle:
        with one_step_per_message(handle.engine):
            third, streamed = asyncio.run(run(handle.url))
        e = err(third, 429, "queue full", "max_queue_len=1")
        assert e["type"] == "rate_limit_error" and third.headers["retry-after"] == "1"
        err(streamed, 429, "queue full")                 # a stream rejected before its first token: plain 429
        wait_idle(handle)
        assert handle.engine.stats()["rejected"] == 2
        assert eng.pool.manager.num_used_blocks == 0
        wait_until(lambda: len(probes.records) >= 4, what="4 probe results")   # the cancelled one reports last
    finite = [t for t, _ in probes.records if math.isfinite(t)]
    assert len(probes.records) == 4 and all(p is True for _, p in probes.records)
    assert len(finite) == 1 and finite[0] > 0            # only the running request produced a token


# ---- disconnects ------------------------------------------------------------------------------------
def test_disconnect_mid_stream_frees_blocks(srv):
    m = srv.engine.engine.pool.manager
    wait_idle(srv)
    initial_available = m.num_available_blocks
    assert m.num_used_blocks == 0
    _, before = scrape(srv.url)
    abort = ("workbench_requests_finished_total", (("finish_reason", "abort"),))
    prompt = "Unique words for a disconnect: " + " ".join(f"w{i}" for i in range(60))   # several blocks
    body = {"prompt": prompt, "max_tokens": CAP, "ignore_eos": True, "stream": True}
    mark = last_step(srv)
    # the engine waits after the request's 2nd step (the client reads two events) until the server aborts it
    with HoldUntilAborted(srv.engine, at=2) as gate:
        with httpx.Client(base_url=srv.url, headers=AUTH, timeout=60) as c:
            with c.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                rid = r.headers["x-request-id"]
                lines = r.iter_lines()
                got = [next(lines) for _ in range(4)]      # two events (each "data: ..." + blank line)
                assert got[0].startswith("data: ")
                assert srv.engine.stats()["kv_used_blocks"] > 0
            # leaving the block closes the connection mid-stream
        assert gate.aborted.wait(60), "the server never aborted the request of a client that left"
    s = wait_idle(srv)
    # aborted where the client left, not run to its end: held after its 2nd step (or, when the abort
    # came first, the abort was queued before the hold was lifted), no step of it after the abort
    assert sum(rid in r.request_ids for r in steps_since(srv, mark)) == 2 < CAP // 2
    assert s["kv_used_blocks"] == 0 and m.num_used_blocks == 0 and m.seq_ids() == []
    assert m.num_available_blocks == initial_available      # free + reusable cached: the whole pool again
    # blocks of the prompt stay in the prefix cache (evictable, counted as available), none is held
    assert m.num_free_blocks + m.num_cached_blocks == m.num_blocks
    wait_until(lambda: scrape(srv.url)[1][abort] > before[abort], what="the abort on /metrics")
    _, after = scrape(srv.url)
    assert after[abort] == before[abort] + 1
    assert after[("workbench_generation_tokens_total", ())] - before[("workbench_generation_tokens_total", ())] < CAP


def test_disconnect_while_waiting_for_whole_response(srv):
    m = srv.engine.engine.pool.manager
    wait_idle(srv)
    initial = m.num_available_blocks
    mark = last_step(srv)

    async def leave_after_step_4(gate):
        async with httpx.AsyncClient(base_url=srv.url, headers=AUTH, timeout=60) as c:
            task = asyncio.ensure_future(c.post("/v1/completions",
                                                json={"prompt": PROMPT, "max_tokens": CAP, "ignore_eos": True}))
            assert await asyncio.to_thread(gate.reached.wait, 60), "the request never ran 4 steps"
            assert not task.done()
            task.cancel()                              # the client gives up waiting: its connection closes
            with pytest.raises(asyncio.CancelledError):
                await task

    with HoldUntilAborted(srv.engine, at=4) as gate:
        asyncio.run(leave_after_step_4(gate))
        assert gate.aborted.wait(60), "the server never aborted the request of a client that left"
    wait_idle(srv)
    ran = [r for r in steps_since(srv, mark) if r.num_seqs]
    assert len(ran) == 4 < CAP // 2                       # aborted where the client left, not run to CAP tokens
    assert m.num_used_blocks == 0 and m.num_available_blocks == initial


# ---- concurrency ------------------------------------------------------------------------------------
def test_concurrent_streams_all_complete(srv):
    prompts = [f"{w} is a built-in type" for w in ("int", "str", "dict", "set")]
    mark = last_step(srv)

    async def one(c, p):
        body = {"prompt": p, "max_tokens": 8, "ignore_eos": True, "temperature": 0, "stream": True}
        async with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            lines = [line async for line in r.aiter_lines() if line]
        return lines

    async def run():
        async with httpx.AsyncClient(base_url=srv.url, headers=AUTH, timeout=60) as c:
            return await asyncio.gather(*(one(c, p) for p in prompts))

    # the engine waits after its first step until all four requests are in (however the server
    # interleaves them): then they run together
    submit, submitted, all_in = srv.engine.submit, [], threading.Event()

    def counting_submit(*args, **kw):
        rid = submit(*args, **kw)
        submitted.append(rid)
        if len(submitted) == len(prompts):
            all_in.set()
        return rid

    held = []
    srv.engine.submit = counting_submit
    try:
        with on_step(srv.engine, lambda stats: held or held.append(all_in.wait(60))):
            results = asyncio.run(run())
    finally:
        del srv.engine.submit
    assert held == [True] and len(submitted) == 4
    for lines in results:
        assert lines[-1] == "data: [DONE]"
        chunks = [json.loads(x[len("data: "):]) for x in lines[:-1]]
        assert len(chunks) == 9 and chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert len({json.loads(r[0][6:])["id"] for r in results}) == 4
    assert max(r.num_seqs for r in steps_since(srv, mark)) >= 2, "the streams were never batched together"
    wait_idle(srv)


# ---- the SLO guard hook -------------------------------------------------------------------------------
def test_guard_sees_priority_and_ttft(http, srv, guard):
    n = len(guard.ttfts)
    _, before = scrape(srv.url)
    r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 3}, headers={"x-priority": "3"})
    assert r.status_code == 200
    assert guard.priorities[-1] == 3
    assert len(guard.ttfts) == n + 1 and guard.ttfts[-1] > 0
    _, after = scrape(srv.url)
    name = "workbench_time_to_first_token_seconds_sum"
    assert guard.ttfts[-1] == pytest.approx(after[(name, ())] - before[(name, ())], rel=1e-6, abs=1e-9)


def test_guard_shed_is_503_with_retry_after(http, srv, guard):
    _, before = scrape(srv.url)
    steps = srv.engine.stats()["steps"]
    guard.shed_reason = "TTFT P95 too high (scripted)"
    try:
        r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 2})
        e = err(r, 503, "shed by the SLO guard", "TTFT P95 too high (scripted)")
        assert r.headers["retry-after"] == "8"           # 7.2 s, rounded up to whole seconds
        assert e["code"] == "slo_guard_shed"
        err(http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "stream": True}), 503,
            "scripted")
        err(http.post("/v1/completions", json={"prompt": PROMPT, "temperature": -1}), 400, "'temperature'")
    finally:
        guard.shed_reason = None
    assert srv.engine.stats()["steps"] == steps          # shed requests never reached the engine
    _, after = scrape(srv.url)
    assert after[("workbench_slo_shed_total", ())] == before[("workbench_slo_shed_total", ())] + 2
    assert after[("workbench_slo_guard_enabled", ())] == 1
    assert http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1}).status_code == 200


def test_real_slo_guard_opens_and_sheds(srv, bundled_llm):
    """A real SLOGuard with a baseline far below any CPU TTFT: two samples open it; then the
    server sheds with its reason, lets a bypass priority through, and shows the state on /metrics."""
    cfg = SLOConfig(window=2, min_samples=2, baseline_s=1e-6, factor=2.0, cooldown_s=30.0, bypass_priorities=(9,))
    slo = SLOGuard(cfg)
    # the same running engine, a second front door; x-priority honoured without an API key only when told
    with start_server(srv.engine, ServerConfig(port=0, trust_priority_header=True), guard=slo) as h:
        url = h.base_url + "/completions"
        for _ in range(2):
            assert httpx.post(url, json={"prompt": PROMPT, "max_tokens": 2}, timeout=60).status_code == 200
        assert slo.state == "open" and slo.counts["samples"] == 2
        r = httpx.post(url, json={"prompt": PROMPT, "max_tokens": 2}, timeout=60)
        err(r, 503, "SLO guard open", "baseline")
        assert 1 <= int(r.headers["retry-after"]) <= 30
        assert httpx.post(url, json={"prompt": PROMPT, "max_tokens": 2}, headers={"x-priority": "9"},
                          timeout=60).status_code == 200
        types, s = scrape(h.url)
        assert types["workbench_slo_guard_state"] == "gauge"
        assert s[("workbench_slo_guard_state", (("state", "open"),))] == 1
        assert s[("workbench_slo_guard_state", (("state", "closed"),))] == 0
        assert s[("workbench_slo_trips_total", ())] == 1
        assert s[("workbench_slo_decisions_total", (("decision", "rejected"),))] == 1
        assert s[("workbench_slo_decisions_total", (("decision", "bypassed"),))] == 1
        assert s[("workbench_slo_baseline_ttft_seconds", ())] == pytest.approx(1e-6)
        assert s[("workbench_slo_shed_total", ())] == 1
        assert httpx.get(h.url + "/health", headers=AUTH).json()["slo_guard"] == "open"
    assert srv.running and httpx.get(srv.url + "/health").json()["engine_alive"]   # the shared engine runs on


HELD = "workbench_slo_held_total"
HOLD = "workbench_slo_hold_seconds"


def held(samples, outcome: str) -> float:
    return samples[(HELD, (("outcome", outcome),))]


@pytest.fixture
def queued(guard, srv):
    """The module's scripted guard with the queue policy, asking again every 50 ms; restored after."""
    wait_idle(srv)
    guard.config.policy, guard.retry_after = "queue", 0.05
    yield guard
    guard.config.policy, guard.config.queue_timeout_s, guard.retry_after = "reject", 10.0, 7.2
    guard.shed_reason = None


def test_guard_queue_holds_then_serves(srv, queued, bundled_llm):
    """policy="queue": a deferred request waits in the server (nothing reaches the engine), asking
    the guard again, and is served as soon as the guard admits it."""
    types, before = scrape(srv.url)
    assert types[HELD] == "counter" and types[HOLD] == "histogram"
    assert types["workbench_slo_held_requests"] == "gauge"
    queued.config.queue_timeout_s = 30.0
    queued.shed_reason = "overloaded (scripted)"
    asks = len(queued.priorities)
    steps = srv.engine.stats()["steps"]

    async def run():
        async with httpx.AsyncClient(base_url=srv.url, headers=AUTH, timeout=60) as c:
            task = asyncio.ensure_future(c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4,
                                                                         "temperature": 0}))
            # refused once, then asked again three times (every 50 ms) while held
            assert await asyncio.to_thread(queued.wait_asked, asks + 4), "the held request was not asked again"
            assert not task.done() and srv.metrics.slo_holding == 1
            assert srv.engine.stats()["steps"] == steps             # held: not at the engine
            _, during = scrape(srv.url)
            queued.shed_reason = None
            return await task, during

    r, during = asyncio.run(run())
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == greedy(bundled_llm, PROMPT, 4)
    assert len(queued.priorities) - asks >= 5                 # refused, asked again 3+ times, admitted
    assert during[("workbench_slo_held_requests", ())] == 1
    _, after = scrape(srv.url)
    assert held(after, "admitted") == held(before, "admitted") + 1
    assert sum(held(after, o) for o in ("timed_out", "refused", "disconnected", "error")) == \
        sum(held(before, o) for o in ("timed_out", "refused", "disconnected", "error"))
    assert hist_count(after, HOLD) == hist_count(before, HOLD) + 1
    assert after[(HOLD + "_sum", ())] - before[(HOLD + "_sum", ())] >= 3 * 0.05 - 1e-3   # at least 3 naps of 50 ms
    assert after[("workbench_slo_held_requests", ())] == 0
    assert after[("workbench_slo_shed_total", ())] == before[("workbench_slo_shed_total", ())]


def test_guard_queue_timeout_is_503_with_reason(http, srv, queued):
    _, before = scrape(srv.url)
    steps = srv.engine.stats()["steps"]
    queued.config.queue_timeout_s = 0.4
    queued.shed_reason = "TTFT P95 too high (scripted)"
    t0 = time.monotonic()
    r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
    assert time.monotonic() - t0 >= 0.4
    e = err(r, 503, "shed by the SLO guard", "TTFT P95 too high (scripted)", "held", "timeout is 0.4 s")
    assert e["code"] == "slo_guard_queue_timeout" and r.headers["retry-after"] == "1"
    err(http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "stream": True}), 503, "scripted")
    # a refusal without "ask again" ends the hold at once
    queued.config.queue_timeout_s = 30.0
    queued.retry_after = None
    err(http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}), 503, "scripted")
    assert srv.engine.stats()["steps"] == steps            # none of them reached the engine
    _, after = scrape(srv.url)
    assert held(after, "timed_out") == held(before, "timed_out") + 2
    assert held(after, "admitted") == held(before, "admitted")
    assert hist_count(after, HOLD) == hist_count(before, HOLD) + 2     # the unheld refusal is not a hold
    # two holds of 0.4 s at least; the histogram's running sum is a float (0.206 -> 1.006 gave
    # 0.79999999999927 in a CI run): compared with a tolerance far below any real shortfall
    assert after[(HOLD + "_sum", ())] - before[(HOLD + "_sum", ())] >= 0.8 - 1e-6
    assert after[("workbench_slo_shed_total", ())] == before[("workbench_slo_shed_total", ())] + 3


def test_guard_queue_client_gone_while_held_is_dropped(srv, queued):
    _, before = scrape(srv.url)
    steps = srv.engine.stats()["steps"]
    queued.config.queue_timeout_s = 30.0
    queued.shed_reason = "overloaded (scripted)"
    asks = len(queued.priorities)

    async def leave_while_held():
        async with httpx.AsyncClient(base_url=srv.url, headers=AUTH, timeout=60) as c:
            task = asyncio.ensure_future(c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}))
            assert await asyncio.to_thread(queued.wait_asked, asks + 2), "the request was never held"
            assert not task.done() and srv.metrics.slo_holding == 1
            task.cancel()                              # the client gives up: its connection closes
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(leave_while_held())
    wait_until(lambda: held(scrape(srv.url)[1], "disconnected") > held(before, "disconnected")
               and not srv.metrics.slo_holding, what="the held request dropped")
    _, after = scrape(srv.url)
    assert held(after, "disconnected") == held(before, "disconnected") + 1
    assert after[("workbench_slo_held_requests", ())] == 0
    assert srv.engine.stats()["steps"] == steps and srv.engine.stats()["waiting"] == 0   # nothing reached it
    assert after[("workbench_slo_shed_total", ())] == before[("workbench_slo_shed_total", ())]
    gone = ("workbench_http_responses_total", (("code", "499"), ("path", "/v1/completions")))
    assert after[gone] == before.get(gone, 0) + 1             # no answer was sent: 499, not 500


def test_real_slo_guard_queue_policy(srv):
    """A real SLOGuard(policy="queue"): opened by two slow TTFTs, it defers a request until its
    cool-down ends; the request is then admitted as the half-open probe, served, and its healthy
    TTFT closes the guard.  Opened again with a queue timeout shorter than the cool-down, the
    held request gets the 503 with the guard's reason."""
    cfg = SLOConfig(window=2, min_samples=2, baseline_s=2.0, factor=2.0, cooldown_s=0.5, probes=1,
                    policy="queue", queue_timeout_s=20.0)
    clock = SimpleNamespace(t=0.0)
    slo = SLOGuard(cfg, clock=lambda: clock.t)            # the guard's time moves only when the test says
    with start_server(srv.engine, guard=slo) as h:
        url = h.base_url + "/completions"
        slo.record(10.0)
        slo.record(10.0)                                  # P95 10 s > 2 x 2 s: open
        assert slo.state == "open"

        async def served_after_the_cooldown():
            async with httpx.AsyncClient(timeout=60) as c:
                task = asyncio.ensure_future(c.post(url, json={"prompt": PROMPT, "max_tokens": 2}))
                # deferred, asked again (after the rest of the cool-down, 0.5 s), deferred again: held
                await asyncio.to_thread(wait_until, lambda: slo.counts["deferred"] >= 2, 60, "two deferrals")
                assert not task.done() and h.metrics.slo_holding == 1 and slo.counts["probes"] == 0
                clock.t = 0.5                             # the cool-down ends: the next ask admits the probe
                return await task

        r = asyncio.run(served_after_the_cooldown())
        assert r.status_code == 200, r.text
        assert slo.counts["deferred"] >= 2 and slo.counts["probes"] == 1
        assert slo.transitions[-2][:3] == (0.5, "open", "half_open")     # not served before the cool-down ended
        assert slo.state == "closed" and slo.transitions[-1][1:3] == ("half_open", "closed")
        _, s = scrape(h.url)
        assert held(s, "admitted") == 1 and hist_count(s, HOLD) == 1 and s[(HOLD + "_sum", ())] > 0
        assert s[("workbench_slo_decisions_total", (("decision", "deferred"),))] == slo.counts["deferred"]

        cfg.queue_timeout_s, cfg.cooldown_s = 0.3, 30.0    # read at each request
        slo.record(10.0)
        slo.record(10.0)
        assert slo.state == "open"
        r = httpx.post(url, json={"prompt": PROMPT, "max_tokens": 2}, timeout=60)
        e = err(r, 503, "SLO guard open", "baseline", "held", "timeout is 0.3 s")
        assert e["code"] == "slo_guard_queue_timeout" and 1 <= int(r.headers["retry-after"]) <= 30
        _, s = scrape(h.url)
        assert held(s, "timed_out") == 1 and s[("workbench_slo_shed_total", ())] == 1
        assert hist_count(s, HOLD) == 2 and s[("workbench_slo_held_requests", ())] == 0
    assert srv.running


def test_guard_must_be_duck_typed():
    from workbench.errors import ConfigError

    with pytest.raises(ConfigError, match="admit"):
        ServerConfig(guard=object())


# ---- the KV pool, client disconnects mid-body, label escaping, 4xx error types --------------------------
def test_400_when_prompt_plus_max_tokens_never_fits_the_pool(bundled_llm):
    """A 4-block pool (64 tokens): asking for more than it can ever hold is a 400 at once (not a
    429 after generating); without max_tokens the default is clamped to what the pool holds."""
    eng = LLMEngine(bundled_llm, kv=PagedKVConfig(num_blocks=4, block_size=16))
    with start_server(eng) as handle, httpx.Client(base_url=handle.url, timeout=30) as c:
        mark = last_step(handle)
        r = c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 100, "ignore_eos": True})
        e = err(r, 400, "KV blocks", "pool has 4", "block size 16")
        assert e["code"] == "context_length_exceeded" and e["param"] == "max_tokens"
        assert e["type"] == "invalid_request_error" and "retry-after" not in r.headers
        r = c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 100, "stream": True})
        assert err(r, 400, "KV blocks")["code"] == "context_length_exceeded"
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                 "max_tokens": 80})
        assert err(r, 400, "KV blocks")["param"] == "max_tokens"
        assert steps_since(handle, mark) == []                   # nothing reached the engine
        ids = [5] * 60                                            # 60 tokens: 4 fit after them
        r = c.post("/v1/completions", json={"prompt": ids, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4
        r = c.post("/v1/completions", json={"prompt": ids, "max_tokens": 4, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        err(c.post("/v1/completions", json={"prompt": ids, "max_tokens": 5}), 400, "needs 5 KV blocks")
        wait_idle(handle)
        assert handle.engine.stats()["rejected"] == 0


def test_engine_rejection_other_than_queue_full_is_not_retryable():
    from workbench.engine.types import StreamEvent
    from workbench.serve.completion import ending_error as _ending_error

    def ending(error):
        return _ending_error(StreamEvent("r", 0, -1, "", 0.0, 0.0, True, "rejected", error))

    full = ending("queue full (1 waiting, max_queue_len=1)")
    assert full.status == 429 and full.headers == {"Retry-After": "1"}
    big = ending("needs 70 KV blocks, the pool has 64 (block size 16)")
    assert big.status == 400 and not big.headers and big.code == "context_length_exceeded"
    assert big.body()["error"]["type"] == "invalid_request_error" and "70 KV blocks" in big.message


def test_client_gone_mid_body_is_499_not_500(srv):
    import socket

    def responses():
        _, s = scrape(srv.url)
        return {dict(k[1])["code"]: v for k, v in s.items()
                if k[0] == "workbench_http_responses_total" and dict(k[1])["path"] == "/v1/completions"}

    before = responses()
    inner, entered = srv.app.app, threading.Event()

    async def spy(scope, receive, send):              # the server has the request: it now waits for the body
        if scope.get("path") == "/v1/completions":
            entered.set()
        await inner(scope, receive, send)

    srv.app.app = spy
    try:
        sock = socket.create_connection(("127.0.0.1", srv.port))
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode() +
                     b"\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"prompt\":")
        assert entered.wait(60), "the server never started on the request"
        sock.close()                                  # mid-body: 11 of its 100 bytes sent
        wait_until(lambda: responses().get("499", 0) != before.get("499", 0), what="a 499 on /metrics")
    finally:
        srv.app.app = inner
    after = responses()
    assert after["499"] == before.get("499", 0) + 1
    assert after.get("500", 0) == before.get("500", 0)


def test_prometheus_label_values_are_escaped():
    from workbench.serve.metrics import ServerMetrics, _label

    assert _label('a\\b"c\nd') == 'a\\\\b\\"c\\nd'
    m = ServerMetrics()
    m.http_response('/odd"path\\x\ny', 404)
    text = m.render({}, True, {"state": 'we"ird\\\nstate'})
    assert 'workbench_slo_guard_state{state="we\\"ird\\\\\\nstate"} 1' in text
    assert 'path="/odd\\"path\\\\x\\ny"' in text
    parser = pytest.importorskip("prometheus_client.parser")
    fams = {f.name: f for f in parser.text_string_to_metric_families(text)}
    states = {s.labels["state"]: s.value for s in fams["workbench_slo_guard_state"].samples}
    assert states['we"ird\\\nstate'] == 1
    paths = {s.labels["path"] for s in fams["workbench_http_responses"].samples}
    assert paths == {'/odd"path\\x\ny'}


def test_every_4xx_is_an_invalid_request_error(http):
    from workbench.serve.protocol import APIError

    r = http.get("/v1/completions")
    assert r.status_code == 405
    assert r.json()["error"]["type"] == "invalid_request_error"
    for status in (400, 405, 409, 413, 415, 422):
        assert APIError(status, "x").body()["error"]["type"] == "invalid_request_error"
    assert APIError(401, "x").body()["error"]["type"] == "authentication_error"
    assert APIError(404, "x").body()["error"]["type"] == "not_found_error"
    assert APIError(429, "x").body()["error"]["type"] == "rate_limit_error"
    assert APIError(500, "x").body()["error"]["type"] == "server_error"
    assert APIError(502, "x").body()["error"]["type"] == "server_error"
