"""Solutions to notebook 05's exercises (workbench exercises list 05)."""

import torch


def group_scales(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric int4 (codes 0..15) per row and group of `group` columns of w [out, in]:
    (scales float32 [out, in // group], zeros int8 [out, in // group])."""
    out, n = w.shape
    groups = w.float().reshape(out, n // group, group)
    lo = groups.amin(dim=-1).clamp(max=0)          # the range always holds 0: 0.0 is exactly a code
    hi = groups.amax(dim=-1).clamp(min=0)
    scales = ((hi - lo) / 15).clamp(min=1e-12)     # 16 codes, 15 steps; a group of zeros must not divide by 0
    zeros = torch.round(-lo / scales).clamp(0, 15)
    return scales, zeros.to(torch.int8)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """codes [out, in] in 0..15 (in even) -> uint8 [out, in // 2]: byte b = codes[2b] | codes[2b + 1] << 4."""
    c = codes.to(torch.uint8)
    low, high = c[:, 0::2], c[:, 1::2]
    return low | (high << 4)


def dequantize(packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int) -> torch.Tensor:
    """uint8 [out, in // 2] + float32 scales / int8 zeros [out, in // group] -> float32 [out, in]."""
    out = packed.shape[0]
    low, high = packed & 0x0F, packed >> 4
    codes = torch.stack([low, high], dim=-1).reshape(out, -1).float()     # column 2b, then 2b + 1
    s = scales.float().repeat_interleave(group, dim=1)
    z = zeros.float().repeat_interleave(group, dim=1)
    return (codes - z) * s
