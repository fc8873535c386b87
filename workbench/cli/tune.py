"""``workbench tune``: tune the serving stack on your own model and your own recorded traffic.

::

    workbench tune --model runs/smollm2 --trace azure_code.csv --slo "ttft_p95<=500ms,ppl<=+2%" --limit 300
    workbench tune --trace mooncake.jsonl --length-scale 0.25 --slo "ttft_p95<=300ms" --verify

One code path with notebook 06: the trace is read and summarised here (a malformed row ends the
command at once: exit 2, one line naming the file, line and field), then
``workbench run-notebooks 06_end_to_end`` runs with ``workload=`` the trace, so the ablation, the
recommendation for the SLO, the capacity search and the serve options are the notebook's.  Then
this command writes into the run folder ``serve.json`` (``workbench serve --config`` reads it),
``tune.json`` (the recommendation, its reason, the capacity table, the SLO, the trace's summary)
and prints the command line that starts the recommended configuration.

``--verify`` then starts that server (port 0, this machine), replays the trace against it with
``workbench load --trace`` (``--verify-rounds`` times) and compares its P95 TTFT with the one the
tuning measured in process (the same noise rule as every verdict).
"""

from __future__ import annotations

import json
import time
from pathlib import Path


def _trace_options(args):
    from workbench.load.trace_workload import TraceOptions, parse_window

    kw = {"format": args.format, "time_scale": args.time_scale, "limit": args.limit,
          "window": parse_window(args.window), "length_scale": args.length_scale,
          "max_tokens_cap": args.max_tokens_cap, "rate": args.trace_rate}
    return TraceOptions(**{k: v for k, v in kw.items() if v is not None})


def _context(model, device: str, mode: str) -> tuple:
    """The tokenizer and the context notebook 06 builds its engines with (a large model on a CPU
    in smoke mode is scaled down: workbench.lab.scale)."""
    from workbench.lab.scale import model_scale
    from workbench.model.loader import BUNDLED_MODEL
    from workbench.model.tokenizer import Tokenizer

    folder = Path(model) if model else BUNDLED_MODEL
    if not (folder / "config.json").is_file():
        from workbench.errors import ConfigError

        raise ConfigError(f"--model {str(folder)!r}: not a model folder (no config.json); give a Hugging Face-format "
                          "folder with a tokenizer, or workbench import-gguf's output")
    scale = model_scale(model, device)
    ctx = scale.context if (mode == "smoke" and scale.large) else scale.max_position_embeddings
    return Tokenizer(folder), ctx


def _sidecar(record: dict) -> dict:
    from workbench.errors import WorkbenchError
    from workbench.lab.results import load_results

    if record.get("status") != "ok":
        raise WorkbenchError(f"notebook 06 did not finish: {record.get('error') or record.get('status')} "
                             f"(the executed copy: {record.get('output')})")
    return load_results(record["results"])


def verify(options: dict, trace: str, trace_options, tuned_p95: list[float], rounds: int = 3,
           timeout_s: float = 600.0, say=print, tokenizer: str | None = None, capacity: float | None = None,
           slo_ms: float | None = None) -> dict:
    """Start ``workbench serve`` with ``options`` (port 0), replay ``trace`` against it ``rounds``
    times with ``workbench load --trace``, and compare each round's P95 TTFT with ``tuned_p95``
    (the tuning's rounds, in process); then, given ``capacity`` (the rate multiple the tuning
    found), ``rounds`` more replays at that multiple, each against ``slo_ms``."""
    from workbench.bench.serve_config import serve_argv
    from workbench.cli.load import run_load_command
    from workbench.measure.compare import compare_samples
    from workbench.serve.spawn import start_server, stop_process

    flags = serve_argv({**options, "port": 0})
    srv = start_server(flags, timeout_s=timeout_s)
    url = srv.url
    try:
        say(f"verify: workbench serve {' '.join(flags)} -> {url}")

        def replay(multiple: float) -> dict:
            o = trace_options
            res, _ = run_load_command(url=url, trace=trace, trace_format=o.format, time_scale=o.time_scale / multiple,
                                      limit=o.limit, window=o.window, length_scale=o.length_scale,
                                      max_tokens_cap=o.max_tokens_cap, trace_rate=o.rate, tokenizer=tokenizer,
                                      progress=None)
            s = res.summary().loc["all"]
            return {"multiple": multiple, "ok": int(s["ok"]), "requests": int(s["requests"]),
                    "ttft_p50_ms": float(s["ttft_p50_ms"]), "ttft_p95_ms": float(s["ttft_p95_ms"]),
                    "tokens_per_s": float(s["tokens_per_s"])}

        # one warm-up replay (a fresh server compiles its static steps at the first requests), not counted
        say(f"verify: warm-up replay, P95 TTFT {replay(1.0)['ttft_p95_ms']:.1f} ms (not counted)")
        runs, at_capacity = [], []
        for r in range(1, rounds + 1):
            runs.append({"round": r, **replay(1.0)})
            say(f"verify: round {r}: {runs[-1]['ok']}/{runs[-1]['requests']} ok, "
                f"P95 TTFT {runs[-1]['ttft_p95_ms']:.1f} ms")
        if capacity and capacity != 1:
            for r in range(1, rounds + 1):
                at_capacity.append({"round": r, **replay(capacity)})
                say(f"verify: at {capacity:.2f}x, round {r}: P95 TTFT {at_capacity[-1]['ttft_p95_ms']:.1f} ms"
                    + (f" ({'within' if at_capacity[-1]['ttft_p95_ms'] <= slo_ms else 'beyond'} the SLO's "
                       f"{slo_ms:g} ms)" if slo_ms else ""))
        p95s = [x["ttft_p95_ms"] for x in runs]
    finally:
        stop_process(srv.proc)
    cmp = compare_samples(p95s, tuned_p95, names=("the started server", "the tuning"), metric="P95 TTFT", unit="ms",
                          lower_is_better=True)
    import numpy as np

    ratio = float(np.median(p95s) / np.median(tuned_p95))
    return {"announce": srv.announce, "rounds": runs, "server_ttft_ms_p95": p95s,
            "tuned_ttft_ms_p95": list(tuned_p95), "ratio": ratio,
            "within_noise": cmp.winner is None, "verdict": cmp.verdict if hasattr(cmp, "verdict") else str(cmp),
            "at_capacity": at_capacity,
            "meets_slo_at_capacity": (all(x["ttft_p95_ms"] <= slo_ms for x in at_capacity)
                                      if at_capacity and slo_ms else None)}


def cmd_tune(args) -> int:
    from workbench.bench.serve_config import serve_command, write_serve_config
    from workbench.bench.tune import parse_slo
    from workbench.errors import ConfigError
    from workbench.lab.runner import run_notebooks
    from workbench.load.trace_workload import build_trace_workload

    slo = parse_slo(args.slo)                     # the cheap checks first: a mistake is said at once
    topts = _trace_options(args)
    device = args.device or "cpu"
    if args.mode not in ("tiny", "smoke", "full"):
        raise ConfigError(f"--mode {args.mode!r}: tiny, smoke or full")
    tok, ctx = _context(args.model, device, args.mode)
    wl = build_trace_workload(args.trace, tok, ctx, topts)    # every row read and checked before anything runs
    print(wl.describe(), flush=True)
    out = Path(args.out) if args.out else Path("runs") / f"tune-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}"
    params = {"model": args.model, "device": device, "mode": args.mode, "workload": str(Path(args.trace).resolve()),
              "workload_options": {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(topts).items()
                                   if k in ("format", "time_scale", "limit", "window", "length_scale",
                                            "max_tokens_cap", "rate") and v is not None},
              "slo_ttft_p95_ms": slo.ttft_p95_ms, "slo_max_rel_ppl": slo.max_rel_ppl,
              "slo_min_agreement": slo.min_agreement, "claims": False, "capacity": True,
              "alone": None if args.alone else [], "stack_quant": args.stack_quant}
    if args.repeats:
        params["repeats"] = args.repeats
    if device == "cpu":          # the threads the server will run with, measured with them (see --threads)
        from workbench.measure.probe import available_cores

        params["threads"] = args.threads or max(1, available_cores() - 1)
    print(f"workbench tune: notebook 06 on {wl.source} -> {out}", flush=True)
    res = run_notebooks(["06_end_to_end"], parameters=params, out_dir=out, progress=not args.quiet,
                        timeout=args.cell_timeout)
    side = _sidecar(res["notebooks"][0])
    m, tables = side["metrics"], side["tables"]
    summary = {"trace": str(args.trace), "trace_options": topts.describe(), "trace_summary": wl.summary(),
               "tuned": m.get("tuned_config"),
               "slo": slo.describe(), "recommended": m.get("recommended_config"),
               "reason": m.get("recommendation_reason"), "capacity_multiple": m.get("capacity_multiple"),
               "capacity_reason": m.get("capacity_reason"), "run_dir": res["run_dir"], "report": res["report"],
               "tuned_ttft_ms_p95_runs": json.loads(m.get("tuned_ttft_ms_p95_runs") or "[]")}
    if "capacity" in tables:
        summary["capacity_table"] = tables["capacity"].to_dict(orient="records")
    print(f"\nat the recorded rate, section 6's rule for {slo.describe()}: {summary['recommended']}\n"
          f"  {summary['reason']}")
    if summary["tuned"]:
        print(f"the tuned configuration (the most headroom, or the nearest when nothing met): {summary['tuned']}")
    code = 0
    if m.get("serve_options"):
        opts = json.loads(m["serve_options"])
        cfg_path = out / "serve.json"
        write_serve_config(cfg_path, opts, about={k: summary[k] for k in ("trace", "trace_options", "slo", "tuned",
                                                                           "capacity_multiple",
                                                                           "tuned_ttft_ms_p95_runs")})
        summary.update(serve_options=opts, serve_config=str(cfg_path), serve_command=serve_command(opts),
                       serve_command_short=serve_command(opts, config_path=cfg_path))
        cap = m.get("capacity_multiple") or 0.0
        print(f"capacity at the SLO: {cap:.2f}x the trace's rate"
              + (" (LESS than the trace offers: this traffic needs more than one such server, or a looser SLO)"
                 if cap < 1 else "") + f"  ({summary['capacity_reason']})")
        print(f"serve it:  {summary['serve_command']}\n      or:  {summary['serve_command_short']}")
        if args.verify:
            summary["verify"] = v = verify(opts, args.trace, topts, summary["tuned_ttft_ms_p95_runs"],
                                           rounds=args.verify_rounds, tokenizer=args.model,
                                           capacity=m.get("capacity_multiple"), slo_ms=slo.ttft_p95_ms)
            print(f"verify: the started server's P95 TTFT {', '.join(f'{x:.1f}' for x in v['server_ttft_ms_p95'])} ms "
                  f"against the tuning's {', '.join(f'{x:.1f}' for x in v['tuned_ttft_ms_p95'])} ms "
                  f"(median ratio {v['ratio']:.2f}): {'within noise' if v['within_noise'] else v['verdict']}")
            if v["at_capacity"]:
                shown = ", ".join(f"{x['ttft_p95_ms']:.1f}" for x in v["at_capacity"])
                print(f"verify: at the capacity ({m.get('capacity_multiple'):.2f}x) the started server's P95 TTFT "
                      f"{shown} ms: "
                      f"{'within' if v['meets_slo_at_capacity'] else 'not within'} the SLO in every round")
    else:
        print("no configuration within the SLO's quality bounds serves any share of the trace within its P95 TTFT "
              "bound: no serve command (see the report)")
        code = 1
    (out / "tune.json").write_text(json.dumps(summary, indent=2, default=str))
    print(f"report: {res['report']}\nsummary: {out / 'tune.json'}")
    return code


def add_tune_parser(sub) -> None:
    p = sub.add_parser("tune", help="tune the stack on your own trace: a measured recommendation for an SLO, its "
                                    "capacity, and the serve command",
                       description="Run notebook 06's ablation on a recorded trace (our JSONL, ShareGPT, Azure or "
                                   "BurstGPT CSV, Mooncake JSONL), pick the configuration that meets the SLO, find "
                                   "its capacity (the highest multiple of the trace's rate within the SLO) and write "
                                   "serve.json and the workbench serve command that starts it.")
    p.add_argument("--model", default=None, help="Hugging Face-format folder (default: the bundled model)")
    p.add_argument("--device", default=None, help="cpu, cuda, ... (default: cpu)")
    p.add_argument("--trace", required=True, help="the trace file")
    p.add_argument("--slo", required=True, help='e.g. "ttft_p95<=500ms,ppl<=+2%%" (and optionally agreement>=90%%)')
    t = p.add_argument_group("the trace")
    t.add_argument("--format", default=None, choices=["workbench", "sharegpt", "azure", "burstgpt", "mooncake"],
                   help="default: detected from the file")
    t.add_argument("--time-scale", type=float, default=None, help="arrival times x this (0.5: twice the recorded rate)")
    t.add_argument("--limit", type=int, default=None, help="the first N requests")
    t.add_argument("--window", default=None, help="START:END seconds of the recorded trace")
    t.add_argument("--length-scale", type=float, default=None, help="recorded lengths x this (a long-context trace "
                                                                    "on a short-context model)")
    t.add_argument("--max-tokens-cap", type=int, default=None, help="new tokens per request at most")
    t.add_argument("--trace-rate", type=float, default=None, help="ShareGPT: new conversations per second")
    r = p.add_argument_group("the run")
    r.add_argument("--mode", default="smoke", help="notebook 06's size: tiny, smoke (default) or full")
    r.add_argument("--repeats", type=int, default=None, help="rounds per configuration (default: the mode's)")
    r.add_argument("--threads", type=int, default=None,
                   help="torch threads on a CPU, for the tuning and the server it writes (default: the cores less "
                        "one, at least 1: a server's HTTP front end and its clients need a core; on 2 cores a "
                        "2-thread server answered the same trace 2x slower than a 1-thread one)")
    r.add_argument("--alone", action="store_true", help="also measure every layer alone (longer)")
    r.add_argument("--stack-quant", default="auto", help="auto (the fastest scheme within the SLO's perplexity "
                                                          "bound on this model), device, or a scheme")
    r.add_argument("--out", default=None, help="the run folder (default runs/tune-<UTC time>)")
    r.add_argument("--cell-timeout", type=int, default=3600, help="seconds a notebook cell may take")
    r.add_argument("--quiet", action="store_true")
    v = p.add_argument_group("verify")
    v.add_argument("--verify", action="store_true", help="start the recommended server and replay the trace against it")
    v.add_argument("--verify-rounds", type=int, default=3)
    p.set_defaults(func=cmd_tune)
