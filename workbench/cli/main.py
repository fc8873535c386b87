"""``workbench`` command line: generate, bench, run-notebooks, info, kv-inspect, prefix-bench,
sched-bench, serve, load, kernels-bench, kernels-aot.

argparse lives only here; each subcommand calls a plain function with the same parameters.
A :class:`WorkbenchError` is printed as one line and the exit status is 2 (no traceback).
"""

from __future__ import annotations

import argparse
import json
import sys


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="Hugging Face–format folder, preset:<name> (random weights), or omit for the bundled model")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    p.add_argument("--dtype", default=None, help="float32, bfloat16, float16 (default: float32 on CPU, "
                                                 "the checkpoint's dtype on GPU)")
    p.add_argument("--no-check-finite", dest="check_finite", action="store_false",
                   help="load weights that hold NaN / Inf (refused by default: one pass over the tensors)")
    p.add_argument("--threads", default=None,
                   help="torch intra-op threads on a CPU: N, or auto (default: measured on the loaded model, the "
                        "fewest threads within 15%% of the fastest decode step; env WORKBENCH_THREADS)")


def _add_backend_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", default=None,
                   help="per-op backends: eager | triton | compile (every op), or OP=BACKEND,... with OP in rmsnorm, "
                        "rope, swiglu, attention_prefill, attention_decode (default: eager)")


def _prepare_triton(args) -> None:
    """``--backend`` with Triton on a CPU: run the kernels under the Triton interpreter.

    ``TRITON_INTERPRET`` is read when triton itself is first imported (its standard library is
    decorated then), so it is set here, before any command loads a model."""
    import os

    spec = getattr(args, "backend", None)
    if not spec or "triton" not in spec or os.environ.get("TRITON_INTERPRET") == "1":
        return
    device = getattr(args, "device", None)
    if device is None:
        import torch
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if str(device).startswith("cpu"):
        os.environ["TRITON_INTERPRET"] = "1"
        print("note: Triton kernels on a CPU run under the Triton interpreter (correct, slow: not speed figures)",
              file=sys.stderr)


def _prepare_threads(args) -> None:
    """``--threads``: checked now (a clear error before any model loads), then handed to every
    engine this command builds through ``WORKBENCH_THREADS`` (see workbench.measure.threads);
    ``bench`` also passes it to its engine directly, so its JSON records the argument."""
    import os

    value = getattr(args, "threads", None)
    if value is None:
        return
    from workbench.measure.threads import ENV, parse_threads

    n = parse_threads(value, where="--threads")
    os.environ[ENV] = "auto" if n is None else str(n)


def _apply_backend(llm, spec: str | None, device_type: str) -> None:
    """Apply ``--backend`` (already checked by :func:`_prepare_triton`) to a loaded LLM."""
    if not spec:
        return
    from workbench.transforms.backends import apply_backends, parse_backend_spec

    apply_backends(llm.model, parse_backend_spec(spec))


def cmd_generate(args) -> int:
    from workbench.engine.llm import LLM, RequestOutput
    from workbench.engine.sampling import SamplingParams

    llm = LLM(args.model, device=args.device, dtype=args.dtype, max_model_len=args.max_model_len,
              check_finite=args.check_finite)
    _apply_backend(llm, args.backend, llm.device.type)
    if args.compile or args.cuda_graphs:     # after the backends: the static step is compiled / captured with them
        llm = LLM(llm.model, tokenizer=llm.tokenizer, max_model_len=args.max_model_len, compile=args.compile,
                  cuda_graphs=args.cuda_graphs)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_tokens=args.max_tokens, seed=args.seed, stop=args.stop or [])
    prompts = args.prompt or ["The Python tutorial"]
    if args.token_ids:
        prompts = [[int(t) for t in p.replace(",", " ").split()] for p in prompts]
    if args.json:
        outs = llm.generate(prompts, params, use_tqdm=not args.quiet and len(prompts) > 1)
        print(json.dumps([{"request_id": o.request_id, "prompt": o.prompt, "text": o.text,
                           "token_ids": o.token_ids, "finish_reason": o.finish_reason,
                           "metrics": o.metrics.as_dict()} for o in outs], indent=2))
        return 0
    for prompt in prompts:
        if isinstance(prompt, str):
            print(prompt, end="", flush=True)
        out = RequestOutput(request_id="", prompt=None, prompt_token_ids=[])
        for ev in llm.stream(prompt, params, output=out):
            print(ev.text if llm.tokenizer else f" {ev.token_id}", end="", flush=True)
        print()
        m = out.metrics
        if not args.quiet:
            tpot = f"{m.tpot * 1e3:.1f} ms" if m.tpot else "n/a"
            print(f"[{m.output_tokens} tokens, {out.finish_reason}; TTFT {m.ttft * 1e3:.1f} ms, TPOT {tpot}, "
                  f"E2E {m.e2e * 1e3:.1f} ms; {m.engine}]", file=sys.stderr)
    return 0


def cmd_bench(args) -> int:
    from workbench.bench.vs_transformers import BenchConfig, format_bench, run_bench

    cfg = BenchConfig(model=args.model, device=args.device, dtype=args.dtype, prompt_tokens=args.prompt_tokens,
                      max_tokens=args.max_tokens, num_prompts=args.num_prompts, repeats=args.repeats,
                      warmup=args.warmup, seed=args.seed, backend=args.backend, threads=args.threads,
                      configs=args.configs)
    res = run_bench(cfg, progress=not args.json and not args.quiet)
    if args.json:
        if not args.raw:
            res.pop("raw")
        print(json.dumps(res, indent=2))
    else:
        print(format_bench(res))
    return 0


def _json_or_str(v: str):
    try:
        return json.loads(v)
    except json.JSONDecodeError:
        return v


def cmd_run_notebooks(args) -> int:
    from workbench.lab.runner import run_notebooks

    params = {}
    for item in args.param or []:
        if "=" not in item:
            from workbench.errors import ConfigError
            raise ConfigError(f"--param {item!r}: expected NAME=VALUE (VALUE parsed as JSON when possible)")
        k, v = item.split("=", 1)
        params[k] = _json_or_str(v)
    sweep = {}
    for item in args.sweep or []:
        if "=" not in item:
            from workbench.errors import ConfigError
            raise ConfigError(f"--sweep {item!r}: expected NAME=V1,V2,... (each value parsed as JSON when possible)")
        k, v = item.split("=", 1)
        sweep[k] = [_json_or_str(x) for x in v.split(",")]
    result = run_notebooks(args.notebooks or None, parameters=params, out_dir=args.out, timeout=args.timeout,
                           progress=not args.quiet, sweep=sweep or None)
    if args.json:
        print(json.dumps(result, indent=2, default=str))
    else:
        for nb in result["notebooks"]:
            status = "ok" if nb["status"] == "ok" else f"FAILED: {nb.get('error', '')}"
            print(f"{nb['name']:<28} {nb['seconds']:>7.1f} s  {status}")
        print(f"report: {result['report']}")
    return 0 if all(nb["status"] == "ok" for nb in result["notebooks"]) else 1


def cmd_info(args) -> int:
    """Shapes and sizes from the config alone: no weights are read (fast for 8B presets too)."""
    from workbench.model.loader import model_config

    cfg = model_config(args.model)
    info = {"architecture": cfg.architecture, "parameters": cfg.num_parameters(),
            "layers": cfg.num_hidden_layers, "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
            "heads": cfg.num_attention_heads, "kv_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim,
            "vocab_size": cfg.vocab_size, "context": cfg.max_position_embeddings, "rope_theta": cfg.rope_theta,
            "rope_scaling": cfg.rope_scaling, "sliding_window": cfg.sliding_window,
            "tied_embeddings": cfg.tie_word_embeddings, "checkpoint_dtype": cfg.torch_dtype,
            "kv_bytes_per_token_bf16": cfg.kv_bytes_per_token(2),
            "kv_bytes_per_token_fp32": cfg.kv_bytes_per_token(4)}
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        for k, v in info.items():
            print(f"{k:<24} {v}")
    return 0


def cmd_kv_inspect(args) -> int:
    """Paged: a shared-prefix workload through the prefix cache, then the pool's report.
    --tiers: one long prompt through the hot / warm / cold cache, then its zone report.
    --url: the live pool of a running `workbench serve` (no model is loaded here)."""
    if args.url:
        import os

        from workbench.errors import ConfigError
        from workbench.kv.inspect import fetch_pool_report
        from workbench.lab.kv_view import format_report

        if args.tiers:
            raise ConfigError("--url shows a server's paged KV pool; --tiers runs a tiered workload here: pick one")
        rep = fetch_pool_report(args.url, api_key=os.environ.get("WORKBENCH_API_KEY") or None)
        print(json.dumps(rep, indent=1) if args.json else format_report(rep, width=args.width))
        return 0
    from workbench.lab.kv_inspect import inspect_paged_workload, inspect_tiered_workload
    from workbench.lab.kv_view import format_report

    progress = not args.json and not args.quiet
    if args.tiers:
        tier = _tier_config(args)
        rep = inspect_tiered_workload(tier, model=args.model, prompt=args.prompt[0] if args.prompt else None,
                                      prompt_tokens=args.prompt_tokens, max_tokens=args.max_tokens,
                                      calibration_docs=args.calibration_docs, device=args.device, dtype=args.dtype,
                                      progress=progress)
    else:
        rep = inspect_paged_workload(model=args.model, prompts=args.prompt, num_requests=args.num_requests,
                                     system_tokens=args.system_tokens, max_tokens=args.max_tokens,
                                     block_size=args.block_size, num_blocks=args.num_blocks, offload=args.offload,
                                     enable_prefix_caching=not args.no_prefix_caching, device=args.device,
                                     dtype=args.dtype, progress=progress)
    if args.json:
        print(json.dumps(rep, indent=1))
        return 0
    print(format_report(rep, width=args.width))
    if args.tiers:
        w, cal = rep["workload"], rep["calibration"]
        print(f"workload: {w['prompt_tokens']} prompt tokens ({w['prompt_source']}) + {w['generated_tokens']} "
              f"generated, TTFT {w['ttft_ms']:.1f} ms" + (
                  f"; PCA basis from {len(cal['documents'])} calibration documents ({cal['tokens']} tokens), "
                  f"{cal['explained_variance_at_rank']:.1%} of {cal['key_space']} key variance at rank "
                  f"{rep['config']['rank']}" if cal else ""))
    else:
        ttft = [r["ttft_ms"] for r in rep["finished"] if r.get("ttft_ms") is not None]
        if ttft:
            print("TTFT per request (ms): " + " ".join(f"{t:.1f}" for t in ttft))
    return 0


def cmd_prefix_bench(args) -> int:
    from workbench.bench.prefix import PrefixBenchConfig, format_prefix_bench, run_prefix_bench

    cfg = PrefixBenchConfig(num_requests=args.num_requests, system_tokens=args.system_tokens,
                            max_tokens=args.max_tokens, block_size=args.block_size,
                            unique_prompt_tokens=args.unique_prompt_tokens, rounds=args.rounds, seed=args.seed)
    res = run_prefix_bench(args.model, cfg, device=args.device, dtype=args.dtype,
                           progress=not args.json and not args.quiet)
    print(json.dumps(res, indent=2) if args.json else format_prefix_bench(res))
    return 0


# ---- sched-bench: what the batched engine buys (workbench.bench.sched) ------------------------------
def cmd_sched_bench(args) -> int:
    from workbench.bench.sched import SchedBenchConfig, format_sched_bench, run_sched_bench

    cfg = SchedBenchConfig(streams=args.streams, prompt_tokens=args.prompt_tokens, max_tokens=args.max_tokens,
                           rounds=args.rounds, rate=args.rate, trace_requests=args.trace_requests,
                           long_prompt_tokens=args.long_prompt_tokens, long_every=args.long_every,
                           token_budget=args.token_budget, windows_ms=tuple(args.windows_ms),
                           overhead_batch=args.overhead_batch, overhead_tokens=args.overhead_tokens, seed=args.seed,
                           batch_invariant={"auto": None, "on": True, "off": False}[args.batch_invariant])
    from workbench.engine.llm import LLM

    llm = LLM(args.model, device=args.device, dtype=args.dtype, check_finite=args.check_finite)
    _apply_backend(llm, args.backend, llm.device.type)
    res = run_sched_bench(llm, cfg, experiments=args.experiments, progress=not args.json and not args.quiet)
    print(json.dumps(res, indent=2) if args.json else format_sched_bench(res))
    return 0


def _add_sched_bench_parser(sub) -> None:
    from workbench.bench.sched import SchedBenchConfig

    d = SchedBenchConfig()
    s = sub.add_parser("sched-bench", help="batched engine: concurrent vs sequential throughput, chunked prefill "
                                           "and micro-batch window under Poisson load, scheduler overhead")
    _add_model_args(s)
    _add_backend_arg(s)
    s.add_argument("--experiments", nargs="+", default=["throughput", "chunked", "window", "overhead"],
                   choices=["throughput", "chunked", "window", "overhead"])
    s.add_argument("--streams", type=int, default=d.streams, help="concurrent requests (throughput)")
    s.add_argument("--prompt-tokens", type=int, default=d.prompt_tokens)
    s.add_argument("--max-tokens", type=int, default=d.max_tokens)
    s.add_argument("--rounds", type=int, default=d.rounds, help="sequential/concurrent alternations")
    s.add_argument("--rate", type=float, default=d.rate, help="Poisson arrivals per second (trace experiments)")
    s.add_argument("--trace-requests", type=int, default=d.trace_requests)
    s.add_argument("--long-prompt-tokens", type=int, default=d.long_prompt_tokens)
    s.add_argument("--long-every", type=int, default=d.long_every, help="every k-th request has the long prompt")
    s.add_argument("--token-budget", type=int, default=d.token_budget, help="max batched tokens per step (traces)")
    s.add_argument("--windows-ms", type=float, nargs="+", default=list(d.windows_ms))
    s.add_argument("--overhead-batch", type=int, default=d.overhead_batch)
    s.add_argument("--overhead-tokens", type=int, default=d.overhead_tokens)
    s.add_argument("--batch-invariant", choices=["auto", "on", "off"], default="auto")
    s.add_argument("--seed", type=int, default=d.seed)
    s.add_argument("--json", action="store_true", help="print a JSON object instead of the tables")
    s.add_argument("--quiet", action="store_true", help="no progress bar")
    s.set_defaults(func=cmd_sched_bench)


# ---- kernels-bench (workbench.bench.kernels) -------------------------------------------------------
def cmd_kernels_bench(args) -> int:
    from workbench.bench.kernels import run_from_args

    return run_from_args(args)


# ---- kernels-aot (workbench.transforms.kernel_aot) -------------------------------------------------------
def cmd_kernels_aot(args) -> int:
    from workbench.transforms.kernel_aot import run_from_args

    return run_from_args(args)


# ---- serve: the OpenAI-compatible HTTP server (workbench.serve) -----------------------------------
def cmd_serve(args) -> int:
    import os

    from workbench.kv.paged import PagedKVConfig
    from workbench.sched import SchedulerConfig
    from workbench.serve import ServerConfig, serve

    sched = SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_batched_tokens,
                            chunked_prefill=not args.no_chunked_prefill, micro_batch_window_s=args.window_ms / 1e3,
                            preemption_mode=args.preemption, max_queue_len=args.max_queue_len)
    config = ServerConfig(host=args.host, port=args.port, model_name=args.served_model_name,
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
              check_finite=args.check_finite)
    _apply_backend(llm, args.backend, llm.device.type)
    tiers = basis = None
    if args.tiers:
        from workbench.lab.kv_inspect import fit_heldout_basis

        tiers = _tier_config(args)
        basis = fit_heldout_basis(llm, tiers, args.calibration_docs)
        kv = None
    elif args.kv == "contiguous":
        kv = "contiguous"
    else:
        kv = PagedKVConfig(block_size=args.block_size, num_blocks=args.num_blocks,
                           enable_prefix_caching=not args.no_prefix_caching, offload=args.offload,
                           offload_blocks=args.offload_blocks)
    engine = LLMEngine(llm, kv=kv, scheduler=sched, tiers=tiers, tier_basis=basis, compile=args.compile,
                       cuda_graphs=args.cuda_graphs)
    announce = lambda line: print(line, flush=True)  # noqa: E731 - scripts read the port from this line
    return serve(engine, config, announce=announce, guard=guard)


def _add_serve_parser(sub) -> None:
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (completions, chat, SSE, /metrics) "
                                     "over the batched engine")
    _add_model_args(s)
    _add_backend_arg(s)
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
                   help="contiguous: one cache per request (no prefix sharing; what --compile / --cuda-graphs need)")
    g = s.add_argument_group("fast paths (with --kv contiguous)")
    _add_fast_path_args(g)
    g = s.add_argument_group("tiered KV (hot / warm / cold cache per request, PCA basis fitted on held-out text)")
    g.add_argument("--tiers", action="store_true", help="serve with the tiered cache instead of the paged pool")
    _add_tier_args(g)
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
    if args.tiers and args.kv != "paged":
        raise ConfigError("--tiers gives each request its own tiered cache; --kv does not apply with it")
    layout = "--tiers" if args.tiers else "--kv contiguous" if args.kv == "contiguous" else None
    if layout and paged_only:
        raise ConfigError(f"{', '.join(paged_only)}: options of the paged pool, which {layout} does not use")
    if (args.compile or args.cuda_graphs) and layout != "--kv contiguous":
        raise ConfigError("--compile / --cuda-graphs run decode steps on static contiguous buffers: add --kv contiguous")


def _add_fast_path_args(g) -> None:
    g.add_argument("--compile", action="store_true",
                   help="decode steps on static buffers through torch.compile (on a CPU inductor builds C++, ~30 s)")
    g.add_argument("--cuda-graphs", action="store_true", help="decode steps captured as CUDA graphs per batch bucket")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="context per request (default: the model's); the static buffers of --compile / --cuda-graphs "
                        "hold this many tokens per sequence and every decode step attends over them")


def _add_tier_args(t) -> None:
    """The hot / warm / cold cache's settings (kv-inspect --tiers, serve --tiers)."""
    t.add_argument("--window", type=int, default=128, help="recent tokens kept hot")
    t.add_argument("--sink", type=int, default=4, help="first tokens kept hot")
    t.add_argument("--rank", type=int, default=8, help="PCA rank of warm keys")
    t.add_argument("--warm-tokens", type=int, default=None, help="warm tokens before chunks turn cold (default: no cold zone)")
    t.add_argument("--chunk", type=int, default=16, help="tokens per cold chunk")
    t.add_argument("--block", type=int, default=None, help="routing block, a multiple of --chunk (default 16 rounded up)")
    t.add_argument("--budget", type=int, default=None, help="tokens fetched exactly per step, layer and KV head")
    t.add_argument("--value-format", choices=["full", "int8"], default="full")
    t.add_argument("--key-space", choices=["post_rope", "pre_rope"], default="post_rope")
    t.add_argument("--cold-mode", choices=["mean", "drop"], default="mean", help="drop: the sliding-window control")
    t.add_argument("--calibration-docs", type=int, default=2, help="held-out calibration documents for the PCA basis")


def _tier_config(args):
    from workbench.kv.tier_config import TierConfig

    block = args.block or -(-16 // args.chunk) * args.chunk    # a multiple of chunk, >= 16
    return TierConfig(window=args.window, sink=args.sink, rank=args.rank, warm_tokens=args.warm_tokens,
                      chunk=args.chunk, block=block, budget=args.budget, value_format=args.value_format,
                      key_space=args.key_space, cold_mode=args.cold_mode)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="workbench", description="The LLM-inference workbench.")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")

    g = sub.add_parser("generate", help="generate text with the engine's reference configuration (streams tokens)")
    _add_model_args(g)
    _add_backend_arg(g)
    _add_fast_path_args(g)
    g.add_argument("prompt", nargs="*", help="prompt text (several prompts run one after another)")
    g.add_argument("--token-ids", action="store_true", help="prompts are space/comma-separated token ids")
    g.add_argument("--max-tokens", type=int, default=48)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--json", action="store_true", help="print outputs and metrics as JSON")
    g.add_argument("--quiet", action="store_true", help="no metrics line / progress bar")
    g.set_defaults(func=cmd_generate)

    b = sub.add_parser("bench", help="workbench engine vs transformers.generate, same model and prompts")
    _add_model_args(b)
    _add_backend_arg(b)
    b.add_argument("--prompt-tokens", type=int, default=64)
    b.add_argument("--max-tokens", type=int, default=64, help="new tokens per request (EOS ignored)")
    b.add_argument("--num-prompts", type=int, default=3)
    b.add_argument("--repeats", type=int, default=3)
    b.add_argument("--warmup", type=int, default=1)
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--configs", default="reference,loop",
                   help="engine configurations to measure, comma-separated: reference (always), loop (the bare decode "
                        "loop: the engine's per-token cost), static, compile, cuda-graphs, compile+graphs, llama.cpp "
                        "(when llama-cpp-python is installed), or all")
    b.add_argument("--json", action="store_true", help="print a JSON object instead of the table")
    b.add_argument("--raw", action="store_true", help="with --json: include every measurement")
    b.add_argument("--quiet", action="store_true", help="no progress bar")
    b.set_defaults(func=cmd_bench)

    r = sub.add_parser("run-notebooks", help="execute notebooks with papermill and write an HTML report")
    r.add_argument("notebooks", nargs="*", help="notebook names or paths (default: all in notebooks/)")
    r.add_argument("-p", "--param", action="append", help="NAME=VALUE injected into every notebook (repeatable)")
    r.add_argument("--sweep", action="append", help="NAME=V1,V2,... run each notebook once per point of the grid "
                                                    "of all --sweep values (repeatable); writes sweep.csv")
    r.add_argument("--out", default=None, help="output folder (default: runs/<timestamp>)")
    r.add_argument("--timeout", type=int, default=900, help="per-cell timeout in seconds")
    r.add_argument("--json", action="store_true", help="print the run summary as JSON")
    r.add_argument("--quiet", action="store_true", help="no progress bar")
    r.set_defaults(func=cmd_run_notebooks)

    i = sub.add_parser("info", help="describe a model from its config: shapes, parameters, KV bytes per token")
    i.add_argument("--model", default=None, help="Hugging Face–format folder, preset:<name>, or omit for the bundled model")
    i.add_argument("--json", action="store_true")
    i.set_defaults(func=cmd_info)

    k = sub.add_parser("kv-inspect", help="run a small workload on the paged (or --tiers: tiered) KV cache and "
                                          "show what is inside: blocks, prefix hits and misses, zones")
    _add_model_args(k)
    k.add_argument("--prompt", action="append", help="prompt text (repeatable; default: the prefix bench's "
                                                     "shared-prefix workload; with --tiers: the long prompt)")
    k.add_argument("--num-requests", type=int, default=8, help="requests in the default shared-prefix workload")
    k.add_argument("--system-tokens", type=int, default=256, help="length of its shared system prompt (tokens)")
    k.add_argument("--max-tokens", type=int, default=8, help="new tokens per request (greedy, EOS ignored)")
    k.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    k.add_argument("--num-blocks", type=int, default=None, help="blocks in the pool (default: room for the "
                                                                "prompts; make it small to see evictions)")
    k.add_argument("--offload", choices=["host", "disk"], default=None, help="tier for evicted cached blocks")
    k.add_argument("--no-prefix-caching", action="store_true", help="turn the prefix cache off")
    k.add_argument("--width", type=int, default=64, help="blocks per line of the text block map")
    k.add_argument("--url", default=None, help="a running `workbench serve` (http://HOST:PORT): show its live KV "
                                               "pool instead (no model loaded; WORKBENCH_API_KEY is its API key)")
    t = k.add_argument_group("tiered cache (--tiers)")
    t.add_argument("--tiers", action="store_true", help="inspect the hot / warm / cold cache instead")
    t.add_argument("--prompt-tokens", type=int, default=512, help="length of the default long prompt")
    _add_tier_args(t)
    k.add_argument("--json", action="store_true", help="print the report as JSON")
    k.add_argument("--quiet", action="store_true", help="no progress bar")
    k.set_defaults(func=cmd_kv_inspect)

    pb = sub.add_parser("prefix-bench", help="prefix cache on vs off, same model, same run: TTFT, hit rate, "
                                             "miss reasons, bookkeeping cost")
    _add_model_args(pb)
    pb.add_argument("--num-requests", type=int, default=50)
    pb.add_argument("--system-tokens", type=int, default=900, help="length of the shared system prompt (tokens)")
    pb.add_argument("--max-tokens", type=int, default=16, help="new tokens per request")
    pb.add_argument("--block-size", type=int, default=16)
    pb.add_argument("--unique-prompt-tokens", type=int, default=256, help="prompt length of the no-sharing workload")
    pb.add_argument("--rounds", type=int, default=2, help="on/off alternations per workload")
    pb.add_argument("--seed", type=int, default=0)
    pb.add_argument("--json", action="store_true", help="print a JSON object instead of the table")
    pb.add_argument("--quiet", action="store_true", help="no progress bar")
    pb.set_defaults(func=cmd_prefix_bench)
    _add_sched_bench_parser(sub)
    _add_serve_parser(sub)
    kb = sub.add_parser("kernels-bench", help="device ceilings, each Triton kernel vs torch eager / compile, and "
                                              "the decode step eager / fused / CUDA graphs (table last, CSV)")
    from workbench.bench.kernels import add_arguments as _add_kernel_bench_args
    _add_kernel_bench_args(kb)
    kb.set_defaults(func=cmd_kernels_bench)
    ka = sub.add_parser("kernels-aot", help="compile every Triton kernel for sm_90 / sm_80 without a GPU: "
                                            "ok/error, shared memory, registers, spills, vector loads, tensor-core MMA")
    from workbench.transforms.kernel_aot import add_arguments as _add_kernel_aot_args
    _add_kernel_aot_args(ka)
    ka.set_defaults(func=cmd_kernels_aot)
    from workbench.cli.load import add_parser as _add_load_parser
    _add_load_parser(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    from workbench.errors import WorkbenchError

    args = build_parser().parse_args(argv)
    try:
        _prepare_threads(args)
        _prepare_triton(args)
        return args.func(args)
    except WorkbenchError as e:
        print(f"workbench {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"workbench {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
