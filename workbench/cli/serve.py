"""``workbench serve``: the OpenAI-compatible HTTP server over the batched engine."""

from __future__ import annotations

from workbench.cli.options import (add_backend_arg, add_fast_path_args, add_model_args, add_quant_arg, add_stream_args,
                                   add_tier_args, apply_backend, tier_config, tier_store, weight_stream_config)


def cmd_serve(args) -> int:
    import os

    from workbench.kv.paged import PagedKVConfig
    from workbench.sched import SchedulerConfig
    from workbench.serve import ServerConfig, serve

    sched = SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_batched_tokens,
                            chunked_prefill=not args.no_chunked_prefill, micro_batch_window_s=args.window_ms / 1e3,
                            preemption_mode=args.preemption, max_queue_len=args.max_queue_len)
    # the engine is built here, so the server cannot see where the model came from: name it (the --help promise)
    config = ServerConfig(host=args.host, port=args.port, model_name=args.served_model_name or args.model,
                          api_key=args.api_key or os.environ.get("WORKBENCH_API_KEY") or None,
                          max_tokens_cap=args.max_tokens_cap, max_body_bytes=args.max_body_bytes,
                          log_level=args.log_level)
    guard = None
    if args.slo_guard:
        from workbench.serve.slo import SLOConfig, SLOGuard
        guard = SLOGuard(SLOConfig(factor=args.slo_factor, window=args.slo_window,
                                   min_samples=min(20, args.slo_window), cooldown_s=args.slo_cooldown_s,
                                   baseline_s=None if args.slo_baseline_ms is None else args.slo_baseline_ms / 1e3,
                                   bypass_priorities=tuple(args.slo_bypass_priority)))
    from workbench.engine.llm import LLM
    from workbench.engine import LLMEngine

    _check_serve_kv_args(args)
    llm = LLM(args.model, device=args.device, dtype=args.dtype, max_model_len=args.max_model_len,
              check_finite=args.check_finite, quant=args.quant,
              quant_backend=args.quant_backend)
    apply_backend(llm, args.backend, llm.device.type)
    tiers = basis = store = None
    if args.tiers:
        from workbench.bench.kv_inspect import fit_heldout_basis

        tiers = tier_config(args)
        basis = fit_heldout_basis(llm, tiers, args.calibration_docs)
        store = tier_store(args)
        kv = None
    elif args.kv == "contiguous":
        kv = "contiguous"
    else:
        kv = PagedKVConfig(block_size=args.block_size, num_blocks=args.num_blocks,
                           enable_prefix_caching=not args.no_prefix_caching, offload=args.offload,
                           offload_blocks=args.offload_blocks)
    engine = LLMEngine(llm, kv=kv, scheduler=sched, tiers=tiers, tier_basis=basis, tier_store=store, compile=args.compile,
                       cuda_graphs=args.cuda_graphs, stream_weights=weight_stream_config(args))
    announce = lambda line: print(line, flush=True)  # noqa: E731 - scripts read the port from this line
    return serve(engine, config, announce=announce, guard=guard)


def add_serve_parser(sub) -> None:
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (completions, chat, SSE, /metrics) "
                                     "over the batched engine")
    add_model_args(s)
    add_quant_arg(s)
    add_backend_arg(s)
    s.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0: every interface; set --api-key)")
    s.add_argument("--port", type=int, default=8000, help="0 = pick a free port (printed)")
    s.add_argument("--served-model-name", default=None, help="name in /v1/models and requests (default: "
                                                             "'bundled' or the --model value)")
    s.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/* "
                                                   "(default: env WORKBENCH_API_KEY)")
    s.add_argument("--max-tokens-cap", type=int, default=None, help="largest max_tokens a request may ask "
                                                                    "(default: the model's context)")
    s.add_argument("--max-body-bytes", type=int, default=1 << 20, help="larger request bodies get 413")
    s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    g = s.add_argument_group("scheduler")
    g.add_argument("--max-num-seqs", type=int, default=32, help="running sequences at most")
    g.add_argument("--max-batched-tokens", type=int, default=512, help="token budget of one engine step")
    g.add_argument("--window-ms", type=float, default=0.0, help="micro-batch window for new arrivals (ms)")
    g.add_argument("--preemption", choices=["recompute", "swap"], default="recompute")
    g.add_argument("--no-chunked-prefill", action="store_true", help="prefill each prompt in one step")
    g.add_argument("--max-queue-len", type=int, default=1024, help="waiting requests beyond this get 429")
    g = s.add_argument_group("KV cache")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    g.add_argument("--num-blocks", type=int, default=None, help="blocks in the pool (default: max-num-seqs "
                                                                "sequences of up to 2048 tokens)")
    g.add_argument("--no-prefix-caching", action="store_true", help="turn the cross-request prefix cache off")
    g.add_argument("--offload", choices=["host", "disk"], default=None,
                   help="keep evicted prefix blocks in host memory or on disk; a later hit copies them back")
    g.add_argument("--offload-blocks", type=int, default=4096, help="capacity of the offload tier, in blocks")
    g.add_argument("--kv", choices=["paged", "contiguous"], default="paged",
                   help="contiguous: one cache per request (no prefix sharing)")
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
    s.set_defaults(func=cmd_serve)


def _check_serve_kv_args(args) -> None:
    """Options that only one KV layout reads are refused with the others (not silently dropped)."""
    from workbench.errors import ConfigError

    paged_only = [name for name, on in (("--offload", args.offload is not None),
                                         ("--num-blocks", args.num_blocks is not None),
                                         ("--block-size", args.block_size != 16),
                                         ("--no-prefix-caching", args.no_prefix_caching)) if on]
    if not args.tiers and (args.tier_store != "accounted" or args.tier_predict != "step"):
        raise ConfigError("--tier-store / --tier-predict choose how the tiered cache keeps its blocks: add --tiers")
    if args.tiers and args.kv != "paged":
        raise ConfigError("--tiers gives each request its own tiered cache; --kv does not apply with it")
    layout = "--tiers" if args.tiers else "--kv contiguous" if args.kv == "contiguous" else None
    if layout and paged_only:
        raise ConfigError(f"{', '.join(paged_only)}: options of the paged pool, which {layout} does not use")
    if (args.compile or args.cuda_graphs) and args.tiers:
        raise ConfigError("--compile / --cuda-graphs run decode steps on static buffers (the paged pool or --kv "
                          "contiguous); the tiered cache routes blocks per step on the host: drop --tiers or them")
