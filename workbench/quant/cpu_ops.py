"""torch's packed low-bit CPU matmuls for a :class:`~workbench.quant.apply.QuantLinear`, and
their timing against the dense and the dequantize-then-matmul reference.

::

    op = cpu_op(qlinear)            # None when the layer's format has no CPU op (and why: cpu_op_reason)
    y = op(x)                        # x [.., in] float32 -> [.., out]
    cpu_op_timing(out=8192, inp=2048, m=1)   # ms per call: dense fp32, reference, int8pack, int8 reduce, int4pack

Which layers have an op (this torch, CPU, float32 activations):

* ``int8`` - int8 symmetric, one scale per output channel: a matrix-vector product written as one
  reduction, ``(x[:, None, :] * W[None].float()).sum(-1) * s``, through ``torch.compile`` (one
  dynamic-shape compiled function for every layer), which inductor turns into a loop that reads each
  int8 weight once and dequantizes it in registers: measured 3-4.5x faster than the fp32 GEMV at
  m = 1 on weights that are not in cache (SmolLM2-135M's layers; 7x on its 49152 x 576 LM head),
  where torch's own ``aten._weight_int8pack_mm`` was 2.6x *slower* than fp32 on the same machine.
  Without a working compiler (inductor's C++) it falls back to ``_weight_int8pack_mm``;
* ``int8 x int8`` (W8A8) - the input rounded per token to int8 (``s_t = max|x_t| / 127``), then
  ``torch._int_mm(x_q int8 [m, in], W^T int8 [in, out]) -> int32``, times ``s_t * s_w``: exact
  integer products, one float rounding at the end.  W4A8 has no CPU op in torch (int4 x int8):
  it runs the reference;
* ``int4`` - ``aten._convert_weight_to_int4pack_for_cpu(W int32 [out, in] in 0..15, inner_k_tiles)``
  once, then ``aten._weight_int4pack_mm_for_cpu(x, packed, group, scales_and_zeros [in/g, out, 2])``
  per call, dequantising ``(q - 8) * scale + zero``: our symmetric values are stored + 8 with
  ``zero = 0``; asymmetric ones get ``zero = (8 - z) * scale``.  Groups of 32, 64, 128 or 256.

The ops are the same arithmetic as the reference up to float32 rounding (tested).  The packed
weight-only ops are matrix-vector kernels: above ``INT4_MAX_ROWS`` / ``INT8_MAX_ROWS`` rows (a
prefill) a call goes to the reference instead (measured crossover, see the constants).  Whether they
are *faster* is a measurement (:func:`cpu_op_timing`), not a promise: at m = 1 a matmul streams
its weight once, so the bound is memory bandwidth - int4 moves 1/8 of fp32's bytes, but the
unpacking costs instructions, and on a small-cache 2-core VM the dense fp32 GEMV may still win.
"""

from __future__ import annotations

import time

import torch

from workbench.quant.rtn import quantize_weight

INT4_GROUPS = (32, 64, 128, 256)
# Rows above which the packed weight-only ops hand the call to the reference (dequantize, then
# one matmul).  They are matrix-*vector* kernels: measured on the 2-core development VM
# (`workbench quant-bench --ops`, 8192 x 2048, 2 threads), int4pack took 14.6 / 119 / 950 ms at
# m = 1 / 8 / 64 and int8pack 9.5 / 58 / 494 ms, against 51 / 60 / 70 ms for the reference.
INT4_MAX_ROWS = 4
INT8_MAX_ROWS = 8
INT4PACK_LAYOUT = "cpu_int4pack"    # QuantLinear.qweight_layout once the int4 op holds the weight
_GEMV: dict = {}          # the compiled int8 reduction (made on first use), or why it could not be


def _int8_rows(x, w, s):
    """``x @ (w * s).T`` for a few rows ``x`` [m, in] and an int8 ``w`` [out, in] with scales ``s``
    [out], as one reduction (what inductor fuses into a single pass over ``w``)."""
    return (x[:, None, :] * w[None].to(x.dtype)).sum(-1) * s


def int8_decode(x, w, s):
    """:func:`_int8_rows` compiled (dynamic shapes: one compiled function for every layer), or torch's
    ``_weight_int8pack_mm`` when compiling failed (the reason is in :func:`int8_decode_backend`)."""
    if "failed" not in _GEMV:
        try:
            fn = _GEMV.get("fn")
            if fn is None:
                fn = _GEMV["fn"] = torch.compile(_int8_rows, dynamic=True)
            return fn(x, w, s)
        except Exception as e:  # noqa: BLE001 - no C++ compiler, an unsupported platform: the aten op runs
            _GEMV["failed"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    return torch.ops.aten._weight_int8pack_mm(x, w, s)


def int8_decode_backend() -> str:
    """What :func:`int8_decode` runs: the compiled reduction, or the aten op and why."""
    if "failed" in _GEMV:
        return f"aten._weight_int8pack_mm (compiling the reduction failed: {_GEMV['failed']})"
    return "compiled int8 reduction (torch.compile, inductor)"


def cpu_op_reason(layer) -> str | None:
    """Why ``layer`` has no packed CPU op (None when it has one)."""
    if layer.qweight.device.type != "cpu":
        return "not on a CPU"
    if getattr(layer, "act_bits", None):
        if layer.bits == 4:
            return "W4A8: torch has no int4 x int8 CPU op (the reference runs)"
        if layer.group is not None or layer.scales.shape[0] != layer.out_features:
            return "W8A8 op: one scale per output channel only"
        return None
    if layer.bits == 8:
        if layer.zeros is not None or layer.group is not None or layer.scales.shape[0] != layer.out_features:
            return "int8 op: symmetric, one scale per output channel only"
        return None
    if layer.group not in INT4_GROUPS:
        return f"int4 op: groups of {INT4_GROUPS} only (this layer: {layer.group or 'no group'})"
    if layer.in_features % layer.group:
        return "int4 op: the group must divide the input width"
    return None


def cpu_op(layer, inner_k_tiles: int = 8, row_fallback: bool = True):
    """A function ``x -> y`` running ``layer`` through torch's packed CPU op, or None.
    ``row_fallback``: calls with more rows than the op handles well go to the reference (False:
    always the op, for timing it)."""
    int4_rows, int8_rows = (INT4_MAX_ROWS, INT8_MAX_ROWS) if row_fallback else (1 << 62, 1 << 62)
    if cpu_op_reason(layer) is not None:
        return None
    if getattr(layer, "act_bits", None):
        wt, sw = layer.qweight.T, layer.scales[:, 0].contiguous()

        def w8a8(x):
            shape = x.shape
            xf = x.reshape(-1, shape[-1]).float()
            st = xf.abs().amax(-1, keepdim=True).clamp_min(1e-12) / 127
            xq = torch.round(xf / st).clamp(-127, 127).to(torch.int8)
            y = torch._int_mm(xq, wt).float() * st * sw
            y = y if layer.bias is None else y + layer.bias
            return y.reshape(*shape[:-1], -1).to(x.dtype)
        return w8a8
    if layer.bits == 8:
        w, s = layer.qweight, layer.scales[:, 0].contiguous()

        def int8(x):
            shape = x.shape
            if x.numel() // shape[-1] > int8_rows:
                return layer.reference_forward(x)
            y = int8_decode(x.reshape(-1, shape[-1]).float(), w, s)
            y = y if layer.bias is None else y + layer.bias
            return y.reshape(*shape[:-1], -1).to(x.dtype)
        return int8
    q = layer.quantized                                                   # the row layout, whatever the buffer holds
    vals = q.int_values()                                                  # symmetric: -7..7; asym: 0..15
    if q.symmetric:
        stored, zero = (vals + 8).to(torch.int32), torch.zeros_like(q.scales)
    else:
        z = q.zeros.float()                                                # in 0..15 for 4 bits
        stored, zero = vals.to(torch.int32), (8 - z) * q.scales
    n, k = q.shape
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(stored.contiguous(), inner_k_tiles)
    sz = torch.stack([q.scales.T, zero.T], dim=-1).contiguous().float()     # [in / g, out, 2]
    g = layer.group
    # One copy of the weight: the op's layout holds the same nibbles as the row layout, permuted, so
    # the layer's qweight buffer becomes the op's packed weight and the row layout is rebuilt from it
    # when asked for (QuantLinear.quantized).  Where this torch packs differently from what
    # int4pack_values reads, the row copy stays and is counted.
    shared = torch.equal(int4pack_values(packed, n, k), stored.to(torch.uint8))
    del stored, vals
    if shared:
        layer.qweight, layer.qweight_layout = packed, INT4PACK_LAYOUT

    def int4(x):
        shape = x.shape
        if x.numel() // shape[-1] > int4_rows:
            return layer.reference_forward(x)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.reshape(-1, shape[-1]).float(), packed, g, sz)
        y = y if layer.bias is None else y + layer.bias
        return y.reshape(*shape[:-1], -1).to(x.dtype)
    # beside the stored bytes: the op's scales-and-zeros (8 bytes a group of a row: 1/8 of the packed
    # weight at g128), and, where the layouts could not be shared, the repacked weight too
    int4.extra_bytes = sz.numel() * 4 + (0 if shared else packed.numel() * packed.element_size())
    return int4


def int4pack_values(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The 4-bit values ``[n, k]`` (uint8, 0..15) held by torch's CPU int4pack layout
    (``aten._convert_weight_to_int4pack_for_cpu`` of an ``[n, k]`` weight): blocks of 64 rows as
    ``[k, 32]`` bytes, low nibble row ``j``, high nibble row ``j + 32``; the last ``n % 64`` rows as
    ``[k, r / 2]`` bytes, low nibble the even row, high the odd one.  (cpu_op checks it against the
    values it packed, so a torch that packs otherwise keeps the row copy.)"""
    b = packed.reshape(-1)
    full = n // 64 * 64
    parts = []
    if full:
        blk = b[: full * k // 2].view(full // 64, k, 32)
        parts.append(torch.cat([blk & 15, blk >> 4], dim=2).transpose(1, 2).reshape(full, k))
    if n - full:
        t = b[full * k // 2:].view(k, (n - full) // 2)
        parts.append(torch.stack([t & 15, t >> 4], dim=2).reshape(k, n - full).T)
    return torch.cat(parts) if len(parts) > 1 else parts[0].contiguous()


def _time(fn, x, repeats: int) -> float:
    fn(x)
    best = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(x)
        best.append(time.perf_counter() - t0)
    best.sort()
    return 1e3 * best[len(best) // 2]


@torch.no_grad()
def cpu_op_timing(out: int = 8192, inp: int = 2048, m: int = 1, repeats: int = 20, rounds: int = 3,
                  group: int = 128, seed: int = 0) -> dict:
    """Median ms per call of one ``[out, inp]`` layer at ``m`` rows: dense fp32 ``F.linear``, the
    reference (dequantize, then matmul), and the int8 / int4 packed ops; sides interleaved over
    ``rounds`` so drift hits all of them.  Random weights: latency only."""
    from workbench.quant.apply import QuantLinear  # lazy: apply imports this module (a cycle)

    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, inp, generator=g) * 0.02
    x = torch.randn(m, inp, generator=g)
    layers = {"int8": QuantLinear(quantize_weight(w, bits=8), None, {}, 0.0),
              "int4": QuantLinear(quantize_weight(w, bits=4, group=group), None, {}, 0.0),
              "w8a8": QuantLinear(quantize_weight(w, bits=8), None, {"act_bits": 8}, 0.0)}
    q8, s8 = layers["int8"].qweight, layers["int8"].scales[:, 0].contiguous()
    sides = {"dense fp32": lambda t: torch.nn.functional.linear(t, w),
             "reference w4 (dequantize + matmul)": layers["int4"].reference_forward,
             "int8pack (w8, per channel)": lambda t: torch.ops.aten._weight_int8pack_mm(t, q8, s8),
             "int8 reduce (w8, per channel, compiled)": cpu_op(layers["int8"], row_fallback=False),
             f"int4pack (w4, g{group})": cpu_op(layers["int4"], row_fallback=False),
             "int_mm (w8a8, per channel x per token)": cpu_op(layers["w8a8"])}
    times: dict[str, list[float]] = {k: [] for k in sides}
    for r in range(rounds):
        for name in (list(sides) if r % 2 == 0 else list(reversed(sides))):
            times[name].append(_time(sides[name], x, repeats))
    ref = sides["dense fp32"](x)
    errors = {k: float((f(x) - ref).abs().max() / ref.abs().max()) for k, f in sides.items()}
    weight_bytes = {"dense fp32": w.numel() * 4, "reference w4 (dequantize + matmul)": layers["int4"].quantized.nbytes,
                    "int8pack (w8, per channel)": layers["int8"].quantized.nbytes,
                    "int8 reduce (w8, per channel, compiled)": layers["int8"].quantized.nbytes,
                    f"int4pack (w4, g{group})": layers["int4"].quantized.nbytes,
                    "int_mm (w8a8, per channel x per token)": layers["w8a8"].quantized.nbytes}
    rows = [{"side": k, "ms_median": sorted(v)[len(v) // 2], "ms_min": min(v), "ms_max": max(v),
             "weight_bytes": weight_bytes[k], "rel_error_vs_dense": errors[k]} for k, v in times.items()]
    return {"shape": [out, inp], "m": m, "threads": torch.get_num_threads(), "rows": rows}
