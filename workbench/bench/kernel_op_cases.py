"""The kernel benchmark's cases: each fused kernel at one size, against torch and an fp32 reference.

:func:`make_case` builds the inputs of one op (one of :data:`OPS`) and the calls of its
providers; :func:`run_case` times each provider (``eager``, ``compile``, ``triton``) and states
its achieved GB/s or TFLOP/s, its fraction of the measured ceiling and its error.  The launch
configurations of every benchmark are in :mod:`~workbench.bench.kernel_launch_cases`; both are
importable from :mod:`workbench.bench.kernel_cases` too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from workbench.bench.kernel_timing import (
    INTERPRETER_NOTE,
    dtype_name,
    error_text,
    new_row,
    time_calls,
    timing_fields,
)
from workbench.errors import ConfigError

from workbench.bench.kernel_names import OPS  # noqa: E402 - torch-free: the CLI's parser reads it
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
