"""``workbench`` command line: generate, bench, run-notebooks, info.

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


def cmd_generate(args) -> int:
    from .engine import LLM, RequestOutput
    from .sampling import SamplingParams

    llm = LLM(args.model, device=args.device, dtype=args.dtype)
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
                  f"E2E {m.e2e * 1e3:.1f} ms]", file=sys.stderr)
    return 0


def cmd_bench(args) -> int:
    from .bench import BenchConfig, format_bench, run_bench

    cfg = BenchConfig(model=args.model, device=args.device, dtype=args.dtype, prompt_tokens=args.prompt_tokens,
                      max_tokens=args.max_tokens, num_prompts=args.num_prompts, repeats=args.repeats,
                      warmup=args.warmup, seed=args.seed)
    res = run_bench(cfg, progress=not args.json and not args.quiet)
    if args.json:
        if not args.raw:
            res.pop("raw")
        print(json.dumps(res, indent=2))
    else:
        print(format_bench(res))
    return 0


def cmd_run_notebooks(args) -> int:
    from .runner import run_notebooks

    params = {}
    for item in args.param or []:
        if "=" not in item:
            from .errors import ConfigError
            raise ConfigError(f"--param {item!r}: expected NAME=VALUE (VALUE parsed as JSON when possible)")
        k, v = item.split("=", 1)
        try:
            params[k] = json.loads(v)
        except json.JSONDecodeError:
            params[k] = v
    result = run_notebooks(args.notebooks or None, parameters=params, out_dir=args.out, timeout=args.timeout,
                           progress=not args.quiet)
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
    from .loader import model_config

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


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="workbench", description="The LLM-inference workbench.")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")

    g = sub.add_parser("generate", help="generate text with the reference engine (streams tokens)")
    _add_model_args(g)
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
    b.add_argument("--prompt-tokens", type=int, default=64)
    b.add_argument("--max-tokens", type=int, default=64, help="new tokens per request (EOS ignored)")
    b.add_argument("--num-prompts", type=int, default=3)
    b.add_argument("--repeats", type=int, default=3)
    b.add_argument("--warmup", type=int, default=1)
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--json", action="store_true", help="print a JSON object instead of the table")
    b.add_argument("--raw", action="store_true", help="with --json: include every measurement")
    b.add_argument("--quiet", action="store_true", help="no progress bar")
    b.set_defaults(func=cmd_bench)

    r = sub.add_parser("run-notebooks", help="execute notebooks with papermill and write an HTML report")
    r.add_argument("notebooks", nargs="*", help="notebook names or paths (default: all in notebooks/)")
    r.add_argument("-p", "--param", action="append", help="NAME=VALUE injected into every notebook (repeatable)")
    r.add_argument("--out", default=None, help="output folder (default: runs/<timestamp>)")
    r.add_argument("--timeout", type=int, default=900, help="per-cell timeout in seconds")
    r.add_argument("--json", action="store_true", help="print the run summary as JSON")
    r.add_argument("--quiet", action="store_true", help="no progress bar")
    r.set_defaults(func=cmd_run_notebooks)

    i = sub.add_parser("info", help="describe a model from its config: shapes, parameters, KV bytes per token")
    i.add_argument("--model", default=None, help="Hugging Face–format folder, preset:<name>, or omit for the bundled model")
    i.add_argument("--json", action="store_true")
    i.set_defaults(func=cmd_info)
    return ap


def main(argv: list[str] | None = None) -> int:
    from .errors import WorkbenchError

    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except WorkbenchError as e:
        print(f"workbench {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"workbench {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
