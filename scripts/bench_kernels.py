"""Benchmark the fused kernels: device ceilings, each kernel vs torch eager / torch.compile, the decode step.

    PYTHONPATH=. python scripts/bench_kernels.py              # full sizes on a GPU (a few minutes)
    PYTHONPATH=. python scripts/bench_kernels.py --device cpu # small sizes, Triton interpreter (< 1 min)
    PYTHONPATH=. python scripts/bench_kernels.py --help

Runs from a plain checkout (no install).  Prints a table last and appends every row to
runs/kernel_bench.csv (--csv); see workbench/bench/kernels.py for the formulas and columns
(the options: workbench/cli/kernels.py).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from workbench.cli.kernels import bench_main  # noqa: E402

if __name__ == "__main__":
    sys.exit(bench_main())
