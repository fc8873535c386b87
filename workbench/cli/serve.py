"""``workbench serve``: the OpenAI-compatible HTTP server over the batched engine."""

from __future__ import annotations

from contextlib import contextmanager

from workbench.cli.options import (add_backend_arg, add_fast_path_args, add_memory_budget_arg, add_model_args,
                                   add_quant_arg, add_stream_args, add_tier_args, apply_backend, check_sizes, count,
                                   tier_config, tier_store, weight_stream_config)


def cmd_serve(args) -> int:
    with _from_config(args):     # a refusal that names an option the --config file set says so
        engine, config, guard = _server_parts(args)
    from workbench.serve import serve

    announce = lambda line: print(line, flush=True)  # noqa: E731 - scripts read the port from this line
    return serve(engine, config, announce=announce, guard=guard)


def _server_parts(args):
    """The engine, the ServerConfig and the SLO guard of serve's flags (the checks first)."""
    import os

    from workbench.sched import SchedulerConfig

    # the checks that need no model, no torch and no web framework first: a mistake is said at once
    api_key = _api_key(args.api_key, os.environ.get("WORKBENCH_API_KEY"))
    _check_serve_kv_args(args)
    from workbench.serve import ServerConfig

    sched = SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_batched_tokens,
                            chunked_prefill=not args.no_chunked_prefill, micro_batch_window_s=args.window_ms / 1e3,
                            preemption_mode=args.preemption, max_queue_len=args.max_queue_len)
    # the engine is built here, so the server cannot see where the model came from: name it (the --help promise)
    config = ServerConfig(host=args.host, port=args.port, model_name=args.served_model_name or args.model,
                          api_key=api_key,
                          max_tokens_cap=args.max_tokens_cap, max_body_bytes=args.max_body_bytes,
                          log_level=args.log_level, max_request_tokens=args.max_request_tokens,
                          max_connections=args.max_connections, request_timeout_s=args.request_timeout,
                          keep_alive_s=args.keep_alive, metrics_public=args.metrics_public,
                          trust_priority_header=args.trust_priority_header,
                          **{k: v for k, v in (("max_logprob_entries", args.max_logprob_entries),
                                               ("max_reply_bytes", args.max_reply_bytes)) if v is not None})
    guard = None
    if args.slo_guard:
        from workbench.serve.slo import SLOConfig, SLOGuard
        guard = SLOGuard(SLOConfig(factor=args.slo_factor, window=args.slo_window,
                                   min_samples=min(20, args.slo_window), cooldown_s=args.slo_cooldown_s,
                                   baseline_s=None if args.slo_baseline_ms is None else args.slo_baseline_ms / 1e3,
                                   bypass_priorities=tuple(args.slo_bypass_priority)))
    from workbench.engine.llm import LLM
    from workbench.engine import LLMEngine

    _check_serve_sizes(args, sched)       # before the model loads: one line, no time or memory spent
    llm = LLM(args.model, device=args.device, dtype=args.dtype, max_model_len=args.max_model_len,
              check_finite=args.check_finite, quant=args.quant,
              quant_backend=args.quant_backend)
    apply_backend(llm, args.backend, llm.device.type)
    engine = LLMEngine(llm, _engine_config(args, llm, sched))
    return engine, config, guard


def _engine_config(args, llm, sched):
    """The EngineConfig of serve's flags (the engine checks it once)."""
    from workbench.engine.config import EngineConfig, FastPathConfig, TierSetup

    tiers, kv = None, None
    if args.tiers:
        from workbench.bench.kv_inspect import fit_heldout_basis

        policy = tier_config(args)
        tiers = TierSetup(policy, fit_heldout_basis(llm, policy, args.calibration_docs), tier_store(args))
    else:
        kv = _serve_kv(args)
    return EngineConfig(kv=kv, scheduler=sched, tiers=tiers, stream_weights=weight_stream_config(args),
                        fast=FastPathConfig(compile=args.compile, cuda_graphs=args.cuda_graphs),
                        memory_budget=args.memory_budget)


def add_serve_parser(sub) -> None:
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (completions, chat, SSE, /metrics) "
                                     "over the batched engine")
    _add_serve_args(s)
    s.set_defaults(func=cmd_serve)


def _add_serve_args(s) -> None:
    s.add_argument("--config", default=None, metavar="FILE",
                   help="serve options from a JSON file, e.g. the one workbench tune writes: "
                        "{\"workbench_serve_config\": 1, \"serve\": {\"max_num_seqs\": 8, \"compile\": true, ...}} "
                        "(each key a flag below, - written _); flags on the command line win")
    add_model_args(s)
    add_quant_arg(s)
    add_backend_arg(s)
    s.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0: every interface; set --api-key)")
    s.add_argument("--port", type=int, default=8000, help="0 = pick a free port (printed)")
    s.add_argument("--served-model-name", default=None, help="name in /v1/models and requests (default: "
                                                             "'bundled' or the --model value)")
    s.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/* and /metrics "
                                                   "(default: env WORKBENCH_API_KEY)")
    s.add_argument("--metrics-public", action="store_true", help="with --api-key: /metrics and /health's details "
                                                                "without the key")
    s.add_argument("--trust-priority-header", action="store_true",
                   help="honour x-priority from clients without the API key (by default only clients with it may "
                        "raise their priority or use --slo-bypass-priority)")
    s.add_argument("--max-tokens-cap", type=int, default=None, help="largest max_tokens a request may ask "
                                                                    "(default: the model's context)")
    s.add_argument("--max-body-bytes", type=int, default=1 << 20, help="larger request bodies get 413")
    g = s.add_argument_group("what one request may ask (400 beyond; see workbench.serve.limits)")
    g.add_argument("--max-request-tokens", type=int, default=None,
                   help="prompt tokens x n + max_tokens x n, over a request's prompts (default: 16 x the context)")
    g.add_argument("--max-logprob-entries", type=int, default=None,
                   help="log-probability entries in one reply: (echoed prompt + max_tokens) x n x (logprobs + 1) "
                        "(default: 65536)")
    g.add_argument("--max-reply-bytes", type=int, default=None, help="bytes of one reply or stream (default: 32 MiB)")
    g = s.add_argument_group("connections")
    g.add_argument("--max-connections", type=int, default=None,
                   help="open connections at most; more are closed on arrival (default: 2048, or half the "
                        "file-descriptor limit)")
    g.add_argument("--request-timeout", type=float, default=30.0,
                   help="seconds a client has to send a request's headers and body")
    g.add_argument("--keep-alive", type=float, default=5.0, help="seconds an idle kept-alive connection stays open")
    s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    g = s.add_argument_group("scheduler")
    g.add_argument("--max-num-seqs", type=count, default=32, help="running sequences at most (the default pool and "
                                                                  "--kv contiguous's caches are sized by it)")
    g.add_argument("--max-batched-tokens", type=count, default=512, help="token budget of one engine step")
    g.add_argument("--window-ms", type=float, default=0.0, help="micro-batch window for new arrivals (ms)")
    g.add_argument("--preemption", choices=["recompute", "swap"], default="recompute")
    g.add_argument("--no-chunked-prefill", action="store_true", help="prefill each prompt in one step")
    g.add_argument("--max-queue-len", type=count, default=1024, help="waiting requests beyond this get 429")
    g = s.add_argument_group("KV cache")
    g.add_argument("--block-size", type=count, default=16, help="tokens per KV block (at most the model's context)")
    g.add_argument("--num-blocks", type=count, default=None, help="blocks in the pool (default: max-num-seqs "
                                                                  "sequences of up to 2048 tokens); more than the "
                                                                  "device has available is refused")
    g.add_argument("--no-prefix-caching", action="store_true", help="turn the cross-request prefix cache off")
    g.add_argument("--offload", choices=["host", "disk"], default=None,
                   help="keep evicted prefix blocks in host memory or on disk; a later hit copies them back")
    g.add_argument("--offload-blocks", type=count, default=4096, help="capacity of the offload tier, in blocks "
                                                                      "(host memory or the file system's free space)")
    g.add_argument("--lookahead", type=count, default=None, metavar="N",
                   help="with --offload: each engine step, stage the offloaded prefix blocks of the next N waiting "
                        "requests back ahead of their admission (0: copy them back at admission; default: 4)")
    g.add_argument("--kv", choices=["paged", "contiguous"], default="paged",
                   help="contiguous: one cache per request (no prefix sharing), max-num-seqs x max-model-len "
                        "tokens at most")
    add_memory_budget_arg(g)
    g = s.add_argument_group("fast paths (static decode steps over the paged pool or --kv contiguous)")
    add_fast_path_args(g)
    add_stream_args(s)
    g = s.add_argument_group("tiered KV (hot / warm / cold cache per request, PCA basis fitted on held-out text)")
    g.add_argument("--tiers", action="store_true", help="serve with the tiered cache instead of the paged pool")
    add_tier_args(g)
    g = s.add_argument_group("SLO guard")
    g.add_argument("--slo-guard", action="store_true", help="shed load (503 + Retry-After) when P95 TTFT degrades")
    g.add_argument("--slo-factor", type=float, default=2.0, help="open when P95 TTFT > factor x baseline")
    g.add_argument("--slo-baseline-ms", type=float, default=None, help="known baseline P95 TTFT (default: learn it)")
    g.add_argument("--slo-window", type=int, default=50, help="TTFTs in the sliding window")
    g.add_argument("--slo-cooldown-s", type=float, default=5.0, help="seconds open before probing")
    g.add_argument("--slo-bypass-priority", type=int, action="append", default=[], help="priorities never shed")


def _serve_kv(args):
    """The engine's ``kv=`` of the KV cache flags (the tiered cache: None, built apart)."""
    from workbench.kv.paged import PagedKVConfig

    if args.tiers:
        return None
    if args.kv == "contiguous":
        return "contiguous"
    return PagedKVConfig(block_size=args.block_size, num_blocks=args.num_blocks,
                         enable_prefix_caching=not args.no_prefix_caching, offload=args.offload,
                         offload_blocks=args.offload_blocks, lookahead=args.lookahead)


def _check_serve_sizes(args, sched) -> None:
    """The pool (or the caches per request), its offload tier and the static buffers, sized from
    the model's config against the machine and --memory-budget before the model loads
    (:func:`workbench.cli.options.check_sizes`)."""
    check_sizes(args, kv=_serve_kv(args), scheduler=sched, tiers=tier_config(args) if args.tiers else None,
                tier_store=None if args.tier_store == "accounted" else args.tier_store,
                static_decode=args.compile or args.cuda_graphs)


def _api_key(flag: str | None, env: str | None) -> str | None:
    """--api-key, else WORKBENCH_API_KEY; an empty or blank key is an error (it would turn
    authentication off without a word), never the same as no key."""
    from workbench.errors import ConfigError

    for value, where in ((flag, "--api-key"), (env, "WORKBENCH_API_KEY")):
        if value is None:
            continue
        if not value.strip():
            raise ConfigError(f"{where} is empty: give a key (clients then send 'Authorization: Bearer KEY'), or "
                              f"leave {where} out to serve without one")
        return value
    return None


def _check_serve_kv_args(args) -> None:
    """Options that only one KV layout reads are refused with the others (not silently dropped)."""
    from workbench.errors import ConfigError

    paged_only = [name for name, on in (("--offload", args.offload is not None),
                                         ("--num-blocks", args.num_blocks is not None),
                                         ("--block-size", args.block_size != 16),
                                         ("--no-prefix-caching", args.no_prefix_caching),
                                         ("--lookahead", args.lookahead is not None)) if on]
    if not args.tiers and (args.tier_store != "accounted" or args.tier_predict != "step"):
        raise ConfigError("--tier-store / --tier-predict choose how the tiered cache keeps its blocks: add --tiers")
    if args.tiers and args.kv != "paged":
        raise ConfigError("--tiers gives each request its own tiered cache; --kv does not apply with it")
    layout = "--tiers" if args.tiers else "--kv contiguous" if args.kv == "contiguous" else None
    if layout and paged_only:
        raise ConfigError(f"{', '.join(paged_only)}: options of the paged pool, which {layout} does not use")
    if args.lookahead is not None and args.lookahead < 0:
        raise ConfigError(f"--lookahead must be a whole number >= 0 (0: no staging ahead), got {args.lookahead}")
    if args.lookahead is not None and args.offload is None:
        raise ConfigError(f"--lookahead {args.lookahead} stages offloaded prefix blocks back ahead of the requests "
                          "that need them: add --offload host or --offload disk (or drop --lookahead)")
    if (args.compile or args.cuda_graphs) and args.tiers:
        raise ConfigError("--compile / --cuda-graphs run decode steps on static buffers (the paged pool or --kv "
                          "contiguous); the tiered cache routes blocks per step on the host: drop --tiers or them")


# ---- serve --config FILE ---------------------------------------------------------------------
def with_serve_config(parser, argv: list[str], args):
    """``serve --config FILE``: the namespace of ``argv`` with the file's options in it.

    The file's options become serve flags (:func:`workbench.bench.serve_config.serve_argv`) placed
    right after ``serve``, before the command line's flags, and ``parser`` parses the whole again:
    every value is checked as if it had been typed, and a flag on the command line wins (argparse
    keeps the last value; an appended flag such as --slo-bypass-priority keeps the file's values and
    adds the command line's).  Before that the file's flags are parsed alone, so that a bad value is
    refused naming the file.  ``args.config_flags``: the flags in effect that the file set (a later
    refusal naming one says where it came from, :func:`_from_config`)."""
    import argparse
    import json

    from workbench.bench.serve_config import read_serve_config, serve_argv
    from workbench.errors import ConfigError

    where = f"--config {args.config}"
    options = read_serve_config(args.config)
    alone = _standalone_serve_parser(where)
    actions = {o[2:].replace("-", "_"): a for a in alone._actions for o in a.option_strings if o.startswith("--")}
    for key, value in options.items():
        action, flag = actions.get(key), "--" + key.replace("_", "-")
        if key in ("config", "help"):
            raise ConfigError(f"{where}: {key!r} cannot be set from a config file")
        if action is None:
            raise ConfigError(f"{where}: unknown option {key!r} (serve has no {flag})")
        if action.nargs == 0 and not isinstance(value, bool) and value is not None:
            raise ConfigError(f"{where}: {key!r} is a switch ({flag}): give true or false, got {json.dumps(value)}")
        if action.nargs != 0 and isinstance(value, bool):
            raise ConfigError(f"{where}: {key!r} takes a value ({flag} VALUE), got {json.dumps(value)}")
        if isinstance(value, list) and not isinstance(action, argparse._AppendAction):
            raise ConfigError(f"{where}: {key!r} takes one value ({flag} VALUE), got a list")
    file_argv = serve_argv(options)
    alone.parse_args(file_argv)                   # a bad value: argparse's message, naming the file
    at = argv.index(args.command) + 1             # nothing precedes the command but the program
    merged = parser.parse_args([*argv[:at], *file_argv, *argv[at:]])
    typed = vars(alone.parse_args(argv[at:]))     # what the command line set (the parser has no defaults)
    merged.config_flags = {"--" + key.replace("_", "-"): (key, value) for key, value in options.items()
                           if value is not None and value is not False
                           and (actions[key].dest not in typed or isinstance(actions[key], argparse._AppendAction))}
    return merged


def _standalone_serve_parser(where: str):
    """serve's flags in a parser of their own, with no defaults (a namespace holds what was given)
    and whose errors are one-line ConfigErrors that name ``where``."""
    import argparse

    from workbench.errors import ConfigError

    class Parser(argparse.ArgumentParser):
        def error(self, message):
            raise ConfigError(f"{where}: {message}")

    p = Parser(prog="workbench serve", add_help=False)
    _add_serve_args(p)
    for action in p._actions:
        action.default = argparse.SUPPRESS
    return p


@contextmanager
def _from_config(args):
    """A WorkbenchError raised inside that names a flag the --config file set (as ``--flag``, as
    its name in the API, ``num_blocks``, or by the file's text, a model path) says so at its end."""
    import re

    from workbench.errors import WorkbenchError

    try:
        yield
    except WorkbenchError as e:
        text = str(e)
        named = [flag for flag, (key, value) in (getattr(args, "config_flags", None) or {}).items()
                 if re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text)
                 # a short one-word key (model, port) is too common a word to be matched as a word
                 or (("_" in key or len(key) > 8) and re.search(rf"(?<![\w-]){key}(?![\w-])", text))
                 or (isinstance(value, str) and len(value) > 2 and value in text)]
        if named:
            e.args = (f"{text} ({', '.join(named)} from --config {args.config})",)
        raise
