"""The kernel benchmark's decode step: one step of a model at batch 1, eager against fused.

:func:`decode_rows` times the step of each variant (a set of per-op backends, and the last one
replayed as a CUDA graph) and states its fraction of the roofline: (weight bytes + KV bytes read,
:func:`step_bytes`) / copy bandwidth / step time, its kernel launches per step
(:func:`count_step_launches`) and its logit error against the first variant.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from workbench.bench.kernel_timing import (INTERPRETER_NOTE, dtype_name, error_text, new_row, time_calls,
                                           timing_fields)


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

    ops = model.ops
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
    base = dict(dtype=dtype_name(dtype), model=model_name, metric="GB/s", bytes=wbytes + kvbytes,
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
            # sampling is read by the engine after the logits: it is not part of the step timed here
            interp = env["interpreter"] and any(b == "triton" for op, b in current_backends(model).items()
                                                if op != "sampling")
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
            row.update(status="error", error=error_text(e))
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
            row.update(status="error", error=error_text(e))
        rows.append(row)
    remove_backends(model)
    eager = rows[0] if rows and rows[0]["ms_median"] else None
    for r in rows:
        if eager and r["ms_median"]:
            r["vs_eager"] = eager["ms_median"] / r["ms_median"]
    return rows

