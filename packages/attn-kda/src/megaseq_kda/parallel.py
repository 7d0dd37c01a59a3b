"""Exact context parallelism for KDA over a zig-zag shard (see ``megaseq.contracts.ContextParallel``).

The sequence is cut into 2W segments; rank r holds segments r and 2W-1-r. Two things cross segments:

1. The causal short convolution needs the last ``conv_size - 1`` inputs before each segment. Every rank
   all-gathers the tails of its two segments; a segment's history is the tail of everything before it (which
   spans several segments when segments are shorter than the kernel).
2. The recurrent state. Each state column evolves independently and linearly in the incoming state: after
   token t of a segment the state is ``P_t S_in + S0_t`` (``S0_t``: the state from zero, ``P_t``: the K x K
   product of the transitions up to t), and the output is ``o_t = o0_t + (q_t^T P_t) S_in`` (up to the
   backend's scale). So every rank runs the backend ONCE per local segment, on values ``[v | 0]`` from the
   initial state ``[0 | I]``: the first V output columns are ``o0``, the last K are ``q_t^T P_t``, and the
   final state is ``[S_loc | M]`` (``S_loc`` = ``S0`` and ``M`` = ``P`` at the segment's end). The ranks
   all-gather ``[S_loc | M]``, fold all 2W of them in global order to get each segment's incoming state
   (2W small K x K products), and add ``(q_t^T P_t) S_in`` to the outputs (one [K x V] product per token).
   CP costs one backend pass with K more value columns, the fold and the correction.

Packed documents: inside a segment the backend restarts at every document boundary (offsets restricted to
the segment). Only the segment's first piece may continue a document from earlier segments; only it starts
from ``[0 | I]``, and only then; the other pieces start from zeros, so their last K output columns are zero
(the correction leaves them alone) and, when the last piece is not the first, the map that leaves the
segment is zero: the fold resets at a document start.

The all-gather is core's ``megaseq.parallel.all_gather``: autograd-aware (its backward is a reduce-scatter,
all-to-all on gloo), so gradients reach every segment's owner on CPU too. The document pieces of each segment
come from core's ``Documents.window`` (host offsets, memoized for the other layers of the forward).
"""

from __future__ import annotations

import torch
from torch import Tensor

from megaseq.contracts import ContextParallel
from megaseq.documents import Documents, as_documents
from megaseq.parallel import all_gather
from megaseq_kda.backends import KDAOp


def gather_segments(local: Tensor, cp: ContextParallel) -> list[Tensor]:
    """All ranks' ``local [2, ...]`` (this rank's two segments stacked) as a list of 2W, in global order."""
    gathered = all_gather(local, cp.group)
    world = cp.world_size
    return [gathered[s][0] if s < world else gathered[2 * world - 1 - s][1] for s in range(2 * world)]


def segment_index(cp: ContextParallel, local: int) -> int:
    """Global index of this rank's local segment 0 or 1."""
    return cp.rank if local == 0 else 2 * cp.world_size - 1 - cp.rank


def conv_histories(segments: list[Tensor], cp: ContextParallel, size: int) -> list[Tensor]:
    """For each local segment ``[B, n, C]``, the ``size`` inputs before it in the global sequence
    (zeros before the start): ``[B, size, C]``."""
    tails = gather_segments(torch.stack([s[:, -size:] for s in segments]), cp)
    zeros = segments[0].new_zeros(segments[0].shape[0], size, segments[0].shape[2])
    return [torch.cat([zeros, *tails[: segment_index(cp, i)]], 1)[:, -size:] for i in range(len(segments))]


def context_parallel_kda(
    op: KDAOp,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    cp: ContextParallel,
    cu_seqlens: Tensor | Documents | None,
) -> Tensor:
    """KDA over this rank's zig-zag share ``[B, 2n, H, D]`` -> o ``[B, 2n, H, V]`` (``cu_seqlens``: the global
    layout, preferably ``ctx.documents``)."""
    n, v_dim, k_dim = cp.segment_len, v.shape[-1], k.shape[-1]
    batch, heads = q.shape[0], q.shape[2]
    documents = None if cu_seqlens is None else as_documents(cu_seqlens, length=cp.seq_len)
    windows = [(None, True) if documents is None else documents.window(*span) for span in cp.segments()]
    identity = torch.eye(k_dim, dtype=torch.float32, device=q.device).expand(batch, heads, k_dim, k_dim)
    seed = torch.cat([identity.new_zeros(batch, heads, k_dim, v_dim), identity], -1)  # [0 | I]

    outputs, ends, corrections = [], [], []  # ends: [B, H, K, V + K] = [S_loc | M] per local segment
    for i, (offsets, continues) in enumerate(windows):
        q_i, k_i, v_i, g_i, beta_i = (x[:, i * n : (i + 1) * n] for x in (q, k, v, g, beta))
        initial = seed if continues else torch.zeros_like(seed)
        if offsets is not None:  # one state per document piece: only the first may continue
            initial = torch.cat([initial, initial.new_zeros(offsets.n_docs - 1, *initial.shape[1:])])
        o, final = op(q_i, k_i, torch.cat([v_i, v_i.new_zeros(*v_i.shape[:-1], k_dim)], -1), g_i, beta_i,
                      initial_state=initial, output_final_state=True, cu_seqlens=offsets)
        outputs.append(o[..., :v_dim])
        corrections.append(o[..., v_dim:])
        ends.append(final if offsets is None else final[-1:])  # the last piece's state leaves the segment

    all_ends = gather_segments(torch.stack(ends), cp)
    incoming = [torch.zeros_like(all_ends[0][..., :v_dim])]
    for end in all_ends[: segment_index(cp, 1)]:
        incoming.append(end[..., v_dim:] @ incoming[-1] + end[..., :v_dim])
    # Every segment adds its correction, also one that starts a document (it is zero there): the all-gather's
    # backward is a collective, so every rank's graph must reach it.
    return torch.cat([
        o + torch.einsum("bthk,bhkv->bthv", c, incoming[segment_index(cp, i)].to(c.dtype))
        for i, (o, c) in enumerate(zip(outputs, corrections, strict=True))
    ], 1)
