"""The tensors of one layer in a compressed-tensors ``pack-quantized`` checkpoint, and the
conversion to and from :class:`~workbench.quant.rtn.QuantizedWeight` without touching a value.

compressed-tensors (0.20, ``compressors/pack_quantized``) stores a quantized ``nn.Linear`` named
``L`` with weight ``[out, in]`` as:

* ``L.weight_packed`` - int32 ``[out, ceil(in * bits / 32)]``: the signed values
  ``q in [-2^(b-1), 2^(b-1) - 1]`` plus ``2^(b-1)`` (int4: + 8, int8: + 128), element ``i`` of a
  row at bits ``[i * b, (i + 1) * b)`` of the row's little-endian bit stream (int4: eight per
  word, element 0 in the lowest nibble; int8: four per word, element 0 in the lowest byte);
  a row is zero-padded to whole words;
* ``L.weight_scale`` - float (the model's dtype) ``[out, in / g]`` (group), ``[out, 1]``
  (channel) or ``[1]`` (tensor);
* ``L.weight_shape`` - int64 ``[2]``: ``(out, in)``;
* ``L.weight_zero_point`` (asymmetric only) - group / channel: int32 packed like the weight but
  along dim 0, ``[ceil(out * bits / 32), in / g]``; tensor: int8 ``[1]``, not packed.  Signed
  like the values: ``w = (q - z) * s``.

Both bit widths are byte-aligned, so a word is four bytes of the stream and our own storage is
already that stream: int4 values packed two per byte (low nibble = even column) and offset to
``[0, 15]`` - symmetric ``q + 8``, asymmetric ``q - (-8)`` = our unsigned value - are the bytes
of ``weight_packed`` as they are; our int8 values (and int8 zero points) are the bytes minus 128.
Our symmetric int4 range [-7, 7] lies inside the library's [-8, 7]; a checkpoint it wrote may
hold -8 (its symmetric scale is ``max|w| / 7.5``), which our storage (nibble 0) and every
backend handle.
"""

from __future__ import annotations

import math
import sys

import torch

from workbench.quant.rtn import QuantizedWeight, pack_int4

STRATEGIES = ("tensor", "channel", "group")


def strategy_of(q: QuantizedWeight) -> tuple[str, int | None]:
    """``(strategy, group_size)`` of one of our quantized weights."""
    if q.group:
        return "group", q.group
    return ("channel" if q.scales.shape[0] == q.shape[0] and q.shape[0] > 1 else "tensor"), None


def _words(stream: torch.Tensor) -> torch.Tensor:
    """uint8 ``[rows, n]`` (a little-endian bit stream per row) -> int32 ``[rows, ceil(n / 4)]``."""
    rows, n = stream.shape
    pad = -n % 4
    if pad:
        stream = torch.cat([stream, stream.new_zeros(rows, pad)], dim=1)
    # reshape(-1) first: torch calls a [n, 1] tensor with strides (1, n) contiguous, and a
    # dtype view needs the last stride to be 1
    b = stream.contiguous().reshape(-1).view(rows, -1, 4)
    if sys.byteorder == "big":       # a word's bytes sit in the other order in memory
        b = b.flip(-1).contiguous()
    return b.reshape(-1).view(torch.int32).view(rows, -1)


def _stream(words: torch.Tensor, nbytes: int) -> torch.Tensor:
    """int32 ``[rows, w]`` -> its first ``nbytes`` stream bytes per row, uint8 ``[rows, nbytes]``."""
    rows = words.shape[0]
    b = words.contiguous().reshape(-1).view(torch.uint8).view(rows, -1, 4)
    if sys.byteorder == "big":
        b = b.flip(-1)
    return b.reshape(rows, -1)[:, :nbytes].contiguous()


def _unsigned_stream(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned values (0 .. 2^bits - 1) ``[rows, n]`` -> uint8 stream ``[rows, ceil(n * bits / 8)]``."""
    v = values.to(torch.uint8)
    if bits == 8:
        return v
    if v.shape[1] % 2:
        v = torch.cat([v, v.new_zeros(v.shape[0], 1)], dim=1)
    return pack_int4(v)


def packed_cols(n: int, bits: int) -> int:
    """int32 words of ``n`` packed ``bits``-bit values."""
    return math.ceil(n * bits / 32)


def expected_tensors(out: int, inp: int, bits: int, strategy: str, group: int | None,
                     symmetric: bool) -> dict[str, tuple[tuple[tuple[int, ...], ...], tuple[str, ...]]]:
    """``{suffix: (accepted shapes, accepted safetensors dtypes)}`` of one layer's tensors."""
    ng = inp // group if strategy == "group" else 1
    scale_shapes = {"group": ((out, ng),), "channel": ((out, 1),), "tensor": ((1,), (1, 1))}[strategy]
    out_shapes: dict = {"weight_packed": (((out, packed_cols(inp, bits)),), ("I32",)),
                        "weight_scale": (scale_shapes, ("F32", "F16", "BF16")),
                        "weight_shape": (((2,),), ("I64", "I32"))}
    if not symmetric:
        out_shapes["weight_zero_point"] = ((((packed_cols(out, bits), ng),), ("I32",)) if strategy != "tensor"
                                           else (((1,), (1, 1)), ("I8",)))
    return out_shapes


def to_compressed(q: QuantizedWeight) -> dict[str, torch.Tensor]:
    """Our quantized weight -> ``{suffix: tensor}`` as compressed-tensors stores it (bit-exact)."""
    out, inp = q.shape
    strategy, _ = strategy_of(q)
    if q.bits == 4:
        weight = _words(q.qweight)                                    # already the stream
    else:
        weight = _words((q.qweight.to(torch.int16) + 128).to(torch.uint8))
    scale = q.scales.reshape(1) if strategy == "tensor" else q.scales
    t = {"weight_packed": weight, "weight_scale": scale.float().contiguous(),
         "weight_shape": torch.tensor([out, inp], dtype=torch.int64)}
    if q.zeros is not None:
        unsigned = q.zeros.to(torch.int16) + (128 if q.bits == 8 else 0)      # ours: int4 [0, 15], int8 minus 128
        if strategy == "tensor":
            t["weight_zero_point"] = (unsigned - (1 << (q.bits - 1))).to(torch.int8).reshape(1)
        else:                                                          # packed along dim 0
            t["weight_zero_point"] = _words(_unsigned_stream(unsigned.T, q.bits)).T.contiguous()
    return t


def from_compressed(t: dict[str, torch.Tensor], out: int, inp: int, bits: int, strategy: str,
                    group: int | None, dtype: torch.dtype) -> QuantizedWeight:
    """``{suffix: tensor}`` of one layer (shapes and dtypes already checked) -> our quantized
    weight holding the same integers; scales as float32 ``[out, n_groups]`` (``[1, 1]`` per tensor)."""
    stream = _stream(t["weight_packed"], inp * bits // 8)
    if bits == 4:
        qweight = stream                                               # nibbles: ours as they are
    else:
        qweight = (stream.to(torch.int16) - 128).to(torch.int8)
    ng = inp // group if strategy == "group" else 1
    rows = 1 if strategy == "tensor" else out
    scales = t["weight_scale"].float().reshape(rows, ng).contiguous()
    zeros = None
    zp = t.get("weight_zero_point")
    if zp is not None:
        if strategy == "tensor":
            unsigned = zp.to(torch.int16).reshape(1, 1) + (1 << (bits - 1))
        else:
            zs = _stream(zp.T, math.ceil(out * bits / 8))              # [ng, bytes]: packed along dim 0
            unsigned = (zs if bits == 8 else _nibbles(zs))[:, :out].T.to(torch.int16)
        zeros = (unsigned - (128 if bits == 8 else 0)).to(torch.int8).contiguous()
    return QuantizedWeight(qweight.contiguous(), scales, zeros, bits, group if strategy == "group" else None,
                           (out, inp), dtype)


def _nibbles(stream: torch.Tensor) -> torch.Tensor:
    """uint8 ``[rows, n]`` -> its 2n nibbles, low first."""
    return torch.stack([stream & 0x0F, stream >> 4], dim=-1).reshape(stream.shape[0], -1)
