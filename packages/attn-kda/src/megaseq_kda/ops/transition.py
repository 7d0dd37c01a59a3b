"""The affine map of a KDA segment, final(S0) = M S0 + S, computed without outputs (context parallelism).

Per 64-token chunk, in the WY form of ``chunk.py`` (Kg = exp(G_last - G) * K, decay = exp(G_last)):

    S_next = T_c S + B_c,    T_c = Diag(decay) - Kg^T W,    B_c = Kg^T U,
    (I + A_kk) [U | W] = Diag(beta) [V | exp(G) * K]

so a chunk needs only the k-k Gram matrix A_kk: no q, no q.k scores, no outputs. The segment's map is the
composition of its chunks' maps, (T2, B2) o (T1, B1) = (T2 T1, T2 B1 + B2), later chunks on the left,
reduced as a balanced tree: log2(n_chunks) levels of batched matmuls instead of n_chunks dependent steps.
Work: the intra-chunk part of one forward pass without A_qk, plus n_chunks K x K x (K + V) products.

Numerics are chunk.py's (float64 cumulative gates, sub-chunk rebasing, only exponents <= 0); M and S are
fp32 (float64 for float64 inputs). Memory: ordinary autograd, O(K (K + V) / 64) per token and head.
"""

from __future__ import annotations

import torch

from megaseq.documents import Documents
from megaseq.dtypes import compute_dtype
from megaseq_kda.ops.chunk import _ChunkLayout, _exp, _gated_grams
from megaseq_kda.ops.inputs import documents_of


def kda_affine_map(
    k: torch.Tensor, v: torch.Tensor | None, g: torch.Tensor, beta: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(M [B, H, K, K], S [B, H, K, V]) with final(S0) = M S0 + S for each row of k, g [B, T, H, K],
    v [B, T, H, V], beta [B, T, H] (one sequence per row, no documents). ``v=None``: M only (S is None)."""
    if k.dim() != 4 or g.shape != k.shape or beta.shape != k.shape[:3]:
        raise ValueError(
            f"k and g must be [B, T, H, K] and beta [B, T, H], got {tuple(k.shape)}, {tuple(g.shape)} and "
            f"{tuple(beta.shape)}"
        )
    if v is not None and (v.dim() != 4 or v.shape[:3] != k.shape[:3]):
        raise ValueError(f"v must be [B, T, H, V] with B, T, H of k {tuple(k.shape[:3])}, got {tuple(v.shape)}")
    batch, length, _, k_dim = k.shape
    dtype = compute_dtype(k.dtype)
    layout = _ChunkLayout.build(batch, length, None, k.device)
    k, g, beta = (layout.to_chunks(x.to(dtype)) for x in (k, g, beta[..., None]))  # [B, H, n, C, *]
    beta = beta.squeeze(-1)
    G = g.to(torch.float64).cumsum(-2)  # restarts at every chunk; see chunk.py for why float64
    _, A_kk = _gated_grams(None, k, g, G)
    rhs = _exp(G, dtype) * k
    if v is not None:
        rhs = torch.cat([layout.to_chunks(v.to(dtype)), rhs], -1)
    UW = torch.linalg.solve_triangular(beta[..., None] * A_kk, beta[..., None] * rhs, upper=False, unitriangular=True)
    U, W = UW.split([UW.shape[-1] - k_dim, k_dim], -1)
    G_last = G[..., -1:, :]
    Kg_t = (_exp(G_last - G, dtype) * k).transpose(-1, -2)  # [B, H, n, K, C]
    T = torch.diag_embed(_exp(G_last.squeeze(-2), dtype)) - Kg_t @ W
    B = Kg_t @ U if v is not None else None
    while T.shape[2] > 1:
        if T.shape[2] % 2:  # an identity map pads the odd chunk out
            T = torch.cat([T, torch.eye(k_dim, dtype=dtype, device=T.device).expand_as(T[:, :, :1])], 2)
            B = None if B is None else torch.cat([B, torch.zeros_like(B[:, :, :1])], 2)
        earlier, later = T[:, :, 0::2], T[:, :, 1::2]
        B = None if B is None else later @ B[:, :, 0::2] + B[:, :, 1::2]
        T = later @ earlier
    return T[:, :, 0], None if B is None else B[:, :, 0]


def kda_transition(
    k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, cu_seqlens: torch.Tensor | Documents | None = None
) -> torch.Tensor:
    """The linear part M of the state update, final(S0) = M @ S0 + final(0): ``[N, H, K, K]``, one per row or
    document (``cu_seqlens``, B == 1). M = prod_t (I - beta_t k_t k_t^T) Diag(exp(g_t)), later tokens left."""
    documents = documents_of(cu_seqlens, k.shape[0], k.shape[1])
    if documents is None:
        return kda_affine_map(k, None, g, beta)[0]
    return torch.cat([kda_affine_map(k[:, a:b], None, g[:, a:b], beta[:, a:b])[0] for a, b in documents.bounds])
