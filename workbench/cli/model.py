"""``workbench generate``, ``info`` and ``kv-inspect``: text from the engine, a model's shapes
from its config, and what sits in its KV cache."""

from __future__ import annotations

import json
import sys

from workbench.cli.options import (add_backend_arg, add_fast_path_args, add_memory_budget_arg, add_model_args,
                                   add_stream_args, add_quant_arg, add_tier_args, apply_backend, check_sizes,
                                   count, tier_config, weight_stream_config)


def cmd_generate(args) -> int:
    from workbench.engine.llm import LLM, RequestOutput
    from workbench.engine.sampling import SamplingParams
    from workbench.sched.config import SchedulerConfig

    stream = weight_stream_config(args)
    fast = args.compile or args.cuda_graphs
    # the reference configuration's cache (and the static buffers of --compile / --cuda-graphs), sized before the load
    check_sizes(args, kv="contiguous", scheduler=SchedulerConfig(max_num_seqs=1), static_decode=fast)
    llm = LLM(args.model, device=args.device, dtype=args.dtype, max_model_len=args.max_model_len,
              check_finite=args.check_finite, stream_weights=None if fast else stream, quant=args.quant,
              quant_backend=args.quant_backend, memory_budget=args.memory_budget)
    apply_backend(llm, args.backend, llm.device.type)
    if fast:     # after the backends: the static step is compiled / captured with them
        llm = LLM(llm.model, tokenizer=llm.tokenizer, max_model_len=args.max_model_len, compile=args.compile,
                  cuda_graphs=args.cuda_graphs, stream_weights=stream, memory_budget=args.memory_budget)
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
    from workbench.bench.kv_inspect import inspect_paged_workload, inspect_tiered_workload
    from workbench.lab.kv_view import format_report

    progress = not args.json and not args.quiet
    if args.tiers:
        tier = tier_config(args)
        if args.tier_store != "accounted":
            from workbench.errors import ConfigError

            raise ConfigError("kv-inspect --tiers reads every representation the accounted cache keeps; "
                              "--tier-store host|disk is for serve and tier-bench (measured memory)")
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


def add_generate_parser(sub) -> None:
    g = sub.add_parser("generate", help="generate text with the engine's reference configuration (streams tokens)")
    add_model_args(g)
    add_quant_arg(g)
    add_backend_arg(g)
    add_fast_path_args(g)
    add_memory_budget_arg(g)
    add_stream_args(g)
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


def add_info_parser(sub) -> None:
    i = sub.add_parser("info", help="describe a model from its config: shapes, parameters, KV bytes per token")
    i.add_argument("--model", default=None,
                   help="Hugging Face–format folder, preset:<name>, or omit for the bundled model")
    i.add_argument("--json", action="store_true")
    i.set_defaults(func=cmd_info)


def add_kv_inspect_parser(sub) -> None:
    k = sub.add_parser("kv-inspect", help="run a small workload on the paged (or --tiers: tiered) KV cache and "
                                          "show what is inside: blocks, prefix hits and misses, zones")
    add_model_args(k)
    k.add_argument("--prompt", action="append", help="prompt text (repeatable; default: the prefix bench's "
                                                     "shared-prefix workload; with --tiers: the long prompt)")
    k.add_argument("--num-requests", type=int, default=8, help="requests in the default shared-prefix workload")
    k.add_argument("--system-tokens", type=int, default=256, help="length of its shared system prompt (tokens)")
    k.add_argument("--max-tokens", type=int, default=8, help="new tokens per request (greedy, EOS ignored)")
    k.add_argument("--block-size", type=count, default=16, help="tokens per KV block")
    k.add_argument("--num-blocks", type=count, default=None, help="blocks in the pool (default: room for the "
                                                                  "prompts; make it small to see evictions; more "
                                                                  "than the machine has available is refused)")
    k.add_argument("--offload", choices=["host", "disk"], default=None, help="tier for evicted cached blocks")
    k.add_argument("--no-prefix-caching", action="store_true", help="turn the prefix cache off")
    k.add_argument("--width", type=int, default=64, help="blocks per line of the text block map")
    k.add_argument("--url", default=None, help="a running `workbench serve` (http://HOST:PORT): show its live KV "
                                               "pool instead (no model loaded; WORKBENCH_API_KEY is its API key)")
    t = k.add_argument_group("tiered cache (--tiers)")
    t.add_argument("--tiers", action="store_true", help="inspect the hot / warm / cold cache instead")
    t.add_argument("--prompt-tokens", type=int, default=512, help="length of the default long prompt")
    add_tier_args(t)
    k.add_argument("--json", action="store_true", help="print the report as JSON")
    k.add_argument("--quiet", action="store_true", help="no progress bar")
    k.set_defaults(func=cmd_kv_inspect)
