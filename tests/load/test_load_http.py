"""The load generator against the real OpenAI-compatible server (``workbench.serve``) over HTTP:
staged constant and closed-loop loads on completions and chat, latencies recorded per request,
the server's own counters agreeing with the client's, an SLO guard in front, and the
``workbench load --url`` command.  One server with the bundled model on CPU for the module."""

from __future__ import annotations

import json
import math

import pytest

pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from workbench.load import HTTPTarget, LoadConfig, run_load_sync
from workbench.serve.slo import GuardedTarget, SLOConfig, SLOGuard  # noqa: E402
from workbench.lab.load_views import pick_metrics  # noqa: E402
from workbench.lab.prom_metrics import parse_prometheus_text  # noqa: E402

PROMPTS = ["The list type", "A dictionary maps keys", "Python is"]


@pytest.fixture(scope="module")
def server():
    from workbench.sched import SchedulerConfig

    try:
        from workbench.serve import start_server
        srv = start_server(device="cpu", scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=128))
    except Exception as e:  # noqa: BLE001 - the server is a separate part; say why instead of erroring here
        pytest.skip(f"workbench.serve.start_server could not start the bundled-model server: "
                    f"{type(e).__name__}: {e}")
    yield srv
    srv.stop()


def server_metrics(srv) -> dict:
    import httpx

    return parse_prometheus_text(httpx.get(srv.url + "/metrics", timeout=10).text)


def responses(m: dict, path: str, code: int = 200) -> float:
    return m.get(f'workbench_http_responses_total{{path="{path}",code="{code}"}}', 0.0)


def settled_metrics(srv, timeout: float = 5.0) -> dict:
    """/metrics once the engine's snapshot shows no running request (it is refreshed right after
    the step whose tokens the client has just read)."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        m = server_metrics(srv)
        if (m["workbench_running_requests"] == 0 and m["workbench_kv_used_blocks"] == 0) or time.monotonic() > deadline:
            return m
        time.sleep(0.02)


def check_ok(res, max_tokens: int) -> None:
    assert res.records and all(r.status == "ok" for r in res.records), res.reasons()
    for r in res.records:
        assert 1 <= r.output_tokens <= max_tokens and r.finish_reason in ("length", "stop")
        assert r.ttft > 0 and r.e2e >= r.ttft and len(r.itl) == r.output_tokens - 1
        assert all(g >= 0 for g in r.itl)
    s = res.summary()
    assert s.loc["all", "ok"] == len(res.records)
    assert s.loc["all", "ttft_p95_ms"] > 0 and s.loc["all", "e2e_p95_ms"] >= s.loc["all", "ttft_p50_ms"]
    if any(r.itl for r in res.records):
        assert s.loc["all", "itl_p50_ms"] >= 0 and not math.isnan(s.loc["all", "itl_p99_ms"])


def test_constant_staged_load_on_completions(server):
    before = responses(server_metrics(server), "/v1/completions")
    target = HTTPTarget(server.url, model="bundled")
    cfg = LoadConfig(mode="constant", stages=[(0.5, 6), (0.5, 6), (0.3, 0)], max_tokens=4, prompts=PROMPTS,
                     sampling={"temperature": 0}, priority=lambda i: i % 2, max_duration_s=60)
    res = run_load_sync(target, cfg)
    assert 5 <= len(res.records) <= 8                 # the integral of the rate: 3 + 3 + 0.9
    check_ok(res, 4)
    assert {r.stage for r in res.records} >= {0, 1}
    m = settled_metrics(server)
    assert responses(m, "/v1/completions") - before == len(res.records)   # every one answered 200
    assert m["workbench_kv_used_blocks"] == 0 and m["workbench_running_requests"] == 0
    got = pick_metrics(m)                             # the dashboard reads this server's names
    assert got["queue_len"] == 0 and got["running"] == 0 and got["kv_usage"] == 0


def test_closed_loop_staged_load_on_chat(server):
    before = responses(server_metrics(server), "/v1/chat/completions")
    target = HTTPTarget(server.url, model="bundled", chat=True)
    cfg = LoadConfig(mode="closed", stages=[(0.4, 2), (0.8, 3)], max_tokens=3, prompts=PROMPTS,
                     max_requests=9, max_duration_s=60, sampling={"temperature": 0})
    res = run_load_sync(target, cfg)
    check_ok(res, 3)
    assert len(res.records) >= 3 and {r.user for r in res.records} <= {0, 1, 2}
    assert all(r.prompt_len > 0 for r in res.records)
    assert responses(server_metrics(server), "/v1/chat/completions") - before == len(res.records)


class _Ticking:
    """A pass-through target that moves the guard's clock ``dt`` seconds forward per request: the
    guard's cool-down is counted in requests, whatever the server's real latency is."""

    def __init__(self, target, clock: dict, dt: float) -> None:
        self.target, self.clock, self.dt = target, clock, dt

    async def send(self, prompt, max_tokens, priority=0, **sampling):
        self.clock["t"] += self.dt
        stream = self.target.send(prompt, max_tokens, priority=priority, **sampling)
        try:
            async for ev in stream:
                yield ev
        finally:
            await stream.aclose()

    async def aclose(self) -> None:            # the HTTP client lives on the run's loop: closed with it
        await self.target.aclose()


def test_slo_guard_in_front_of_the_server_sheds_without_sending(server):
    """A guard whose baseline (0.1 ms) no real request can meet: it opens after two samples,
    refuses requests without sending them, probes after the cool-down, and opens again.
    One user, one request at a time, and the guard's clock moves 50 ms per request: the cool-down
    (0.3 s) passes after six requests, however long the server takes to answer."""
    before = responses(server_metrics(server), "/v1/completions")
    clock = {"t": 0.0}
    guard = SLOGuard(SLOConfig(baseline_s=1e-4, window=4, min_samples=2, factor=2.0, cooldown_s=0.3, probes=1),
                     clock=lambda: clock["t"])
    target = _Ticking(GuardedTarget(HTTPTarget(server.url, model="bundled"), guard), clock, 0.05)
    cfg = LoadConfig(mode="closed", concurrency=1, max_requests=24, max_tokens=2, prompts=PROMPTS,
                     max_duration_s=120)
    res = run_load_sync(target, cfg)
    assert len(res.records) == 24
    status = [r.status for r in res.records]
    assert status.count("error") == 0 and status.count("ok") >= 2
    assert status.count("rejected") > 0
    assert all(r.reason.startswith("SLO guard") for r in res.records if r.status == "rejected")
    snap = guard.snapshot()
    assert snap["trips"] >= 2 and snap["probes"] >= 1          # opened, probed, the probe was slow: open again
    assert [t[2] for t in guard.transitions][:3] == ["open", "half_open", "open"]
    assert guard.transitions[1][0] - guard.transitions[0][0] >= 0.3 - 1e-9    # probed after the cool-down
    sent = responses(server_metrics(server), "/v1/completions") - before
    assert sent == status.count("ok")                          # refused requests never reached the server


def test_cli_against_the_server_json(server, capsys):
    import argparse

    from workbench.cli.load import add_parser

    ap = argparse.ArgumentParser(prog="workbench")
    add_parser(ap.add_subparsers(dest="command", required=True))
    args = ap.parse_args(["load", "--url", server.url, "--chat", "--mode", "closed", "--stages", "0.6s:2",
                          "--max-tokens", "3", "--max-requests", "4", "--max-seconds", "60", "--temperature", "0",
                          "--json"])
    assert args.func(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["target"]["model"] == "bundled" and out["target"]["url"].endswith("/v1/chat/completions")
    stages = {s["stage_name"]: s for s in out["stages"]}
    assert stages["all"]["ok"] == stages["all"]["requests"] >= 1
    assert stages["all"]["ttft_p50_ms"] > 0 and out["reasons"] == []
