"""Your own pieces of the int4 quantizer, run by the real one (notebook 05's exercises).

::

    quantize_model(model, "w4a16:g128:asym", group_scales=my_group_scales, pack=my_pack_int4)

* ``group_scales(w, group) -> (scales, zeros)`` replaces :func:`~workbench.quant.rtn.compute_scales`
  for every layer: ``w`` is the layer's weight ``[out, in]`` (float32), ``group`` its group size
  (``in`` for a layer that falls back to one scale per output channel); ``scales`` float32
  ``[out, in // group]``, every one finite and > 0, and ``zeros`` int8 of the same shape, whole
  numbers in ``[0, 15]``.  Asymmetric 4-bit recipes only (``w4a16:g128:asym``): symmetric int4 has
  no zero point.
* ``pack(codes) -> packed`` replaces :func:`~workbench.quant.rtn.pack_int4`: ``codes`` uint8
  ``[out, in]`` in ``[0, 15]`` -> uint8 ``[out, in // 2]``, low nibble = even column.  Any 4-bit
  recipe.  The bytes are checked by unpacking them the way the layer reads its buffer.

Both need round-to-nearest (``method="rtn"``: AWQ and GPTQ choose their own scales / integers).
A return value that breaks a rule is a :class:`~workbench.errors.WorkbenchError` naming the rule
and the layer, and :func:`~workbench.quant.apply.quantize_model` replaces the layers only once
every one was quantized: a failure leaves the model as it was.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from workbench.errors import ConfigError, WorkbenchError
from workbench.quant.rtn import unpack_int4

GroupScalesFn = Callable[[torch.Tensor, int], tuple]
PackFn = Callable[[torch.Tensor], torch.Tensor]


def check_settings(layers: list[tuple[str, dict]], group_scales: GroupScalesFn | None, pack: PackFn | None) -> None:
    """Refuse hooks that a layer's settings (``recipe.layer_settings``) cannot use, before any
    layer is quantized (a ConfigError naming the layer)."""
    for fn, what in ((group_scales, "group_scales"), (pack, "pack")):
        if fn is not None and not callable(fn):
            raise ConfigError(f"{what} must be a function, got {type(fn).__name__}")
    if group_scales is None and pack is None:
        return
    for name, st in layers:
        why = _problem(st, group_scales is not None)
        if why:
            raise ConfigError(f"layer {name}: {why}")


def _problem(st: dict, scales: bool) -> str | None:
    if st.get("method", "rtn") != "rtn":
        return (f"group_scales / pack plug into round-to-nearest; method {st['method']!r} picks its own scales and "
                "integers (use method rtn)")
    if st["bits"] != 4:
        return f"group_scales / pack make int4 weights, not {st['bits']}-bit ones (use a 4-bit recipe: w4a16:g128:asym)"
    if scales and st["symmetric"]:
        return ("group_scales gives scales and zero points (asymmetric int4), and this layer is symmetric: add ':asym' "
                "to the recipe (w4a16:g128:asym)")
    if scales and st["group"] is None and not st["per_channel"]:
        return "group_scales gives one scale per row and group, and this layer is per-tensor: use groups or per-channel"
    return None


def check_weight_settings(bits: int, group: int | None, per_channel: bool, symmetric: bool,
                          scale_multiplier, group_scales: GroupScalesFn | None, pack: PackFn | None) -> None:
    """The same rules for :func:`~workbench.quant.rtn.quantize_weight` called with hooks."""
    check_settings([], group_scales, pack)
    if group_scales is None and pack is None:
        return
    why = _problem({"bits": bits, "group": group, "per_channel": per_channel, "symmetric": symmetric},
                   group_scales is not None)
    if why is None and group_scales is not None and scale_multiplier is not None:
        why = "group_scales takes no scale_multiplier (a clip search's): use one or the other"
    if why:
        raise ConfigError(f"quantize_weight: {why}")


def _raised(what: str, e: Exception) -> WorkbenchError:
    return WorkbenchError(f"your {what} raised {type(e).__name__}: {e}")


def scales_from(fn: GroupScalesFn, w: torch.Tensor, group: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``fn(w, group)`` checked: (scales float32, zeros as float32 whole numbers), the pair
    :func:`~workbench.quant.rtn.encode_weight` takes."""
    out, n = w.shape
    g = group or n
    try:
        got = fn(w.detach().float().clone(), g)
    except Exception as e:  # the learner's code: one line, no traceback through the quantizer
        raise _raised("group_scales", e) from None
    if not (isinstance(got, (tuple, list)) and len(got) == 2):
        raise WorkbenchError(f"group_scales must return a pair (scales, zeros), got {type(got).__name__}")
    shape = (out, n // g)
    for t, what, dtype in ((got[0], "scales", torch.float32), (got[1], "zeros", torch.int8)):
        if not isinstance(t, torch.Tensor):
            raise WorkbenchError(f"group_scales: {what} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype != dtype or tuple(t.shape) != shape:
            raise WorkbenchError(f"group_scales: {what} must be {str(dtype).replace('torch.', '')} {list(shape)} "
                                 f"(one per row and group of {g} columns), got {str(t.dtype).replace('torch.', '')} "
                                 f"{list(t.shape)}")
    s, z = got[0].detach().to(w.device), got[1].detach().to(w.device)
    bad = ~(torch.isfinite(s) & (s > 0))
    if bool(bad.any()):
        r, k = (int(i) for i in bad.nonzero()[0])
        raise WorkbenchError(f"group_scales: the scale of group {k} of row {r} is {float(s[r, k])!r}: every scale "
                             "must be finite and > 0 (a group of zeros has max - min = 0: the package clamps its "
                             "scale to 1e-12)")
    off = (z < 0) | (z > 15)
    if bool(off.any()):
        r, k = (int(i) for i in off.nonzero()[0])
        raise WorkbenchError(f"group_scales: the zero point of group {k} of row {r} is {int(z[r, k])}: zero points are "
                             "int4 codes, in [0, 15]")
    return s.float().contiguous(), z.float()


def packer(fn: PackFn) -> PackFn:
    """``fn`` as :func:`~workbench.quant.rtn.encode_weight` calls a packer: the codes as uint8, the
    result checked by unpacking it."""
    def pack(values: torch.Tensor) -> torch.Tensor:
        codes = values.to(torch.uint8)
        rows, n = codes.shape
        try:
            got = fn(codes.clone())
        except Exception as e:
            raise _raised("pack", e) from None
        if not isinstance(got, torch.Tensor):
            raise WorkbenchError(f"pack must return a torch.Tensor, got {type(got).__name__}")
        if got.dtype != torch.uint8 or tuple(got.shape) != (rows, n // 2):
            raise WorkbenchError(f"pack: the packed weight must be uint8 {[rows, n // 2]} (two codes per byte along "
                                 f"the input dimension), got {str(got.dtype).replace('torch.', '')} {list(got.shape)}")
        got = got.detach().to(codes.device)
        bad = (unpack_int4(got) != codes).reshape(rows, n // 2, 2).any(-1)
        if bool(bad.any()):
            r, b = (int(i) for i in bad.nonzero()[0])
            lo, hi, gb = int(codes[r, 2 * b]), int(codes[r, 2 * b + 1]), int(got[r, b])
            rule = "the layer reads byte b as codes[2b] | codes[2b + 1] << 4"
            if gb == (hi | lo << 4) & 0xFF:
                raise WorkbenchError(f"pack: code {2 * b + 1} of row {r} must be the HIGH nibble of byte {b} and code "
                                     f"{2 * b} the low one (got {gb}, expected {lo | hi << 4}): {rule}")
            raise WorkbenchError(f"pack: byte {b} of row {r} is {gb}, expected {lo} | {hi} << 4 = {lo | hi << 4} "
                                 f"(codes {2 * b} and {2 * b + 1}): {rule}")
        return got.contiguous()
    return pack
