"""The kernel benchmark's cases: each fused kernel at one size, against torch and an fp32 reference;
and every launch configuration the benchmarks make.

:func:`make_case` builds the inputs of one op (one of :data:`OPS`) and the calls of its
providers; :func:`run_case` times each provider (``eager``, ``compile``, ``triton``) and states
its achieved GB/s or TFLOP/s, its fraction of the measured ceiling and its error.

:func:`bench_launch_cases` lists the kernel calls of every GPU benchmark at its own sizes (the
kernel bench, its decode roofline, decode-stack, the quantized-kernel table, notebook 06's
ablation): ``workbench kernels-aot`` compiles them for sm_90 (:mod:`workbench.transforms.kernel_aot`)
and :func:`warm_up`, the device check's first step, compiles and autotunes them on the GPU.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from workbench.bench.kernel_timing import (INTERPRETER_NOTE, dtype_name, error_text, new_row, time_calls,
                                           timing_fields)
from workbench.errors import ConfigError

OPS = ("rmsnorm", "add_rmsnorm", "rope", "swiglu", "flash_prefill", "paged_decode")
# kernel -> the op of workbench.transforms.backends it serves (a row's ``backends`` column: "<op>=<provider>")
BACKEND_OP = {"rmsnorm": "rmsnorm", "add_rmsnorm": "rmsnorm", "rope": "rope", "swiglu": "swiglu",
              "flash_prefill": "attention_prefill", "paged_decode": "attention_decode"}


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
    # on a GPU the inputs are drawn there (the full sizes are GBs: a host draw and copy took seconds per case)
    g_dev = torch.Generator(device=dev).manual_seed(seed) if dev.type == "cuda" else None

    def rnd(*shape, scale=1.0):
        if dev.type == "meta":          # shapes only (kernels-aot records the launches): no host tensor
            return torch.empty(*shape, device=dev, dtype=dtype)
        if g_dev is not None:
            return (torch.randn(*shape, generator=g_dev, device=dev, dtype=torch.float32) * scale).to(dtype)
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
        row = new_row(env, "kernels", case.op, provider, dtype=dtype_name(dtype), sizes=case.sizes, metric=case.metric,
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
            row.update(status="error", error=error_text(e))
        rows.append(row)
    eager = next((r for r in rows if r["provider"] == "eager" and r["ms_median"]), None)
    for r in rows:
        if eager and r["ms_median"]:
            r["vs_eager"] = eager["ms_median"] / r["ms_median"]     # > 1: faster than eager
    return rows



# ---- every launch configuration the benchmarks make ------------------------------------------------
#
# ``workbench kernels-aot`` compiles these for sm_90 next to its representative cases, and the
# device check's warm-up step compiles (and autotunes) them on the GPU before the benchmarks run,
# so that no benchmark pays a JIT compile inside its time cap.  Each case calls the host wrappers
# of ONE kernel file (kernels-aot records a file's launches with its kernels swapped for recorders)
# as the benchmark or the model's backends call them, at the sizes of the benchmark's own table:
#
# * ``kernels-bench``: :data:`workbench.bench.kernels.SIZES` ``["full"]`` through :func:`make_case`;
# * ``decode-roofline``: the kernel bench's decode step (``workbench.bench.kernel_decode``): the
#   size's model at batch 1, ``context`` cached tokens, a contiguous cache of ``context + 8`` (the
#   step's headroom there), fused backends, eager and graphed (same static layout);
# * ``decode-stack``: :data:`workbench.bench.decode_stack.DEFAULTS` ``["cuda"]``: the batches' prefill
#   and a decode step at every batch-size bucket (powers of two up to the largest batch, as the
#   engine's static runners make them), over the paged pool (``DecodeStackConfig.block_size``) and
#   over the contiguous static cache (one page of ``prompt + max_tokens + 1`` per row);
# * ``e2e``: notebook 06's tiny ablation (:meth:`workbench.bench.e2e_configs.E2EConfig.preset`) on the
#   bundled model: decode buckets up to its ``max_num_seqs`` over its paged pool, and the Triton
#   prefill of its prompts (``TRITON_OPS`` includes prefill attention there);
# * ``quant-bench``: :data:`workbench.bench.quant_kernels.SHAPES` x ``MS``: W4A16 / W8A16 / W4A8 at
#   every (layer shape, m) of the kernel table (the device check's subset included).

@dataclass(frozen=True)
class LaunchCase:
    """One benchmark configuration's calls into one kernel file."""
    file: str                                          # workbench_kernels.<file>
    source: str                                        # the benchmark it comes from
    name: str
    call: Callable[[torch.device, torch.dtype], None]  # (device, dtype) -> the wrapper calls
    config: dict = field(default_factory=dict, compare=False)   # the sizes it stands for (tests read them)

    def label(self) -> str:
        return f"{self.source}: {self.name}"


def _kmod(file: str):
    import importlib

    importlib.import_module("workbench")          # registers the workbench_kernels import name
    return importlib.import_module(f"workbench_kernels.{file}")


def _buckets(max_seqs: int) -> list[int]:
    """The batch-size buckets of the engine's static runners (``workbench.engine.runners``)."""
    return sorted({min(1 << i, max_seqs) for i in range(max_seqs.bit_length() + 1)})


def _kernel_bench_cases() -> list[LaunchCase]:
    from workbench.bench.kernels import SIZES

    sz = SIZES["full"]
    files = {"rmsnorm": "rmsnorm", "add_rmsnorm": "rmsnorm", "rope": "rope", "swiglu": "swiglu",
             "flash_prefill": "flash_prefill", "paged_decode": "paged_decode"}

    def call(op):
        def run(dev, dtype):
            fn, args, kwargs = make_case(op, sz, dev, dtype).triton
            fn(*args, **kwargs)
        return run

    return [LaunchCase(files[op], "kernels-bench", f"{op} (size full)", call(op), {"op": op, "size": "full"})
            for op in OPS]


def _model_cases(source: str, cfg, *, batches, prompt_tokens: int, max_len: int, kv: str, block_size: int = 16,
                 prefill: bool = True, prefill_triton: bool = False, sampling: bool = True) -> list[LaunchCase]:
    """The kernel calls of a model with every Triton backend on its decode path: one decode step
    per batch size of ``batches`` (a static step's layout: what a captured CUDA graph replays) over
    the paged pool (``kv="paged"``) or the contiguous static cache (``kv="contiguous"``, one page
    of ``max_len`` per row), and the prefill of ``batch x prompt_tokens`` tokens."""
    H, I, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    W = -(-max_len // block_size)                           # blocks per sequence in the paged pool
    eps = cfg.rms_norm_eps
    shape = f"H={H} I={I} nh={nh} nkv={nkv} hd={hd}"
    cases: list[LaunchCase] = []

    def caches(rows, dev, dtype):
        """(k_cache, v_cache) of one layer in the layout the attention kernels read."""
        if kv == "paged":
            kc = torch.zeros(rows * W + 1, block_size, nkv, hd, device=dev, dtype=dtype)   # + the scratch block
            return kc, torch.zeros_like(kc)
        full = torch.zeros(rows, nkv, max_len, hd, device=dev, dtype=dtype)             # KVCache: [B, nkv, L, hd]
        return full.permute(0, 2, 1, 3), torch.zeros_like(full).permute(0, 2, 1, 3)

    def tables(B, dev):
        if kv == "paged":
            return torch.arange(B * W, device=dev, dtype=torch.int32).view(B, W)
        return torch.arange(B, device=dev, dtype=torch.int32)[:, None]

    def slots(B, T, dev):
        pos = torch.arange(T, device=dev)
        per_row = W * block_size if kv == "paged" else max_len
        return (torch.arange(B, device=dev)[:, None] * per_row + pos[None, :]).reshape(-1)

    def rnd(dev, dtype, *shape):
        return torch.randn(*shape, device=dev, dtype=dtype)

    steps = [("decode", B, 1) for B in batches]
    if prefill:
        steps += [("prefill", B, prompt_tokens) for B in sorted({max(batches), min(batches)})]
    for phase, B, T in steps:
        M = B * T
        tag = f"{phase} batch {B}" + (f" x {T} tokens" if T > 1 else "") + f", {kv} kv"
        conf = {"phase": phase, "batch": B, "tokens": T, "kv": kv, "max_len": max_len, "block_size": block_size,
                "hidden": H, "inter": I, "heads": (nh, nkv, hd), "vocab": V}

        def norm(dev, dtype, M=M):
            m = _kmod("rmsnorm")
            x, r, w = rnd(dev, dtype, 1, M, H), rnd(dev, dtype, 1, M, H), rnd(dev, dtype, H)
            m.rmsnorm(x, w, eps)
            m.add_rmsnorm(x, r, w, eps)

        def mlp(dev, dtype, M=M):
            _kmod("swiglu").swiglu(rnd(dev, dtype, 1, M, I), rnd(dev, dtype, 1, M, I))

        def rope(dev, dtype, B=B, T=T, M=M):
            q, k, v = rnd(dev, dtype, M, nh, hd), rnd(dev, dtype, M, nkv, hd), rnd(dev, dtype, M, nkv, hd)
            cos, sin = rnd(dev, dtype, max(T, 1), hd), rnd(dev, dtype, max(T, 1), hd)
            pos = torch.arange(T, device=dev).repeat(B) if T > 1 else torch.zeros(B, device=dev, dtype=torch.long)
            kc, vc = caches(B, dev, dtype)
            _kmod("rope").rope_kv_write(q, k, v, cos, sin, pos, kc, vc, slots(B, T, dev))

        cases += [LaunchCase("rmsnorm", source, f"{tag}: rmsnorm, add_rmsnorm {M}x{H}", norm, conf),
                  LaunchCase("swiglu", source, f"{tag}: swiglu {M}x{I}", mlp, conf),
                  LaunchCase("rope", source, f"{tag}: rope_kv_write {M} tokens {shape}", rope, conf)]
        if phase == "decode":
            def attend(dev, dtype, B=B):
                kc, vc = caches(B, dev, dtype)
                lens = torch.full((B,), max_len - 1, device=dev, dtype=torch.int32)
                _kmod("paged_decode").attention_decode(rnd(dev, dtype, B, nh, hd), kc, vc, tables(B, dev), lens)

            cases.append(LaunchCase("paged_decode", source, f"{tag}: attention_decode {shape} "
                                    f"page={block_size if kv == 'paged' else max_len}", attend, conf))
            if sampling:
                def greedy(dev, dtype, B=B):
                    _kmod("sampling").greedy_tokens(rnd(dev, dtype, B, V))

                cases.append(LaunchCase("sampling", source, f"{tag}: greedy_tokens V={V}", greedy, conf))
        elif prefill_triton:
            def prefill_attn(dev, dtype, B=B, T=T):
                m = _kmod("flash_prefill")
                q = rnd(dev, dtype, B, T, nh, hd).transpose(1, 2)
                k = rnd(dev, dtype, B, T, nkv, hd).transpose(1, 2)
                m.attention_prefill(q, k, torch.zeros_like(k), causal=True)
                if kv == "paged":
                    kc, vc = caches(B, dev, dtype)
                    cu = torch.arange(0, (B + 1) * T, T, device=dev, dtype=torch.int32)
                    lens = torch.full((B,), T, device=dev, dtype=torch.int32)
                    m.attention_prefill_paged(rnd(dev, dtype, B * T, nh, hd), kc, vc, tables(B, dev), cu, lens, T)

            cases.append(LaunchCase("flash_prefill", source, f"{tag}: attention_prefill {shape}", prefill_attn, conf))
    return cases


def _decode_roofline_cases() -> list[LaunchCase]:
    from workbench.bench.kernels import SIZES
    from workbench.model.loader import model_config

    sz = SIZES["full"]
    cfg = model_config(sz["model"])
    # kernel_decode: model.new_cache(1, context + 8) and GraphedDecoder(max_len=context + 8, buckets=(1,)),
    # prefilled with `context` tokens (the graphed decoder's prefill runs the fused backends)
    return [LaunchCase(c.file, c.source, c.name, c.call, {**c.config, "model": sz["model"], "context": sz["context"]})
            for c in _model_cases("decode-roofline", cfg, batches=(1,), prompt_tokens=sz["context"],
                                  max_len=sz["context"] + 8, kv="contiguous", sampling=False)]


def _decode_stack_cases() -> list[LaunchCase]:
    from workbench.bench.decode_stack import DEFAULTS, DecodeStackConfig
    from workbench.model.loader import model_config

    d = DEFAULTS["cuda"]
    cfg = model_config(d["model"])
    ctx = d["prompt_tokens"] + d["max_tokens"] + 1              # decode_stack._build's max_model_len
    out = []
    for kv in ("paged", "contiguous"):
        for c in _model_cases("decode-stack", cfg, batches=_buckets(max(d["batches"])), prompt_tokens=d["prompt_tokens"],
                              max_len=ctx, kv=kv, block_size=DecodeStackConfig.block_size):
            out.append(LaunchCase(c.file, c.source, c.name, c.call, {**c.config, "model": d["model"]}))
    return out


def _e2e_cases() -> list[LaunchCase]:
    from workbench.bench.e2e_configs import E2EConfig
    from workbench.model.loader import model_config

    e = E2EConfig.preset("tiny")
    cfg = model_config(None)                                   # the bundled model
    return [LaunchCase(c.file, c.source, c.name, c.call, {**c.config, "model": "bundled"})
            for c in _model_cases("e2e", cfg, batches=_buckets(e.max_num_seqs), prompt_tokens=64,
                                  max_len=256, kv="paged", block_size=e.block_size, prefill_triton=True,
                                  sampling=False)]


def _quant_cases() -> list[LaunchCase]:
    from workbench.bench.quant_kernels import GROUP, MS, SHAPES

    out = []
    for N, K in SHAPES:
        for rows in MS:
            def call(dev, dtype, N=N, K=K, rows=rows):
                m = _kmod("quant_matmul")
                q4 = torch.zeros(N, K // 2, device=dev, dtype=torch.uint8)
                q8 = torch.zeros(N, K, device=dev, dtype=torch.int8)
                s = torch.ones(N, K // GROUP, device=dev, dtype=torch.float32)
                x = torch.randn(rows, K, device=dev, dtype=dtype)
                m.w4a16_matmul(x, q4, s, None, GROUP)
                m.w8a16_matmul(x, q8, s, None, GROUP)
                m.w4a8_matmul(x, q4, s, GROUP)

            out.append(LaunchCase("quant_matmul", "quant-bench", f"w4a16 / w8a16 / w4a8 {N}x{K} g{GROUP} m={rows}",
                                  call, {"shape": (N, K), "m": rows, "group": GROUP}))
    return out


def bench_launch_cases(sources=("kernels-bench", "decode-roofline", "decode-stack", "quant-bench", "e2e")
                       ) -> list[LaunchCase]:
    """Every launch configuration of the benchmarks (see the comment above), most valuable first."""
    make = {"kernels-bench": _kernel_bench_cases, "decode-roofline": _decode_roofline_cases,
            "decode-stack": _decode_stack_cases, "quant-bench": _quant_cases, "e2e": _e2e_cases}
    bad = [s for s in sources if s not in make]
    if bad:
        raise ConfigError(f"bench_launch_cases: unknown sources {bad}; choose from {', '.join(make)}")
    return [c for s in ("decode-roofline", "kernels-bench", "decode-stack", "quant-bench", "e2e") if s in sources
            for c in make[s]()]


# ---- the device check's warm-up: compile and autotune every case before the benchmarks run -----------

def compile_shard(shard: int, shards: int, device=None, dtype=None) -> list[dict]:
    """Compile, without launching, the launches of cases ``shard::shards`` of
    :func:`bench_launch_cases` on ``device`` (CUDA): each case is recorded with real tensors
    (the wrappers' arithmetic, nothing runs), then every launch goes through Triton's own
    ``warmup`` (an autotuned kernel: every config its pruning keeps) into Triton's cache.  Several
    processes run shards side by side (compiling is CPU work); one row per case."""
    from workbench.transforms.kernel_aot import record_case

    dev = torch.device(device or "cuda")
    dtype = dtype or torch.bfloat16
    rows = []
    for case in bench_launch_cases()[shard::shards]:
        t0 = time.perf_counter()
        row = {"phase": "compile", "source": case.source, "case": case.name, "file": case.file, "launches": 0,
               "status": "ok", "error": None}
        try:
            launches, real = record_case(case, dev, dtype)
            for ln in launches:
                real[ln.kernel].warmup(*ln.args, grid=ln.grid, **ln.kwargs)
            row["launches"] = len(launches)
        except Exception as e:  # noqa: BLE001 - the run phase compiles what this could not
            row.update(status="error", error=error_text(e))
        row["seconds"] = round(time.perf_counter() - t0, 3)
        rows.append(row)
    return rows


def warm_up(device=None, dtype=None, workers: int = 0, inductor: bool = True, deadline: float | None = None,
            progress: Callable[[str], None] | None = None, on_rows: Callable[[list], None] | None = None) -> dict:
    """Compile and autotune the benchmarks' kernels once, before they are timed (the device
    check's first step; Triton's and inductor's caches carry the results to the later steps).

    On CUDA: (1) with ``workers`` > 1, that many processes compile the cases' launches side by
    side without launching (:func:`compile_shard`); (2) every case runs once for real, in order
    (an autotuned kernel benchmarks its configs here, once: Triton writes the choice to its cache
    when ``TRITON_CACHE_AUTOTUNING=1``); (3) ``inductor``: ``torch.compile`` of the kernel bench's
    eager ops at its full sizes (the ``compile`` provider: inductor's FX-graph cache serves the
    bench).  Without CUDA (the dry run) each case is recorded on meta tensors at its GPU sizes:
    the builders and the wrappers' launch arithmetic run, nothing compiles.  ``deadline``
    (``time.time()``): later cases are skipped past it.  Returns ``{"rows": [...], ...}``."""
    import os
    import subprocess
    import sys

    from workbench.model.loader import resolve_device
    from workbench.transforms.kernel_aot import record_case

    dev = resolve_device(device)
    say = progress or (lambda msg: None)
    rows: list[dict] = []
    t_start = time.perf_counter()

    def done(row):
        rows.append(row)
        if on_rows is not None:
            on_rows(rows)

    def late() -> bool:
        return deadline is not None and time.time() > deadline

    cases = bench_launch_cases()
    if dev.type != "cuda":
        for case in cases:
            t0 = time.perf_counter()
            row = {"phase": "record (meta, no GPU)", "source": case.source, "case": case.name, "file": case.file,
                   "status": "ok", "error": None}
            try:
                launches, _ = record_case(case, "meta", torch.bfloat16, sms=132)
                row["launches"] = len(launches)
            except Exception as e:  # noqa: BLE001
                row.update(status="error", error=error_text(e))
            row["seconds"] = round(time.perf_counter() - t0, 3)
            done(row)
        return {"device": str(dev), "cases": len(cases), "rows": rows,
                "seconds": round(time.perf_counter() - t_start, 2)}
    dtype = dtype or torch.bfloat16
    if workers > 1:
        say(f"compile: {len(cases)} cases in {workers} processes")
        t0 = time.perf_counter()
        env = {k: v for k, v in os.environ.items() if k not in ("WORKBENCH_PARTIAL_OUT", "WORKBENCH_COMPILE_LOG")}
        env["OMP_NUM_THREADS"] = "1"
        procs = [subprocess.Popen([sys.executable, "-m", "workbench.cli.gpu_results", "step", "warmup-compile",
                                   "--shard", str(i), "--shards", str(workers), "--device", str(dev)],
                                  stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
                 for i in range(workers)]
        for p in procs:
            left = None if deadline is None else max(1.0, deadline - time.time())
            try:
                out, _ = p.communicate(timeout=left)
                last = (out or "").strip().splitlines()[-1:] or ["{}"]      # the worker prints its JSON last
                for r in json.loads(last[0]).get("rows", []):
                    done(r)
            except (subprocess.TimeoutExpired, ValueError) as e:
                p.kill()
                done({"phase": "compile", "source": "", "case": f"worker {procs.index(p)}", "status": "error",
                      "error": f"{type(e).__name__}", "seconds": round(time.perf_counter() - t0, 3)})
        say(f"compiled in {time.perf_counter() - t0:.1f} s")
    for case in cases:
        if late():
            done({"phase": "run", "source": case.source, "case": case.name, "file": case.file, "status": "skipped",
                  "error": "past the step's deadline", "seconds": 0.0})
            continue
        t0 = time.perf_counter()
        row = {"phase": "run", "source": case.source, "case": case.name, "file": case.file, "status": "ok",
               "error": None}
        try:
            with torch.inference_mode():
                case.call(dev, dtype)
            torch.cuda.synchronize(dev)
        except Exception as e:  # noqa: BLE001 - the benchmark then compiles it (its compile seconds show it)
            row.update(status="error", error=error_text(e))
        row["seconds"] = round(time.perf_counter() - t0, 3)
        say(f"{case.label()}: {row['status']} {row['seconds']:.2f} s")
        done(row)
    if inductor:
        from workbench.bench.kernels import SIZES

        for op in OPS:
            if late():
                break
            t0 = time.perf_counter()
            row = {"phase": "inductor", "source": "kernels-bench", "case": f"torch.compile {op} (size full)",
                   "file": "", "status": "ok", "error": None}
            try:
                fn, args, kwargs = make_case(op, SIZES["full"], dev, dtype).eager
                with torch.inference_mode():
                    torch.compile(fn)(*args, **kwargs)
                torch.cuda.synchronize(dev)
            except Exception as e:  # noqa: BLE001
                row.update(status="error", error=error_text(e))
            row["seconds"] = round(time.perf_counter() - t0, 3)
            say(f"{row['case']}: {row['status']} {row['seconds']:.2f} s")
            done(row)
            torch.cuda.empty_cache()
    return {"device": str(dev), "cases": len(cases), "workers": workers, "rows": rows,
            "seconds": round(time.perf_counter() - t_start, 2)}
