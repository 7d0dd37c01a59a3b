"""Chunked KDA for CPU (pure PyTorch): batched matmuls within 64-token chunks, one short loop across chunks.

Within a chunk let G be the inclusive cumulative log-decay (restarting at every chunk), S the state entering
the chunk, and delta_s = beta_s (v_s - (exp(G_s) * k_s)^T S - sum_{j<s} A_kk[s, j] delta_j) the per-token
correction with A_kk[s, j] = beta_s sum_d k_s[d] k_j[d] exp(G_s[d] - G_j[d]). Solving the unit
lower-triangular system (WY/UT representation) gives delta = U - W S with

    U = (I + A_kk)^{-1} Diag(beta) V,    W = (I + A_kk)^{-1} Diag(beta) (exp(G) * K)

and then, with A_qk[s, j] = sum_d q_s[d] k_j[d] exp(G_s[d] - G_j[d]) for j <= s,

    o      = (exp(G) * Q) S + A_qk delta
    S_next = Diag(exp(G_last)) S + (exp(G_last - G) * K)^T delta.

Numerics: only exponents <= 0 are ever exponentiated. The gated Gram matrices are built in 16-token
sub-chunks (``_GatedGrams``): a block below the diagonal factorises as exp(G_s - G_r) * exp(G_r - G_j) with r
the first row of the row's sub-chunk (j < r <= s, so both factors decay), and the 16 x 16 diagonal blocks are
formed one sub-diagonal at a time from exp(G_s - G_j), j <= s; no [T, 16, K] tensor is ever stored.
Cumulative log-decays are summed in float64 (differences of large sums would lose accuracy in fp32);
everything else runs in fp32 (float64 for float64 inputs), also under bf16 autocast (which the op
switches off inside: it takes bf16 inputs and returns its output in q's dtype).

Memory: one custom autograd Function runs the whole op. Forward saves only its inputs (q, k, v, g, beta: what
the layer holds anyway) and the state entering each chunk ([.., n_chunks, K, V], K V / 64 floats per token and
head), about 4 K + K V / 64 floats per token and head instead of the ~30 K that autograd would keep through
the intra-chunk tensors. Backward walks groups of chunks from last to first: it recomputes a group's
intra-chunk tensors with autograd on, runs the reverse recurrence over the group's chunks from the saved
states (the hand-written part), and differentiates the group's intra-chunk graph at once. Forward and
backward touch at most one group of intra-chunk tensors at a time (``GROUP_HEAD_TOKENS`` tokens x heads),
so their temporaries do not grow with the sequence. The price is one more intra-chunk forward.

Documents (``cu_seqlens``) are laid out in chunk slots, each document starting at a fresh chunk and its tail
padded with k = v = g = beta = 0 (such tokens leave the state untouched), so a single pass over the chunks
handles ragged documents; the state is replaced by the document's initial state at each document start.

Context parallel (``megaseq_kda/parallel.py``) needs nothing special: outputs and final state are linear in
the initial state, so one call with K more value columns also gives the map of a segment.
"""

import itertools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from megaseq.documents import Documents
from megaseq.dtypes import compute_dtype
from megaseq_kda.ops.inputs import check_kda_inputs

CHUNK = 64
SUBCHUNK = 16  # the gated Grams' blocks (``_GatedGrams``)
# Forward and backward hold the intra-chunk tensors of about this many (token, head) pairs at a time.
GROUP_HEAD_TOKENS = 16384



@dataclass(frozen=True)
class IntraChunkKernels:
    """The two intra-chunk steps a backend may replace, each differentiable in its tensor arguments:
    ``grams(k, q, G) -> (A_kk, A_qk)``, the gated Gram matrices of every chunk (``_GatedGrams``' contract), and
    ``solve(A, B) -> (I + strict_lower(A))^{-1} B`` (the diagonal and upper part of A not read)."""

    grams: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
    solve: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | Documents | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked KDA (same maths as the oracle): ``(o [B, T, H, V], final_state [N, H, K, V] or None)``."""
    return chunk_kda_with(PYTORCH_KERNELS, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens)


def chunk_kda_with(
    kernels: IntraChunkKernels,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | Documents | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`chunk_kda` with its intra-chunk steps by ``kernels`` (the native backend's C kernels,
    ``megaseq_kda.ops.native``; `chunk_kda` itself runs ``PYTORCH_KERNELS``)."""
    documents, n_seqs = check_kda_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    B, T, H, K = q.shape
    scale = K**-0.5 if scale is None else scale
    layout = _ChunkLayout.build(B, T, documents, q.device)
    if initial_state is None:
        initial_state = q.new_zeros(n_seqs, H, K, v.shape[-1], dtype=compute_dtype(q.dtype))
    group = max(1, GROUP_HEAD_TOKENS // (layout.rows * H * CHUNK))
    with torch.autocast(q.device.type, enabled=False):  # fp32 inside, whatever autocast the caller runs
        o, final_state = _ChunkedKDA.apply(q, k, v, g, beta, initial_state, scale, layout, group, kernels)
    return o, final_state if output_final_state else None


@dataclass(frozen=True)
class _ChunkLayout:
    """Where tokens sit in the chunk grid ``[rows, H, n_chunks, CHUNK, D]`` and where sequences start/end.

    Without cu_seqlens the rows are the batch (each row padded to whole chunks); with cu_seqlens there is one
    row and each document occupies its own run of chunks. ``starts``/``ends`` map a chunk index to the rows
    of the initial/final states that enter/leave there.
    """

    rows: int
    n_chunks: int
    starts: dict[int, slice]
    ends: dict[int, slice]
    token_of_slot: torch.Tensor | None  # [n_chunks * CHUNK]; padding slots point at T (one past the last token)

    @classmethod
    def build(cls, batch: int, length: int, documents: Documents | None, device: torch.device) -> "_ChunkLayout":
        """The layout of a ``[batch, length]`` input; with documents, built once per batch (memoized on them:
        every layer of a forward shares it)."""
        if documents is None:
            n_chunks = max(1, math.ceil(length / CHUNK))
            return cls(batch, n_chunks, {0: slice(None)}, {n_chunks - 1: slice(None)}, None)
        return documents.derive(("megaseq_kda.chunk_layout", CHUNK, device), lambda: cls._packed(documents, device))

    @classmethod
    def _packed(cls, documents: Documents, device: torch.device) -> "_ChunkLayout":
        offsets, length = documents.offsets, documents.length
        lengths = [end - start for start, end in itertools.pairwise(offsets)]
        # An empty document still gets one all-padding chunk so that its final state is its initial state.
        doc_chunks = [max(1, math.ceil(n / CHUNK)) for n in lengths]
        first_chunks = [0, *itertools.accumulate(doc_chunks)][:-1]
        starts = {c: slice(d, d + 1) for d, c in enumerate(first_chunks)}
        ends = {
            c + n - 1: slice(d, d + 1) for d, (c, n) in enumerate(zip(first_chunks, doc_chunks, strict=True))
        }
        n_chunks = sum(doc_chunks)
        doc_of_token = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
        token = torch.arange(length)
        slot_of_token = (torch.tensor(first_chunks) * CHUNK - torch.tensor(offsets[:-1]))[
            doc_of_token
        ] + token
        token_of_slot = torch.full((n_chunks * CHUNK,), length, dtype=torch.long)
        token_of_slot[slot_of_token] = token
        return cls(1, n_chunks, starts, ends, token_of_slot.to(device))

    def groups(self, size: int) -> list[tuple[int, int]]:
        """Consecutive runs ``[c0, c1)`` of at most ``size`` chunks covering all of them."""
        return [(c, min(c + size, self.n_chunks)) for c in range(0, self.n_chunks, size)]

    def to_chunks(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, T, H, D]`` -> ``[rows, H, n_chunks, CHUNK, D]`` with zero padding (all of :meth:`slots`)."""
        return self.slots(x, 0, self.n_chunks, x.dtype)

    def slots(self, x: torch.Tensor, c0: int, c1: int, dtype: torch.dtype) -> torch.Tensor:
        """Chunks ``[c0, c1)`` of ``x [B, T, H, D]`` as ``[rows, H, c1 - c0, CHUNK, D]`` in ``dtype``, zero padded."""
        _, T, H, D = x.shape
        n = c1 - c0
        if self.token_of_slot is None:
            part = x[:, c0 * CHUNK : c1 * CHUNK].to(dtype)
            if part.shape[1] < n * CHUNK:
                part = F.pad(part, (0, 0, 0, 0, 0, n * CHUNK - part.shape[1]))
        else:
            tokens = self.token_of_slot[c0 * CHUNK : c1 * CHUNK]
            padding = (tokens == T)[:, None, None]
            part = x[0].index_select(0, tokens.clamp_max(max(T - 1, 0))) if T else x.new_zeros(len(tokens), H, D)
            part = part.to(dtype).masked_fill_(padding, 0.0)[None]
        return part.reshape(-1, n, CHUNK, H, D).permute(0, 3, 1, 2, 4).contiguous()

    def put(self, out: torch.Tensor, x: torch.Tensor, c0: int, c1: int) -> None:
        """Write chunks ``[c0, c1)`` of ``x [rows, H, n, CHUNK, D]`` into ``out [B, T, H, D]``, dropping the
        padding (the inverse of :meth:`slots`)."""
        rows, H, n, _, D = x.shape
        flat = x.permute(0, 2, 3, 1, 4).reshape(rows, n * CHUNK, H, D)
        T = out.shape[1]
        if self.token_of_slot is None:
            end = min(c1 * CHUNK, T)
            out[:, c0 * CHUNK : end] = flat[:, : end - c0 * CHUNK]
            return
        tokens = self.token_of_slot[c0 * CHUNK : c1 * CHUNK]
        real = tokens < T
        out[0].index_copy_(0, tokens[real], flat[0][real].to(out.dtype))


def _intra_chunk(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, scale: float,
    kernels: IntraChunkKernels,
) -> tuple[torch.Tensor, ...]:
    """Everything that needs no state, batched over a group of chunks ``[rows, H, n, CHUNK, D]``.

    Returns Qg = exp(G) * scale q, Kg = exp(G_last - G) * k, W, U, A_qk and the per-chunk decay exp(G_last).
    """
    q = q * scale
    # Float64 log-decay: exponents are differences of cumulative sums that can be large (|G| ~ 300 for
    # g = -5), and in fp32 the difference of two such sums would lose ~|G| * 6e-8 of absolute accuracy.
    G = g.to(torch.float64).cumsum(-2)
    A_kk, A_qk = kernels.grams(k, q, G)
    V = v.shape[-1]
    decay = _exp(G, k.dtype)
    rhs = beta[..., None] * torch.cat([v, decay * k], -1)
    # unitriangular: the solver takes the unit diagonal as given, so the strict lower part is all it reads.
    UW = kernels.solve(beta[..., None] * A_kk, rhs)
    U, W = UW.split([V, UW.shape[-1] - V], -1)
    G_last = G[..., -1:, :]
    return decay * q, _exp(G_last - G, k.dtype) * k, W, U, A_qk, _exp(G_last.squeeze(-2), k.dtype)


def _exp(exponent: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """exp of a float64 exponent (always <= 0 here), evaluated in the compute dtype."""
    return exponent.to(dtype).exp()


class _GatedGrams(torch.autograd.Function):
    """A_kk (strictly lower) and A_qk (lower, diagonal included) of every chunk: ``(k, q [..., CHUNK, K], G)`` ->
    two ``[..., CHUNK, CHUNK]``, with G the float64 cumulative log-decay of the chunk.

    In blocks of ``SUBCHUNK`` rows: a block below the diagonal is one matmul of rows and columns rebased on the
    first row r of its block row, exp(G_s - G_r) * x_s against exp(G_r - G_j) * k_j (j < r <= s, so both
    exponents are <= 0); a block on the diagonal is formed one sub-diagonal at a time from exp(G_s - G_j),
    j <= s. Exponents are differences of the float64 G, exponentiated in the compute dtype. Backward runs the
    same blocks by hand with the forward's decays (an autograd graph of these slices and pads would fill a
    whole-size zero tensor for the gradient of each); the op runs on one group of chunks at a time, so the
    decays kept are bounded like the group.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, k: torch.Tensor, q: torch.Tensor, G: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        rows = torch.stack([k, q])  # rows[0] pairs k with k (strictly lower), rows[1] q with k
        grams = rows.new_zeros(*rows.shape[:-1], rows.shape[-2])
        ctx.decays = _grams_into(grams, rows, G)
        ctx.save_for_backward(rows, G)
        return grams[0], grams[1]

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, d_kk: torch.Tensor, d_qk: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        rows, G = ctx.saved_tensors
        d_rows, dG = torch.zeros_like(rows), torch.zeros_like(G)
        _grams_backward(torch.stack([d_kk, d_qk]), rows, G, iter(ctx.decays), d_rows, dG)
        return d_rows[0], d_rows[1], dG


def _subchunks(x: torch.Tensor) -> torch.Tensor:
    """``[..., L, D]`` -> ``[..., L // SUBCHUNK, SUBCHUNK, D]`` (a view)."""
    return x.unflatten(-2, (-1, SUBCHUNK))


def _diagonal_blocks(x: torch.Tensor) -> torch.Tensor:
    """The ``SUBCHUNK x SUBCHUNK`` blocks on the diagonal of ``x [..., L, L]`` as a view ``[..., L // SUBCHUNK,
    SUBCHUNK, SUBCHUNK]``."""
    n = x.shape[-1] // SUBCHUNK
    return x.unflatten(-1, (n, SUBCHUNK)).unflatten(-3, (n, SUBCHUNK)).diagonal(0, -4, -2).movedim(-1, -3)


def _grams_into(out: torch.Tensor, rows: torch.Tensor, G: torch.Tensor) -> list[torch.Tensor]:
    """Writes the gated Grams of ``rows [P, ..., L, K]`` against ``rows[0]`` into the zeros ``out [P, ..., L, L]``
    (above the diagonal stays zero, and on it for rows[0]); ``G [..., L, K]``. Returns the decays of the blocks
    below the diagonal, in the order :func:`_grams_backward` takes them (the diagonal blocks' are formed again
    there: kept, they would add 7.5 x head_dim per token to the backward's working set)."""
    L, dtype = rows.shape[-2], rows.dtype
    decays = []
    for r in range(SUBCHUNK, L, SUBCHUNK):  # rows [r, r + SUBCHUNK) and columns [0, r), rebased on row r
        row_decay = _exp(G[..., r : r + SUBCHUNK, :] - G[..., r : r + 1, :], dtype)
        col_decay = _exp(G[..., r : r + 1, :] - G[..., :r, :], dtype)
        decays += [row_decay, col_decay]
        row_part, col_part = rows[..., r : r + SUBCHUNK, :] * row_decay, rows[0, ..., :r, :] * col_decay
        out[..., r : r + SUBCHUNK, :r] = row_part @ col_part.mT
    for c in _chunk_slices(G):
        _diagonal_grams(out[..., c, :, :], rows[..., c, :, :], G[..., c, :, :])
    return decays


def _grams_backward(
    d_out: torch.Tensor,
    rows: torch.Tensor,
    G: torch.Tensor,
    decays: Iterator[torch.Tensor],
    d_rows: torch.Tensor,
    dG: torch.Tensor,
) -> None:
    """Adds the gradients of :func:`_grams_into` given ``d_out`` into ``d_rows`` and ``dG`` (the shapes of rows
    and G). An exponent G_a - G_b adds its gradient to dG_a and subtracts it from dG_b."""
    L = rows.shape[-2]
    for r in range(SUBCHUNK, L, SUBCHUNK):
        row_decay, col_decay = next(decays), next(decays)
        row_part, col_part = rows[..., r : r + SUBCHUNK, :] * row_decay, rows[0, ..., :r, :] * col_decay
        d_block = d_out[..., r : r + SUBCHUNK, :r]
        d_row = d_block @ col_part
        d_col = (d_block.mT @ row_part).sum(0)
        d_rows[..., r : r + SUBCHUNK, :] += d_row * row_decay
        d_rows[0, ..., :r, :] += d_col * col_decay
        d_row_exponent = (d_row * row_part).sum(0)
        d_col_exponent = d_col * col_part
        dG[..., r : r + SUBCHUNK, :] += d_row_exponent
        dG[..., r, :] += d_col_exponent.sum(-2) - d_row_exponent.sum(-2)
        dG[..., :r, :] -= d_col_exponent
    for c in _chunk_slices(G):
        _diagonal_grams_backward(*(x[..., c, :, :] for x in (d_out, rows, G, d_rows, dG)))


# The diagonal blocks' sub-diagonal loop makes many elementwise passes over its tensors: it runs on slices of
# about this many (token, head) pairs, whose tensors stay in a core's L2 cache (0.5 MiB at head_dim 64), while
# the rest of a group's intra-chunk work runs on the whole group. Measured on a 2 MiB-L2 CPU at 8k tokens, 2
# heads of 64, one thread: one layer's op forward and backward 0.38-0.40 CPU s in one pass over a group of
# 16,384 pairs, 0.33-0.34 in slices of 2,048.
DIAGONAL_HEAD_TOKENS = 2048


def _chunk_slices(G: torch.Tensor) -> list[slice]:
    """Runs of chunks of ``G [..., n_chunks, CHUNK, K]`` holding about DIAGONAL_HEAD_TOKENS (token, head) pairs."""
    step = max(1, DIAGONAL_HEAD_TOKENS // (G[..., 0, 0, 0].numel() * CHUNK))
    return [slice(c, c + step) for c in range(0, G.shape[-3], step)]


def _diagonal_grams(out: torch.Tensor, rows: torch.Tensor, G: torch.Tensor) -> None:
    """The ``SUBCHUNK x SUBCHUNK`` blocks on the diagonal of the Grams (:func:`_grams_into`), one sub-diagonal d
    at a time: row s with column s - d."""
    out, rows, G = _diagonal_blocks(out), _subchunks(rows), _subchunks(G)
    for d in range(SUBCHUNK):
        k_decayed = rows[0]
        if d:
            k_decayed = rows[0, ..., : SUBCHUNK - d, :] * _exp(G[..., d:, :] - G[..., : SUBCHUNK - d, :], rows.dtype)
        pairs = slice(None) if d else slice(1, None)
        out[pairs].diagonal(-d, -2, -1).copy_((rows[pairs, ..., d:, :] * k_decayed).sum(-1))


def _diagonal_grams_backward(
    d_out: torch.Tensor, rows: torch.Tensor, G: torch.Tensor, d_rows: torch.Tensor, dG: torch.Tensor
) -> None:
    """Adds the gradients of :func:`_diagonal_grams` into ``d_rows`` and ``dG`` (their decays formed again)."""
    d_out, rows, G, d_rows, dG = (_diagonal_blocks(d_out), *(_subchunks(x) for x in (rows, G, d_rows, dG)))
    for d in range(SUBCHUNK):
        head, tail = slice(None, SUBCHUNK - d), slice(d, None)
        decay = _exp(G[..., tail, :] - G[..., head, :], rows.dtype) if d else None
        k_decayed = rows[0, ..., head, :] * decay if d else rows[0]
        pairs = slice(None) if d else slice(1, None)
        grads = d_out[pairs].diagonal(-d, -2, -1)[..., None]
        d_rows[pairs, ..., tail, :] += grads * k_decayed
        d_k_decayed = (grads * rows[pairs, ..., tail, :]).sum(0)
        d_rows[0, ..., head, :] += d_k_decayed * decay if d else d_k_decayed
        if d:
            d_exponent = d_k_decayed * k_decayed
            dG[..., tail, :] += d_exponent
            dG[..., head, :] -= d_exponent


def _solve_triangular(A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    return torch.linalg.solve_triangular(A, B, upper=False, unitriangular=True)


PYTORCH_KERNELS = IntraChunkKernels(grams=_GatedGrams.apply, solve=_solve_triangular)


class _ChunkedKDA(torch.autograd.Function):
    """The whole op (module docstring): ``(q, k, v, g, beta, initial_state, scale, layout, group)`` ->
    ``(o [B, T, H, V] in q's dtype, final states [N, H, K, V])``. For each chunk, with S the state entering it:
    v_new = U - W S; o = Qg S + A_qk v_new; S_next = decay * S + Kg^T v_new."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        initial_state: torch.Tensor,
        scale: float,
        layout: _ChunkLayout,
        group: int,
        kernels: IntraChunkKernels,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        dtype = compute_dtype(q.dtype)
        _, _, H, K = q.shape
        states = q.new_empty(layout.rows, H, layout.n_chunks, K, v.shape[-1], dtype=dtype)
        o = q.new_empty(v.shape)
        finals = []
        for c0, c1 in layout.groups(group):
            chunks = [layout.slots(x, c0, c1, dtype) for x in (q, k, v, g, beta[..., None])]
            Qg, Kg, W, U, A_qk, decay = _intra_chunk(*chunks[:4], chunks[4].squeeze(-1), scale, kernels)
            v_new = torch.empty_like(U)
            for c in range(c0, c1):
                i = c - c0
                if c in layout.starts:
                    S = initial_state[layout.starts[c]].to(dtype)
                states[:, :, c] = S
                v_new[:, :, i] = U[:, :, i] - W[:, :, i] @ S
                S = decay[:, :, i, :, None] * S + Kg[:, :, i].transpose(-1, -2) @ v_new[:, :, i]
                if c in layout.ends:
                    finals.append(S)
            layout.put(o, Qg @ states[:, :, c0:c1] + A_qk @ v_new, c0, c1)
        ctx.save_for_backward(q, k, v, g, beta, states)
        ctx.layout, ctx.scale, ctx.group, ctx.kernels = layout, scale, group, kernels
        ctx.initial = (initial_state.shape, initial_state.dtype)
        return o, torch.cat(finals)

    @staticmethod
    def backward(ctx: Any, d_o: torch.Tensor, d_final: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        with torch.autocast(d_o.device.type, enabled=False):
            return _ChunkedKDA._backward(ctx, d_o, d_final)

    @staticmethod
    def _backward(ctx: Any, d_o: torch.Tensor, d_final: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, g, beta, states = ctx.saved_tensors
        layout, scale = ctx.layout, ctx.scale
        dtype = states.dtype
        inputs = (q, k, v, g, beta[..., None])
        grads = [torch.zeros(x.shape, dtype=dtype, device=x.device) for x in inputs]
        initial_shape, initial_dtype = ctx.initial
        d_initial = torch.zeros(initial_shape, dtype=dtype, device=q.device)
        d_final = d_final.to(dtype)
        for c0, c1 in reversed(layout.groups(ctx.group)):
            leaves = [layout.slots(x, c0, c1, dtype).requires_grad_() for x in inputs]
            with torch.enable_grad():
                intra = _intra_chunk(*leaves[:4], leaves[4].squeeze(-1), scale, ctx.kernels)
            Qg, Kg, W, U, A_qk, decay = (x.detach() for x in intra)
            S = states[:, :, c0:c1]
            d_out = layout.slots(d_o, c0, c1, dtype)
            v_new = U - W @ S
            # The parts of the gradients that come straight from the outputs need no loop.
            d_v_new = A_qk.transpose(-1, -2) @ d_out
            d_states = Qg.transpose(-1, -2) @ d_out
            d_states_after = torch.empty_like(S)
            for c in reversed(range(c0, c1)):
                i = c - c0
                if c in layout.ends:
                    dS = d_final[layout.ends[c]]  # replaces, not adds: a sequence's last state flows nowhere else
                d_states_after[:, :, i] = dS
                d_v_new[:, :, i] += Kg[:, :, i] @ dS
                dS = d_states[:, :, i] + decay[:, :, i, :, None] * dS - W[:, :, i].transpose(-1, -2) @ d_v_new[:, :, i]
                if c in layout.starts:
                    d_initial[layout.starts[c]] = dS
            d_intra = (
                d_out @ S.transpose(-1, -2),  # Qg
                v_new @ d_states_after.transpose(-1, -2),  # Kg
                -(d_v_new @ S.transpose(-1, -2)),  # W
                d_v_new,  # U
                d_out @ v_new.transpose(-1, -2),  # A_qk
                (d_states_after * S).sum(-1),  # decay
            )
            for grad, part in zip(grads, torch.autograd.grad(intra, leaves, d_intra), strict=True):
                layout.put(grad, part, c0, c1)
        d_beta = grads.pop().squeeze(-1)
        return (
            *(grad.to(x.dtype) for grad, x in zip([*grads, d_beta], (q, k, v, g, beta), strict=True)),
            d_initial.to(initial_dtype),
            None,
            None,
            None,
            None,
        )

