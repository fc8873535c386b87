"""``workbench bench``, ``prefix-bench`` and ``sched-bench``: the engine against
transformers.generate, the prefix cache on and off, and what the batched engine buys."""

from __future__ import annotations

import json

from workbench.cli.options import add_backend_arg, add_model_args, apply_backend


def cmd_bench(args) -> int:
    from workbench.bench.vs_transformers import BenchConfig, format_bench, run_bench

    cfg = BenchConfig(model=args.model, device=args.device, dtype=args.dtype, prompt_tokens=args.prompt_tokens,
                      max_tokens=args.max_tokens, num_prompts=args.num_prompts, repeats=args.repeats,
                      warmup=args.warmup, seed=args.seed, backend=args.backend, threads=args.threads,
                      configs=args.configs, batch=args.batch, max_model_len=args.max_model_len, quant=args.quant or "",
                      quality_windows=args.quality_windows)
    res = run_bench(cfg, progress=not args.json and not args.quiet)
    if args.json:
        out = res.as_dict()
        if not args.raw:
            out.pop("raw")
        print(json.dumps(out, indent=2))
    else:
        print(format_bench(res))
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
    apply_backend(llm, args.backend, llm.device.type)
    res = run_sched_bench(llm, cfg, experiments=args.experiments, progress=not args.json and not args.quiet)
    print(json.dumps(res, indent=2) if args.json else format_sched_bench(res))
    return 0


def add_sched_bench_parser(sub) -> None:
    from workbench.bench.sched_config import SchedBenchConfig

    d = SchedBenchConfig()
    s = sub.add_parser("sched-bench", help="batched engine: concurrent vs sequential throughput, chunked prefill "
                                           "and micro-batch window under Poisson load, scheduler overhead")
    add_model_args(s)
    add_backend_arg(s)
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


def add_bench_parser(sub) -> None:
    b = sub.add_parser("bench", help="workbench engine vs transformers.generate, same model and prompts")
    add_model_args(b)
    add_backend_arg(b)
    b.add_argument("--prompt-tokens", type=int, default=64)
    b.add_argument("--max-tokens", type=int, default=64, help="new tokens per request (EOS ignored)")
    b.add_argument("--num-prompts", type=int, default=3)
    b.add_argument("--repeats", type=int, default=3)
    b.add_argument("--warmup", type=int, default=1)
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--configs", default="reference,loop",
                   help="engine configurations to measure, comma-separated: reference (always), loop (the bare decode "
                        "loop: the engine's per-token cost), static, compile, cuda-graphs, compile+graphs, paged, "
                        "paged+compile, paged+graphs, llama.cpp (when llama-cpp-python is installed), or all")
    b.add_argument("--batch", default="1", help="batch sizes, comma-separated (e.g. 1,8): that many prompts submitted "
                                                "together to every side (default 1)")
    b.add_argument("--quant", default=None,
                   help="quantization schemes, comma-separated (e.g. w8a16:head,w8a8): each a row q:<scheme> on the "
                        "device's fastest engine path (paged + compile; CUDA graphs on a GPU), with its held-out "
                        "perplexity against the unquantized model (default with --configs all: w8a16:head,w8a8:head on "
                        "a CPU, w4a16:g128,w8a16 on a GPU)")
    b.add_argument("--quality-windows", type=int, default=4, help="held-out windows of 256 tokens for perplexity")
    b.add_argument("--max-model-len", type=int, default=None,
                   help="context of the engines other than the reference (default: prompt + new tokens + 1, what a "
                        "request needs: the best case of static contiguous rows, which every decode step attends over "
                        "whole; a server sizes them for the model's context, e.g. 1024 for the bundled model)")
    b.add_argument("--json", action="store_true", help="print a JSON object instead of the table")
    b.add_argument("--raw", action="store_true", help="with --json: include every measurement")
    b.add_argument("--quiet", action="store_true", help="no progress bar")
    b.set_defaults(func=cmd_bench)


def add_prefix_bench_parser(sub) -> None:
    pb = sub.add_parser("prefix-bench", help="prefix cache on vs off, same model, same run: TTFT, hit rate, "
                                             "miss reasons, bookkeeping cost")
    add_model_args(pb)
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
