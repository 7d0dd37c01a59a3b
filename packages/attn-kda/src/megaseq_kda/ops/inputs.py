"""Argument checks shared by every KDA implementation, so all of them reject the same mistakes alike.

Conventions (fla's): q, k, g ``[B, T, H, K]``, v ``[B, T, H, V]``, beta ``[B, T, H]``, states ``[N, H, K, V]``
where N is B, or the number of documents when ``cu_seqlens`` (``[N + 1]`` offsets, B == 1) is given.
``cu_seqlens`` may be a tensor or core's ``megaseq.documents.Documents`` (what the layer passes: the
boundaries are then already on the host, so an op never synchronises with the device to read them).
"""

import torch

from megaseq.documents import Documents, as_documents


def documents_of(cu_seqlens: torch.Tensor | Documents | None, batch: int, length: int) -> Documents | None:
    """``cu_seqlens`` as validated core ``Documents`` for a ``[batch, length]`` input (None stays None)."""
    if cu_seqlens is None:
        return None
    return as_documents(cu_seqlens, batch=batch, length=length)


def check_kda_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    cu_seqlens: torch.Tensor | Documents | None,
) -> tuple[Documents | None, int]:
    """Validate shapes; return ``cu_seqlens`` as :func:`documents_of` (a tensor read to the host once, here)
    and N, the number of independent sequences (rows of the state)."""
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
    documents = documents_of(cu_seqlens, B, T)
    n_seqs = B if documents is None else documents.n_docs
    if initial_state is not None and initial_state.shape != (n_seqs, H, K, v.shape[-1]):
        raise ValueError(
            f"initial_state must be [N, H, K, V] = [{n_seqs}, {H}, {K}, {v.shape[-1]}], "
            f"got {tuple(initial_state.shape)}"
        )
    return documents, n_seqs
