"""The dtype rules every component follows (core's built-ins and the shipped plugins alike).

1. A component returns its input's dtype: ``forward(x).dtype == x.dtype`` (bf16 in, bf16 out).
2. Numerically sensitive arithmetic (norms, gates and decays, softmax statistics, recurrent states,
   accumulations over many terms) runs in :func:`compute_dtype` of the input: at least float32, and float64
   when the input is float64. Never ``.float()``: that silently drops float64 to float32, which defeats the
   float64 gradient checks of the conformance suites (and any float64 reference computation).
3. Parameters keep the dtype the model was cast to; mixed precision comes from autocast, not from components.
"""

from __future__ import annotations

import torch


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype for sensitive arithmetic on inputs of ``dtype``: float32 for 16-bit and float32 inputs,
    float64 for float64 inputs."""
    return torch.promote_types(dtype, torch.float32)


__all__ = ["compute_dtype"]
