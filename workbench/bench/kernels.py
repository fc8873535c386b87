"""Kernel benchmark: the device's ceilings, each fused kernel against torch, the decode step.

One command does it all (a few minutes on a GPU, well under a minute at the small CPU sizes)::

    PYTHONPATH=. python scripts/bench_kernels.py                 # full sizes on CUDA, small on CPU
    PYTHONPATH=. python scripts/bench_kernels.py --device cpu --ops rmsnorm,swiglu --json out.json

Three sections, measured side by side in one run:

1. **ceilings** - device copy bandwidth (``dst.copy_(src)`` of a large tensor, bytes = read +
   write) and the matmul rate (``a @ b``, ``2 n^3`` FLOPs; bf16 on a GPU, fp32 on a CPU);
2. **kernels** - each op with every provider: ``eager`` (the plain-torch path the model runs
   with backend ``eager``), ``compile`` (``torch.compile`` of it) and ``triton`` (the fused
   kernel); achieved GB/s or TFLOP/s from the minimum bytes / FLOPs stated in the row's
   ``formula``, its fraction of the ceiling measured above, and its max abs error against a
   float32 reference computed on the same (upcast) inputs;
3. **decode** - one decode step of a model at batch 1 with ``eager`` / ``fused`` (every op with
   a Triton kernel on its path) / ``fused+graphs`` (the step replayed as a CUDA graph): latency,
   the fraction of the roofline ``(weight bytes + KV bytes read) / copy bandwidth / step time``,
   kernel launches per step, and the max logit error against the eager step.

Every measurement is one row (columns :data:`ROW_FIELDS`) stating device, dtype, sizes, backend
per op and the torch / triton versions.  A row that fails keeps its error (``status="error"``)
and the run goes on; a provider that is not run says why (``status="skipped"``).

Timing: warm-up calls, then ``repeats`` timed calls, median / min / max.  On CUDA each call is
timed with CUDA events after a 256 MB write that evicts the L2 cache (kernel rows); on a CPU with
``perf_counter``.  On a CPU the Triton kernels run under the interpreter (``TRITON_INTERPRET=1``,
set here before any kernel module is imported): those rows are labelled ``timing =
"triton-interpreter"``: they test the code path and its errors, they are not speed claims.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

import torch

from workbench.errors import ConfigError, WorkbenchError

ROW_FIELDS = [
    "time", "section", "op", "provider", "status", "error", "note", "timing",
    "device", "device_name", "dtype", "sizes", "backends", "model",
    "repeats", "ms_median", "ms_min", "ms_max", "vs_eager",
    "metric", "formula", "bytes", "flops", "achieved", "ceiling_name", "ceiling", "frac_of_ceiling",
    "max_err", "err_vs", "launches_per_step", "launch_counter", "torch", "triton", "interpreter",
]
OPS = ("rmsnorm", "add_rmsnorm", "rope", "swiglu", "flash_prefill", "paged_decode")
# kernel -> the op of workbench.transforms.backends it serves (a row's ``backends`` column: "<op>=<provider>")
BACKEND_OP = {"rmsnorm": "rmsnorm", "add_rmsnorm": "rmsnorm", "rope": "rope", "swiglu": "swiglu",
              "flash_prefill": "attention_prefill", "paged_decode": "attention_decode"}
SECTIONS = ("ceilings", "kernels", "decode")
INTERPRETER_NOTE = "triton-interpreter"

# Sizes.  "full": shapes of Llama-3.2-1B (hidden 2048, MLP 8192, 32 q / 8 kv heads of 64) at
# many tokens, so that every tensor is larger than the L2 cache; the attention kernels at the
# Llama-3-8B head shape (head dim 128).  "small": what the Triton interpreter runs in seconds.
SIZES = {
    "full": dict(rows=32768, hidden=2048, inter=8192, rope_tokens=16384, rope_heads=(32, 8, 64),
                 attn_heads=(32, 8, 128), prefill=(4, 4096), decode=(16, 4096), page=16,
                 copy_mib=1024, matmul=8192, model="preset:llama-3.2-1b", context=1024, warmup=5, repeats=20),
    "small": dict(rows=64, hidden=256, inter=704, rope_tokens=48, rope_heads=(8, 4, 32),
                  attn_heads=(4, 2, 32), prefill=(2, 40), decode=(2, 72), page=16,
                  copy_mib=32, matmul=384, model="preset:tiny", context=24, warmup=1, repeats=3),
}


@dataclass
class KernelBenchConfig:
    device: str | None = None          # None: cuda if available, else cpu
    size: str = "auto"                 # "small" | "full" | "auto" (full on CUDA, small on CPU)
    dtype: str | None = None           # None: bfloat16 on CUDA, float32 on CPU
    compile: str = "auto"              # "on" | "off" | "auto" (on for CUDA; CPU compiles take ~10 s per op)
    sections: tuple[str, ...] = SECTIONS
    ops: tuple[str, ...] = OPS
    model: str | None = None           # decode section; None: the size's model (preset:llama-3.2-1b / preset:tiny)
    context: int | None = None         # decode section: tokens already in the KV cache
    warmup: int | None = None
    repeats: int | None = None
    seed: int = 0
    overrides: dict = field(default_factory=dict)   # any SIZES entry, e.g. {"rows": 128}

    def __post_init__(self) -> None:
        if self.size not in ("auto", "small", "full"):
            raise ConfigError(f"kernel bench: size must be auto, small or full, got {self.size!r}")
        if self.compile not in ("auto", "on", "off"):
            raise ConfigError(f"kernel bench: compile must be auto, on or off, got {self.compile!r}")
        for name, allowed in (("sections", SECTIONS), ("ops", OPS)):
            bad = [x for x in getattr(self, name) if x not in allowed]
            if bad:
                raise ConfigError(f"kernel bench: unknown {name} {bad}; choose from {', '.join(allowed)}")
        for name in ("warmup", "repeats", "context"):
            v = getattr(self, name)
            if v is not None and v < (0 if name == "warmup" else 1):
                raise ConfigError(f"kernel bench: {name} must be >= {0 if name == 'warmup' else 1}, got {v}")
        unknown = set(self.overrides) - set(SIZES["small"])
        if unknown:
            raise ConfigError(f"kernel bench: unknown size overrides {sorted(unknown)}; "
                              f"known: {', '.join(SIZES['small'])}")


# ---- environment ------------------------------------------------------------------------------
def prepare_device(device: str | torch.device | None) -> torch.device:
    """Resolve the device; on a CPU switch the Triton interpreter on (before any kernel module is
    imported: ``@triton.jit`` chooses compiler or interpreter at import time)."""
    from workbench.model.loader import resolve_device

    dev = resolve_device(device)
    if dev.type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") != "1":
        loaded = [m for m in sys.modules if m.startswith("workbench_kernels.") and not m.endswith("_testing")]
        if loaded:
            raise WorkbenchError(f"kernel bench on a CPU needs TRITON_INTERPRET=1, but {', '.join(loaded)} were "
                                 "already imported without it; set the variable before starting Python")
        os.environ["TRITON_INTERPRET"] = "1"
    return dev


def environment(dev: torch.device) -> dict:
    from workbench.bench.vs_transformers import cpu_name

    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {"device": str(dev), "torch": torch.__version__, "triton": triton_version,
            "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else cpu_name(),
            "interpreter": os.environ.get("TRITON_INTERPRET", "0") == "1"}


def new_row(env: dict, section: str, op: str, provider: str, **values) -> dict:
    row = dict.fromkeys(ROW_FIELDS)
    row.update(env, time=datetime.now(timezone.utc).isoformat(timespec="seconds"), section=section, op=op,
               provider=provider, status="ok")
    row.update(values)
    return row


def _error(e: BaseException) -> str:
    msg = f"{type(e).__name__}: {e}".replace("\n", " ")
    return msg if len(msg) <= 400 else msg[:397] + "..."


# ---- timing -----------------------------------------------------------------------------------
_FLUSH: dict[torch.device, torch.Tensor] = {}


def time_calls(fn: Callable, dev: torch.device, warmup: int, repeats: int, flush_l2: bool = False) -> list[float]:
    """Seconds per call of ``fn`` (``repeats`` of them, after ``warmup`` untimed calls)."""
    for _ in range(warmup):
        fn()
    if dev.type != "cuda":
        out = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
        return out
    torch.cuda.synchronize(dev)
    if flush_l2 and dev not in _FLUSH:
        _FLUSH[dev] = torch.empty(256 << 20, dtype=torch.int8, device=dev)      # > any L2 cache today
    flush = _FLUSH.get(dev) if flush_l2 else None
    out = []
    for _ in range(repeats):
        if flush is not None:
            flush.zero_()                            # evict the L2 cache (outside the timed window)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize(dev)
        out.append(start.elapsed_time(end) / 1e3)
    return out


def timing_fields(times: list[float]) -> dict:
    return {"repeats": len(times), "ms_median": statistics.median(times) * 1e3, "ms_min": min(times) * 1e3,
            "ms_max": max(times) * 1e3}


# ---- 1. ceilings ------------------------------------------------------------------------------
def measure_ceilings(dev: torch.device, dtype: torch.dtype, sz: dict, env: dict, warmup: int,
                     repeats: int) -> tuple[list[dict], dict]:
    """Rows for copy bandwidth and matmul rate, and ``{"GB/s": ..., "TFLOP/s": ...}`` (None if failed)."""
    rows, ceilings = [], {"GB/s": None, "TFLOP/s": None}
    mm_dtype = dtype if dev.type == "cuda" else torch.float32
    try:
        n = (sz["copy_mib"] << 20) // torch.finfo(dtype).bits * 8
        src = torch.randn(n, device=dev).to(dtype)
        dst = torch.empty_like(src)
        t = timing_fields(time_calls(lambda: dst.copy_(src), dev, warmup, repeats))
        nbytes = 2 * n * src.element_size()
        ceilings["GB/s"] = nbytes / (t["ms_median"] / 1e3) / 1e9
        rows.append(new_row(env, "ceilings", "copy", "torch", backends="torch", dtype=_dt(dtype), sizes=f"n={n}",
                            metric="GB/s",
                            formula="2 * n * elem_bytes (read + write)", bytes=nbytes, achieved=ceilings["GB/s"],
                            timing="device" if dev.type == "cuda" else "host", **t))
    except Exception as e:  # noqa: BLE001 - recorded, the run goes on
        rows.append(new_row(env, "ceilings", "copy", "torch", status="error", error=_error(e), dtype=_dt(dtype)))
    try:
        m = sz["matmul"]
        a, b = (torch.randn(m, m, device=dev).to(mm_dtype) for _ in range(2))
        t = timing_fields(time_calls(lambda: a @ b, dev, warmup, repeats))
        flops = 2 * m ** 3
        ceilings["TFLOP/s"] = flops / (t["ms_median"] / 1e3) / 1e12
        rows.append(new_row(env, "ceilings", "matmul", "torch", backends="torch", dtype=_dt(mm_dtype),
                            sizes=f"m=n=k={m}",
                            metric="TFLOP/s", formula="2 * m * n * k", flops=flops, achieved=ceilings["TFLOP/s"],
                            timing="device" if dev.type == "cuda" else "host", note=f"{torch.get_num_threads()} threads"
                            if dev.type == "cpu" else None, **t))
    except Exception as e:  # noqa: BLE001
        rows.append(new_row(env, "ceilings", "matmul", "torch", status="error", error=_error(e), dtype=_dt(mm_dtype)))
    return rows, ceilings


def _dt(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ---- 2. kernels -------------------------------------------------------------------------------
@dataclass
class Case:
    """One op at one size: the providers' calls, an fp32 reference, and the cost formula."""
    op: str
    sizes: str
    metric: str                              # "GB/s" (bandwidth-bound) or "TFLOP/s" (compute-bound)
    amount: float                            # minimum bytes or FLOPs of one call
    formula: str
    eager: tuple                             # (fn, args, kwargs): what torch runs
    triton: tuple                            # (fn, args, kwargs): the kernel
    reference: Callable                      # () -> fp32 output(s) in the common layout
    post: dict = field(default_factory=dict)  # provider -> output to common layout (for errors)
    note: str | None = None


def make_case(op: str, sz: dict, dev: torch.device, dtype: torch.dtype, seed: int = 0) -> Case:
    """The inputs and calls of ``op`` (one of :data:`OPS`) at sizes ``sz`` (a :data:`SIZES` entry)."""
    import workbench_kernels.rmsnorm as kr
    import workbench_kernels.rope as kp
    import workbench_kernels.swiglu as ks

    g = torch.Generator(device="cpu").manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device=dev, dtype=dtype)

    e = torch.finfo(dtype).bits // 8
    f32 = (lambda *ts: [t.float() for t in ts])
    if op in ("rmsnorm", "add_rmsnorm"):
        M, N = sz["rows"], sz["hidden"]
        x, r, w = rnd(M, N), rnd(M, N), rnd(N, scale=0.1) + 1
        sizes = f"M={M} N={N}"
        if op == "rmsnorm":
            return Case(op, sizes, "GB/s", 2 * e * M * N, "2 * M * N * e (read x, write y)",
                        (kr.rmsnorm_ref, (x, w, 1e-5), {}), (kr.rmsnorm, (x, w, 1e-5), {}),
                        lambda: kr.rmsnorm_ref(*f32(x, w), 1e-5))
        return Case(op, sizes, "GB/s", 4 * e * M * N, "4 * M * N * e (read x, r; write y, h)",
                    (kr.add_rmsnorm_ref, (x, r, w, 1e-5), {}), (kr.add_rmsnorm, (x, r, w, 1e-5), {}),
                    lambda: kr.add_rmsnorm_ref(*f32(x, r, w), 1e-5))
    if op == "swiglu":
        M, I = sz["rows"], sz["inter"]
        gate, up = rnd(M, I), rnd(M, I)
        return Case(op, f"M={M} I={I}", "GB/s", 3 * e * M * I, "3 * M * I * e (read gate, up; write y)",
                    (ks.swiglu_ref, (gate, up), {}), (ks.swiglu, (gate, up), {}),
                    lambda: ks.swiglu_ref(*f32(gate, up)))
    if op == "rope":
        T, (nh, nkv, D) = sz["rope_tokens"], sz["rope_heads"]
        q, k = rnd(T, nh, D), rnd(T, nkv, D)
        inv = 1.0 / 10000 ** (torch.arange(0, D, 2, dtype=torch.float32) / D)
        ang = torch.arange(T, dtype=torch.float32)[:, None] * inv[None, :]
        cos, sin = (torch.cat((f(ang), f(ang)), -1).to(dev, dtype) for f in (torch.cos, torch.sin))
        pos = torch.arange(T, device=dev)
        return Case(op, f"tokens={T} nh={nh} nkv={nkv} D={D}", "GB/s", 2 * e * T * (nh + nkv) * D,
                    "2 * tokens * (nh + nkv) * D * e (q, k read + written; cos/sin rows not counted)",
                    (kp.rope_ref, (q, k, cos, sin, pos), {}), (kp.rope, (q, k, cos, sin, pos), {}),
                    lambda: kp.rope_ref(*f32(q, k, cos, sin), pos))
    if op == "flash_prefill":
        import workbench_kernels.flash_prefill as kf

        (B, T), (nh, nkv, hd) = sz["prefill"], sz["attn_heads"]
        q, k, v = rnd(B * T, nh, hd), rnd(B * T, nkv, hd), rnd(B * T, nkv, hd)
        cu = torch.arange(0, (B + 1) * T, T, device=dev, dtype=torch.int32)
        q4, k4, v4 = (t.view(B, T, -1, hd).transpose(1, 2) for t in (q, k, v))       # [B, heads, T, hd] views
        flops, _ = kf.prefill_cost([T] * B, [T] * B, nh, nkv, hd, e, causal=True)
        return Case(op, f"B={B} T={T} nh={nh} nkv={nkv} hd={hd} causal", "TFLOP/s", flops,
                    "4 * hd * nh * sum_b T_b (T_b + 1) / 2 (causal q.k and p.v)",
                    (kf.attention_prefill_ref, (q4, k4, v4, True), {}),
                    (kf.flash_prefill, (q, k, v, cu, T), {"check": False}),
                    lambda: kf.flash_prefill_ref(*f32(q, k, v), cu),
                    post={"eager": lambda o: o.transpose(1, 2).reshape(B * T, nh, hd),
                          "compile": lambda o: o.transpose(1, 2).reshape(B * T, nh, hd)},
                    note="eager = F.scaled_dot_product_attention (enable_gqa)")
    if op == "paged_decode":
        import workbench_kernels.paged_decode as kd

        (B, S), (nh, nkv, hd), page = sz["decode"], sz["attn_heads"], sz["page"]
        per_seq = -(-S // page)
        kc, vc = rnd(B * per_seq + 1, page, nkv, hd), rnd(B * per_seq + 1, page, nkv, hd)
        perm = torch.randperm(B * per_seq, generator=g).to(torch.int32)               # scattered blocks
        tables = perm.view(B, per_seq).to(dev)
        lens = torch.full((B,), S, dtype=torch.int32, device=dev)
        q = rnd(B, nh, hd)
        _, nbytes = kd.decode_cost([S] * B, nh, nkv, hd, e)
        splits = kd.choose_num_splits(B, nkv, S, kd._num_sms(dev))
        return Case(op, f"B={B} context={S} nh={nh} nkv={nkv} hd={hd} page={page}", "GB/s", nbytes,
                    "e * hd * (2 * nkv * sum_b S_b + 2 * B * nh) (K, V once per kv head; q, o)",
                    (kd.attention_decode_ref, (q, kc, vc, tables, lens), {}),
                    (kd.paged_decode, (q, kc, vc, tables, lens), {"max_context_len": S, "check": False}),
                    lambda: kd.paged_decode_ref(*f32(q, kc, vc), tables, lens),
                    note=f"eager = gather blocks + masked SDPA; triton num_splits={splits}")
    raise ConfigError(f"kernel bench: unknown op {op!r}; ops: {', '.join(OPS)}")


def _outputs(out) -> list[torch.Tensor]:
    return list(out) if isinstance(out, (tuple, list)) else [out]


def _max_err(out, ref) -> float:
    return max(float((a.double() - b.double()).abs().max()) for a, b in zip(_outputs(out), _outputs(ref)))


def run_case(case: Case, providers: dict[str, str | None], dev: torch.device, env: dict, ceilings: dict,
             warmup: int, repeats: int, dtype: torch.dtype) -> list[dict]:
    """One row per provider.  ``providers``: name -> None to run it, or the reason it is skipped."""
    ref = case.reference()
    rows = []
    for provider, skip in providers.items():
        row = new_row(env, "kernels", case.op, provider, dtype=_dt(dtype), sizes=case.sizes, metric=case.metric,
                      formula=case.formula, note=case.note, err_vs="float32 reference",
                      backends=f"{BACKEND_OP[case.op]}={provider}",
                      **{"bytes" if case.metric == "GB/s" else "flops": case.amount})
        if provider == "triton" and env["interpreter"]:
            row["timing"] = INTERPRETER_NOTE
        else:
            row["timing"] = "device" if dev.type == "cuda" else "host"
        if skip:
            row.update(status="skipped", note=skip)
            rows.append(row)
            continue
        try:
            fn, args, kwargs = case.triton if provider == "triton" else case.eager
            if provider == "compile":
                fn = torch.compile(fn)
            call = (lambda fn=fn: fn(*args, **kwargs))
            with torch.inference_mode():
                out = call()
                post = case.post.get(provider, lambda o: o)
                row["max_err"] = _max_err([post(o) for o in _outputs(out)], ref)
                row.update(timing_fields(time_calls(call, dev, warmup, repeats, flush_l2=True)))
            seconds = row["ms_median"] / 1e3
            scale = 1e9 if case.metric == "GB/s" else 1e12
            row["achieved"] = case.amount / seconds / scale
            row["ceiling_name"] = "copy bandwidth" if case.metric == "GB/s" else "matmul rate"
            row["ceiling"] = ceilings.get(case.metric)
            row["frac_of_ceiling"] = row["achieved"] / row["ceiling"] if row["ceiling"] else None
        except Exception as e:  # noqa: BLE001 - recorded, the run goes on
            row.update(status="error", error=_error(e))
        rows.append(row)
    eager = next((r for r in rows if r["provider"] == "eager" and r["ms_median"]), None)
    for r in rows:
        if eager and r["ms_median"]:
            r["vs_eager"] = eager["ms_median"] / r["ms_median"]     # > 1: faster than eager
    return rows


# ---- 3. decode step ---------------------------------------------------------------------------
def fused_backends() -> dict[str, str]:
    """Every op on a decode step's path that has a Triton backend in this checkout.  Prefill
    attention is not on that path and stays eager."""
    from workbench.transforms.backends import OPS as BACKEND_OPS, available_backends

    return {op: ("triton" if op != "attention_prefill" and "triton" in available_backends(op) else "eager")
            for op in BACKEND_OPS}


def count_step_launches(model, step: Callable) -> dict:
    """Kernel launches of one call of ``step`` (:func:`workbench.transforms.cuda_graphs.count_launches`), plus
    calls of Triton entry points whose host wrapper does not report to ``LAUNCHES`` (each is
    counted as one launch, a lower bound for wrappers that launch more than one kernel)."""
    import workbench_kernels

    from workbench.transforms.backends import OPS as BACKEND_OPS
    from workbench.transforms.cuda_graphs import count_launches

    ops = getattr(model.model.norm, "_wb_ops", None)
    uncounted, saved = [0], {}

    def wrap(fn):
        def counted(*a, **k):
            before = sum(workbench_kernels.LAUNCHES.values())
            out = fn(*a, **k)
            if sum(workbench_kernels.LAUNCHES.values()) == before:
                uncounted[0] += 1
            return out
        return counted

    if ops is not None:
        for op, b in ops.backends.items():
            if b == "triton":
                for entry in BACKEND_OPS[op]:
                    saved[entry] = getattr(ops, entry)
                    setattr(ops, entry, wrap(saved[entry]))
    try:
        with torch.inference_mode():
            c = count_launches(step)
    finally:
        for entry, fn in saved.items():
            setattr(ops, entry, fn)
    c["triton"] += uncounted[0]
    c["total"] += uncounted[0]
    return c


def step_bytes(model, context: int) -> tuple[int, int]:
    """(weight bytes, KV bytes read) of one decode step at batch 1 with ``context`` cached tokens:
    every parameter once (a tied embedding counts once: the LM head reads it whole), and K and V
    of ``context + 1`` positions in every layer."""
    cfg = model.config
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    e = model.lm_head.weight.element_size()
    kv = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * (context + 1) * e
    return weights, kv


def decode_rows(model, variants: dict[str, dict[str, str]], context: int, env: dict, ceilings: dict,
                warmup: int, repeats: int, graphs: bool = True, model_name: str = "", seed: int = 0) -> list[dict]:
    """One row per variant (name -> backends; ``{}`` = the plain reference model), plus
    ``fused+graphs`` (the last variant under a CUDA graph) when ``graphs``.  Each variant's step
    is timed on the same cache (filled once by the plain model's prefill), its logits compared
    with the first variant's."""
    from workbench.transforms.backends import apply_backends, current_backends, format_backends, remove_backends
    from workbench.transforms.cuda_graphs import NO_CUDA, GraphedDecoder, count_cuda_kernels

    dev, cfg = model.device, model.config
    dtype = model.lm_head.weight.dtype
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (1, context + 1), generator=g)
    prompt, tok = ids[:, :context].to(dev), ids[:, context:].to(dev)
    wbytes, kvbytes = step_bytes(model, context)
    base = dict(dtype=_dt(dtype), model=model_name, metric="GB/s", bytes=wbytes + kvbytes,
                err_vs="first variant's logits",
                sizes=f"batch=1 context={context} layers={cfg.num_hidden_layers} hidden={cfg.hidden_size}",
                formula=f"weights {wbytes} B + KV 2*layers*nkv*hd*(context+1)*e = {kvbytes} B per step",
                ceiling_name="copy bandwidth", ceiling=ceilings.get("GB/s"))
    remove_backends(model)
    cache = model.new_cache(1, context + 8)
    with torch.inference_mode():
        model(prompt, 0, cache)
    rows, ref_logits, last = [], None, None

    def finish(row, step, times):
        row.update(timing_fields(times))
        step_s = row["ms_median"] / 1e3
        row["achieved"] = row["bytes"] / step_s / 1e9
        row["frac_of_ceiling"] = row["achieved"] / row["ceiling"] if row["ceiling"] else None
        if dev.type == "cuda":
            c = count_cuda_kernels(step)
            row["launches_per_step"] = c["host_launches"]
            row["launch_counter"] = f"torch.profiler host launches ({c['device_kernels']:.0f} device kernels)"
        else:
            c = count_step_launches(model, step)
            row["launches_per_step"] = c["total"]
            row["launch_counter"] = f"dispatched ops + Triton launches ({c['aten']} aten + {c['triton']} triton)"

    for name, spec in variants.items():
        row = new_row(env, "decode", "decode_step", name, **base)
        try:
            if spec:
                apply_backends(model, {**{op: "eager" for op in fused_backends()}, **spec})
            else:
                remove_backends(model)
            row["backends"] = format_backends(current_backends(model))
            interp = env["interpreter"] and "triton" in current_backends(model).values()
            row["timing"] = INTERPRETER_NOTE if interp else ("device" if dev.type == "cuda" else "host")

            def step():
                cache.length = context             # every timed step decodes position `context` again
                return model(tok, context, cache)[0, -1]
            with torch.inference_mode():
                logits = step().float()
                ref_logits = logits if ref_logits is None else ref_logits
                row["max_err"] = float((logits - ref_logits).abs().max())
                row["note"] = f"argmax {'==' if logits.argmax() == ref_logits.argmax() else '!='} first variant's"
                finish(row, step, time_calls(step, dev, warmup, repeats))
            last = spec
        except Exception as e:  # noqa: BLE001
            row.update(status="error", error=_error(e))
        rows.append(row)
    if graphs:
        row = new_row(env, "decode", "decode_step", "fused+graphs", **base)
        try:
            apply_backends(model, {**{op: "eager" for op in fused_backends()}, **(last or {})})
            row["backends"] = format_backends(current_backends(model)) + " +cuda_graphs"
            if dev.type != "cuda":
                row.update(status="skipped", note=f"{NO_CUDA}: not measured here")
            else:
                dec = GraphedDecoder(model, max_len=context + 8, buckets=(1,))
                dec.prefill(0, prompt[0].tolist())
                dec.capture(strict=True)
                row["timing"] = "device"
                tok_id = int(tok)                       # a host int: no device sync inside the timed step

                def step():
                    return dec.decode([tok_id], [context])[0]
                logits = step().float()
                row["max_err"] = float((logits - ref_logits).abs().max()) if ref_logits is not None else None
                finish(row, step, time_calls(step, dev, warmup, repeats))
        except Exception as e:  # noqa: BLE001
            row.update(status="error", error=_error(e))
        rows.append(row)
    remove_backends(model)
    eager = rows[0] if rows and rows[0]["ms_median"] else None
    for r in rows:
        if eager and r["ms_median"]:
            r["vs_eager"] = eager["ms_median"] / r["ms_median"]
    return rows


# ---- the run ----------------------------------------------------------------------------------
def resolve_sizes(cfg: KernelBenchConfig, dev: torch.device) -> dict:
    size = cfg.size if cfg.size != "auto" else ("full" if dev.type == "cuda" else "small")
    sz = {**SIZES[size], **cfg.overrides, "name": size}
    for name in ("warmup", "repeats", "context", "model"):
        if getattr(cfg, name) is not None:
            sz[name] = getattr(cfg, name)
    return sz


def run_kernel_bench(cfg: KernelBenchConfig, progress: Callable[[str], None] | None = None) -> list[dict]:
    """Run the configured sections; returns every row (failed and skipped ones included)."""
    from workbench.model.loader import load_model, parse_dtype

    dev = prepare_device(cfg.device)
    dtype = parse_dtype(cfg.dtype) or (torch.bfloat16 if dev.type == "cuda" else torch.float32)
    sz = resolve_sizes(cfg, dev)
    env = environment(dev)
    say = progress or (lambda msg: None)
    torch.manual_seed(cfg.seed)
    # The ceilings are measured whatever the sections: every fraction below divides by them.
    say("ceilings: copy bandwidth, matmul rate")
    rows, ceilings = measure_ceilings(dev, dtype, sz, env, sz["warmup"] + 1, max(sz["repeats"], 5))
    if "kernels" in cfg.sections:
        compile_skip = None
        if cfg.compile == "off":
            compile_skip = "torch.compile switched off (--compile off)"
        elif cfg.compile == "auto" and dev.type != "cuda":
            compile_skip = ("torch.compile skipped on CPU by default (~10 s of C++ compilation per op); "
                            "--compile on runs it")
        for op in cfg.ops:
            say(f"kernels: {op}")
            providers = {"eager": None, "compile": compile_skip, "triton": None}
            try:
                case = make_case(op, sz, dev, dtype, cfg.seed)
                rows += run_case(case, providers, dev, env, ceilings, sz["warmup"], sz["repeats"], dtype)
            except Exception as e:  # noqa: BLE001 - the inputs or the reference failed
                rows += [new_row(env, "kernels", op, p, status="error", error=_error(e), dtype=_dt(dtype))
                         for p in providers]
    if "decode" in cfg.sections:
        say(f"decode step: {sz['model']} at context {sz['context']}")
        try:
            model = load_model(sz["model"], device=dev, dtype=cfg.dtype or (dtype if dev.type == "cuda" else None))
            name = sz["model"] + ("" if dev.type == "cuda" else " (CPU size, not the Llama-3.2-1B shape)")
            rows += decode_rows(model, {"eager": {}, "fused": {k: v for k, v in fused_backends().items()
                                                               if v == "triton"}},
                                sz["context"], env, ceilings, sz["warmup"], sz["repeats"], model_name=name,
                                seed=cfg.seed)
            del model
        except Exception as e:  # noqa: BLE001
            rows += [new_row(env, "decode", "decode_step", p, status="error", error=_error(e), model=sz["model"])
                     for p in ("eager", "fused", "fused+graphs")]
    return rows


# ---- output -----------------------------------------------------------------------------------
def check_csv(path: str | Path) -> None:
    """Refuse (before running) to append to a CSV whose header is not :data:`ROW_FIELDS`."""
    p = Path(path)
    if p.is_file() and p.stat().st_size:
        with open(p, newline="") as f:
            header = next(csv.reader(f), [])
        if header != ROW_FIELDS:
            raise WorkbenchError(f"{p}: its columns differ from this benchmark's ({len(header)} vs "
                                 f"{len(ROW_FIELDS)}); pass another --csv path or move the old file")


def append_csv(rows: list[dict], path: str | Path) -> Path:
    p = Path(path)
    check_csv(p)
    p.parent.mkdir(parents=True, exist_ok=True)
    new = not p.is_file() or not p.stat().st_size
    with open(p, "a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=ROW_FIELDS, extrasaction="ignore")
        if new:
            w.writeheader()
        w.writerows(rows)
    return p


def _fmt(v, spec: str) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def format_table(rows: list[dict]) -> str:
    """The rows as a fixed-width text table (what the command prints last)."""
    if not rows:
        return "(no rows)"
    r0 = rows[0]
    head = (f"{r0['device']} ({r0['device_name']}); torch {r0['torch']}, triton {r0['triton']}"
            + ("; Triton interpreter ON" if r0["interpreter"] else ""))
    cols = f"{'section':<9}{'op':<14}{'provider':<14}{'dtype':<9}{'ms p50':>10}{'min..max':>19}{'achieved':>18}" \
           f"{'of ceil':>9}{'vs eager':>9}{'max err':>10}{'launch':>8}  sizes / status"
    lines = [head, cols, "-" * len(cols)]
    for r in rows:
        mark = "*" if r["timing"] == INTERPRETER_NOTE else " "
        ach = f"{_fmt(r['achieved'], '.3g')} {r['metric']}" if r["achieved"] is not None else "-"
        tail = r["sizes"] or ""
        if r["status"] != "ok":
            tail = f"{r['status'].upper()}: {r['error'] or r['note']}"
        lines.append(f"{r['section']:<9}{r['op']:<14}{(r['provider'] + mark):<14}{(r['dtype'] or '-'):<9}"
                     f"{_fmt(r['ms_median'], '.4f'):>10}"
                     f"{(_fmt(r['ms_min'], '.3f') + '..' + _fmt(r['ms_max'], '.3f')):>19}{ach:>18}"
                     f"{_fmt(r['frac_of_ceiling'], '.1%'):>9}{_fmt(r['vs_eager'], '.2f'):>9}"
                     f"{_fmt(r['max_err'], '.2e'):>10}{_fmt(r['launches_per_step'], '.0f'):>8}  {tail}")
    if any(r["timing"] == INTERPRETER_NOTE for r in rows):
        lines.append("* Triton interpreter (CPU): these times test the code path, they are not speed claims")
    if any((r["frac_of_ceiling"] or 0) > 1 for r in rows):
        lines.append("of ceil > 100%: the tensors fit in a cache that the copy ceiling's larger tensor does not "
                     "(small sizes); compare such rows only with each other")
    lines.append("achieved: from the row's stated formula; of ceil: fraction of the copy bandwidth / matmul rate "
                 "measured in this run (decode: of the roofline); vs eager: eager time / this time")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
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


def config_from_args(args: argparse.Namespace) -> KernelBenchConfig:
    split = (lambda s: tuple(x.strip() for x in s.split(",") if x.strip()))
    return KernelBenchConfig(device=args.device, size=args.size, dtype=args.dtype, compile=args.compile,
                             sections=split(args.sections), ops=split(args.ops), model=args.model,
                             context=args.context, warmup=args.warmup, repeats=args.repeats)


def run_from_args(args: argparse.Namespace) -> int:
    """Run, write CSV / JSON, print the table last.  Exit status 0 (failed rows are data, not a crash)."""
    cfg = config_from_args(args)
    if args.csv:
        check_csv(args.csv)
    say = None if args.quiet else (lambda msg: print(f"[kernel bench] {msg}", file=sys.stderr, flush=True))
    t0 = time.perf_counter()
    rows = run_kernel_bench(cfg, progress=say)
    if args.csv:
        print(f"appended {len(rows)} rows to {append_csv(rows, args.csv)}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"rows": rows}, indent=1))
        print(f"wrote {args.json}")
    bad = sum(r["status"] == "error" for r in rows)
    print(f"{len(rows)} rows in {time.perf_counter() - t0:.1f} s; {bad} failed (see their error column)")
    print(format_table(rows))
    return 0


def main(argv: list[str] | None = None) -> int:
    """``workbench kernels-bench`` / ``scripts/bench_kernels.py``."""
    p = add_arguments(argparse.ArgumentParser(prog="bench_kernels", description=__doc__.split("\n\n")[0]))
    args = p.parse_args(argv)
    try:
        return run_from_args(args)
    except WorkbenchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
