"""Argument checks shared by every KDA implementation, so all of them reject the same mistakes alike.

Conventions (fla's): q, k, g ``[B, T, H, K]``, v ``[B, T, H, V]``, beta ``[B, T, H]``, states ``[N, H, K, V]``
where N is B, or the number of documents when ``cu_seqlens`` (``[N + 1]`` offsets, B == 1) is given.
"""

import itertools

import torch


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """Gates, beta and states are kept in fp32; float64 inputs stay float64 (for tight tests)."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def check_kda_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
) -> int:
    """Validate shapes; return N, the number of independent sequences (rows of the state)."""
    if q.dim() != 4:
        raise ValueError(f"q must be [B, T, H, K], got shape {tuple(q.shape)}")
    B, T, H, K = q.shape
    if k.shape != q.shape or g.shape != q.shape:
        raise ValueError(
            f"k and g must have q's shape {tuple(q.shape)}, got {tuple(k.shape)} and {tuple(g.shape)}"
        )
    if v.dim() != 4 or v.shape[:3] != (B, T, H):
        raise ValueError(f"v must be [B, T, H, V] = [{B}, {T}, {H}, V], got {tuple(v.shape)}")
    if beta.shape != (B, T, H):
        raise ValueError(f"beta must be [B, T, H] = [{B}, {T}, {H}], got {tuple(beta.shape)}")
    n_seqs = B
    if cu_seqlens is not None:
        n_seqs = check_cu_seqlens(cu_seqlens, B, T)
    if initial_state is not None and initial_state.shape != (n_seqs, H, K, v.shape[-1]):
        raise ValueError(
            f"initial_state must be [N, H, K, V] = [{n_seqs}, {H}, {K}, {v.shape[-1]}], "
            f"got {tuple(initial_state.shape)}"
        )
    return n_seqs


def check_cu_seqlens(cu_seqlens: torch.Tensor, batch: int, length: int) -> int:
    """Validate document offsets; return the number of documents."""
    if batch != 1:
        raise ValueError(f"cu_seqlens needs batch size 1 (documents are packed along T), got B={batch}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"cu_seqlens must be a 1-D int32/int64 tensor [N + 1], got {cu_seqlens.dtype} "
            f"of shape {tuple(cu_seqlens.shape)}"
        )
    offsets = cu_seqlens.tolist()
    if offsets[0] != 0 or offsets[-1] != length or any(b < a for a, b in itertools.pairwise(offsets)):
        raise ValueError(f"cu_seqlens must be non-decreasing from 0 to T={length}, got {offsets}")
    return len(offsets) - 1
