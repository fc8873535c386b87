"""``workbench load``: drive a server (``--url``) or the batched engine in this process (``--model``)
with a staged load, and print P50/P95/P99 and jitter per stage.

::

    workbench load --mode poisson --stages "5s:2,10s:6,5s:0" --max-tokens 16          # bundled model, in process
    workbench load --url http://127.0.0.1:8000 --mode closed --stages "10s:8" --chat --json
    workbench load --url http://127.0.0.1:8000 --rate 4 --max-requests 50 --slo-factor 2 --csv runs/load.csv
    workbench load --url http://127.0.0.1:8000 --trace azure.csv --window 0:600 --time-scale 0.5   # a recorded trace

The subcommand is added to a parser with :func:`add_parser`; the work is done by
:func:`run_load_command`, a plain function with the same parameters (for notebooks and tests).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path

from workbench.errors import ConfigError, WorkbenchError

_UNITS = {"ms": 1e-3, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0, "": 1.0}
_DURATION = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(ms|s|min|m|h|)\s*$")


def parse_duration(text: str, where: str = "duration") -> float:
    """``"10s"``, ``"500ms"``, ``"2m"``, ``"1.5"`` (seconds) -> seconds."""
    m = _DURATION.match(str(text))
    if not m:
        raise ConfigError(f"{where}: {text!r} is not a duration; write e.g. 10s, 500ms, 2m or 1.5 (seconds)")
    return float(m.group(1)) * _UNITS[m.group(2)]


def parse_stages(text: str) -> list[tuple[float, float]]:
    """k6-style stages ``"10s:5,30s:20,10s:0"`` -> ``[(10.0, 5.0), (30.0, 20.0), (10.0, 0.0)]``:
    each ``duration:target`` ramps linearly to ``target`` (a rate in requests/s, or a number of
    virtual users for ``--mode closed``)."""
    stages = []
    parts = [p for p in str(text).split(",") if p.strip()]
    if not parts:
        raise ConfigError(f"--stages {text!r} is empty; write e.g. \"10s:5,30s:20,10s:0\" (duration:target, ...)")
    for i, part in enumerate(parts):
        if part.count(":") != 1:
            raise ConfigError(f"--stages stage {i + 1} {part.strip()!r}: expected duration:target, e.g. 30s:20")
        dur, tgt = part.split(":")
        d = parse_duration(dur, f"--stages stage {i + 1} duration")
        try:
            t = float(tgt)
        except ValueError:
            raise ConfigError(f"--stages stage {i + 1} target {tgt.strip()!r} is not a number") from None
        if not d > 0:
            raise ConfigError(f"--stages stage {i + 1}: duration {dur.strip()!r} must be > 0")
        if not (t >= 0 and math.isfinite(t)):
            raise ConfigError(f"--stages stage {i + 1}: target {tgt.strip()!r} must be a finite number >= 0")
        stages.append((d, t))
    return stages


def read_prompts(path: str | Path) -> list[str]:
    """Prompts from a file: ``.json`` - a list of strings; ``.jsonl`` - one string or
    ``{"prompt": ...}`` object per line; anything else - one prompt per non-empty line."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"--prompt-file {str(p)!r}: no such file")
    text = p.read_text(encoding="utf-8", errors="replace")
    if p.suffix == ".json":
        try:
            data = json.loads(text)
        except ValueError as e:
            raise ConfigError(f"--prompt-file {str(p)!r}: not valid JSON ({e})") from None
        if not (isinstance(data, list) and all(isinstance(x, str) and x for x in data)):
            raise ConfigError(f"--prompt-file {str(p)!r}: a .json prompt file must hold a list of non-empty strings")
        prompts = data
    elif p.suffix == ".jsonl":
        prompts = []
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except ValueError as e:
                raise ConfigError(f"--prompt-file {str(p)!r} line {n}: not valid JSON ({e})") from None
            val = obj.get("prompt") if isinstance(obj, dict) else obj
            if not (isinstance(val, str) and val):
                raise ConfigError(f"--prompt-file {str(p)!r} line {n}: expected a string or {{\"prompt\": \"...\"}}")
            prompts.append(val)
    else:
        prompts = [line for line in text.splitlines() if line.strip()]
    if not prompts:
        raise ConfigError(f"--prompt-file {str(p)!r}: no prompts in it")
    return prompts


def discover_model_name(url: str, api_key: str | None = None, timeout: float = 10.0) -> str:
    """The first model a server lists at ``GET /v1/models``."""
    return discover_model_card(url, api_key, timeout)["id"]


def discover_model_card(url: str, api_key: str | None = None, timeout: float = 10.0, name: str | None = None) -> dict:
    """The entry of ``GET /v1/models`` for ``name`` (None: the first), e.g. ``{"id": ...,
    "max_model_len": ...}`` (vLLM and workbench serve list the context length)."""
    import httpx

    base = url.rstrip("/")
    base = base if base.endswith("/v1") else base + "/v1"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.get(base + "/models", headers=headers, timeout=timeout)
    except httpx.HTTPError as e:
        raise WorkbenchError(f"--url {url}: cannot reach the server ({type(e).__name__}: {e}); "
                             "is it running?") from None
    if r.status_code != 200:
        raise WorkbenchError(f"--url {url}: GET /v1/models answered HTTP {r.status_code}; pass --served-model-name")
    try:
        cards = [c for c in r.json()["data"] if isinstance(c, dict) and c.get("id")]
    except (ValueError, KeyError, TypeError):
        cards = []
    if not cards:
        raise WorkbenchError(f"--url {url}: GET /v1/models listed no model; pass --served-model-name")
    return next((c for c in cards if c["id"] == name), cards[0])


# ---- a recorded trace ---------------------------------------------------------------------------
def _check_trace_flags(trace, mode, stages, rate, concurrency, prompt_file, max_tokens, priority, chat, send,
                       flags: dict) -> None:
    """--trace's refusals: the load-shape flags it replaces, and its own flags without it."""
    if trace is None:
        given = [f for f, v in flags.items() if v is not None]
        if given:
            raise ConfigError(f"{given[0]} applies to --trace FILE (a recorded trace to replay); give --trace or "
                              f"leave {given[0]} out")
        if mode == "trace":
            raise ConfigError("mode 'trace' needs --trace FILE (the recorded trace to replay)")
        return
    clash = [f for f, v in (("--stages", stages), ("--rate", rate), ("--concurrency", concurrency),
                            ("--mode", None if mode in (None, "trace") else mode), ("--prompt-file", prompt_file),
                            ("--max-tokens", max_tokens), ("--priority", priority or None)) if v is not None]
    if clash:
        raise ConfigError(f"--trace and {clash[0]}: a trace is replayed at its own arrival times with its own prompts, "
                          f"lengths and priorities; leave {clash[0]} out (--time-scale changes the rate, "
                          "--max-tokens-cap caps the lengths)")
    if send not in (None, "tokens", "text"):
        raise ConfigError(f"--send {send!r}: expected tokens (the trace's token ids) or text (the ids decoded)")
    if chat and send != "text":
        raise ConfigError("--trace with --chat: a chat request's prompt is text; add --send text")
    checks = (("--time-scale", flags.get("--time-scale"), lambda v: v > 0,
               "a number > 0 (arrival times x this: 0.5 replays the trace at twice its recorded rate)"),
              ("--length-scale", flags.get("--length-scale"), lambda v: v > 0, "a number > 0 (lengths x this)"),
              ("--max-tokens-cap", flags.get("--max-tokens-cap"), lambda v: isinstance(v, int) and v >= 1,
               "an integer >= 1 (new tokens per request at most)"),
              ("--limit", flags.get("--limit"), lambda v: isinstance(v, int) and v >= 1,
               "an integer >= 1 (the first N requests)"),
              ("--trace-rate", flags.get("--trace-rate"), lambda v: v > 0 and math.isfinite(v),
               "a number > 0 (ShareGPT: new conversations per second)"))
    for flag, v, ok, what in checks:
        if v is not None and not ok(v):
            raise ConfigError(f"{flag} {v!r}: expected {what}")


def _trace_tokenizer(tokenizer, url, model):
    """(Tokenizer, its folder): --tokenizer, else the in-process --model's, else the bundled model's."""
    from workbench.model.loader import BUNDLED_MODEL
    from workbench.model.tokenizer import Tokenizer

    spec = tokenizer if tokenizer is not None else (None if url is not None else model)
    if spec is not None and str(spec).startswith("preset:"):
        raise ConfigError(f"--model {spec}: a preset has random weights and no tokenizer; give --tokenizer DIR "
                          "(a model folder with tokenizer.json) to turn the trace into token ids")
    folder = BUNDLED_MODEL if spec in (None, "bundled") else Path(spec).expanduser()
    return Tokenizer(folder), folder


def _trace_context(url, model, card: dict | None, tok_folder) -> int:
    """The context the trace's requests must fit: the server's (GET /v1/models' max_model_len), else
    the tokenizer folder's config.json; in process the model's."""
    from workbench.model.loader import model_config

    if url is None:
        return model_config(model).max_position_embeddings
    ctx = (card or {}).get("max_model_len")
    if isinstance(ctx, int) and ctx >= 2:
        return ctx
    if (Path(tok_folder) / "config.json").is_file():
        return model_config(tok_folder).max_position_embeddings
    raise ConfigError(f"--url {url}: GET /v1/models gives no max_model_len and --tokenizer {tok_folder} has no "
                      "config.json: cannot tell what context the trace's requests must fit")


def build_trace(path, tok, context: int, send: str, options):
    """The workload of the trace at ``path`` (:func:`workbench.load.trace_workload.build_trace_workload`)
    and the :class:`~workbench.engine.traces.Trace` to send: token ids, or (``send="text"``) the ids decoded."""
    from workbench.engine.traces import Trace, TraceRequest
    from workbench.load.trace_workload import build_trace_workload

    wl = build_trace_workload(path, tok, context, options)
    trace = wl.trace()
    if send == "text":
        reqs = []
        for i, r in enumerate(trace.requests):
            text = tok.decode(list(r.prompt))
            if not text:
                raise ConfigError(f"--send text: request {i} of {wl.source} (line {wl.info[i]['line']}) decodes to no "
                                  "text (special tokens only); use --send tokens")
            reqs.append(TraceRequest(r.at, text, r.params, r.priority))
        trace = Trace(reqs)
    return wl, trace


def _json_clean(v):
    if isinstance(v, dict):
        return {str(k): _json_clean(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_json_clean(x) for x in v]
    return _json_safe(v)


def send_lag(records) -> dict:
    """How far from its scheduled time each request was sent: |sent - scheduled| in ms (max, P50, P99)."""
    import numpy as np

    lag = np.abs([r.sent - r.scheduled for r in records]) * 1e3 if records else np.zeros(0)
    if not lag.size:
        return {"max_ms": None, "p50_ms": None, "p99_ms": None}
    return {"max_ms": float(lag.max()), "p50_ms": float(np.percentile(lag, 50)),
            "p99_ms": float(np.percentile(lag, 99))}


# ---- the plain function -------------------------------------------------------------------------
def run_load_command(url: str | None = None, model: str | None = None, device: str | None = None,
                     dtype: str | None = None, served_model_name: str | None = None, api_key: str | None = None,
                     chat: bool = False, mode: str | None = None, stages: str | list | None = None,
                     rate: float | None = None, concurrency: int | None = None, max_requests: int | None = None,
                     max_seconds: float | None = None, max_tokens: int | None = None, prompt_file: str | None = None,
                     num_prompts: int = 64, priority: int = 0, temperature: float | None = None,
                     slo_factor: float | None = None, slo_policy: str = "reject", slo_cooldown_s: float = 5.0,
                     seed: int = 0, max_num_seqs: int | None = None, progress=None,
                     trace: str | Path | None = None, trace_format: str | None = None, time_scale: float | None = None,
                     limit: int | None = None, window: str | tuple | None = None, length_scale: float | None = None,
                     max_tokens_cap: int | None = None, trace_rate: float | None = None, tokenizer: str | None = None,
                     send: str | None = None, announce=None):
    """Build the target (HTTP or in-process engine, optionally behind an SLO guard), run the load,
    return ``(LoadResult, info)``; ``info`` describes the target and the guard's final snapshot.
    ``progress``: called with the LoadRun on each tick (None: silent).  ``mode``: None is poisson;
    ``max_tokens``: None is 16.

    ``trace``: a recorded trace file replayed at its arrival times (mode "trace"; the load-shape
    arguments are refused with it): ``trace_format`` (None: detected), ``time_scale``, ``limit``,
    ``window`` ("START:END" s), ``length_scale``, ``max_tokens_cap``, ``trace_rate`` (ShareGPT) as in
    :class:`~workbench.load.trace_workload.TraceOptions`; ``tokenizer`` turns it into token ids (default:
    ``model``'s in process, else the bundled model's); ``send``: "tokens" (default) or "text".  Then
    ``info["trace"]`` is the trace's summary, ``info["send_lag_ms"]`` how far from its time each request
    was sent, and ``announce`` (if given) is called with the summary text before the run starts."""
    from workbench.load.generator import LoadConfig

    if url is not None and model is not None:
        raise ConfigError("--url and --model: --model loads a model in this process; to name the model a server "
                          "serves, use --served-model-name")
    _check_trace_flags(trace, mode, stages, rate, concurrency, prompt_file, max_tokens, priority, chat, send,
                       {"--format": trace_format, "--time-scale": time_scale, "--limit": limit, "--window": window,
                        "--length-scale": length_scale, "--max-tokens-cap": max_tokens_cap,
                        "--trace-rate": trace_rate, "--tokenizer": tokenizer, "--send": send})
    if trace is not None:
        return _run_trace(url=url, model=model, device=device, dtype=dtype, served_model_name=served_model_name,
                          api_key=api_key, chat=chat, max_requests=max_requests, max_seconds=max_seconds,
                          temperature=temperature, slo_factor=slo_factor, slo_policy=slo_policy,
                          slo_cooldown_s=slo_cooldown_s, seed=seed, max_num_seqs=max_num_seqs, progress=progress,
                          trace=trace, trace_format=trace_format, time_scale=time_scale, limit=limit, window=window,
                          length_scale=length_scale, max_tokens_cap=max_tokens_cap, trace_rate=trace_rate,
                          tokenizer=tokenizer, send=send or "tokens", announce=announce)
    mode = mode or "poisson"
    max_tokens = 16 if max_tokens is None else max_tokens
    if isinstance(stages, str):
        stages = parse_stages(stages)
    if mode == "closed" and stages:
        bad = [t for _, t in stages if t != int(t)]
        if bad:
            raise ConfigError(f"--stages targets are virtual users with --mode closed: use whole numbers, got {bad}")
        stages = [(d, int(t)) for d, t in stages]
    if not stages:
        if mode == "closed" and not concurrency:
            raise ConfigError("--mode closed needs --stages or --concurrency N")
        if mode != "closed" and not rate:
            raise ConfigError(f"--mode {mode} needs --stages or --rate R (requests/s)")
        if max_requests is None and max_seconds is None:
            raise ConfigError("without --stages the load never ends by itself: "
                              "give --max-requests and/or --max-seconds")
    sampling = {} if temperature is None else {"temperature": temperature}
    cfg = LoadConfig(mode=mode, stages=stages or None, rate=rate, concurrency=concurrency, max_requests=max_requests,
                     max_duration_s=max_seconds, max_tokens=max_tokens,
                     prompts=read_prompts(prompt_file) if prompt_file else None, num_prompts=num_prompts,
                     priority=priority, sampling=sampling, seed=seed, tick_s=1.0,
                     name="http" if url else "in-process")
    return _run(cfg, url=url, model=model, device=device, dtype=dtype, served_model_name=served_model_name,
                api_key=api_key, chat=chat, slo_factor=slo_factor, slo_policy=slo_policy, slo_cooldown_s=slo_cooldown_s,
                max_num_seqs=max_num_seqs, progress=progress)


def _run_trace(url, model, device, dtype, served_model_name, api_key, chat, max_requests, max_seconds, temperature,
               slo_factor, slo_policy, slo_cooldown_s, seed, max_num_seqs, progress, trace, trace_format, time_scale,
               limit, window, length_scale, max_tokens_cap, trace_rate, tokenizer, send, announce):
    """run_load_command with ``trace``: the workload first (a bad file fails before a model loads)."""
    from workbench.load.generator import LoadConfig
    from workbench.load.trace_workload import TraceOptions, parse_window

    card = None
    if url is not None:
        card = discover_model_card(url, api_key, name=served_model_name)
        served_model_name = served_model_name or card["id"]
    tok, tok_folder = _trace_tokenizer(tokenizer, url, model)
    context = _trace_context(url, model, card, tok_folder)
    options = TraceOptions(format=trace_format, time_scale=1.0 if time_scale is None else time_scale, limit=limit,
                           window=parse_window(window), length_scale=1.0 if length_scale is None else length_scale,
                           max_tokens_cap=max_tokens_cap, rate=1.0 if trace_rate is None else trace_rate, seed=seed)
    wl, replay = build_trace(trace, tok, context, send, options)
    if announce is not None:
        announce(wl.describe())
    sampling = {} if temperature is None else {"temperature": temperature}
    cfg = LoadConfig(mode="trace", trace=replay, max_requests=max_requests, max_duration_s=max_seconds,
                     sampling=sampling, seed=seed, tick_s=1.0, name="http" if url else "in-process")
    res, info = _run(cfg, url=url, model=model, device=device, dtype=dtype, served_model_name=served_model_name,
                     api_key=api_key, chat=chat, slo_factor=slo_factor, slo_policy=slo_policy,
                     slo_cooldown_s=slo_cooldown_s, max_num_seqs=max_num_seqs, progress=progress)
    info["trace"] = _json_clean({**wl.summary(), "tokenizer": str(tok_folder), "context": context, "send": send})
    info["send_lag_ms"] = send_lag(res.records)
    return res, info


def _run(cfg, url, model, device, dtype, served_model_name, api_key, chat, slo_factor, slo_policy, slo_cooldown_s,
         max_num_seqs, progress):
    """Build the target of ``url`` / ``model`` (behind an SLO guard with ``slo_factor``), run ``cfg`` on it."""
    from workbench.load.generator import LoadRun
    from workbench.serve.slo import GuardedTarget, SLOConfig, SLOGuard
    from workbench.load.target import HTTPTarget

    guard = None
    if slo_factor is not None:
        try:
            guard = SLOGuard(SLOConfig(factor=slo_factor, policy=slo_policy, cooldown_s=slo_cooldown_s,
                                       learn_factor=min(1.25, slo_factor)))
        except ConfigError as e:
            raise ConfigError(f"--slo-factor / --slo-cooldown: {e}") from None
    engine_target = None
    if url is not None:
        name = served_model_name or discover_model_name(url, api_key)
        target = HTTPTarget(url, model=name, api_key=api_key, chat=chat)
        info = {"target": "http", "url": target.url, "model": name}
    else:
        from workbench.sched import SchedulerConfig
        from workbench.load.engine_target import EngineTarget

        if chat:
            raise ConfigError("--chat applies to --url (the server's chat template); "
                              "in process the prompt is sent as is")
        sched = SchedulerConfig(max_num_seqs=max_num_seqs) if max_num_seqs else None
        engine_target = target = EngineTarget.from_model(model, device=device, dtype=dtype, scheduler=sched)
        info = {"target": "in-process", "model": model or "bundled", "device": str(engine_target.engine.device)}
    if guard is not None:
        target = GuardedTarget(target, guard)
    try:
        run = LoadRun(target, cfg, observers=[] if progress is None else [lambda r, rec: rec is None and progress(r)])
        res = run.run()
    finally:
        if engine_target is not None:
            info["engine"] = engine_target.engine.stats()
            engine_target.close()
    if guard is not None:
        snap = guard.snapshot()
        info["slo"] = {k: snap[k] for k in ("state", "baseline_s", "threshold_s", "trips", "admitted", "rejected",
                                            "deferred", "probes")}
        info["slo"]["transitions"] = [list(t) for t in guard.transitions]
    return res, info


# ---- printing -----------------------------------------------------------------------------------
TABLE_COLUMNS = (("target", "target", "{:g}"), ("requests", "sent", "{:d}"), ("ok", "ok", "{:d}"),
                 ("rejected", "rej", "{:d}"), ("errors", "err", "{:d}"), ("cancelled", "canc", "{:d}"),
                 ("offered_qps", "qps", "{:.2f}"),
                 ("ttft_p50_ms", "TTFT p50", "{:.1f}"), ("ttft_p95_ms", "p95", "{:.1f}"),
                 ("ttft_p99_ms", "p99", "{:.1f}"), ("ttft_jitter_ms", "jitter", "{:.1f}"),
                 ("itl_p50_ms", "ITL p50", "{:.1f}"), ("itl_p95_ms", "p95", "{:.1f}"),
                 ("itl_p99_ms", "p99", "{:.1f}"), ("itl_jitter_ms", "jitter", "{:.1f}"),
                 ("e2e_p50_ms", "E2E p50", "{:.0f}"), ("e2e_p95_ms", "p95", "{:.0f}"),
                 ("e2e_p99_ms", "p99", "{:.0f}"), ("tokens_per_s", "tok/s", "{:.1f}"))


def _cell(v, fmt: str) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if fmt == "{:d}":
        v = int(v)
    return fmt.format(v)


def format_summary(summary) -> str:
    """The per-stage table (LoadResult.summary()): counts, TTFT / ITL / E2E P50/P95/P99 and jitter
    (std) in ms over ok requests."""
    rows = [["stage"] + [h for _, h, _ in TABLE_COLUMNS]]
    for name, r in summary.iterrows():
        rows.append([str(name)] + [_cell(r[c], f) for c, _, f in TABLE_COLUMNS])
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
             for row in rows]
    lines.insert(1, "-" * len(lines[0]))
    lines.insert(len(lines) - 1, "-" * len(lines[0]))
    return "\n".join(lines) + "\n(latencies in ms over ok requests; jitter = standard deviation)"


def _json_safe(v):
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if hasattr(v, "item"):
        return _json_safe(v.item())
    return v


def summary_records(summary) -> list[dict]:
    return [{"stage_name": str(name), **{k: _json_safe(v) for k, v in r.items()}} for name, r in summary.iterrows()]


def cmd_load(args) -> int:
    quiet = args.quiet or args.json

    def progress(run) -> None:
        c = run.counts
        print(f"[{run.elapsed():6.1f} s] {run.stage_name}: sent {run.sent}, ok {c['ok']}, rejected {c['rejected']}, "
              f"errors {c['error']}, in flight {run.in_flight}", file=sys.stderr, flush=True)

    res, info = run_load_command(
        url=args.url, model=args.model, device=args.device, dtype=args.dtype,
        served_model_name=args.served_model_name, api_key=args.api_key, chat=args.chat, mode=args.mode,
        stages=args.stages, rate=args.rate, concurrency=args.concurrency, max_requests=args.max_requests,
        max_seconds=args.max_seconds, max_tokens=args.max_tokens, prompt_file=args.prompt_file,
        num_prompts=args.num_prompts, priority=args.priority, temperature=args.temperature,
        slo_factor=args.slo_factor, slo_policy=args.slo_policy, slo_cooldown_s=args.slo_cooldown,
        seed=args.seed, max_num_seqs=args.max_num_seqs, progress=None if quiet else progress,
        trace=args.trace, trace_format=args.format, time_scale=args.time_scale, limit=args.limit, window=args.window,
        length_scale=args.length_scale, max_tokens_cap=args.max_tokens_cap, trace_rate=args.trace_rate,
        tokenizer=args.tokenizer, send=args.send,
        announce=None if args.json else (lambda text: print(text, flush=True)))
    if args.csv:
        Path(args.csv).parent.mkdir(parents=True, exist_ok=True)
        df = res.frame()
        df["itl_ms"] = df["itl_ms"].map(lambda g: " ".join(f"{x:.3f}" for x in g))
        df.to_csv(args.csv, index=False)
    if args.out:
        res.to_json(args.out)
    summary = res.summary()
    ok = int(summary.loc["all", "ok"])
    trace, lag = info.pop("trace", None), info.pop("send_lag_ms", None)
    if args.json:
        out = {"target": info, "config": res.config, "duration_s": res.duration_s, "started_at": res.started_at,
               "stages": summary_records(summary), "reasons": res.reasons().to_dict(orient="records")}
        if trace is not None:
            out.update(trace=trace, send_lag_ms=lag)
        print(json.dumps(out, indent=2, default=str))
    else:
        where = info.get("url") or f"{info['model']} in process on {info.get('device')}"
        print(f"workbench load: {res.config['mode']} against {where}, {len(res.records)} requests in "
              f"{res.duration_s:.1f} s")
        reasons = res.reasons()
        for _, r in reasons.head(5).iterrows():
            print(f"  {r['count']:>5} x {r['status']}: {r['reason']}")
        if lag is not None and lag["max_ms"] is not None:
            print(f"  sent at the trace's times to within {lag['max_ms']:.1f} ms (|sent - scheduled|: P50 "
                  f"{lag['p50_ms']:.1f} ms, P99 {lag['p99_ms']:.1f} ms)")
        if "slo" in info:
            s = info["slo"]
            print(f"  SLO guard: {s['state']}, tripped {s['trips']} times, shed {s['rejected']} requests")
        print(format_summary(summary))
    if ok == 0:
        print("workbench load: no request finished ok (see the reasons above)", file=sys.stderr)
        return 1
    return 0


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``load`` subcommand to ``subparsers`` (from ``ArgumentParser.add_subparsers``);
    its ``func`` default is :func:`cmd_load` (returns the exit status)."""
    p = subparsers.add_parser(
        "load", help="load generator: constant / Poisson / closed-loop stages against a server or the engine",
        description="Send a staged load, or a recorded trace at its own arrival times (--trace), to an "
                    "OpenAI-compatible server (--url) or to the batched engine in this process (--model; default the "
                    "bundled model), record TTFT / ITL / E2E per request, and print P50/P95/P99 and jitter per stage.")
    t = p.add_argument_group("target")
    t.add_argument("--url", default=None, help="OpenAI-compatible server, e.g. http://127.0.0.1:8000")
    t.add_argument("--model", default=None, help="in process: Hugging Face–format folder or preset:<name> "
                                                 "(default: the bundled model)")
    t.add_argument("--device", default=None, help="in process: cpu, cuda, ... (default: cuda if available)")
    t.add_argument("--dtype", default=None, help="in process: float32, bfloat16, float16")
    t.add_argument("--max-num-seqs", type=int, default=None, help="in process: running sequences at most")
    t.add_argument("--served-model-name", default=None, help="with --url: the model name to request "
                                                             "(default: the first in GET /v1/models)")
    t.add_argument("--api-key", default=None, help="with --url: sent as 'Authorization: Bearer KEY'")
    t.add_argument("--chat", action="store_true", help="with --url: /v1/chat/completions instead of /v1/completions")
    s = p.add_argument_group("load shape")
    s.add_argument("--mode", choices=["constant", "poisson", "closed"], default=None,
                   help="open loop at a rate (constant spacing or Poisson; default poisson), or closed loop "
                        "(virtual users)")
    s.add_argument("--stages", default=None, help='k6-style "10s:5,30s:20,10s:0": ramp to each target (req/s, or '
                                                  "users for --mode closed) over each duration")
    s.add_argument("--rate", type=float, default=None, help="without --stages: requests/s (open loop)")
    s.add_argument("--concurrency", type=int, default=None, help="without --stages: virtual users (closed loop)")
    s.add_argument("--max-requests", type=int, default=None, help="send at most this many requests")
    s.add_argument("--max-seconds", type=float, default=None, help="stop after this long; requests still in "
                                                                  "flight are cancelled and recorded")
    r = p.add_argument_group("requests")
    r.add_argument("--max-tokens", type=int, default=None, help="new tokens per request (default 16)")
    r.add_argument("--prompt-file", default=None, help="prompts: one per line, or .json list, or .jsonl "
                                                       "(default: held-out prompts bundled with the workbench)")
    r.add_argument("--num-prompts", type=int, default=64, help="held-out prompts to cycle through")
    r.add_argument("--priority", type=int, default=0, help="request priority (x-priority header; higher first)")
    r.add_argument("--temperature", type=float, default=None, help="sampling temperature (default: the target's)")
    r.add_argument("--seed", type=int, default=0, help="Poisson arrivals and prompt choice")
    tr = p.add_argument_group(
        "recorded trace", "--trace FILE replays a recorded trace open loop: each request is sent at its recorded "
        "time with its own prompt, its recorded number of new tokens (greedy, ignore_eos: exactly that many) and "
        "priority; the trace's summary is printed before the run.  It replaces --mode, --stages, --rate, "
        "--concurrency, --prompt-file, --max-tokens and --priority; --max-requests / --max-seconds still bound it.")
    tr.add_argument("--trace", default=None, metavar="FILE",
                    help="the trace: our JSONL, ShareGPT (JSON / JSONL), Azure CSV, BurstGPT CSV or Mooncake JSONL")
    tr.add_argument("--format", default=None, choices=["workbench", "sharegpt", "azure", "burstgpt", "mooncake"],
                    help="the trace's format (default: detected from the file's name and first bytes)")
    tr.add_argument("--time-scale", type=float, default=None,
                    help="arrival times x this (0.5 replays the trace at twice its recorded rate; default 1)")
    tr.add_argument("--limit", type=int, default=None, help="replay the first N requests (of the window)")
    tr.add_argument("--window", default=None, metavar="START:END",
                    help="replay the requests recorded START to END seconds after the trace's first, e.g. 60:660")
    tr.add_argument("--length-scale", type=float, default=None,
                    help="prompt and output lengths x this (a long-context trace on a short model keeps its shape; "
                         "prompts that still do not fit the context are cut and counted)")
    tr.add_argument("--max-tokens-cap", type=int, default=None, help="new tokens per request at most")
    tr.add_argument("--trace-rate", type=float, default=None,
                    help="ShareGPT (which records no times): new conversations per second (default 1)")
    tr.add_argument("--tokenizer", default=None, metavar="DIR",
                    help="the tokenizer that turns the trace into token ids (default: --model's in process, else the "
                         "bundled model's); with --url the server must serve a model with the same tokenizer for "
                         "token-id prompts, else use --send text")
    tr.add_argument("--send", choices=["tokens", "text"], default=None,
                    help="tokens (default): the token ids, exact lengths; text: the ids decoded, for a server whose "
                         "tokenizer differs (its lengths then differ a little)")
    g = p.add_argument_group("SLO guard")
    g.add_argument("--slo-factor", type=float, default=None, help="put a latency circuit breaker in front: shed "
                                                                  "when P95 TTFT > factor x its learned baseline")
    g.add_argument("--slo-policy", choices=["reject", "queue"], default="reject",
                   help="while open: refuse requests, or hold them until the guard admits")
    g.add_argument("--slo-cooldown", type=float, default=5.0, help="seconds open before probing")
    o = p.add_argument_group("output")
    o.add_argument("--json", action="store_true", help="print JSON (target, config, per-stage summary, reasons; with "
                                                         "--trace the trace's summary and send lag too)")
    o.add_argument("--csv", default=None, help="write one row per request (TTFT, ITL, E2E, status) to this CSV")
    o.add_argument("--out", default=None, help="write the whole run (with token times) as JSON; "
                                               "LoadResult.from_json reads it")
    o.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    p.set_defaults(func=cmd_load)
    return p


def main(argv: list[str] | None = None) -> int:
    """``python -m workbench.cli.load ...`` (the same as ``workbench load ...``)."""
    ap = argparse.ArgumentParser(prog="workbench")
    add_parser(ap.add_subparsers(dest="command", required=True))
    args = ap.parse_args(["load", *(sys.argv[1:] if argv is None else argv)])
    try:
        return args.func(args)
    except WorkbenchError as e:
        print(f"workbench load: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
