"""``workbench decode-stack``: the paged pool + prefix cache + Triton paged decode + CUDA graphs
against the contiguous graph path, in the engine, at several batch sizes
(:mod:`workbench.bench.decode_stack`)."""

from __future__ import annotations

import argparse
import json
import sys

from workbench.cli.options import add_model_args


def _ints(text: str) -> tuple[int, ...]:
    from workbench.errors import ConfigError

    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ConfigError(f"--batches {text!r}: expected comma-separated integers such as 1,8,32") from None


def cmd_decode_stack(args: argparse.Namespace) -> int:
    """Exit status 0 when at least one row was measured (refused and failed rows are in the table
    with their reason), 1 when none was."""
    from workbench.bench.decode_stack import DecodeStackConfig, format_decode_stack, run_decode_stack, write_rows_csv

    cfg = DecodeStackConfig(
        model=args.model, device=args.device, dtype=args.dtype,
        configs=tuple(c.strip() for c in args.configs.split(",") if c.strip()) if args.configs else None,
        batches=_ints(args.batches) if args.batches else None, prompt_tokens=args.prompt_tokens,
        max_tokens=args.max_tokens, repeats=args.repeats, warmup_tokens=args.warmup_tokens, backend=args.backend,
        block_size=args.block_size, budget_s=args.budget_s, measure_ceiling=not args.no_ceiling,
        copy_mib=args.copy_mib, seed=args.seed)
    say = None if args.quiet else (lambda msg: print(f"[decode-stack] {msg}", file=sys.stderr, flush=True))
    res = run_decode_stack(cfg, progress=say)
    if args.csv:
        print(f"wrote {write_rows_csv(res, args.csv)}", file=sys.stderr)
    if args.json:
        print(json.dumps(res, indent=1, default=str))
    for r in res["rows"]:
        if r["status"] == "error":
            print(f"decode-stack: {r['config']} batch {r['batch']}: {r['reason']}", file=sys.stderr)
    print(format_decode_stack(res))            # the table, last
    return 0 if any(r["status"] == "ok" for r in res["rows"]) else 1


def add_decode_stack_parser(sub) -> None:
    from workbench.bench.decode_stack_configs import CONFIGS, DEFAULTS

    cu, cpu = DEFAULTS["cuda"], DEFAULTS["cpu"]
    p = sub.add_parser("decode-stack", help="decode tokens/s in the engine: paged pool + prefix cache + Triton paged "
                                            "decode + CUDA graphs vs the contiguous graph path, per batch size; "
                                            "fraction of the measured copy bandwidth at batch 1, greedy agreement")
    add_model_args(p)
    p.add_argument("--configs", default=None,
                   help=f"comma-separated, from {', '.join(CONFIGS)}; ratios and agreement are against the first "
                        f"contiguous one (default {','.join(cu['configs'])} on CUDA, {','.join(cpu['configs'])} "
                        "on a CPU)")
    p.add_argument("--batches", default=None,
                   help=f"batch sizes: that many equal-length prompts submitted together (default "
                        f"{','.join(map(str, cu['batches']))} on CUDA, {','.join(map(str, cpu['batches']))} on a CPU)")
    p.add_argument("--prompt-tokens", type=int, default=None,
                   help=f"default {cu['prompt_tokens']} on CUDA, {cpu['prompt_tokens']} on a CPU")
    p.add_argument("--max-tokens", type=int, default=None,
                   help=f"new tokens per request, EOS ignored (default {cu['max_tokens']} / {cpu['max_tokens']})")
    p.add_argument("--repeats", type=int, default=None,
                   help=f"interleaved timed rounds (default {cu['repeats']} / {cpu['repeats']})")
    p.add_argument("--warmup-tokens", type=int, default=4, help="tokens per untimed warm-up request")
    p.add_argument("--backend", default=None,
                   help="fused (every Triton kernel on the decode path; the CUDA default), eager (the CPU default), "
                        "or a backend spec such as triton,attention_prefill=eager")
    p.add_argument("--block-size", type=int, default=16, help="paged pool block size")
    p.add_argument("--budget-s", type=float, default=None,
                   help="start no further repeat (after the first) that would end past this many seconds")
    p.add_argument("--copy-mib", type=int, default=None,
                   help=f"size of the copy that measures the bandwidth ceiling (default {cu['copy_mib']} / "
                        f"{cpu['copy_mib']})")
    p.add_argument("--no-ceiling", action="store_true", help="do not measure the copy bandwidth (no fraction stated)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--csv", default=None, help="write the rows to this CSV (replaced)")
    p.add_argument("--json", action="store_true", help="print the result as JSON before the table")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.set_defaults(func=cmd_decode_stack)
