"""Round-to-nearest weight quantization: scales, zero points, int8 and packed int4, and back.

::

    q = quantize_weight(w, bits=4, group=128, symmetric=True)     # w [out, in] -> QuantizedWeight
    q.dequantize()                                                  # [out, in] in w's dtype
    q.nbytes                                                        # packed values + scales + zeros

Granularity, for a weight ``[out, in]`` (``y = x W^T``: a row is one output channel):

* ``group=None, per_channel=False`` - one scale for the whole tensor (*per-tensor*);
* ``group=None, per_channel=True``  - one scale per output channel (row);
* ``group=g``                       - one scale per row and per ``g`` consecutive input columns
  (``in % g == 0`` is required here; :mod:`workbench.quant.recipe` states what happens otherwise).

Symmetric: ``q = round(w / s)`` clamped to ``[-(2^(b-1) - 1), 2^(b-1) - 1]`` with
``s = max|w| / (2^(b-1) - 1)``, no zero point (int8: [-127, 127]; int4: [-7, 7]).
Asymmetric: ``q = round(w / s) + z`` clamped to ``[0, 2^b - 1]`` with ``s = (max - min) / (2^b - 1)``
and an integer zero point ``z = round(-min / s)``; dequantised as ``(q - z) * s``.

Storage: int8 values as ``torch.int8``; int4 values *packed two per byte* along the input
dimension (``uint8``: low nibble = even column, high nibble = odd column), stored offset to
``[0, 15]`` (symmetric values + 8).  Scales are kept in float32 (and counted as such); zero
points as int8 (int4 asymmetric: in ``[0, 15]``; int8 asymmetric: stored minus 128).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workbench.errors import ConfigError

BITS = (4, 8)


def qrange(bits: int, symmetric: bool) -> tuple[int, int]:
    """The integer range of the quantized values."""
    if symmetric:
        m = (1 << (bits - 1)) - 1
        return -m, m
    return 0, (1 << bits) - 1


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int values in [0, 15], shape [..., n] with n even -> uint8 [..., n // 2] (low nibble first)."""
    if q.shape[-1] % 2:
        raise ConfigError(f"pack_int4: the last dimension must be even, got {q.shape[-1]}")
    u = q.to(torch.uint8)
    return u[..., 0::2] | (u[..., 1::2] << 4)


def unpack_int4(p: torch.Tensor) -> torch.Tensor:
    """uint8 [..., n // 2] -> uint8 values in [0, 15], shape [..., n] (inverse of :func:`pack_int4`)."""
    lo, hi = p & 0x0F, p >> 4
    return torch.stack([lo, hi], dim=-1).reshape(*p.shape[:-1], p.shape[-1] * 2)


@dataclass
class QuantizedWeight:
    """A weight ``[out, in]`` as integers plus scales (and zero points when asymmetric).

    ``qweight``: int8 ``[out, in]`` or, for 4 bits, packed uint8 ``[out, in // 2]``;
    ``scales``: float32 ``[out, n_groups]`` (``n_groups = 1`` per channel, and ``[1, 1]`` per
    tensor); ``zeros``: int8 like ``scales`` or None (symmetric)."""

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    bits: int
    group: int | None
    shape: tuple[int, int]
    dtype: torch.dtype

    @property
    def symmetric(self) -> bool:
        return self.zeros is None

    @property
    def group_size(self) -> int:
        """Input columns per scale (the whole row for per-channel and per-tensor)."""
        return self.group or self.shape[1]

    def int_values(self) -> torch.Tensor:
        """The integer values [out, in] (int16), zero point not yet subtracted."""
        if self.bits == 4:
            v = unpack_int4(self.qweight).to(torch.int16)
            return v - 8 if self.symmetric else v
        v = self.qweight.to(torch.int16)
        return v if self.symmetric else v + 128

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        out, n = self.shape
        q = self.int_values().float().view(out, -1, self.group_size)
        if self.zeros is not None:
            z = self.zeros.to(torch.int16) + (128 if self.bits == 8 else 0)
            q = q - z.float()[..., None]
        s = self.scales if self.scales.shape[0] == out else self.scales.expand(out, -1)
        return (q * s[..., None]).view(out, n).to(dtype or self.dtype)

    @property
    def nbytes(self) -> int:
        t = [self.qweight, self.scales] + ([self.zeros] if self.zeros is not None else [])
        return sum(x.numel() * x.element_size() for x in t)


def _grouped(w: torch.Tensor, group: int | None, per_channel: bool, who: str) -> torch.Tensor:
    """``w [out, in]`` as float32 ``[out, n_groups, g]`` (per tensor: ``[1, 1, out * in]``)."""
    if w.dim() != 2:
        raise ConfigError(f"{who}: expected a 2-D weight [out, in], got shape {tuple(w.shape)}")
    out, n = w.shape
    if group is not None and (group < 1 or n % group):
        raise ConfigError(f"{who}: group {group} does not divide the input width {n} "
                          f"(the recipe's group fallback decides what such a layer gets)")
    g = group or n
    wf = w.detach().float()
    return wf.view(out, n // g, g) if (group is not None or per_channel) else wf.reshape(1, 1, -1)


def compute_scales(w: torch.Tensor, bits: int = 8, group: int | None = None, per_channel: bool = True,
                   symmetric: bool = True, scale_multiplier: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Round-to-nearest scales ``[out, n_groups]`` (float32) and integer zero points (float32
    holding integers, None when symmetric) of ``w [out, in]``; ``scale_multiplier`` multiplies
    the scales (a clip search shrinks the range with values < 1)."""
    if bits not in BITS:
        raise ConfigError(f"quantize_weight: bits must be one of {BITS}, got {bits}")
    x = _grouped(w, group, per_channel, "quantize_weight")
    lo, hi = qrange(bits, symmetric)
    if symmetric:
        s = x.abs().amax(-1) / hi
    else:
        mn, mx = x.amin(-1).clamp(max=0), x.amax(-1).clamp(min=0)
        s = (mx - mn) / (hi - lo)
    if scale_multiplier is not None:
        s = s * scale_multiplier
    s = s.clamp_min(1e-12)
    return s, (None if symmetric else torch.round(-mn / s).clamp(lo, hi))


def encode_weight(w: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, bits: int,
                  group: int | None = None, per_channel: bool = True, *, pack=None) -> QuantizedWeight:
    """``w [out, in]`` rounded to the grid of ``scales`` / ``zeros`` (as :func:`compute_scales`
    gives them, or as GPTQ fixes them group by group) and stored (see the module docstring).
    ``pack``: a function packing int4 codes in place of :func:`pack_int4` (checked:
    :mod:`workbench.quant.hooks`)."""
    if bits not in BITS:
        raise ConfigError(f"encode_weight: bits must be one of {BITS}, got {bits}")
    out, n = w.shape
    x = _grouped(w, group, per_channel, "encode_weight")
    s = scales.float().reshape(x.shape[0], x.shape[1])
    lo, hi = qrange(bits, zeros is None)
    if zeros is None:
        q = torch.round(x / s[..., None]).clamp(lo, hi)
    else:
        z = zeros.float().reshape(s.shape)
        q = (torch.round(x / s[..., None]) + z[..., None]).clamp(lo, hi)
    q = q.reshape(out, n)
    if bits == 4:
        codes = (q + 8) if zeros is None else q
        if pack is None:
            stored = pack_int4(codes)
        else:                                    # a learner's packer, its bytes checked
            from workbench.quant.hooks import packer  # lazy: hooks imports this module (a cycle)
            stored = packer(pack)(codes)
    else:
        stored = (q if zeros is None else q - 128).to(torch.int8)
    zs = None if zeros is None else (zeros.float().reshape(s.shape) - (128 if bits == 8 else 0)).to(torch.int8)
    return QuantizedWeight(stored.contiguous(), s.contiguous(), zs, bits, group, (out, n), w.dtype)


def quantize_weight(w: torch.Tensor, bits: int = 8, group: int | None = None, per_channel: bool = True,
                    symmetric: bool = True, scale_multiplier: torch.Tensor | None = None, *,
                    group_scales=None, pack=None) -> QuantizedWeight:
    """Round-to-nearest quantization of ``w [out, in]`` (see the module docstring).
    ``scale_multiplier`` [out, n_groups]: scales are multiplied by it before rounding (a clip
    search shrinks the range with values < 1).  ``group_scales`` / ``pack``: your functions in
    place of :func:`compute_scales` (asymmetric int4) / :func:`pack_int4`, their results checked
    (:mod:`workbench.quant.hooks`)."""
    if group_scales is None and pack is None:
        s, z = compute_scales(w, bits, group, per_channel, symmetric, scale_multiplier)
        return encode_weight(w, s, z, bits, group, per_channel)
    from workbench.quant import hooks

    hooks.check_weight_settings(bits, group, per_channel, symmetric, scale_multiplier, group_scales, pack)
    _grouped(w, group, per_channel, "quantize_weight")          # the shape and group checks, before any hook runs
    if group_scales is not None:
        s, z = hooks.scales_from(group_scales, w, group)
    else:
        s, z = compute_scales(w, bits, group, per_channel, symmetric, scale_multiplier)
    return encode_weight(w, s, z, bits, group, per_channel, pack=pack)
