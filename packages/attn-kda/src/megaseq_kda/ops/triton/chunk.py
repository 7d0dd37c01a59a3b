"""``chunk_kda_triton``: chunked KDA as a torch.autograd.Function over Triton kernels.

The forward runs kernels_fwd (gate cumsum, in-chunk scores, WY/UT inverse, sequential state pass,
output). The backward saves only the inputs and recomputes those intermediates (one state per chunk, no
per-token state), then runs kernels_bwd: a reverse sequential pass for the state gradients, then three
chunk-parallel kernels whose partial gradients are summed here, and a reverse in-chunk cumsum turning
the gradient of the cumulative gate into the gradient of g.

The cumulative gates are float64 ([T, H, K], 8 bytes per entry, alive during one forward or one backward):
every exponent is a difference of them, exact before it is rounded to fp32 (see kernels_fwd). The output
is in q's dtype, the final state fp32, the gradients in their inputs' dtypes.
"""

import functools
import itertools
from dataclasses import dataclass

import torch
import triton

from megaseq.documents import Documents
from megaseq_kda.ops.inputs import check_kda_inputs

from .kernels_bwd import chunk_grads_kernel, pair_grads_kernel, state_bwd_kernel, wy_bwd_kernel
from .kernels_fwd import (
    chunk_cumsum_kernel,
    kk_scores_kernel,
    output_fwd_kernel,
    state_fwd_kernel,
    wy_fwd_kernel,
)

CHUNK = 64  # tokens per chunk (BT): one stored state per chunk
SUB_CHUNK = 16  # tokens per sub-chunk (BC): the exponent rebasing granularity inside a chunk


@dataclass(frozen=True)
class Layout:
    """Sizes and tile widths for one call; the packed sequence has ``T_total`` tokens in N documents."""

    heads: int
    k_dim: int
    v_dim: int
    bounds: torch.Tensor  # [NT, 2] int32: first and end token of every chunk, documents in order
    doc_chunks: torch.Tensor  # [N + 1] int32: first chunk of each document
    block_k: int  # K tile of the kernels that loop over K (16-token sub-chunk scores, per-channel grads)
    block_k_full: int  # whole K padded to a power of two: the state tile holds all of K
    block_v: int

    @property
    def num_chunks(self) -> int:
        return self.bounds.shape[0]

    @property
    def wide_warps(self) -> int:
        """Warps of the kernels that hold a [K, BV] state tile or [BT, K] chunk tiles: at K = 128, BV = 32 ptxas
        spilled 4-29 KB per thread with 4 warps, 0.1-6.6 KB with 8 (tests/test_hopper_fit.py reads its counts)."""
        return 8 if self.block_k_full * self.block_v >= 4096 else 4

    @property
    def num_docs(self) -> int:
        return self.doc_chunks.shape[0] - 1


def make_layout(documents: Documents, heads: int, k_dim: int, v_dim: int, device: torch.device) -> Layout:
    """The launch layout, built once per batch: memoized on ``documents`` (every layer of a forward shares it)."""
    key = ("megaseq_kda.triton_layout", heads, k_dim, v_dim, device)
    return documents.derive(key, lambda: _make_layout(documents.offsets, heads, k_dim, v_dim, device))


@functools.lru_cache(maxsize=64)
def rows_layout(batch: int, seq: int, heads: int, k_dim: int, v_dim: int, device: torch.device) -> Layout:
    """The launch layout of ``batch`` unpacked rows of ``seq`` tokens: it depends on shapes only, so it is built
    (and copied to the device, which waits for the device) once per shape, not once per layer."""
    return _make_layout(tuple(row * seq for row in range(batch + 1)), heads, k_dim, v_dim, device)


def _make_layout(edges: tuple[int, ...], heads: int, k_dim: int, v_dim: int, device: torch.device) -> Layout:
    bounds, doc_chunks = [], [0]
    for bos, eos in itertools.pairwise(edges):
        bounds += [(t0, min(t0 + CHUNK, eos)) for t0 in range(bos, eos, CHUNK)]
        doc_chunks.append(len(bounds))
    full_k = max(16, triton.next_power_of_2(k_dim))
    return Layout(
        heads=heads,
        k_dim=k_dim,
        v_dim=v_dim,
        bounds=torch.tensor(bounds, dtype=torch.int32, device=device).reshape(-1, 2),
        doc_chunks=torch.tensor(doc_chunks, dtype=torch.int32, device=device),
        block_k=min(32, full_k),
        block_k_full=full_k,
        # The state tile is [full K, BV]: at most 4k fp32 values. At K = 128, BV = 64 with 4 warps, ptxas for sm_90
        # spilled 38 KB (forward state) to 68 KB (backward state) per thread; BV = 32 with 8 warps, 0.1-6.6 KB
        # (tests/test_hopper_fit.py reads its counts), and twice the programs along V.
        block_v=max(16, min(triton.next_power_of_2(v_dim), 4096 // full_k, 64)),
    )


def chunk_cumsum(x: torch.Tensor, lay: Layout, reverse: bool) -> torch.Tensor:
    """Prefix sums of the gates per chunk in float64 (exponents are their differences), or suffix sums of
    a gradient in fp32 (``reverse``)."""
    out = torch.empty_like(x, dtype=torch.float32 if reverse else torch.float64)
    grid = (lay.num_chunks, triton.cdiv(lay.k_dim, lay.block_k), lay.heads)
    chunk_cumsum_kernel[grid](x, out, lay.bounds, lay.heads, lay.k_dim, CHUNK, lay.block_k, reverse)
    return out


@dataclass
class Intermediates:
    """fp32 tensors shared by the forward and the recomputation in the backward."""

    gcum: torch.Tensor  # [T, H, K] float64 gate cumsum restarting at each chunk
    b: torch.Tensor  # [T, H, BT] strictly causal k-k scores (without beta)
    aqk: torch.Tensor  # [T, H, BT] causal q-k scores times scale
    tm: torch.Tensor  # [T, H, BT] (I + Diag(beta) B)^-1
    w: torch.Tensor  # [T, H, K]
    u_new: torch.Tensor  # [T, H, V]
    states: torch.Tensor  # [NT, H, K, V] state entering each chunk


def forward_intermediates(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    h0: torch.Tensor | None,
    lay: Layout,
    final_state: torch.Tensor | None,
) -> Intermediates:
    """Everything up to the output, per chunk; writes the final states into ``final_state`` if given."""
    total, heads, k_dim, v_dim = *q.shape[:2], lay.k_dim, lay.v_dim
    f32 = dict(dtype=torch.float32, device=q.device)
    gcum = chunk_cumsum(g, lay, reverse=False)
    # Blocks above the diagonal are never written: they stay zero.
    b = torch.zeros(total, heads, CHUNK, **f32)
    aqk = torch.zeros(total, heads, CHUNK, **f32)
    grid = (lay.num_chunks, CHUNK // SUB_CHUNK, heads)
    kk_scores_kernel[grid](q, k, gcum, b, aqk, lay.bounds, scale, heads, k_dim, CHUNK, SUB_CHUNK, lay.block_k)
    tm = torch.empty(total, heads, CHUNK, **f32)
    w = torch.empty(total, heads, k_dim, **f32)
    u = torch.empty(total, heads, v_dim, **f32)
    wy_fwd_kernel[(lay.num_chunks, heads)](
        k, v, gcum, beta, b, tm, w, u, lay.bounds, heads, k_dim, v_dim, CHUNK, lay.block_k, lay.block_v,
        num_warps=lay.wide_warps,
    )
    states = torch.empty(lay.num_chunks, heads, k_dim, v_dim, **f32)
    u_new = torch.empty_like(u)
    grid = (triton.cdiv(v_dim, lay.block_v), heads, lay.num_docs)
    state_fwd_kernel[grid](
        k, gcum, w, u, h0, states, u_new, final_state, lay.bounds, lay.doc_chunks,
        heads, k_dim, v_dim, CHUNK, lay.block_k_full, lay.block_v, h0 is not None, final_state is not None,
        num_warps=lay.wide_warps,
    )
    return Intermediates(gcum, b, aqk, tm, w, u_new, states)


def backward_grads(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    h0: torch.Tensor | None,
    lay: Layout,
    do: torch.Tensor,
    dht: torch.Tensor | None,
) -> tuple[torch.Tensor, ...]:
    """Gradients of (q, k, v, g, beta, h0) given dO [T, H, V] and d final state (or None)."""
    heads, k_dim, v_dim = lay.heads, lay.k_dim, lay.v_dim
    mid = forward_intermediates(q, k, v, g, beta, scale, h0, lay, final_state=None)
    f32 = dict(dtype=torch.float32, device=q.device)

    d_states = torch.empty_like(mid.states)
    du_new = torch.empty_like(mid.u_new)
    dh0 = torch.empty_like(h0) if h0 is not None else None
    grid = (triton.cdiv(v_dim, lay.block_v), heads, lay.num_docs)
    # fp32 operands at K = 128 with the default software pipelining ask for 241 KiB of shared memory, over an
    # H200's 227 KiB: one stage fits (the loop carries d_state from chunk to chunk, so prefetching gains little)
    stages = {"num_stages": 1} if q.element_size() == 4 else {}
    state_bwd_kernel[grid](
        q, k, mid.gcum, mid.w, mid.aqk, do, dht, d_states, du_new, dh0, lay.bounds, lay.doc_chunks, scale,
        heads, k_dim, v_dim, CHUNK, lay.block_k_full, lay.block_v, dht is not None, h0 is not None, **stages,
        num_warps=lay.wide_warps,
    )

    dq_state, dk_state, dg_state = (torch.empty_like(mid.w) for _ in range(3))
    dw = torch.empty_like(mid.w)
    daqk = torch.empty_like(mid.aqk)
    grid = (lay.num_chunks, triton.cdiv(k_dim, lay.block_k), heads)
    chunk_grads_kernel[grid](
        q, k, mid.gcum, mid.states, d_states, mid.u_new, du_new, do,
        dq_state, dk_state, dg_state, dw, daqk, lay.bounds, scale,
        heads, k_dim, v_dim, CHUNK, lay.block_k, lay.block_v, num_warps=lay.wide_warps,
    )

    dk_wy, dg_wy = torch.empty_like(mid.w), torch.empty_like(mid.w)
    dv = torch.empty(v.shape, **f32)
    dbeta = torch.empty(beta.shape, **f32)
    db = torch.empty_like(mid.b)
    wy_bwd_kernel[(lay.num_chunks, heads)](
        k, v, mid.gcum, beta, mid.b, mid.tm, dw, du_new, dk_wy, dv, dg_wy, dbeta, db, lay.bounds,
        heads, k_dim, v_dim, CHUNK, lay.block_k, lay.block_v, num_warps=lay.wide_warps,
    )

    dq_pair, dk_pair, dg_pair = (torch.empty_like(mid.w) for _ in range(3))
    grid = (lay.num_chunks, (CHUNK // SUB_CHUNK) * triton.cdiv(k_dim, lay.block_k), heads)
    pair_grads_kernel[grid](
        q, k, mid.gcum, daqk, db, dq_pair, dk_pair, dg_pair, lay.bounds,
        heads, k_dim, CHUNK, SUB_CHUNK, lay.block_k,
    )

    dg = chunk_cumsum(dg_state + dg_wy + dg_pair, lay, reverse=True)
    return dq_state + dq_pair, dk_state + dk_wy + dk_pair, dv, dg, dbeta, dh0


class ChunkKDAFunction(torch.autograd.Function):
    """Inputs are packed ``[T_total, H, D]`` contiguous tensors; see ``chunk_kda_triton``."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, scale, h0, output_final_state, lay: Layout):
        final_state = None
        if output_final_state:
            final_state = torch.empty(lay.num_docs, lay.heads, lay.k_dim, lay.v_dim,
                                      dtype=torch.float32, device=q.device)
        mid = forward_intermediates(q, k, v, g, beta, scale, h0, lay, final_state)
        o = torch.empty(v.shape, dtype=torch.float32, device=q.device)
        grid = (lay.num_chunks, triton.cdiv(lay.v_dim, lay.block_v), lay.heads)
        output_fwd_kernel[grid](
            q, mid.gcum, mid.aqk, mid.states, mid.u_new, o, lay.bounds, scale,
            lay.heads, lay.k_dim, lay.v_dim, CHUNK, lay.block_k, lay.block_v,
        )
        # Only the inputs are kept: the backward recomputes the per-chunk intermediates.
        ctx.save_for_backward(q, k, v, g, beta, h0)
        ctx.scale, ctx.lay = scale, lay
        return o.to(q.dtype), final_state

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, g, beta, h0 = ctx.saved_tensors
        dq, dk, dv, dg, dbeta, dh0 = backward_grads(
            q, k, v, g, beta, ctx.scale, h0, ctx.lay, do.contiguous(),
            dht.contiguous() if dht is not None else None,
        )
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dg.to(g.dtype), dbeta.to(beta.dtype),
                None, dh0, None, None)


def chunk_kda_triton(
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
    """Chunked Kimi Delta Attention on Triton kernels, differentiable in all tensor inputs.

    q, k: [B, T, H, K] (L2-normalised), v: [B, T, H, V], g: [B, T, H, K] log-decay <= 0, beta: [B, T, H].
    initial_state: [N, H, K, V] with N = B, or the number of documents when cu_seqlens is given (then
    B must be 1 and the state restarts at every document boundary). Returns o [B, T, H, V] in q's dtype
    and, if output_final_state, the fp32 final states [N, H, K, V] (else None).
    """
    batch, seq, heads, k_dim = q.shape
    documents, _ = check_kda_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    v_dim = v.shape[-1]
    scale = k_dim**-0.5 if scale is None else scale
    if documents is None:  # the rows of the batch, one after another
        lay = rows_layout(batch, seq, heads, k_dim, v_dim, q.device)
    else:
        lay = make_layout(documents, heads, k_dim, v_dim, q.device)

    def packed(x: torch.Tensor) -> torch.Tensor:
        return x.reshape(batch * seq, *x.shape[2:]).contiguous()

    # The state is fp32 in the kernels; autograd carries its gradient back through this cast.
    h0 = initial_state.float().contiguous() if initial_state is not None else None
    o, final_state = ChunkKDAFunction.apply(
        packed(q), packed(k), packed(v), packed(g), packed(beta), scale, h0, output_final_state, lay
    )
    return o.reshape(batch, seq, heads, v_dim), final_state
