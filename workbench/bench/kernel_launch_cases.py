"""Every launch configuration the benchmarks make (:func:`bench_launch_cases`): the kernel calls of
every GPU benchmark at its own sizes (the kernel bench, its decode roofline, decode-stack, the
quantized-kernel table, notebook 06's ablation).  ``workbench kernels-aot`` compiles them for sm_90
(:mod:`workbench.transforms.kernel_aot`) and :func:`~workbench.bench.kernel_cases.warm_up`, the
device check's first step, compiles and autotunes them on the GPU.  Importable from
:mod:`workbench.bench.kernel_cases` too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from workbench.bench.kernel_op_cases import OPS, make_case
from workbench.errors import ConfigError

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
    """The batch-size buckets of the engine's static runners (as ``workbench.engine.sizing.static_buckets``)."""
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
        for c in _model_cases("decode-stack", cfg, batches=_buckets(max(d["batches"])),
                              prompt_tokens=d["prompt_tokens"], max_len=ctx, kv=kv,
                              block_size=DecodeStackConfig.block_size):
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
