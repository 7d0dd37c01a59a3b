"""Sparse MQA attention over selected key positions, forward and backward, in Triton.

One program handles one query token and all of its heads (padded to >= 16 rows so ``tl.dot`` applies):
every head shares one key/value row per position (MQA over the MLA latent), so the token's index list
selects the same gathered K/V rows for all heads. The forward walks the index list in blocks of 64,
gathers those K rows (the head dim in chunks of 64, so D = 576 costs 9 chunks rather than a padded 1024)
and V rows, and runs an online softmax; it stores the output and the per-head logsumexp. Slots holding -1
are ignored; a row with no valid slot outputs 0.

The backward recomputes the probabilities from the saved logsumexp, P = exp(S - lse), and with
delta = rowsum(dO * O): dS = P * (dO V^T - delta), dq = scale dS K (the program owns its token's dq),
dK[idx] += scale dS^T q and dV[idx] += P^T dO by fp32 atomic adds, since many tokens select one row.
All accumulation is fp32. An index listed twice in one row counts twice (as a gather-based softmax would).
GPU speed is unmeasured: every launch is compiled for sm_90 on the CPU and fits its shared memory
(tests/test_hopper_fit.py).
"""

import torch
import triton
import triton.language as tl

from megaseq_dsa.ops.triton._launch import check_runnable

BLOCK_S = 64  # index slots per step; selected lists are padded to a multiple of 64
BLOCK_D = 64  # head-dim chunk of q/k
# ptxas 13 for sm_90 at H=16, D=576, Dv=512: 8 warps spill nothing in bf16 (fp32, the device check's
# correctness rows: 2.4 KB in the forward); 4 warps spill 38 KB in the fp32 forward, 16 warps 6.7 KB in the
# fp32 backward. tests/test_hopper_fit.py holds each launch to its count.
NUM_WARPS = 8
# Software-pipelining stages by (pass, element size), sized for sm_90's 227 KiB of shared memory per block at
# H=16, D=576, Dv=512 (packages/attn-dsa/tests/test_hopper_fit.py): the forward in bf16 fits the default 3
# stages (157 KiB); fp32 needs 312 KiB with 2 or 3 stages and 168 KiB with 1. The backward, which gathers K
# twice and V once per block, asks for 295 KiB in bf16 with 2 or 3 stages and 16 KiB with 1.
STAGES = {("fwd", 2): 3, ("fwd", 4): 1, ("bwd", 2): 1, ("bwd", 4): 1}


@triton.jit
def _selected_rows(idx_ptr, token, batch, slot_start, SLOTS, TK, BLOCK_S: tl.constexpr):
    # The key rows that slots [slot_start, slot_start + BLOCK_S) of the token's index list select, and which
    # of them count: forward and backward must skip the same slots (-1 padding, past the list, out of range).
    slots = slot_start + tl.arange(0, BLOCK_S)
    idx = tl.load(idx_ptr + token * SLOTS + slots, mask=slots < SLOTS, other=-1)
    valid = (idx >= 0) & (idx < TK)
    return batch * TK + tl.where(valid, idx, 0), valid


@triton.jit
def _gather_scores(
    q_ptr,
    k_ptr,
    token,
    heads,
    head_ok,
    rows,
    valid,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HEADS: tl.constexpr,
    HEADS_P: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    # q . k for the token's heads against the gathered rows, head dim in chunks: [HEADS_P, BLOCK_S].
    scores = tl.zeros([HEADS_P, BLOCK_S], dtype=tl.float32)
    for d_start in tl.static_range(0, D, BLOCK_D):
        dims = d_start + tl.arange(0, BLOCK_D)
        dim_ok = dims < D
        q = tl.load(
            q_ptr + (token * HEADS + heads[:, None]) * D + dims[None, :],
            mask=head_ok[:, None] & dim_ok[None, :],
            other=0.0,
        )
        k_t = tl.load(
            k_ptr + rows[None, :] * D + dims[:, None], mask=valid[None, :] & dim_ok[:, None], other=0.0
        )
        scores += tl.dot(q, k_t, input_precision="ieee")
    return scores


@triton.jit
def _sparse_attention_fwd_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    idx_ptr,
    o_ptr,
    lse_ptr,
    scale,
    TQ,
    TK,
    SLOTS,
    HEADS: tl.constexpr,
    D: tl.constexpr,
    DV: tl.constexpr,
    HEADS_P: tl.constexpr,
    DV_P: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    batch = tl.program_id(1).to(tl.int64)
    token = batch * TQ + tl.program_id(0)
    heads = tl.arange(0, HEADS_P)
    head_ok = heads < HEADS
    dv = tl.arange(0, DV_P)
    dv_ok = dv < DV

    row_max = tl.full([HEADS_P], float("-inf"), dtype=tl.float32)
    row_sum = tl.zeros([HEADS_P], dtype=tl.float32)
    acc = tl.zeros([HEADS_P, DV_P], dtype=tl.float32)
    for slot_start in range(0, SLOTS, BLOCK_S):
        rows, valid = _selected_rows(idx_ptr, token, batch, slot_start, SLOTS, TK, BLOCK_S)
        scores = _gather_scores(
            q_ptr, k_ptr, token, heads, head_ok, rows, valid, D, BLOCK_D, HEADS, HEADS_P, BLOCK_S
        )
        scores = tl.where(valid[None, :], scores * scale, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(scores, axis=1))
        # While a row has seen no valid slot its max is -inf; shift by 0 then so exp gives 0, not NaN.
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        p = tl.exp(scores - shift[:, None])
        rescale = tl.exp(row_max - shift)
        v = tl.load(v_ptr + rows[:, None] * DV + dv[None, :], mask=valid[:, None] & dv_ok[None, :], other=0.0)
        acc = acc * rescale[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        row_sum = row_sum * rescale + tl.sum(p, axis=1)
        row_max = new_max

    has_keys = row_sum > 0
    out = tl.where(has_keys[:, None], acc / tl.where(has_keys, row_sum, 1.0)[:, None], 0.0)
    tl.store(
        o_ptr + (token * HEADS + heads[:, None]) * DV + dv[None, :],
        out.to(o_ptr.dtype.element_ty),
        mask=head_ok[:, None] & dv_ok[None, :],
    )
    lse = tl.where(has_keys, row_max + tl.log(tl.where(has_keys, row_sum, 1.0)), float("-inf"))
    tl.store(lse_ptr + token * HEADS + heads, lse, mask=head_ok)


@triton.jit
def _sparse_attention_bwd_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    idx_ptr,
    o_ptr,
    do_ptr,
    lse_ptr,
    dq_ptr,
    dk_ptr,
    dv_ptr,
    scale,
    TQ,
    TK,
    SLOTS,
    HEADS: tl.constexpr,
    D: tl.constexpr,
    DV: tl.constexpr,
    HEADS_P: tl.constexpr,
    DV_P: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    batch = tl.program_id(1).to(tl.int64)
    token = batch * TQ + tl.program_id(0)
    heads = tl.arange(0, HEADS_P)
    head_ok = heads < HEADS
    dv = tl.arange(0, DV_P)
    dv_ok = dv < DV
    out_offsets = (token * HEADS + heads[:, None]) * DV + dv[None, :]
    out_mask = head_ok[:, None] & dv_ok[None, :]
    d_out = tl.load(do_ptr + out_offsets, mask=out_mask, other=0.0)
    out = tl.load(o_ptr + out_offsets, mask=out_mask, other=0.0)
    delta = tl.sum(d_out.to(tl.float32) * out.to(tl.float32), axis=1)
    lse = tl.load(lse_ptr + token * HEADS + heads, mask=head_ok, other=0.0)

    for slot_start in range(0, SLOTS, BLOCK_S):
        rows, valid = _selected_rows(idx_ptr, token, batch, slot_start, SLOTS, TK, BLOCK_S)
        scores = _gather_scores(
            q_ptr, k_ptr, token, heads, head_ok, rows, valid, D, BLOCK_D, HEADS, HEADS_P, BLOCK_S
        )
        p = tl.where(valid[None, :] & head_ok[:, None], tl.exp(scores * scale - lse[:, None]), 0.0)
        # The value dim in chunks, as the head dim: whole [BLOCK_S, 512] value and dV tiles asked for 401 KiB
        # of shared memory on an H200 (227 KiB there).
        d_p = tl.zeros([HEADS_P, BLOCK_S], dtype=tl.float32)
        for dv_start in tl.static_range(0, DV, BLOCK_DV):
            dvs = dv_start + tl.arange(0, BLOCK_DV)
            v_mask = valid[:, None] & (dvs < DV)[None, :]
            v = tl.load(v_ptr + rows[:, None] * DV + dvs[None, :], mask=v_mask, other=0.0)
            d_out_part = tl.load(do_ptr + (token * HEADS + heads[:, None]) * DV + dvs[None, :],
                                 mask=head_ok[:, None] & (dvs < DV)[None, :], other=0.0)
            d_p += tl.dot(d_out_part, tl.trans(v), input_precision="ieee")
            d_v = tl.dot(tl.trans(p.to(d_out_part.dtype)), d_out_part, input_precision="ieee")
            tl.atomic_add(dv_ptr + rows[:, None] * DV + dvs[None, :], d_v, mask=v_mask)
        d_scores = p * (d_p - delta[:, None]) * scale
        d_scores_in = d_scores.to(q_ptr.dtype.element_ty)
        for d_start in tl.static_range(0, D, BLOCK_D):
            dims = d_start + tl.arange(0, BLOCK_D)
            dim_ok = dims < D
            q_offsets = (token * HEADS + heads[:, None]) * D + dims[None, :]
            q_mask = head_ok[:, None] & dim_ok[None, :]
            q = tl.load(q_ptr + q_offsets, mask=q_mask, other=0.0)
            k_offsets = rows[:, None] * D + dims[None, :]
            k_mask = valid[:, None] & dim_ok[None, :]
            k = tl.load(k_ptr + k_offsets, mask=k_mask, other=0.0)
            # This program alone writes its token's dq rows: a plain read-add-write, no atomics.
            d_q = tl.load(dq_ptr + q_offsets, mask=q_mask, other=0.0)
            tl.store(dq_ptr + q_offsets, d_q + tl.dot(d_scores_in, k, input_precision="ieee"), mask=q_mask)
            tl.atomic_add(
                dk_ptr + k_offsets, tl.dot(tl.trans(d_scores_in), q, input_precision="ieee"), mask=k_mask
            )


def _launch_config(q: torch.Tensor, v: torch.Tensor) -> dict[str, int]:
    heads, dim = q.shape[2], q.shape[3]
    dim_v = v.shape[2]
    return dict(
        HEADS=heads,
        D=dim,
        DV=dim_v,
        # tl.dot needs >= 16 rows and columns; the head dim is chunked, so a small D only pads to 16.
        HEADS_P=max(16, triton.next_power_of_2(heads)),
        DV_P=max(16, triton.next_power_of_2(dim_v)),
        BLOCK_S=BLOCK_S,
        BLOCK_D=min(BLOCK_D, max(16, triton.next_power_of_2(dim))),
    )


class SparseAttentionTriton(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indices: torch.Tensor, scale: float
    ) -> torch.Tensor:
        q, k, v, indices = q.contiguous(), k.contiguous(), v.contiguous(), indices.contiguous()
        batch, length, heads, _ = q.shape
        out = torch.empty(batch, length, heads, v.shape[2], dtype=q.dtype, device=q.device)
        lse = torch.empty(batch, length, heads, dtype=torch.float32, device=q.device)
        if length > 0:
            _sparse_attention_fwd_kernel[(length, batch)](
                q,
                k,
                v,
                indices,
                out,
                lse,
                scale,
                length,
                k.shape[1],
                indices.shape[2],
                num_warps=NUM_WARPS,
                num_stages=STAGES["fwd", q.element_size()],
                **_launch_config(q, v),
            )
        ctx.save_for_backward(q, k, v, indices, out, lse)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, d_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None, None]:
        q, k, v, indices, out, lse = ctx.saved_tensors
        batch, length = q.shape[:2]
        d_q = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        d_k = torch.zeros(k.shape, dtype=torch.float32, device=q.device)
        d_v = torch.zeros(v.shape, dtype=torch.float32, device=q.device)
        config = _launch_config(q, v)
        if length > 0:
            _sparse_attention_bwd_kernel[(length, batch)](
                q,
                k,
                v,
                indices,
                out,
                d_out.to(q.dtype).contiguous(),
                lse,
                d_q,
                d_k,
                d_v,
                ctx.scale,
                length,
                k.shape[1],
                indices.shape[2],
                num_warps=NUM_WARPS,
                num_stages=STAGES["bwd", q.element_size()],
                BLOCK_DV=min(BLOCK_D, config["DV_P"]),
                **config,
            )
        return d_q.to(q.dtype), d_k.to(k.dtype), d_v.to(v.dtype), None, None


def sparse_attention_triton(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indices: torch.Tensor, scale: float
) -> torch.Tensor:
    """Softmax attention of each query over its selected positions only (MQA: heads share K/V rows).

    q [B, Tq, H, D], k [B, Tk, D], v [B, Tk, Dv] (Tk >= Tq), indices int32 [B, Tq, S] into the keys (-1 =
    empty slot). Returns [B, Tq, H, Dv]; a row without a valid index returns zeros. Differentiable in q, k, v.
    """
    if q.dim() != 4 or k.dim() != 3 or v.dim() != 3 or indices.dim() != 3:
        raise ValueError(
            f"expected q [B,Tq,H,D], k [B,Tk,D], v [B,Tk,Dv], indices [B,Tq,S]; got {tuple(q.shape)}, "
            f"{tuple(k.shape)}, {tuple(v.shape)}, {tuple(indices.shape)}"
        )
    batch, n_queries, _, dim = q.shape
    n_keys = k.shape[1]
    if (
        k.shape[0] != batch
        or k.shape[2] != dim
        or n_keys < n_queries
        or v.shape[:2] != (batch, n_keys)
        or indices.shape[:2] != (batch, n_queries)
    ):
        raise ValueError(
            f"k must be [B, Tk, D] with B = {batch}, D = {dim}, Tk >= Tq = {n_queries}; v must start with "
            f"(B, Tk) and indices with {(batch, n_queries)}; got {tuple(k.shape)}, {tuple(v.shape)}, "
            f"{tuple(indices.shape)}"
        )
    if indices.dtype != torch.int32:
        raise ValueError(f"indices must be int32, got {indices.dtype}")
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"q, k and v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    check_runnable(q)
    return SparseAttentionTriton.apply(q, k, v, indices, scale)
