"""Rotary position embedding (RoPE), shared by core's ``sdpa`` and any plugin that wants the same rotation.

Positions are whatever the caller says they are: restart them at every document
(``ctx.documents.positions_in_doc(device)``) so that a packed row equals its documents run separately.
"""

from __future__ import annotations

import torch
from torch import Tensor

from megaseq.dtypes import compute_dtype


def rotary(x: Tensor, positions: Tensor, theta: float) -> Tensor:
    """Rotate pairs of channels of ``x [B, T, H, D]`` by angles ``position * theta^(-2i/D)`` (in
    ``compute_dtype``: fp32, or float64 for float64 inputs)."""
    d, dtype = x.shape[-1], compute_dtype(x.dtype)
    inv_freq = theta ** (-torch.arange(0, d, 2, device=x.device, dtype=dtype) / d)
    angles = positions.to(dtype)[..., None] * inv_freq  # [T, D/2] or [B, T, D/2]
    if angles.dim() == 2:
        angles = angles[None]
    cos, sin = angles.cos()[:, :, None, :], angles.sin()[:, :, None, :]
    x1, x2 = x.to(dtype)[..., 0::2], x.to(dtype)[..., 1::2]
    out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
    return out.to(x.dtype)


__all__ = ["rotary"]
