"""``workbench kernels-bench`` and ``workbench kernels-aot``: the Triton kernels measured
(:mod:`workbench.bench.kernels`) and compiled ahead of time for GPU targets
(:mod:`workbench.transforms.kernel_aot`).

:func:`bench_main` is ``kernels-bench`` on its own (``scripts/bench_kernels.py``).  Library
modules are imported inside the functions: on a CPU the kernel benchmark must switch the Triton
interpreter on before any kernel module is imported.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys


def _split(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


# ---- kernels-bench (workbench.bench.kernels) -------------------------------------------------------
def add_kernels_bench_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    from workbench.bench.kernel_names import OPS, SECTIONS

    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    p.add_argument("--dtype", default=None, help="bfloat16 (CUDA default), float32 (CPU default), float16")
    p.add_argument("--size", default="auto", choices=("auto", "small", "full"),
                   help="full: Llama-3.2-1B-sized tensors (GPU); small: interpreter sizes (CPU); auto: by device")
    p.add_argument("--ops", default=",".join(OPS), help=f"comma-separated kernels (default all: {','.join(OPS)})")
    p.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated: ceilings,kernels,decode")
    p.add_argument("--compile", default="auto", choices=("auto", "on", "off"),
                   help="torch.compile provider (auto: on for CUDA, skipped with a reason on CPU)")
    p.add_argument("--model", default=None, help="decode section's model (default preset:llama-3.2-1b on CUDA, "
                                                 "preset:tiny on CPU; 'bundled' for the trained reference model)")
    p.add_argument("--context", type=int, default=None, help="decode: tokens already cached (default 1024 / 24)")
    p.add_argument("--repeats", type=int, default=None, help="timed calls per row (default 20 GPU / 3 CPU)")
    p.add_argument("--warmup", type=int, default=None, help="untimed calls first (default 5 GPU / 1 CPU)")
    p.add_argument("--csv", default="runs/kernel_bench.csv", help="append rows here ('' to skip)")
    p.add_argument("--json", default=None, help="also write {'rows': [...]} to this file")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    return p


def kernel_bench_config(args: argparse.Namespace):
    """The :class:`~workbench.bench.kernels.KernelBenchConfig` of parsed ``kernels-bench`` options."""
    from workbench.bench.kernels import KernelBenchConfig

    return KernelBenchConfig(device=args.device, size=args.size, dtype=args.dtype, compile=args.compile,
                             sections=_split(args.sections), ops=_split(args.ops), model=args.model,
                             context=args.context, warmup=args.warmup, repeats=args.repeats)


def cmd_kernels_bench(args: argparse.Namespace) -> int:
    """Run, write CSV / JSON, print the table last.  Exit status 0 (failed rows are data, not a crash)."""
    from workbench.bench.kernels import run_and_report

    run_and_report(kernel_bench_config(args), csv=args.csv, json_path=args.json, quiet=args.quiet)
    return 0


def bench_main(argv: list[str] | None = None) -> int:
    """``scripts/bench_kernels.py``: ``kernels-bench`` alone (a WorkbenchError exits 2)."""
    from workbench.bench import kernels
    from workbench.errors import WorkbenchError

    p = add_kernels_bench_arguments(argparse.ArgumentParser(prog="bench_kernels",
                                                            description=kernels.__doc__.split("\n\n")[0]))
    args = p.parse_args(argv)
    try:
        return cmd_kernels_bench(args)
    except WorkbenchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def add_kernels_bench_parser(sub) -> None:
    kb = sub.add_parser("kernels-bench", help="device ceilings, each Triton kernel vs torch eager / compile, and "
                                              "the decode step eager / fused / CUDA graphs (table last, CSV)")
    add_kernels_bench_arguments(kb)
    kb.set_defaults(func=cmd_kernels_bench)


# ---- kernels-aot (workbench.transforms.kernel_aot) ---------------------------------------------------
def add_kernels_aot_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    from workbench.transforms.kernel_aot import CONFIG_CHOICES
    from workbench.transforms.kernel_launches import KERNEL_FILES

    p.add_argument("--targets", default="90,80",
                   help="comma-separated CUDA compute capabilities: 90 (Hopper), 80 (Ampere); default 90,80")
    p.add_argument("--dtypes", default="bfloat16",
                   help="comma-separated: bfloat16, float16, float32, or 'all' (default bfloat16)")
    p.add_argument("--configs", default="all", choices=CONFIG_CHOICES,
                   help="autotuned kernels: every config the autotuner would try (all), the first (largest "
                        "tile), the last (smallest), or both (ends); default all")
    p.add_argument("--kernels", default=",".join(KERNEL_FILES),
                   help=f"comma-separated kernel files (default all: {','.join(KERNEL_FILES)})")
    p.add_argument("--json", action="store_true", help="print {'rows': [...]} as JSON instead of the table")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    return p


def _interpreted() -> bool:
    from workbench.transforms.kernel_launches import check_not_interpreted

    try:
        check_not_interpreted()
    except Exception:
        return True
    return False


def cmd_kernels_aot(args: argparse.Namespace) -> int:
    """Exit status 0 when every row compiled, 1 when some failed (their errors are printed),
    2 on bad options or a missing toolchain.  A process that runs the Triton interpreter
    compiles in a clean child process (``python -m workbench.cli kernels-aot``)."""
    from workbench.errors import WorkbenchError

    if _interpreted():
        argv = [sys.executable, "-m", "workbench.cli", "kernels-aot", "--targets", args.targets,
                "--dtypes", args.dtypes, "--configs", args.configs, "--kernels", args.kernels] + \
            ["--json"] * args.json + ["--quiet"] * args.quiet
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        return subprocess.run(argv, env=env).returncode
    from workbench.transforms.kernel_aot import report_aot
    from workbench.transforms.kernel_launches import DTYPES

    try:
        targets = tuple(int(t.removeprefix("sm_").removeprefix("sm")) for t in _split(args.targets))
    except ValueError:
        raise WorkbenchError(f"--targets {args.targets!r}: expected capabilities such as 90,80") from None
    dtypes = DTYPES if args.dtypes.strip() == "all" else _split(args.dtypes)
    from workbench.bench.kernel_cases import bench_launch_cases

    rows = report_aot(targets=targets, dtypes=dtypes, configs=args.configs, kernels=_split(args.kernels),
                      as_json=args.json, quiet=args.quiet, bench_cases=bench_launch_cases())
    return 0 if all(r["status"] == "ok" for r in rows) else 1


def add_kernels_aot_parser(sub) -> None:
    ka = sub.add_parser("kernels-aot", help="compile every Triton kernel for sm_90 / sm_80 without a GPU: "
                                            "ok/error, shared memory, registers, spills, vector loads, tensor-core MMA")
    add_kernels_aot_arguments(ka)
    ka.set_defaults(func=cmd_kernels_aot)
