"""Forward Triton kernels of chunked KDA (WY/UT form, chunk BT = 64, sub-chunks BC = 16).

Per head, with G the gate cumsum restarting at each chunk and S the state entering the chunk:

    B[i, j]   = sum_c k_ic k_jc exp(G_ic - G_jc)              j < i   (kk_scores_kernel)
    Aqk[i, j] = scale * sum_c q_ic k_jc exp(G_ic - G_jc)      j <= i  (kk_scores_kernel)
    Tm        = (I + Diag(beta) B)^-1                                  (wy_fwd_kernel)
    W = Tm (beta * exp(G) * K),  U = Tm (beta * V)                     (wy_fwd_kernel)
    U_new     = U - W S                                                (state_fwd_kernel, sequential)
    S_next    = exp(G_last) * S + (exp(G_last - G) * K)^T U_new        (state_fwd_kernel)
    O         = scale * (exp(G) * Q) S + Aqk U_new                     (output_fwd_kernel)

Numerics (the scheme of the PyTorch op ``megaseq_kda.ops.chunk``): only exponents <= 0 are exponentiated,
and no exponent is a difference of two rounded cumulative sums. G is summed and stored in float64
(chunk_cumsum_kernel): with g down to -5, |G| reaches ~320 in a chunk, where an fp32 difference G_i - G_j
would carry ~3e-5 of absolute error into exp(G_i - G_j) however small the difference. Every exponent is
formed in float64 and rounded to fp32 once, just before exp (``tiles.decay``); all products and
accumulations are fp32. exp(G_i - G_j) is never formed as exp(G_i) * exp(-G_j) over a whole chunk
(exp(-G) overflows for strong decay): between two different 16-token sub-chunks it is split at the first
row r of the later one, exp(G_i - G_r) * exp(G_r - G_j), both exponents <= 0, so the block is one tl.dot;
inside a sub-chunk it is formed pairwise as a [16, 16, BK] tensor with the non-causal exponents set to
-inf before exp.

Chunks are described by a ``[NT, 2]`` table of (first token, end token) over the packed sequence, so
ragged documents need no padding; the chunk's row in that table is also its slot in the per-chunk
state tensor.
"""

import triton
import triton.language as tl

from .tiles import decay, load_gate_row, load_gates, load_tile, load_vec, state_offsets, store_tile


@triton.jit
def chunk_cumsum_kernel(x_ptr, out_ptr, bounds_ptr, H: tl.constexpr, K: tl.constexpr,
                        BT: tl.constexpr, BK: tl.constexpr, REVERSE: tl.constexpr):
    """Cumulative sum over each chunk's tokens in the output's dtype (float64 for the gates; REVERSE: suffix
    sums in fp32, the adjoint of the prefix sum, for their gradient)."""
    i_t, i_k, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    t0, t1 = tl.load(bounds_ptr + 2 * i_t), tl.load(bounds_ptr + 2 * i_t + 1)
    rows = t0 + tl.arange(0, BT)
    ks = i_k * BK + tl.arange(0, BK)
    x = load_tile(x_ptr, rows, rows < t1, ks, ks < K, i_h, H, K).to(out_ptr.dtype.element_ty)
    out = tl.cumsum(x, axis=0)
    if REVERSE:
        out = tl.sum(x, axis=0)[None, :] - out + x
    store_tile(out_ptr, out, rows, rows < t1, ks, ks < K, i_h, H, K)


@triton.jit
def kk_scores_kernel(q_ptr, k_ptr, gcum_ptr, b_ptr, aqk_ptr, bounds_ptr, scale,
                     H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
                     BK: tl.constexpr):
    """Rows of sub-chunk i_i of B (strictly causal) and Aqk (causal, scaled); one [BC, BC] block per J."""
    i_t, i_i, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    t0, t1 = tl.load(bounds_ptr + 2 * i_t), tl.load(bounds_ptr + 2 * i_t + 1)
    r0 = t0 + i_i * BC
    if r0 < t1:
        rows = r0 + tl.arange(0, BC)
        row_ok = rows < t1
        sub = tl.arange(0, BC)
        # Blocks left of the diagonal: rebase both sides on the first row r0 of this sub-chunk.
        for i_j in range(0, i_i):
            cols = t0 + i_j * BC + sub
            acc_qk = tl.zeros([BC, BC], dtype=tl.float32)
            acc_kk = tl.zeros([BC, BC], dtype=tl.float32)
            for i_k in range(0, tl.cdiv(K, BK)):
                ks = i_k * BK + tl.arange(0, BK)
                k_ok = ks < K
                g_ref = load_gate_row(gcum_ptr, r0, ks, k_ok, i_h, H, K)
                row_decay = decay(load_gates(gcum_ptr, rows, row_ok, ks, k_ok, i_h, H, K) - g_ref[None, :])
                q_i = load_tile(q_ptr, rows, row_ok, ks, k_ok, i_h, H, K) * row_decay
                k_i = load_tile(k_ptr, rows, row_ok, ks, k_ok, i_h, H, K) * row_decay
                g_j = load_gates(gcum_ptr, cols, cols < t1, ks, k_ok, i_h, H, K)
                k_j = load_tile(k_ptr, cols, cols < t1, ks, k_ok, i_h, H, K) * decay(g_ref[None, :] - g_j)
                acc_qk += tl.dot(q_i, tl.trans(k_j), input_precision="ieee")
                acc_kk += tl.dot(k_i, tl.trans(k_j), input_precision="ieee")
            store_tile(aqk_ptr, acc_qk * scale, rows, row_ok, i_j * BC + sub, sub < BC, i_h, H, BT)
            store_tile(b_ptr, acc_kk, rows, row_ok, i_j * BC + sub, sub < BC, i_h, H, BT)
        # Diagonal block: pairwise exponents, non-causal ones masked to -inf before exp.
        causal = sub[:, None] >= sub[None, :]
        acc_qk = tl.zeros([BC, BC], dtype=tl.float32)
        acc_kk = tl.zeros([BC, BC], dtype=tl.float32)
        for i_k in range(0, tl.cdiv(K, BK)):
            ks = i_k * BK + tl.arange(0, BK)
            k_ok = ks < K
            g_i = load_gates(gcum_ptr, rows, row_ok, ks, k_ok, i_h, H, K)
            q_i = load_tile(q_ptr, rows, row_ok, ks, k_ok, i_h, H, K)
            k_i = load_tile(k_ptr, rows, row_ok, ks, k_ok, i_h, H, K)
            pair_decay = decay(tl.where(causal[:, :, None], g_i[:, None, :] - g_i[None, :, :], float("-inf")))
            acc_qk += tl.sum(q_i[:, None, :] * k_i[None, :, :] * pair_decay, axis=2)
            acc_kk += tl.sum(k_i[:, None, :] * k_i[None, :, :] * pair_decay, axis=2)
        acc_kk = tl.where(sub[:, None] > sub[None, :], acc_kk, 0.0)
        store_tile(aqk_ptr, acc_qk * scale, rows, row_ok, i_i * BC + sub, sub < BC, i_h, H, BT)
        store_tile(b_ptr, acc_kk, rows, row_ok, i_i * BC + sub, sub < BC, i_h, H, BT)


@triton.jit
def unit_lower_inverse(a, BT: tl.constexpr):
    """(I + a)^-1 for strictly lower-triangular a, by forward substitution one row at a time."""
    idx = tl.arange(0, BT)
    inv = tl.zeros([BT, BT], dtype=tl.float32)
    for i in range(0, BT):
        a_i = tl.sum(tl.where(idx[:, None] == i, a, 0.0), axis=0)
        # Rows >= i of inv are still zero, so the full contraction only sees the solved rows j < i.
        inv_i = tl.where(idx == i, 1.0, 0.0) - tl.sum(a_i[:, None] * inv, axis=0)
        inv = tl.where(idx[:, None] == i, inv_i[None, :], inv)
    return inv


@triton.jit
def wy_fwd_kernel(k_ptr, v_ptr, gcum_ptr, beta_ptr, b_ptr, tm_ptr, w_ptr, u_ptr, bounds_ptr,
                  H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                  BK: tl.constexpr, BV: tl.constexpr):
    i_t, i_h = tl.program_id(0), tl.program_id(1)
    t0, t1 = tl.load(bounds_ptr + 2 * i_t), tl.load(bounds_ptr + 2 * i_t + 1)
    rows = t0 + tl.arange(0, BT)
    row_ok = rows < t1
    cs = tl.arange(0, BT)
    beta = load_vec(beta_ptr, rows, row_ok, i_h, H)
    b = load_tile(b_ptr, rows, row_ok, cs, cs < BT, i_h, H, BT)
    tm = unit_lower_inverse(beta[:, None] * b, BT)
    store_tile(tm_ptr, tm, rows, row_ok, cs, cs < BT, i_h, H, BT)
    for i_k in range(0, tl.cdiv(K, BK)):
        ks = i_k * BK + tl.arange(0, BK)
        k_ok = ks < K
        k = load_tile(k_ptr, rows, row_ok, ks, k_ok, i_h, H, K)
        gate = decay(load_gates(gcum_ptr, rows, row_ok, ks, k_ok, i_h, H, K))
        w = tl.dot(tm, beta[:, None] * gate * k, input_precision="ieee")
        store_tile(w_ptr, w, rows, row_ok, ks, k_ok, i_h, H, K)
    for i_v in range(0, tl.cdiv(V, BV)):
        vs = i_v * BV + tl.arange(0, BV)
        v = load_tile(v_ptr, rows, row_ok, vs, vs < V, i_h, H, V)
        u = tl.dot(tm, beta[:, None] * v, input_precision="ieee")
        store_tile(u_ptr, u, rows, row_ok, vs, vs < V, i_h, H, V)


@triton.jit
def state_fwd_kernel(k_ptr, gcum_ptr, w_ptr, u_ptr, h0_ptr, states_ptr, u_new_ptr, ht_ptr,
                     bounds_ptr, doc_chunks_ptr, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                     BT: tl.constexpr, BKP: tl.constexpr, BV: tl.constexpr,
                     HAS_H0: tl.constexpr, STORE_HT: tl.constexpr):
    """Walk one document's chunks in order for one head and V-block; the only sequential kernel."""
    i_v, i_h, i_n = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    ks = tl.arange(0, BKP)
    vs = i_v * BV + tl.arange(0, BV)
    k_ok, v_ok = ks < K, vs < V
    state_mask = k_ok[:, None] & v_ok[None, :]
    state = tl.zeros([BKP, BV], dtype=tl.float32)
    if HAS_H0:
        state += tl.load(h0_ptr + state_offsets(i_n, i_h, ks, vs, H, K, V), mask=state_mask, other=0.0)
    c_begin, c_end = tl.load(doc_chunks_ptr + i_n), tl.load(doc_chunks_ptr + i_n + 1)
    for i in range(0, c_end - c_begin):
        c = c_begin + i  # a loaded int32 scalar, so it widens to int64 in the offsets
        t0, t1 = tl.load(bounds_ptr + 2 * c), tl.load(bounds_ptr + 2 * c + 1)
        rows = t0 + tl.arange(0, BT)
        row_ok = rows < t1
        tl.store(states_ptr + state_offsets(c, i_h, ks, vs, H, K, V), state, mask=state_mask)
        w = load_tile(w_ptr, rows, row_ok, ks, k_ok, i_h, H, K)
        u_new = load_tile(u_ptr, rows, row_ok, vs, v_ok, i_h, H, V) - tl.dot(w, state, input_precision="ieee")
        store_tile(u_new_ptr, u_new, rows, row_ok, vs, v_ok, i_h, H, V)
        g = load_gates(gcum_ptr, rows, row_ok, ks, k_ok, i_h, H, K)
        g_last = load_gate_row(gcum_ptr, t1 - 1, ks, k_ok, i_h, H, K)
        k_to_end = load_tile(k_ptr, rows, row_ok, ks, k_ok, i_h, H, K) * decay(g_last[None, :] - g)
        state = state * decay(g_last)[:, None] + tl.dot(tl.trans(k_to_end), u_new, input_precision="ieee")
    if STORE_HT:
        tl.store(ht_ptr + state_offsets(i_n, i_h, ks, vs, H, K, V), state, mask=state_mask)


@triton.jit
def output_fwd_kernel(q_ptr, gcum_ptr, aqk_ptr, states_ptr, u_new_ptr, o_ptr, bounds_ptr, scale,
                      H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                      BK: tl.constexpr, BV: tl.constexpr):
    i_t, i_v, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    t0, t1 = tl.load(bounds_ptr + 2 * i_t), tl.load(bounds_ptr + 2 * i_t + 1)
    rows = t0 + tl.arange(0, BT)
    row_ok = rows < t1
    vs = i_v * BV + tl.arange(0, BV)
    cs = tl.arange(0, BT)
    v_ok = vs < V
    aqk = load_tile(aqk_ptr, rows, row_ok, cs, cs < BT, i_h, H, BT)
    u_new = load_tile(u_new_ptr, rows, row_ok, vs, v_ok, i_h, H, V)
    o = tl.dot(aqk, u_new, input_precision="ieee")
    for i_k in range(0, tl.cdiv(K, BK)):
        ks = i_k * BK + tl.arange(0, BK)
        k_ok = ks < K
        q_decayed = load_tile(q_ptr, rows, row_ok, ks, k_ok, i_h, H, K) * decay(
            load_gates(gcum_ptr, rows, row_ok, ks, k_ok, i_h, H, K)) * scale
        state = tl.load(states_ptr + state_offsets(i_t, i_h, ks, vs, H, K, V),
                        mask=k_ok[:, None] & v_ok[None, :], other=0.0)
        o += tl.dot(q_decayed, state, input_precision="ieee")
    store_tile(o_ptr, o, rows, row_ok, vs, v_ok, i_h, H, V)
