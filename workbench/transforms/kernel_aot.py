"""Compile every Triton kernel ahead of time for real GPU targets -- no GPU needed -- and read
what the compiled code says.

On a CPU the kernels run only under the Triton interpreter, which accepts some code the real
compiler rejects.  Triton can, however, compile for a GPU *target* without a GPU: ``triton.compile``
runs the whole pipeline (TTIR -> TTGIR -> LLVM IR -> PTX -> ptxas -> cubin) for, say,
``GPUTarget("cuda", 90, 32)``.  This module does that for every kernel of ``kernels/workbench_kernels/`` at
representative sizes and reports, per kernel / case / target:

* whether it compiles (the compiler's message when not) and how long it took;
* shared memory (from Triton's metadata) and registers per thread (from the cubin, via the
  ``cuobjdump`` that ships with Triton), with a note where a config needs more shared memory
  than the target has (the autotuner skips such a config on that GPU) or more registers than
  the register file holds;
* PTX facts a kernel tutorial points at: vectorised global loads (``ld.global.v4`` /
  ``.v2``), asynchronous copies (``cp.async``: Ampere's global -> shared pipeline), tensor-core
  instructions (``mma.sync`` on sm_80 and sm_90; ``wgmma.mma_async``, Hopper's warpgroup MMA,
  where Triton emits it), and local memory (``st.local`` in the PTX, spill bytes from ptxas,
  the stack frame from the cubin).

How launches are obtained.  Nothing is duplicated from the host wrappers: each case *calls the
real wrapper* (``rmsnorm``, ``attention_prefill``, ``paged_decode`` ...) with ``meta`` tensors
(shapes, strides, dtypes, no storage) while the module's kernel objects are swapped for
recorders, so every BLOCK size, ``num_warps``, grid and runtime argument is what the wrapper
computes.  For autotuned kernels every config that survives the kernel's own pruning is
compiled (on a GPU the autotuner tries each of them).  The recorded arguments then go through
Triton's own launch-time specialisation (integer == 1 -> constexpr, 16-divisible integers and
16-aligned pointers get ``tt.divisibility``, exactly as ``JITFunction.run`` does), with a meta
tensor's ``data_ptr()`` standing for a 16-byte-aligned allocation plus its storage offset.
(That path uses Triton-internal helpers, ``create_function_from_signature`` and
``JITFunction._pack_args`` among them, feature-detected for Triton 3.6 - 3.9: see
``kernel_compile._triton_internals``; should they change, every row reports the error.)

The one thing no wrapper can compute here is the number of SMs (``paged_decode`` asks the
CUDA device): the decode cases pass ``num_splits`` from the wrapper's own
``choose_num_splits`` with the SM count of a representative GPU of the target (H100/H200:
132, A100: 108).

The process must not run the interpreter (``TRITON_INTERPRET=1`` turns ``@triton.jit`` into an
interpreted function when a kernel module is imported).  :func:`collect` checks that, and
``workbench kernels-aot`` (:mod:`workbench.cli.kernels`) re-runs itself as
``python -m workbench.cli kernels-aot`` without the variable when it is set.

The parts: :mod:`~workbench.transforms.kernel_launches` records the launches,
:mod:`~workbench.transforms.kernel_compile` compiles one; this module runs them all
(:func:`collect`) and reports (:func:`format_aot`, :func:`report_aot`).

CLI: ``workbench kernels-aot [--targets 90,80] [--dtypes bfloat16,float16,float32]
[--configs all|first|last|ends] [--kernels rmsnorm,...] [--json]``.
"""

from __future__ import annotations

import json
import sys
from typing import Callable

from workbench.transforms.kernel_compile import compile_launch, ptxas_missing, toolchain
from workbench.transforms.kernel_launches import (DTYPE_SHORT, KERNEL_FILES, TARGETS, check_not_interpreted,
                                                  record_launches, torch_dtype)

CONFIG_CHOICES = ("all", "first", "last", "ends")


def collect(targets=(90, 80), dtypes=("bfloat16",), configs: str = "all", kernels=KERNEL_FILES,
            progress: Callable[[str], None] | None = None) -> list[dict]:
    """Compile every kernel of ``kernels`` (file names) at its representative cases for each
    target capability and dtype.  ``configs``: ``all`` autotune configs (after pruning), the
    ``first`` of each, the ``last``, or both (``ends``: the largest and the smallest tile in
    this library's config lists).  Returns one row per (launch, config, target); see
    :func:`compile_launch`.
    A kernel that no case launches gets an error row (a new kernel needs a case here)."""
    check_not_interpreted()
    if configs not in CONFIG_CHOICES:
        raise ValueError(f"configs={configs!r}: expected one of {', '.join(CONFIG_CHOICES)}")
    for cap in targets:
        if cap not in TARGETS:
            raise ValueError(f"target {cap}: expected one of {sorted(TARGETS)}")
    bad = [k for k in kernels if k not in KERNEL_FILES]
    if bad:
        raise ValueError(f"kernels {bad}: expected some of {', '.join(KERNEL_FILES)}")
    tools = toolchain()
    rows: list[dict] = []
    for file in kernels:
        for dt in dtypes:
            dtype = torch_dtype(dt)
            for cap in targets:
                launches, names = record_launches(file, dtype, cap)
                seen: set = set()
                for ln in launches:
                    cfgs = {"all": ln.configs, "first": ln.configs[:1], "last": ln.configs[-1:],
                            "ends": ln.configs[:1] + ln.configs[1:][-1:]}[configs]
                    for cfg in cfgs:
                        key = (ln.kernel, ln.case, None if cfg is None else str(cfg))
                        if key in seen:     # e.g. a wrapper launching the same kernel twice
                            continue
                        seen.add(key)
                        row = compile_launch(ln, cfg, cap, tools)
                        row["dtype"] = DTYPE_SHORT.get(dt, dt)
                        rows.append(row)
                        if progress:
                            progress(f"{row['target']} {row['kernel']} [{row['case']}] {row['config']}: "
                                     f"{row['status']} {row['seconds']:.1f}s")
                launched = {ln.kernel for ln in launches}
                for n in names:
                    if n not in launched:
                        rows.append({"file": file, "kernel": n, "case": f"(no case) {DTYPE_SHORT.get(dt, dt)}",
                                     "target": f"sm_{cap}", "config": "", "grid": "", "status": "error",
                                     "error": "no representative case launches this kernel: add one to "
                                              "workbench.transforms.kernel_launches._cases", "seconds": 0.0,
                                     "dtype": DTYPE_SHORT.get(dt, dt), "note": ""})
    return rows


# ---- presentation ---------------------------------------------------------------------------------

_COLUMNS = [("kernel", "kernel"), ("case", "case"), ("target", "target"), ("config", "config"),
            ("status", "ok"), ("seconds", "s"), ("smem", "smem B"), ("num_warps", "warps"), ("regs", "regs"),
            ("ld_v4", "ld.v4"), ("ld_v2", "ld.v2"), ("ld_scalar", "ld.1"), ("cp_async", "cp.async"),
            ("mma", "mma.sync"), ("wgmma", "wgmma"), ("spill_bytes", "spill B")]


def format_aot(rows: list[dict]) -> str:
    """A plain-text table (one line per row), then notes and the compiler's errors in full."""
    def cell(row, key):
        v = row.get(key)
        if key == "status":
            return "ok" if v == "ok" else "FAIL"
        if key == "kernel":
            return str(v).strip("_").removesuffix("_kernel")
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:.1f}"
        return str(v)

    table = [[h for _, h in _COLUMNS]] + [[cell(r, k) for k, _ in _COLUMNS] for r in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(_COLUMNS))]
    text = ["  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in table]
    text.insert(1, "  ".join("-" * w for w in widths))
    ok = sum(r["status"] == "ok" for r in rows)
    total_s = sum(r.get("seconds") or 0.0 for r in rows)
    text.append("")
    text.append(f"{ok}/{len(rows)} compiled ({total_s:.1f} s).  ld.v4 / ld.v2 / ld.1: vector / scalar "
                "ld.global in the PTX (static counts); cp.async: global->shared async copies; mma.sync / "
                "wgmma: tensor-core instructions; regs: per thread (cuobjdump); spill B: ptxas spill "
                "stores + loads ('-' when Triton's cache served the kernel).")
    for r in rows:
        if r.get("note"):
            text.append(f"note: {r['target']} {cell(r, 'kernel')} [{r['case']}] {r['config']}: {r['note']}")
    for r in rows:
        if r["status"] != "ok":
            lines = (r.get("error") or "").strip().splitlines() or [""]
            shown = lines if len(lines) <= 10 else lines[:1] + ["..."] + lines[-8:]   # the message is last
            text.append(f"FAILED: {r['target']} {cell(r, 'kernel')} [{r['case']}] {r['config']}:")
            text.extend(f"    {line}" for line in shown)
    return "\n".join(text)


def report_aot(targets=(90, 80), dtypes=("bfloat16",), configs: str = "all", kernels=KERNEL_FILES,
               as_json: bool = False, quiet: bool = False) -> list[dict]:
    """What ``workbench kernels-aot`` does in a process without the interpreter: compile
    (:func:`collect`, progress lines on stderr unless ``quiet`` or ``as_json``), then print
    ``{'rows': [...]}`` as JSON or the table (:func:`format_aot`).  Returns the rows.
    Raises WorkbenchError on bad options or a missing toolchain (ptxas)."""
    from workbench.errors import WorkbenchError

    missing = ptxas_missing(targets)
    if missing:
        raise WorkbenchError(missing)
    say = None if (quiet or as_json) else (lambda msg: print(f"[kernels-aot] {msg}", file=sys.stderr, flush=True))
    try:
        rows = collect(targets=targets, dtypes=dtypes, configs=configs, kernels=kernels, progress=say)
    except ValueError as e:
        raise WorkbenchError(str(e)) from None
    if as_json:
        print(json.dumps({"rows": rows}, indent=1))
    else:
        print(format_aot(rows))
    return rows
