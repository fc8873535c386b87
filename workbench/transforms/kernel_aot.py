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
132, A100: 108); the benchmark cases below see that count through the wrappers' ``_num_sms``.

Two sets of cases.  The representative ones (:func:`~workbench.transforms.kernel_launches._cases`:
each wrapper at model shapes, every dtype) and, for bf16 (the dtype every GPU benchmark runs),
every launch configuration the benchmarks make, for sm_90 (the GPUs the device check runs on)
(:func:`workbench.bench.kernel_launch_cases.bench_launch_cases`: the kernel bench at its full sizes, the
decode roofline, decode-stack's batches over the paged pool and the contiguous cache, the W4A16 /
W8A16 / W4A8 table's shapes and rows, notebook 06's ablation).  A launch whose specialisation
(signature, constexprs, alignment / ``== 1`` attributes, options) and config equal one already
compiled for the target is not compiled again: its case is added to that row's ``covers``.  So
each row is one distinct binary, and ``covers`` names every case that launches it.

The process must not run the interpreter (``TRITON_INTERPRET=1`` turns ``@triton.jit`` into an
interpreted function when a kernel module is imported).  :func:`collect` checks that, and
``workbench kernels-aot`` (:mod:`workbench.cli.kernels`) re-runs itself as
``python -m workbench.cli kernels-aot`` without the variable when it is set.

The parts: :mod:`~workbench.transforms.kernel_launches` records the launches,
:mod:`~workbench.transforms.kernel_compile` compiles one; this module runs them all
(:func:`collect`) and reports (:func:`format_aot`, :func:`report_aot`).

CLI: ``workbench kernels-aot [--targets 90,80] [--dtypes bfloat16,float16,float32]
[--configs all|first|last|ends] [--kernels rmsnorm,...] [--json]``.  :func:`plan` lists the
launches and their de-duplication without compiling (the coverage tests use it).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import sys
from collections.abc import Callable

from workbench.transforms.kernel_compile import _specialize, _triton_internals, compile_launch, ptxas_missing, toolchain
from workbench.transforms.kernel_launches import (DTYPE_SHORT, KERNEL_FILES, TARGETS, Launch, _recording,
                                                  check_not_interpreted, record_launches, torch_dtype)
from workbench.errors import WorkbenchError

CONFIG_CHOICES = ("all", "first", "last", "ends")
BENCH_DTYPES = ("bfloat16",)          # the dtype of every GPU benchmark: its launch configurations are added,
BENCH_TARGETS = (90,)                 # for the GPUs the device check runs on (H100 / H200)


# ---- the benchmarks' launch configurations, recorded ------------------------------------------------

@contextlib.contextmanager
def _sm_count(sms: int | None):
    """The wrappers' SM count (``_num_sms``) fixed to ``sms`` (None: unchanged, a live device's)."""
    if sms is None:
        yield
        return
    saved = []
    for file in ("paged_decode", "quant_plan"):      # quant_plan: the low-bit matmuls' plans
        mod = importlib.import_module(f"workbench_kernels.{file}")
        saved.append((mod, mod._num_sms))
        mod._num_sms = lambda device=None, _n=sms: _n
    try:
        yield
    finally:
        for mod, fn in saved:
            mod._num_sms = fn


def _with_configs(launches: list[Launch], real: dict) -> None:
    """Each launch's autotune configs after the kernel's own pruning ([None]: not autotuned)."""
    for ln in launches:
        kern = real[ln.kernel]
        if hasattr(kern, "configs"):
            kern.nargs = dict(zip(kern.arg_names, ln.args))
            try:
                ln.configs = list(kern.prune_configs(ln.kwargs))
            finally:
                kern.nargs = None
        else:
            ln.configs = [None]


def record_case(case, device, dtype, sms: int | None = None) -> tuple[list[Launch], dict]:
    """The launches one :class:`~workbench.bench.kernel_launch_cases.LaunchCase` makes on ``device``
    (meta: shapes only), with its file's kernels swapped for recorders (nothing runs); and the
    real kernel objects by name.  ``sms``: the SM count the wrappers see (a target's, for meta)."""
    import torch  # lazy: torch (~3 s) only to record launches; the CLI's parser reads this module's constants

    importlib.import_module("workbench")
    module = importlib.import_module(f"workbench_kernels.{case.file}")
    launches: list[Launch] = []
    short = DTYPE_SHORT.get(str(dtype).removeprefix("torch."), str(dtype))
    context = {"file": case.file, "case": f"{case.label()} {short}"}
    with _sm_count(sms), _recording(module, launches, context) as real, torch.inference_mode():
        case.call(torch.device(device), dtype)
    _with_configs(launches, real)
    return launches, real


def bench_launches(file: str, dtype, capability: int, cases) -> list[Launch]:
    """The launches of the benchmark ``cases`` of kernel ``file`` on meta tensors, for ``capability``."""
    out: list[Launch] = []
    for case in cases:
        if case.file == file:
            out += record_case(case, "meta", dtype, sms=TARGETS[capability][1])[0]
    return out


def _spec_key(ln: Launch, cfg, capability: int, backends: dict):
    """What makes a distinct binary: Triton's launch-time specialisation of this launch (with
    ``cfg``'s meta-parameters) for the target; None when it cannot be derived (then the launch
    is compiled on its own and reports the error)."""
    try:
        _, GPUTarget, _, make_backend, _ = _triton_internals()
        if capability not in backends:
            backends[capability] = make_backend(GPUTarget("cuda", capability, 32))
        kern = getattr(importlib.import_module(f"workbench_kernels.{ln.file}"), ln.kernel)
        jit = kern.fn if hasattr(kern, "configs") else kern
        kwargs = {**ln.kwargs, **(cfg.all_kwargs() if cfg is not None else {})}
        sig, constexprs, attrs, options, _ = _specialize(jit, backends[capability], ln.args, kwargs)
        return (ln.kernel, repr(sig), repr(sorted(constexprs.items(), key=repr)), repr(attrs), repr(options))
    except Exception:   # noqa: BLE001 - compile_launch reports it
        return None


def plan(targets=(90, 80), dtypes=("bfloat16",), configs: str = "all", kernels=KERNEL_FILES,
         bench_cases=None) -> list[tuple]:
    """What :func:`collect` compiles, without compiling: ``(launch, config, capability, dtype name,
    covers)`` per distinct binary, ``covers`` the case names that launch it.  ``bench_cases``: add these
    benchmark launch configurations (:func:`workbench.bench.kernel_launch_cases.bench_launch_cases`, which the
    caller passes: this layer sits below the benchmarks), bf16 for sm_90 only (:data:`BENCH_DTYPES`,
    :data:`BENCH_TARGETS`)."""
    check_not_interpreted()
    if configs not in CONFIG_CHOICES:
        raise ValueError(f"configs={configs!r}: expected one of {', '.join(CONFIG_CHOICES)}")
    for cap in targets:
        if cap not in TARGETS:
            raise ValueError(f"target {cap}: expected one of {sorted(TARGETS)}")
    bad = [k for k in kernels if k not in KERNEL_FILES]
    if bad:
        raise ValueError(f"kernels {bad}: expected some of {', '.join(KERNEL_FILES)}")
    cases = list(bench_cases) if bench_cases is not None and any(dt in BENCH_DTYPES for dt in dtypes) else None
    out: list[tuple] = []
    backends: dict = {}
    for file in kernels:
        for dt in dtypes:
            dtype = torch_dtype(dt)
            for cap in targets:
                launches, names = record_launches(file, dtype, cap)
                extra = (bench_launches(file, dtype, cap, cases)
                         if cases is not None and dt in BENCH_DTYPES and cap in BENCH_TARGETS else [])
                bench_ids = {id(x) for x in extra}
                seen: set = set()           # representative cases: one row per (kernel, case, config), as always
                binaries: dict = {}         # specialisation -> its row: a benchmark launch joins it
                for ln in launches + extra:
                    cfgs = {"all": ln.configs, "first": ln.configs[:1], "last": ln.configs[-1:],
                            "ends": ln.configs[:1] + ln.configs[1:][-1:]}[configs]
                    for cfg in cfgs:
                        spec = _spec_key(ln, cfg, cap, backends)
                        if id(ln) in bench_ids and spec is not None:
                            if spec in binaries:                     # the same binary: one more case launches it
                                if ln.case not in binaries[spec][4]:
                                    binaries[spec][4].append(ln.case)
                                continue
                            key = spec
                        else:
                            key = (ln.kernel, ln.case, None if cfg is None else str(cfg))
                        if key in seen:     # e.g. a wrapper launching the same kernel twice
                            continue
                        seen.add(key)
                        entry = (ln, cfg, cap, dt, [ln.case])
                        if spec is not None:
                            binaries.setdefault(spec, entry)
                        out.append(entry)
                launches = launches + extra
                launched = {ln.kernel for ln in launches}
                out += [(None, n, cap, dt, [file]) for n in names if n not in launched]
    return out


def collect(targets=(90, 80), dtypes=("bfloat16",), configs: str = "all", kernels=KERNEL_FILES,
            progress: Callable[[str], None] | None = None, bench_cases=None) -> list[dict]:
    """Compile every kernel of ``kernels`` (file names) at its representative cases, and (bf16,
    ``bench_cases``) at every launch configuration of the benchmarks, for each target capability and
    dtype.  ``configs``: ``all`` autotune configs (after pruning), the ``first`` of each, the
    ``last``, or both (``ends``: the largest and the smallest tile in this library's config
    lists).  Returns one row per distinct binary (launch specialisation, config, target; see
    :func:`plan`) with ``covers``: the cases that launch it; see :func:`compile_launch`.
    A kernel that no case launches gets an error row (a new kernel needs a case here)."""
    planned = plan(targets, dtypes, configs, kernels, bench_cases)
    tools = toolchain()
    rows: list[dict] = []
    for ln, cfg, cap, dt, covers in planned:
        if ln is None:              # cfg holds the kernel's name: no case launches it
            rows.append({"file": covers[0], "kernel": cfg, "case": f"(no case) {DTYPE_SHORT.get(dt, dt)}",
                         "target": f"sm_{cap}", "config": "", "grid": "", "status": "error",
                         "error": "no representative case launches this kernel: add one to "
                                  "workbench.transforms.kernel_launches._cases", "seconds": 0.0,
                         "dtype": DTYPE_SHORT.get(dt, dt), "note": "", "covers": []})
            continue
        row = compile_launch(ln, cfg, cap, tools)
        row["dtype"] = DTYPE_SHORT.get(dt, dt)
        row["covers"] = list(covers)
        rows.append(row)
        if progress:
            more = f" (+{len(covers) - 1} cases)" if len(covers) > 1 else ""
            progress(f"{row['target']} {row['kernel']} [{row['case']}]{more} {row['config']}: "
                     f"{row['status']} {row['seconds']:.1f}s")
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
    bench = [r for r in rows if any(": " in c for c in r.get("covers") or ())]
    if bench:
        cases = {c for r in bench for c in r["covers"] if ": " in c}
        text.append(f"{len(bench)} of the binaries are launched by the benchmarks ({len(cases)} benchmark cases; "
                    "a row's 'covers' in --json names every case that launches it).")
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
               as_json: bool = False, quiet: bool = False, bench_cases=None) -> list[dict]:
    """What ``workbench kernels-aot`` does in a process without the interpreter: compile
    (:func:`collect`, progress lines on stderr unless ``quiet`` or ``as_json``), then print
    ``{'rows': [...]}`` as JSON or the table (:func:`format_aot`).  Returns the rows.
    Raises WorkbenchError on bad options or a missing toolchain (ptxas)."""
    missing = ptxas_missing(targets)
    if missing:
        raise WorkbenchError(missing)
    say = None if (quiet or as_json) else (lambda msg: print(f"[kernels-aot] {msg}", file=sys.stderr, flush=True))
    try:
        rows = collect(targets=targets, dtypes=dtypes, configs=configs, kernels=kernels, progress=say,
                       bench_cases=bench_cases)
    except ValueError as e:
        raise WorkbenchError(str(e)) from None
    if as_json:
        print(json.dumps({"rows": rows}, indent=1))
    else:
        print(format_aot(rows))
    return rows
