"""Exact context parallelism for KDA over a zig-zag shard (see ``megaseq.contracts.ContextParallel``).

The sequence is cut into 2W segments; rank r holds segments r and 2W-1-r. Two things cross segments:

1. The causal short convolution needs the last ``conv_size - 1`` inputs before each segment. Every rank
   all-gathers the tails of its two segments; a segment's history is the tail of everything before it (which
   spans several segments when segments are shorter than the kernel).
2. The recurrent state. Each state column evolves independently and affinely in the incoming state, so a
   segment's end state is ``M S_in + S_loc``. A transition-only pass (``ops.kda_affine_map``: no q, no
   outputs, PyTorch whatever the backend) gives ``(M, S_loc)`` of each local segment; every rank
   all-gathers ``[S_loc | M]`` of its two segments, folds all 2W of them in global order to get each
   segment's incoming state (2W small K x K products), then runs the backend once on its segments from
   those states for the outputs. CP costs one backend pass plus the transition pass and the fold.

Packed documents: inside a segment the backend restarts at every document boundary (offsets restricted to
the segment). Only the segment's first piece may continue a document from earlier segments; it starts from
``S_in`` only then. The map that leaves a segment is its last piece's: ``M`` from that piece's start, which
is zero unless the last piece is the first and continues, so the fold resets at a document start.

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
from megaseq_kda.ops import kda_affine_map


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
    n, v_dim = cp.segment_len, v.shape[-1]
    pieces = [tuple(x[:, i * n : (i + 1) * n] for x in (q, k, v, g, beta)) for i in range(2)]
    documents = None if cu_seqlens is None else as_documents(cu_seqlens, length=cp.seq_len)
    windows = [(None, True) if documents is None else documents.window(*span) for span in cp.segments()]

    ends = []  # [B, H, K, V + K] = [S_loc | M] per local segment
    for (_, k_i, v_i, g_i, beta_i), (offsets, continues) in zip(pieces, windows, strict=True):
        last = 0 if offsets is None else offsets.offsets[-2]  # the last document piece's start
        M, S_loc = kda_affine_map(k_i[:, last:], v_i[:, last:], g_i[:, last:], beta_i[:, last:])
        if last > 0 or not continues:
            M = torch.zeros_like(M)  # the last piece starts a document: nothing from before reaches its end
        ends.append(torch.cat([S_loc, M], -1))

    all_ends = gather_segments(torch.stack(ends), cp)
    incoming = [torch.zeros_like(all_ends[0][..., :v_dim])]
    for end in all_ends[: segment_index(cp, 1)]:
        incoming.append(end[..., v_dim:] @ incoming[-1] + end[..., :v_dim])

    def first_piece_state(initial: Tensor, offsets: Documents | None) -> Tensor:
        """A state per document piece: ``initial`` for the first, zeros for the others."""
        if offsets is None:
            return initial
        return torch.cat([initial, initial.new_zeros(offsets.n_docs - 1, *initial.shape[1:])])

    outputs = []
    for i, ((q_i, k_i, v_i, g_i, beta_i), (offsets, continues)) in enumerate(
        zip(pieces, windows, strict=True)
    ):
        state = incoming[segment_index(cp, i)]
        # Multiply rather than drop: the all-gather's backward is a collective, so every rank's graph must
        # reach it, also when both of its segments start a document and ignore the incoming state.
        initial = first_piece_state(state * float(continues), offsets)
        o, _ = op(q_i, k_i, v_i, g_i, beta_i, initial_state=initial, cu_seqlens=offsets)
        outputs.append(o)
    return torch.cat(outputs, 1)
