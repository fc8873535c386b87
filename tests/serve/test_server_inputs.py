"""The server under inputs real clients send: huge prompts, odd bodies, odd headers.

* A near-1 MiB prompt must not stall other streams: the server refuses it from its byte length
  (a byte-level BPE token covers at most ``max_token_bytes`` bytes, so the prompt has at least
  ``bytes / max_token_bytes`` tokens) and tokenizes what passes that bound off the event loop.
* Every bad input is a 4xx in OpenAI's JSON error shape, never a plain-text 500: JSON nested
  too deeply, lone surrogates, non-JSON content types, invalid UTF-8; an unexpected exception is
  a 500 in the same shape.
* ``Authorization: bearer <key>`` (the scheme is case-insensitive, RFC 7235); ``/health`` shows an
  engine error while it is current and says when the engine recovered.

The latency tests compare one stream's worst inter-token gap (seen by an HTTP client) with and
without the disturbing requests (near-1 MiB prompts; a slow tokenizer that releases the GIL, as
the server's call does) and, for a tokenizer that holds the GIL, how fast the event loop still
answers; see their docstrings for the bounds.  The model is the small random-weight one
(``random_llm``), so a decode step takes milliseconds and the file runs in ~20 s.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from workbench.kv.paged import PagedKVConfig  # noqa: E402
from workbench.sched import SchedulerConfig  # noqa: E402
from workbench.engine import LLMEngine  # noqa: E402
from workbench.serve import ServerConfig, start_server  # noqa: E402

KEY = "inputs-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
JSON = {**AUTH, "content-type": "application/json"}
PROMPT = "The list type"
STREAM_IDS = [464, 1351, 2099, 318]
MIB = 1 << 20


@pytest.fixture(scope="module")
def srv(random_llm):
    eng = LLMEngine(random_llm, kv=PagedKVConfig(block_size=16, num_blocks=64),
                    scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256))
    config = ServerConfig(port=0, api_key=KEY, max_body_bytes=MIB)     # the default body limit: 1 MiB
    with start_server(eng, config) as handle:
        yield handle


@pytest.fixture(scope="module")
def http(srv):
    with httpx.Client(base_url=srv.url, headers=AUTH, timeout=60) as c:
        yield c


def api_error(r, status: int) -> dict:
    """The OpenAI error object of a JSON error response with this status."""
    assert r.status_code == status, (r.status_code, r.text[:300])
    assert r.headers["content-type"].startswith("application/json"), r.headers["content-type"]
    e = r.json()["error"]
    assert set(e) == {"message", "type", "param", "code"}, e
    assert e["type"] == ("server_error" if status >= 500 else
                         "authentication_error" if status == 401 else "invalid_request_error"), e
    return e


def post(http, body: bytes, path: str = "/v1/completions", content_type: str | None = "application/json"):
    headers = {} if content_type is None else {"content-type": content_type}
    return http.post(path, content=body, headers=headers)


# ---- bad bodies: 4xx in the OpenAI shape ----------------------------------------------------------
def test_deep_nesting_is_400_json(http):
    deep = b'{"prompt": ' + b"[" * 50_000 + b"]" * 50_000 + b', "max_tokens": 1}'
    e = api_error(post(http, deep), 400)
    assert "nested" in e["message"] and e["code"] == "invalid_json"
    unclosed = b'{"prompt": ' + b"[" * 200_000                       # never closed: deep, and not JSON either
    assert api_error(post(http, unclosed), 400)["code"] == "invalid_json"
    # deeper than the limit, though shallow enough for Python's json: still refused, in an ignored field
    nested = b'{"prompt": "x", "max_tokens": 1, "metadata": ' + b'{"a": ' * 500 + b"1" + b"}" * 500 + b"}"
    assert "nested" in api_error(post(http, nested), 400)["message"]
    # brackets inside strings are text, not nesting
    r = post(http, json.dumps({"prompt": "[" * 70 + "{" * 70, "max_tokens": 1}).encode())
    assert r.status_code == 200, r.text[:300]


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", b'{"prompt": "abc\\ud800def", "max_tokens": 1}', "prompt"),
    ("/v1/completions", b'{"prompt": "ok", "max_tokens": 1, "stop": ["\\udfff"]}', "stop[0]"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}, '
                             b'{"role": "user", "content": [{"type": "text", "text": "x\\uDBFF"}]}]}',
     "messages[1].content[0].text"),
])
def test_lone_surrogate_is_400_naming_the_field(http, path, body, param):
    e = api_error(post(http, body, path), 400)
    assert e["param"] == param and "surrogate" in e["message"] and f"'{param}'" in e["message"], e


def test_surrogate_pairs_and_invalid_utf8(http):
    # a valid pair (an emoji) is fine
    assert post(http, b'{"prompt": "smile \\ud83d\\ude00", "max_tokens": 1}').status_code == 200
    # a surrogate written as raw UTF-8 bytes is not UTF-8 at all; nor is \xff
    for raw in (b'{"prompt": "a\xed\xa0\x80b", "max_tokens": 1}', b'{"prompt": "a\xffb", "max_tokens": 1}'):
        e = api_error(post(http, raw), 400)
        assert "UTF-8" in e["message"], e


def test_wrong_content_type_is_415_json(http):
    body = json.dumps({"prompt": PROMPT, "max_tokens": 1}).encode()
    for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
                  "application/json; charset=latin-1"):
        e = api_error(post(http, body, content_type=ctype), 415)
        assert "application/json" in e["message"] and e["code"] == "unsupported_media_type", (ctype, e)
    for ctype in (None, "application/json", "Application/JSON; charset=UTF-8", "application/vnd.api+json"):
        assert post(http, body, content_type=ctype).status_code == 200, ctype   # missing: taken as JSON
    e = api_error(post(http, b"prompt=hi", content_type=None), 400)           # missing and not JSON
    assert e["code"] == "invalid_json"


def test_bearer_scheme_is_case_insensitive(srv):
    body = {"prompt": PROMPT, "max_tokens": 1}
    for auth in (f"bearer {KEY}", f"BEARER {KEY}", f"Bearer  {KEY}", f"bEaReR \t{KEY}"):
        r = httpx.post(srv.base_url + "/completions", json=body, headers={"Authorization": auth})
        assert r.status_code == 200, (auth, r.text[:200])
    for auth in (f"Basic {KEY}", f"Bearer{KEY}", f"bearer {KEY}x", KEY, "bearer"):
        api_error(httpx.post(srv.base_url + "/completions", json=body, headers={"Authorization": auth}), 401)


def test_unexpected_exception_is_500_json(srv, http, monkeypatch, caplog):
    state = srv.app.state.server

    def broken(model):
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(state, "check_model", broken)
    with caplog.at_level("ERROR", logger="workbench.serve"):
        e = api_error(http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1}), 500)
    assert "ZeroDivisionError" in e["message"] and "a bug" not in e["message"]   # details go to the log
    logged = [r for r in caplog.records if r.name == "workbench.serve" and r.exc_info]
    assert len(logged) == 1 and "a bug" in str(logged[0].exc_info[1])
    monkeypatch.undo()
    assert http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1}).status_code == 200


def test_unexpected_exception_while_answering(srv, http, monkeypatch):
    """A bug while relaying the engine's events: a whole response is a 500 in OpenAI's shape; a
    stream already under way ends with an error event and [DONE]; the engine request is aborted."""
    from workbench.serve import responses

    calls, real_chunk = [], responses.chunk

    def chunk_failing_third(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyError("a bug")
        return real_chunk(*args, **kwargs)

    def broken_response(*args, **kwargs):
        raise KeyError("a bug")

    monkeypatch.setattr(responses, "response", broken_response)
    e = api_error(http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 3}), 500)
    assert e["code"] == "internal_error" and "KeyError" in e["message"]
    monkeypatch.setattr(responses, "chunk", chunk_failing_third)
    body = {"prompt": STREAM_IDS, "max_tokens": 50, "ignore_eos": True, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and len(lines) == 4, lines
    assert json.loads(lines[-2].removeprefix("data: "))["error"]["code"] == "internal_error"
    monkeypatch.undo()
    deadline = time.monotonic() + 30                 # the aborted request gave its blocks back
    while srv.engine.stats()["kv_used_blocks"] or srv.engine.stats()["running"]:
        assert time.monotonic() < deadline, srv.engine.stats()
        time.sleep(0.02)
    assert http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1}).status_code == 200


def test_nan_is_400_naming_the_field(http):
    e = api_error(post(http, b'{"prompt": "x", "max_tokens": 1, "temperature": NaN}'), 400)
    assert e["param"] == "temperature" and "NaN" in e["message"]


# ---- the byte bound ---------------------------------------------------------------------------------
def test_byte_bound_is_a_lower_bound(bundled_tokenizer, tmp_path):
    """tokens >= ceil(UTF-8 bytes / max_token_bytes) on text made to have few tokens: the longest
    tokens repeated, the special token's text, multi-byte characters; and no bound is claimed for
    a tokenizer whose configuration does not prove one (a normalizer, truncation)."""
    tok = bundled_tokenizer
    L = tok.max_token_bytes
    assert L is not None and L >= 8
    longest = sorted(range(tok.vocab_size), key=lambda i: len(tok.decode([i], skip_special_tokens=False)))[-20:]
    texts = [tok.decode([i] * 7, skip_special_tokens=False) for i in longest]
    texts += ["<|endoftext|>" * 50, "é漢字😀" * 300, "\n\t  " * 400, "".join(chr(c) for c in range(32, 3000)),
              "x", " " * 5000, "-" * 10_000]
    for text in texts:
        n = len(tok.encode(text))
        assert tok.min_tokens(text) <= n, (text[:40], tok.min_tokens(text), n)
        assert tok.encode_nogil(text) == (n, tok.encode(text))
    n = len(tok.encode("x " * 300))
    assert n > 100 and tok.encode_nogil("x " * 300, limit=100) == (n, None)     # counted, never made a list
    cfg = json.loads(tok.path.read_text())
    stripping = [{**a, "lstrip": True} for a in cfg["added_tokens"]]
    for change in ({"normalizer": {"type": "NFC"}},
                   {"truncation": {"direction": "Right", "max_length": 8, "strategy": "LongestFirst", "stride": 0}},
                   {"added_tokens": stripping}):
        folder = tmp_path / next(iter(change))
        folder.mkdir()
        (folder / "tokenizer.json").write_text(json.dumps({**cfg, **change}))
        other = type(tok)(folder)
        assert other.max_token_bytes is None and other.min_tokens("x" * 10_000) == 0


def test_health_shows_last_error_only_while_current(srv, http, monkeypatch):
    eng = srv.engine.engine
    real_step, failed = eng.step, []

    def step_failing_once():
        if not failed:
            failed.append(1)
            raise RuntimeError("injected step failure")
        return real_step()

    monkeypatch.setattr(eng, "step", step_failing_once)
    body = {"prompt": PROMPT, "max_tokens": 2}
    e = api_error(http.post("/v1/completions", json=body), 500)
    assert "injected step failure" in e["message"]
    h = httpx.get(srv.url + "/health", headers=AUTH).json()
    assert h["status"] == "ok" and h["engine_alive"] is True
    assert "injected step failure" in h["last_error"]
    err = h["engine_error"]
    assert "injected step failure" in err["message"] and err["recovered"] is False and err["at"] <= time.time()

    assert http.post("/v1/completions", json=body).status_code == 200       # the engine works again
    h = httpx.get(srv.url + "/health", headers=AUTH).json()
    assert h["status"] == "ok" and h["last_error"] is None, h
    err = h["engine_error"]                                                # still told, as history
    assert "injected step failure" in err["message"] and err["recovered"] is True
    assert err["at"] <= err["recovered_at"] <= time.time()
    monkeypatch.undo()

    # a forward that fails inside the engine's step (the engine ends that step's requests and goes on),
    # twice the same way: each failure is current again until a token follows it
    runner = getattr(eng, "runner", None)
    if runner is None or not hasattr(runner, "execute"):
        return
    real_execute = runner.execute
    for attempt in range(2):
        fails = [1]

        def execute_failing_once(*args, **kwargs):
            if fails:
                fails.pop()
                raise RuntimeError("injected forward failure")
            return real_execute(*args, **kwargs)

        monkeypatch.setattr(runner, "execute", execute_failing_once)
        assert "injected forward failure" in api_error(http.post("/v1/completions", json=body), 500)["message"]
        h = httpx.get(srv.url + "/health", headers=AUTH).json()
        assert "injected forward failure" in h["last_error"] and h["engine_error"]["recovered"] is False, (attempt, h)
        assert http.post("/v1/completions", json=body).status_code == 200
        h = httpx.get(srv.url + "/health", headers=AUTH).json()
        assert h["last_error"] is None and h["engine_error"]["recovered"] is True, (attempt, h)
        monkeypatch.undo()


# ---- latency: big and slow prompts must not stall other streams --------------------------------------
STEP_S = 0.004     # each engine step also waits this long with the GIL released (as a GPU step waits for
                   # the device): a 200-token stream then lasts >= 0.8 s, longer than what disturbs it


@pytest.fixture
def paced(srv):
    srv.engine.on_step = lambda stats: time.sleep(STEP_S)
    yield srv
    srv.engine.on_step = None


def _stream_gaps(srv, n: int, on_token=None) -> tuple[list[float], float]:
    """Stream ``n`` tokens; returns (gaps between consecutive tokens as the client saw them, time of
    the last token).  ``on_token(i)`` runs after the i-th token (1-based) arrives."""
    # token ids: the stream's own prompt does not meet the tokenizer a test slows down
    body = {"prompt": STREAM_IDS, "max_tokens": n, "temperature": 0, "ignore_eos": True, "stream": True}
    times: list[float] = []
    with httpx.stream("POST", srv.base_url + "/completions", json=body, headers=AUTH, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {") and '"finish_reason":null' in line:
                times.append(time.perf_counter())
                if on_token is not None:
                    on_token(len(times))
    assert len(times) == n, len(times)
    return [b - a for a, b in zip(times, times[1:])], times[-1]


def _disturb(client: httpx.Client, bodies: list[bytes], results: list) -> list[threading.Thread]:
    """Send each body from its own thread; results get (status, error code, time answered).
    ``client`` is made beforehand: making one (its SSL context) holds the GIL for ~30 ms."""
    def one(body: bytes) -> None:
        r = client.post("/v1/completions", content=body)
        results.append((r.status_code, r.json()["error"]["code"] if r.status_code >= 400 else None,
                        time.perf_counter()))

    threads = [threading.Thread(target=one, args=(b,), daemon=True) for b in bodies]
    for t in threads:
        t.start()
    return threads


class _Probe:
    """GET /health every 10 ms from a thread (its handler runs on the event loop); ``worst``: the
    slowest answer while it ran."""

    def __init__(self, srv) -> None:
        self.srv, self.times, self.stop = srv, [], threading.Event()
        self.client = httpx.Client(base_url=srv.url, timeout=60)
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.is_set():
            t = time.perf_counter()
            assert self.client.get("/health").status_code == 200
            self.times.append(time.perf_counter() - t)
            time.sleep(0.01)

    def __enter__(self) -> _Probe:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(60)
        self.client.close()

    @property
    def worst(self) -> float:
        return max(self.times)


def _measure(srv, n: int, bodies: list[bytes], bound, probe: bool = False) -> dict:
    """One stream of ``n`` tokens alone (twice: ``alone`` is the worse), then again while ``bodies``
    arrive after its 5th token: ``worst`` (its worst gap), ``results`` of the bodies, ``last`` (time
    of its last token), ``health`` (the slowest /health answer meanwhile, with ``probe``).  Timing on a
    shared machine is noisy (CI runs another test file on the other core): while a try is over
    ``bound(try)``, it is measured again, up to three tries, and the best is kept; a stall of the kind
    these tests catch happens every time."""
    _stream_gaps(srv, 8)                                         # warm up the path
    best = None
    for _ in range(3):
        alone = max(max(_stream_gaps(srv, n)[0]) for _ in range(2))
        results: list = []
        threads: list[threading.Thread] = []
        client = httpx.Client(base_url=srv.url, headers=JSON, timeout=60,
                              limits=httpx.Limits(max_connections=len(bodies)))

        def start(i: int) -> None:
            if i == 5:
                threads.extend(_disturb(client, bodies, results))

        with client, (_Probe(srv) if probe else contextlib.nullcontext()) as p:
            gaps, last = _stream_gaps(srv, n, start)
            for t in threads:
                t.join(60)
        assert len(results) == len(bodies)
        tried = {"alone": alone, "worst": max(gaps), "results": results, "last": last,
                 "health": p.worst if probe else None}
        if best is None or bound(tried) < bound(best):
            best = tried
        if bound(best) <= 0:
            break
    return best


def _overlapped(m: dict) -> None:
    """The disturbing requests were answered while the stream still ran (else it measured nothing)."""
    assert max(t for _, _, t in m["results"]) < m["last"], "the stream ended before the other requests were answered"


def test_near_1mib_prompts_do_not_stall_a_stream(paced):
    """Four prompts just under the 1 MiB body limit arrive while a stream runs.  Before, each was
    tokenized on the event loop (~0.6 s with every stream stopped) and then refused as too long;
    now the byte bound refuses them at once (1 MiB / 123 bytes per token >> the 256-token context).

    Bound: the stream's worst gap stays within 2x its worst gap alone + 50 ms.  The 50 ms absorbs
    what a 2-core CI machine adds that is not a stall: the four bodies are made, sent, received and
    parsed in this same process (JSON of 1 MiB: ~2 ms each, holding the GIL), and the client
    threads, the server's event loop, the engine thread and torch's threads share two cores with
    OS time slices of ~4-10 ms and a 5 ms GIL switch interval; a stall of the old kind is >= 500 ms."""
    text = ("lorem ipsum " * (MIB // 12))[: MIB - 200]
    bodies = [json.dumps({"prompt": text, "max_tokens": 1}).encode() for _ in range(4)]
    assert all(MIB - 300 < len(b) <= MIB for b in bodies)
    _assert_not_stalled(paced, bodies, "4 near-1 MiB prompts")


def _assert_not_stalled(paced, bodies, what: str) -> None:
    """A stream's worst inter-token gap while ``bodies`` (each refused as too long) arrive stays
    within 2x its worst gap alone + 50 ms."""
    m = _measure(paced, 200, bodies, lambda m: m["worst"] - (2 * m["alone"] + 0.05))
    print(f"\nworst inter-token gap: alone {m['alone'] * 1e3:.1f} ms, with {what} {m['worst'] * 1e3:.1f} ms")
    assert [(s, c) for s, c, _ in m["results"]] == [(400, "context_length_exceeded")] * len(bodies)
    assert m["worst"] <= 2 * m["alone"] + 0.05, m
    _overlapped(m)


def busy(seconds: float) -> None:
    """Spin in Python (a tokenizer written in Python: it holds the GIL, yielding it only at the
    interpreter's switch interval), unlike time.sleep, which releases the GIL at once."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _slow_tokenizer(monkeypatch, tok, wait) -> None:
    """Every text the server tokenizes first waits ``wait()``; the stream itself sends token ids."""
    for name in ("encode", "encode_nogil"):        # whichever the server calls
        real = getattr(tok, name, None)
        if real is not None:
            def slow(*args, _real=real, **kwargs):
                wait()
                return _real(*args, **kwargs)

            monkeypatch.setattr(tok, name, slow)


# 3 kB: at least 25 tokens by the byte bound, ~1000 by the tokenizer, over the 256-token context
SLOW_BODIES = [json.dumps({"prompt": "ab " * 1000, "max_tokens": 1}).encode()] * 2


def test_slow_tokenizer_does_not_stall_a_stream(paced, random_llm, monkeypatch):
    """Two prompts that pass the byte bound (so they are tokenized) meet a tokenizer that takes
    0.3 s with the GIL released - what the server's call is like: ``encode_nogil`` runs the Rust
    tokenizer with the GIL released (``encode`` would hold it: see the next test).  On the event
    loop each would stop every stream for 0.3 s; off it, nothing waits for it.
    Bound: 2x the worst gap alone + 50 ms (as for the big prompts)."""
    tok = random_llm.tokenizer
    assert tok.min_tokens(SLOW_BODIES[0].decode()) < random_llm.max_model_len
    _slow_tokenizer(monkeypatch, tok, lambda: time.sleep(0.3))
    _assert_not_stalled(paced, SLOW_BODIES, "2 slow tokenizations")


def test_gil_holding_tokenizer_leaves_the_event_loop_free(paced, random_llm, monkeypatch):
    """The same prompts meet a tokenizer that spins 0.5 s in Python, holding the GIL (a tokenizer
    written in Python; see :func:`busy`).  The event loop stays free: /health, answered on it,
    keeps answering within 0.25 s (on the loop, the tokenization would hold it 0.5 s).

    The stream's gap is printed, not bounded: while a thread spins holding the GIL, the *engine*
    thread waits up to the 5 ms switch interval each time it takes the GIL back after a torch call
    released it, dozens of times per step, so its steps stretch to hundreds of ms whichever thread
    spins (measured: worst gap 0.4-1.2 s; alone ~12 ms).  No server thread can avoid that; a
    tokenizer must release the GIL (ours does, see the test above) or run in another process."""
    tok = random_llm.tokenizer
    _slow_tokenizer(monkeypatch, tok, lambda: busy(0.5))
    m = _measure(paced, 200, SLOW_BODIES, lambda m: m["health"] - 0.25, probe=True)
    print(f"\nGIL-holding tokenizer: slowest /health {m['health'] * 1e3:.1f} ms; the stream's worst gap: alone "
          f"{m['alone'] * 1e3:.1f} ms, with 2 tokenizations {m['worst'] * 1e3:.1f} ms")
    assert [(s, c) for s, c, _ in m["results"]] == [(400, "context_length_exceeded")] * 2
    assert m["health"] <= 0.25, m
    _overlapped(m)
