"""A served run of the tiered cache: ``workbench serve --tiers`` in its own process, real HTTP
clients, and the server's own memory gauges.

::

    res = served_tier_run(stores=("accounted", "host"), requests=8, concurrency=4)
    print(format_served_run(res))

Per store, one server process (``python -m workbench.cli serve --tiers ... --tier-store S``) on
a free port; ``requests`` streamed completions of held-out text (``prompt_tokens`` each, greedy,
``max_tokens`` each), ``concurrency`` at a time, from client threads of this process.  Measured
per request: TTFT (first SSE chunk with text) and the whole time; per run: output tokens/s
(all tokens / wall time), TTFT p50 / p95, and the *server's* ``/metrics`` sampled every
``sample_s``: the peak of measured resident KV bytes (``workbench_kv_resident_bytes``, summed
over zones, staging apart) next to the formula and the full cache for the same live sequences.
The accounted store has no memory gauges: it keeps a full copy and only counts.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from workbench.errors import WorkbenchError
from workbench.serve.spawn import stop_process

# the TierConfig fields `workbench serve --tiers` takes as flags (element_bytes is accounting only)
SERVE_FIELDS = ("window", "sink", "rank", "warm_tokens", "chunk", "block", "budget", "value_format", "key_space",
                "cold_mode")
_GAUGE = re.compile(r'^(workbench_kv_(?:resident|formula)_bytes)\{zone="(\w+)"\} (\S+)$'
                    r'|^(workbench_kv_full_cache_bytes) (\S+)$')


def _tier_args(tier: dict) -> list[str]:
    out = []
    for k, v in tier.items():
        if v is None:
            continue
        out += [f"--{k.replace('_', '-')}", str(v)]
    return out


def _start(store: str, tier: dict, extra: list[str], timeout: float = 180.0):
    from workbench.serve.spawn import start_server

    srv = start_server(["--port", "0", "--tiers", "--tier-store", store, *_tier_args(tier), *extra], timeout_s=timeout,
                       env=dict(os.environ, PYTHONUNBUFFERED="1"))
    return srv.proc, srv.url


def _scrape(http, url: str) -> dict:
    out: dict = {"resident": {}, "formula": {}, "full": 0.0}
    for line in http.get(url + "/metrics").text.splitlines():
        m = _GAUGE.match(line)
        if not m:
            continue
        if m.group(4):
            out["full"] = float(m.group(5))
        else:
            out["resident" if "resident" in m.group(1) else "formula"][m.group(2)] = float(m.group(3))
    return out


def _one(http, url: str, prompt: str, max_tokens: int) -> dict:
    t0 = time.perf_counter()
    ttft, n, text = None, 0, []
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    with http.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            return {"error": f"HTTP {r.status_code}: {r.read()[:200]!r}"}
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if ev.get("usage"):
                n = ev["usage"]["completion_tokens"]
            for ch in ev.get("choices", []):
                if ch.get("text"):
                    ttft = ttft or time.perf_counter() - t0
                    text.append(ch["text"])
    return {"ttft_s": ttft, "e2e_s": time.perf_counter() - t0, "tokens": n, "text": "".join(text)}


def _run_store(store: str, tier: dict, prompts: list[str], max_tokens: int, concurrency: int,
               extra: list[str], sample_s: float) -> dict:
    import httpx

    proc, url = _start(store, tier, extra)
    peak = {"resident_kv": 0.0, "staging": 0.0, "formula_kv": 0.0, "full": 0.0, "samples": 0}
    stop = threading.Event()

    def sampler():
        with httpx.Client(timeout=30) as h:
            while not stop.is_set():
                g = _scrape(h, url)
                kv = sum(v for z, v in g["resident"].items() if z != "staging")
                if kv > peak["resident_kv"]:
                    peak.update(resident_kv=kv, staging=g["resident"].get("staging", 0.0),
                                formula_kv=sum(g["formula"].values()), full=g["full"])
                peak["samples"] += 1
                stop.wait(sample_s)

    try:
        with httpx.Client(timeout=600) as http:
            _one(http, url, prompts[0], 2)                                   # warm-up: first-call costs
            th = threading.Thread(target=sampler, daemon=True)
            th.start()
            t0 = time.perf_counter()
            with ThreadPoolExecutor(concurrency) as ex:
                rows = list(ex.map(lambda p: _one(http, url, p, max_tokens), prompts))
            wall = time.perf_counter() - t0
            stop.set()
            th.join(timeout=30)
            prefetch = {}
            for line in http.get(url + "/metrics").text.splitlines():
                m = re.match(r'^workbench_prefetch_(\w+)\{kind="tiers"\} (\S+)$', line)
                if m:
                    prefetch[m.group(1)] = float(m.group(2))
    finally:
        stop_process(proc)
    ok = [r for r in rows if "error" not in r]
    ttfts = sorted(r["ttft_s"] for r in ok if r["ttft_s"] is not None)
    tokens = sum(r["tokens"] for r in ok)
    q = lambda xs, f: xs[min(len(xs) - 1, int(round(f * (len(xs) - 1))))] if xs else None  # noqa: E731
    return {"store": store, "requests": len(rows), "errors": [r["error"] for r in rows if "error" in r],
            "tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall if wall else None,
            "ttft_ms_p50": 1e3 * statistics.median(ttfts) if ttfts else None,
            "ttft_ms_p95": 1e3 * q(ttfts, 0.95) if ttfts else None,
            "memory_peak": peak if peak["resident_kv"] else None, "prefetch": prefetch or None,
            "texts": [r.get("text") for r in rows]}


def served_tier_run(stores=("accounted", "host"), tier: dict | None = None, requests: int = 8,
                    concurrency: int = 4, prompt_tokens: int = 384, max_tokens: int = 32,
                    extra: list[str] | None = None, sample_s: float = 0.05, device: str | None = None) -> dict:
    """One server per store, the same requests to each (see the module docstring)."""
    if requests < 1 or concurrency < 1:
        raise WorkbenchError(f"served run: requests and concurrency must be >= 1, got {requests} and {concurrency}")
    import workbench as wb
    from workbench.bench.tier_eval import heldout_split

    tier = tier or dict(window=32, rank=8, warm_tokens=64, chunk=16, block=16, budget=64, key_space="pre_rope")
    tok = wb.LLM().tokenizer
    docs = heldout_split(tok, 1024)["evaluation"]
    prompts = [tok.decode(docs[i % len(docs)][(i // len(docs)) * 64:][:prompt_tokens]) for i in range(requests)]
    extra = extra if extra is not None else ["--max-num-seqs", str(concurrency), "--calibration-docs", "2"]
    if device:
        extra = [*extra, "--device", device]
    runs = [_run_store(s, tier, prompts, max_tokens, concurrency, extra, sample_s) for s in stores]
    same = all(r["texts"] == runs[0]["texts"] for r in runs)
    for r in runs:
        r.pop("texts")
    return {"kind": "measurement", "tier": tier, "requests": requests, "concurrency": concurrency,
            "prompt_tokens": prompt_tokens, "max_tokens": max_tokens, "runs": runs, "identical_texts": same}


def format_served_run(res: dict) -> str:
    lines = [f"served run: {res['requests']} streamed requests, {res['concurrency']} at a time, "
             f"{res['prompt_tokens']}-token prompts, {res['max_tokens']} tokens each (greedy); "
             f"texts identical across stores: {res['identical_texts']}",
             f"{'store':<10}{'tok/s':>8}{'TTFT p50':>10}{'TTFT p95':>10}{'KV MB':>9}{'formula MB':>11}"
             f"{'staging MB':>11}{'full MB':>9}{'hit rate':>9}{'stall s':>9}"]
    for r in res["runs"]:
        m, p = r["memory_peak"] or {}, r["prefetch"] or {}
        mb = lambda k: f"{m[k] / 1e6:.2f}" if m else "-"  # noqa: E731
        lines.append(f"{r['store']:<10}{r['tokens_per_s']:>8.1f}{r['ttft_ms_p50']:>10.0f}{r['ttft_ms_p95']:>10.0f}"
                     f"{mb('resident_kv'):>9}{mb('formula_kv'):>11}{mb('staging'):>11}{mb('full'):>9}"
                     f"{p.get('hit_rate', float('nan')):>9.2f}{p.get('stall_seconds_total', float('nan')):>9.2f}")
    lines.append("KV MB: the peak of the server's measured resident KV bytes over live sequences (staging apart); "
                 "full MB: a full cache for the same sequences at that moment.")
    return "\n".join(lines)
