"""``workbench kv-inspect --url``: the live paged KV pool of a running server.

A real server (uvicorn on a free port, the small random-weight model of ``conftest.py`` behind
the batched engine, an API key set) answers ``GET /v1/workbench/kv``; :func:`fetch_pool_report`
and the CLI read it.  The pool is checked against the engine's own block manager: once the
engine is idle the report must match it exactly; while a request runs, the engine is held at a
known step by its ``on_step`` hook (as in ``test_server.py``), so the live request's blocks
are in the report for certain, not by timing luck.
"""

from __future__ import annotations

import json
import random
import socket
import sys
import threading
import time
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from workbench.cli.main import main  # noqa: E402
from workbench.errors import WorkbenchError  # noqa: E402
from workbench.kv import inspect as kvi  # noqa: E402
from workbench.bench import kv_inspect as kv_inspect_bench  # noqa: E402
from workbench.kv.block_manager import BlockManager  # noqa: E402
from workbench.kv.inspect import KV_POOL_PATH, fetch_pool_report, pool_report_from_thread  # noqa: E402
from workbench.kv.layout import KVLayout  # noqa: E402
from workbench.kv.paged import PagedKVConfig  # noqa: E402
from workbench.sched import SchedulerConfig  # noqa: E402
from workbench.engine import LLMEngine  # noqa: E402
from workbench.serve import ServerConfig, start_server  # noqa: E402

KEY = "kv-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
BLOCK, NUM_BLOCKS = 4, 48
SYSTEM = list(range(100, 124))                    # 24 shared tokens = 6 full blocks
PROMPT_A, PROMPT_B = SYSTEM + [7, 8, 9, 10], SYSTEM + [11, 12, 13, 14]
STATES = ("free", "owned", "shared", "cached")


@pytest.fixture
def srv(random_llm):
    eng = LLMEngine(random_llm, kv=PagedKVConfig(block_size=BLOCK, num_blocks=NUM_BLOCKS),
                    scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=128))
    with start_server(eng, ServerConfig(port=0, api_key=KEY)) as handle:
        yield handle


def complete(handle, prompt: list[int], max_tokens: int = 3) -> dict:
    r = httpx.post(handle.url + "/v1/completions", headers=AUTH, timeout=60,
                   json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


def wait_idle(handle, timeout: float = 30.0) -> None:
    """Until the engine has released every request (a response can arrive just before)."""
    deadline = time.monotonic() + timeout
    while handle.engine.engine.seqs or handle.engine.engine.pool.manager.seq_ids():
        assert time.monotonic() < deadline, f"the engine did not drain within {timeout} s"
        time.sleep(0.01)


@contextmanager
def held_after_first_step(aengine):
    """The engine waits on its thread after its next step (pool untouched) until the block ends;
    yields the event set when it is waiting."""
    reached, release = threading.Event(), threading.Event()

    def hook(stats) -> None:
        reached.set()
        release.wait(60)

    aengine.on_step = hook
    try:
        yield reached
    finally:
        aengine.on_step = None
        release.set()


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]        # nothing listens once it is closed


def check_counts(rep: dict) -> None:
    """Block counts add up to the pool and agree with the per-block states."""
    assert rep["num_blocks"] == NUM_BLOCKS == len(rep["block_states"]) == sum(rep["blocks"].values())
    assert rep["blocks"] == {s: rep["block_states"].count(s) for s in STATES}


# ---- the endpoint and fetch_pool_report ----------------------------------------------------------
def test_report_after_shared_prefix_requests_matches_the_engine(srv):
    fresh = fetch_pool_report(srv.url, api_key=KEY)
    check_counts(fresh)
    assert fresh["blocks"]["free"] == NUM_BLOCKS and fresh["prefix_cache"]["requests"] == 0

    complete(srv, PROMPT_A)
    complete(srv, PROMPT_B)
    wait_idle(srv)
    rep = fetch_pool_report(srv.url + "/v1/", timeout=5, api_key=KEY)     # the OpenAI base URL works too
    json.dumps(rep, allow_nan=False)                                      # strict JSON all through
    assert rep["object"] == "workbench.kv_pool" and rep["mode"] == "paged" and rep["block_size"] == BLOCK
    check_counts(rep)
    m = srv.engine.engine.pool.manager
    assert rep["block_states"] == m.block_states()                        # idle: exactly the engine's pool
    assert rep["blocks"]["owned"] == rep["blocks"]["shared"] == 0 and rep["sequences"] == []
    assert rep["blocks"]["cached"] >= len(SYSTEM) // BLOCK                # the shared prefix stays cached
    pc = rep["prefix_cache"]
    assert pc["enabled"] and pc["requests"] == 2 and pc["prompt_tokens"] == len(PROMPT_A) + len(PROMPT_B)
    assert pc["hit_tokens"] == len(SYSTEM) == m.stats.hit_tokens          # B reused A's 6 prefix blocks
    assert pc["hit_rate"] == pytest.approx(len(SYSTEM) / (len(PROMPT_A) + len(PROMPT_B)))
    assert pc["full_hits"] + pc["partial_hits"] == 1 and pc["indexed_blocks"] >= rep["blocks"]["cached"]
    server = rep["server"]
    assert server["model"] == "bundled" and server["engine_alive"] and server["engine"]["finished"] == 2
    assert server["snapshot"]["stable"] and server["snapshot"]["attempts"] == 1


def test_live_request_is_in_the_report_with_its_prefix_reuse(srv):
    complete(srv, PROMPT_A)
    wait_idle(srv)
    cached_before = {i for i, s in enumerate(fetch_pool_report(srv.url, api_key=KEY)["block_states"])
                     if s == "cached"}
    answer: dict = {}
    with held_after_first_step(srv.engine) as reached:
        t = threading.Thread(target=lambda: answer.update(complete(srv, PROMPT_B, max_tokens=4)))
        t.start()
        assert reached.wait(60), "the engine never stepped"
        rep = fetch_pool_report(srv.url, api_key=KEY)
    t.join(60)
    check_counts(rep)
    assert rep["server"]["snapshot"] == {**rep["server"]["snapshot"], "stable": True, "attempts": 1}
    (seq,) = rep["sequences"]
    assert seq["seq_id"] == answer["id"]                                  # the engine's id is the response's
    assert seq["prompt_tokens"] == len(PROMPT_B) and seq["cached_tokens"] == len(SYSTEM)
    assert seq["reuse_ratio"] == pytest.approx(len(SYSTEM) / len(PROMPT_B))
    table = seq["block_table"]
    assert seq["num_blocks"] == len(table) == rep["blocks"]["owned"] and rep["blocks"]["shared"] == 0
    assert set(table[:len(SYSTEM) // BLOCK]) <= cached_before             # its prefix: A's cached blocks
    assert rep["block_owners"] == {str(b): [seq["seq_id"]] for b in sorted(table)}
    assert all(rep["block_states"][b] == "owned" for b in table)


def test_reports_taken_while_requests_run_always_add_up(srv):
    """Poll the endpoint while several requests stream through the engine: every answer is a
    whole report, and a stable one is self-consistent (owners and states agree)."""
    results: list = []
    threads = [threading.Thread(target=lambda p=p: results.append(complete(srv, p, max_tokens=12)))
               for p in (PROMPT_A, PROMPT_B, SYSTEM + [15, 16], SYSTEM + [17])]
    for t in threads:
        t.start()
    stable, polls = 0, 0
    with httpx.Client(base_url=srv.url, headers=AUTH, timeout=30) as c:
        while not polls or any(t.is_alive() for t in threads):         # once more after they end
            polls += 1
            r = c.get(KV_POOL_PATH)
            assert r.status_code == 200, r.text
            rep = r.json()
            check_counts(rep)
            if rep["server"]["snapshot"]["stable"]:
                stable += 1
                used = {i for i, s in enumerate(rep["block_states"]) if s in ("owned", "shared")}
                assert {int(b) for b in rep["block_owners"]} == used
                assert sum(s["num_blocks"] for s in rep["sequences"]) == rep["blocks"]["owned"] + sum(
                    len(o) for b, o in rep["block_owners"].items() if len(o) > 1)
    for t in threads:
        t.join(60)
    assert len(results) == 4 and stable >= 1
    print(f"{polls} reports while the requests ran, {stable} stable")


def test_reads_from_another_thread_never_fail_and_stable_ones_are_consistent():
    """A thread allocates, extends and frees sequences on a block manager as fast as it can
    (thread switches forced every microsecond), while this one takes reports: none raises, and
    every report called stable agrees with itself - owners and block states, tables and token
    counts - although it was read while the manager was changing."""
    m = BlockManager(64, BLOCK)
    pool = SimpleNamespace(manager=m, layout=KVLayout(2, 2, 8, BLOCK, 2), offload=None, nbytes=lambda: 0,
                           manager_seconds=0.0, admissions={})
    stop, failures = threading.Event(), []

    def churn() -> None:
        rng, live, n = random.Random(0), [], 0
        try:
            while not stop.is_set():
                if len(live) < 6 and rng.random() < 0.6:
                    sid, n = f"s{n}", n + 1
                    a = m.allocate(sid, SYSTEM[:rng.randint(1, len(SYSTEM))] + [rng.randint(0, 9)])
                    if a is not None:
                        m.commit(sid, m.num_tokens(sid))
                        pool.admissions[sid] = {"allocation": a, "restored_blocks": 0, "evictions": 0}
                        live.append(sid)
                elif live:
                    sid = live.pop(rng.randrange(len(live)))
                    if rng.random() < 0.5 and m.append_slot(sid, 5) is not None:
                        m.take_copies()
                    pool.admissions.pop(sid, None)
                    m.free(sid)
        except Exception as e:  # noqa: BLE001 - reported below, not lost on the thread
            failures.append(e)

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    t = threading.Thread(target=churn)
    t.start()
    reads = stable = 0
    try:
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            rep = pool_report_from_thread(pool, pause_s=0)
            reads += 1
            assert sum(rep["blocks"].values()) == len(rep["block_states"]) == 64
            if rep["snapshot"]["stable"]:
                stable += 1
                used = {i for i, s in enumerate(rep["block_states"]) if s in ("owned", "shared")}
                assert {int(b) for b in rep["block_owners"]} == used
                assert all(len(r["block_table"]) == -(-r["tokens"] // BLOCK) for r in rep["sequences"])
    finally:
        sys.setswitchinterval(old)
        stop.set()
        t.join(10)
    assert not failures, failures
    m.check_invariants()
    assert reads > 10 and stable >= reads // 2


def test_torn_reads_are_retried_and_a_busy_pool_is_a_503(srv, monkeypatch):
    real, calls = kvi.pool_report, []

    def torn_once(pool, allocations=None, finished=None):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("dictionary changed size during iteration")
        return real(pool, allocations, finished)

    monkeypatch.setattr(kvi, "pool_report", torn_once)
    rep = pool_report_from_thread(srv.engine.engine.pool, pause_s=0)
    assert rep["snapshot"]["attempts"] == 2 and rep["snapshot"]["stable"] and len(calls) == 2

    monkeypatch.setattr(kvi, "pool_report", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("torn")))
    with pytest.raises(WorkbenchError, match="all 3 reads failed.*RuntimeError: torn"):
        pool_report_from_thread(srv.engine.engine.pool, attempts=3, pause_s=0)
    r = httpx.get(srv.url + KV_POOL_PATH, headers=AUTH, timeout=30)
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["code"] == "kv_pool_busy"


# ---- the CLI -----------------------------------------------------------------------------------
def test_cli_url_prints_the_servers_pool_without_loading_a_model(srv, capsys, monkeypatch):
    complete(srv, PROMPT_A)
    complete(srv, PROMPT_B)
    wait_idle(srv)

    def no_model(*a, **k):
        raise AssertionError("kv-inspect --url ran the local workload")

    monkeypatch.setattr(kv_inspect_bench, "inspect_paged_workload", no_model)
    monkeypatch.setenv("WORKBENCH_API_KEY", KEY)
    assert main(["kv-inspect", "--url", srv.url, "--width", "16"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].startswith("server: model bundled; engine running") and "stable snapshot" in lines[0]
    assert f"paged KV pool: {NUM_BLOCKS} blocks x {BLOCK} tokens" in out
    rep = fetch_pool_report(srv.url, api_key=KEY)
    assert "blocks now: " + ", ".join(f"{rep['blocks'][s]} {s}" for s in STATES) in out
    n = len(PROMPT_A) + len(PROMPT_B)
    assert f"({len(SYSTEM)} / {n} prompt tokens over 2 requests)" in out
    start = next(i for i, ln in enumerate(lines) if ln.startswith("block map now")) + 1
    rows = lines[start:start + NUM_BLOCKS // 16]                          # --width 16: 16 blocks a line
    assert [int(r.split()[0]) for r in rows] == list(range(0, NUM_BLOCKS, 16))
    assert "".join(r.split()[1] for r in rows) == "".join(kvi.CHARS[s] for s in rep["block_states"])

    assert main(["kv-inspect", "--url", srv.url, "--json"]) == 0
    as_json = json.loads(capsys.readouterr().out)
    assert as_json["block_states"] == rep["block_states"] and as_json["prefix_cache"] == rep["prefix_cache"]


# ---- clear errors, no tracebacks ---------------------------------------------------------------
def test_unreachable_url_is_a_clear_error(capsys):
    url = f"http://127.0.0.1:{closed_port()}"
    with pytest.raises(WorkbenchError, match=f"--url {url}: GET {url}{KV_POOL_PATH}: cannot reach the server"):
        fetch_pool_report(url, timeout=5)
    assert main(["kv-inspect", "--url", url]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"workbench kv-inspect: error: --url {url}: ") and "is `workbench serve` running" in err
    assert "Traceback" not in err and err.count("\n") == 1


def test_missing_api_key_and_tiers_with_url_are_clear_errors(srv, capsys, monkeypatch):
    with pytest.raises(WorkbenchError, match="HTTP 401 .*WORKBENCH_API_KEY"):
        fetch_pool_report(srv.url)
    monkeypatch.delenv("WORKBENCH_API_KEY", raising=False)
    assert main(["kv-inspect", "--url", srv.url]) == 2
    assert "HTTP 401" in capsys.readouterr().err
    assert main(["kv-inspect", "--url", srv.url, "--tiers"]) == 2
    assert "--url shows a server's paged KV pool" in capsys.readouterr().err


class _OtherServer(BaseHTTPRequestHandler):
    """Some HTTP server that is not workbench: JSON for / , 404 elsewhere, HTML on /html."""

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        if self.path.startswith("/html"):
            self._send(200, b"<html>hello</html>", "text/html")
        elif self.path.startswith("/json"):
            self._send(200, b'{"object": "list", "data": []}', "application/json")
        else:
            self._send(404, b"no such page", "text/plain")

    def _send(self, status: int, body: bytes, kind: str) -> None:
        self.send_response(status)
        self.send_header("content-type", kind)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


def test_a_server_that_is_not_workbench_is_named_as_such():
    other = ThreadingHTTPServer(("127.0.0.1", 0), _OtherServer)
    threading.Thread(target=other.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    base = f"http://127.0.0.1:{other.server_address[1]}"
    try:
        with pytest.raises(WorkbenchError, match=r"HTTP 404 \(no such page\); not a workbench server"):
            fetch_pool_report(base, timeout=5)
        # a path prefix is kept: these servers answer 200 there, with something else than the report
        with pytest.raises(WorkbenchError, match=r"\(text/html\) is not a workbench KV pool report"):
            fetch_pool_report(base + "/html", timeout=5)
        with pytest.raises(WorkbenchError, match=r"\(application/json\) is not a workbench KV pool report"):
            fetch_pool_report(base + "/json", timeout=5)
    finally:
        other.shutdown()
        other.server_close()
