"""``workbench`` command line: generate, bench, run-notebooks, info, kv-inspect, prefix-bench,
sched-bench, serve, load, tune, kernels-bench, kernels-aot, prefetch-bench, tier-bench, quant-bench, quantize,
calibrate-quant, claims, decode-stack, import-gguf, exercises.

argparse lives only in this package; each subcommand calls a plain function with the same parameters.
A :class:`WorkbenchError` is printed as one line and the exit status is 2 (no traceback).
This module builds the parser from the subcommands' modules (in the order ``--help`` lists them):
:mod:`~workbench.cli.model` (generate, info, kv-inspect), :mod:`~workbench.cli.bench` (bench,
prefix-bench, sched-bench), :mod:`~workbench.cli.notebooks` (run-notebooks),
:mod:`~workbench.cli.serve`, :mod:`~workbench.cli.kernels` (kernels-bench, kernels-aot),
:mod:`~workbench.cli.load`, :mod:`~workbench.cli.tune` (tune: notebook 06 on your own trace),
:mod:`~workbench.cli.prefetch` (prefetch-bench), :mod:`~workbench.cli.tiers`
(tier-bench), :mod:`~workbench.cli.quant` (quant-bench), :mod:`~workbench.cli.quantize` (quantize: a
compressed-tensors checkpoint), :mod:`~workbench.cli.calibrate` (calibrate-quant), :mod:`~workbench.cli.claims`
(the claims lab), :mod:`~workbench.cli.decode_stack` (decode-stack: the paged decode stack against the
contiguous graph path), :mod:`~workbench.cli.gguf` (import-gguf: a GGUF file as a Hugging Face folder) and
:mod:`~workbench.cli.exercises` (exercises: list, check, hint);
the shared options are in
:mod:`~workbench.cli.options`.
"""

from __future__ import annotations

import argparse
import sys

from workbench.cli.bench import add_bench_parser, add_prefix_bench_parser, add_sched_bench_parser
from workbench.cli.calibrate import add_calibrate_parser
from workbench.cli.claims import add_claims_parser
from workbench.cli.exercises import add_exercises_parser
from workbench.cli.gguf import add_import_gguf_parser
from workbench.cli.decode_stack import add_decode_stack_parser
from workbench.cli.kernels import add_kernels_aot_parser, add_kernels_bench_parser
from workbench.cli.load import add_parser as add_load_parser
from workbench.cli.model import add_generate_parser, add_info_parser, add_kv_inspect_parser
from workbench.cli.notebooks import add_run_notebooks_parser
from workbench.cli.options import prepare_threads, prepare_triton
from workbench.cli.prefetch import add_prefetch_bench_parser
from workbench.cli.quant import add_quant_bench_parser
from workbench.cli.quantize import add_quantize_parser
from workbench.cli.serve import add_serve_parser, with_serve_config
from workbench.cli.tiers import add_tier_bench_parser
from workbench.cli.tune import add_tune_parser


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="workbench", description="The LLM-inference workbench.")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_generate_parser(sub)
    add_bench_parser(sub)
    add_run_notebooks_parser(sub)
    add_info_parser(sub)
    add_kv_inspect_parser(sub)
    add_prefix_bench_parser(sub)
    add_sched_bench_parser(sub)
    add_serve_parser(sub)
    add_kernels_bench_parser(sub)
    add_kernels_aot_parser(sub)
    add_load_parser(sub)
    add_tune_parser(sub)
    add_prefetch_bench_parser(sub)
    add_tier_bench_parser(sub)
    add_quant_bench_parser(sub)
    add_quantize_parser(sub)
    add_calibrate_parser(sub)
    add_claims_parser(sub)
    add_decode_stack_parser(sub)
    add_import_gguf_parser(sub)
    add_exercises_parser(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    from workbench.errors import WorkbenchError

    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "serve" and args.config is not None:
            args = with_serve_config(parser, argv, args)   # the file's flags, then the command line's, parsed again
        prepare_threads(args)
        prepare_triton(args)
        return args.func(args)
    except WorkbenchError as e:
        print(f"workbench {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"workbench {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
