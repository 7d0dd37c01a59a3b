"""Backward Triton kernels of chunked KDA; notation as in kernels_fwd (S = state entering a chunk,
dS_end = gradient of the state leaving it, U_new = U - W S).

state_bwd_kernel (sequential, chunks in reverse, one program per document, head and V-block):
    dU_new = Aqk^T dO + (exp(G_last - G) * K) dS_end
    dS     = exp(G_last) * dS_end + scale (exp(G) * Q)^T dO - W^T dU_new
chunk_grads_kernel (per chunk): the terms that touch the chunk's states,
    dQ = scale dO S^T * exp(G),   dK = U_new dS_end^T * exp(G_last - G),   dW = -dU_new S^T,
    dAqk = dO U_new^T, and the gradient of the cumulative gate through exp(G), exp(G_last - G)
    and exp(G_last) * S.
wy_bwd_kernel (per chunk): through W = Tm (beta exp(G) K), U = Tm (beta V) and
    Tm = (I + Diag(beta) B)^-1, whose adjoint is dB = -Diag(beta) strict_lower(Tm^T dTm Tm^T).
pair_grads_kernel (per chunk, sub-chunk and K-block): through the pairwise scores
    P[i, j] = sum_c x_ic y_jc exp(G_ic - G_jc)  (x = q, y = k for Aqk; x = y = k for B):
    dx_ic = sum_j dP_ij y_jc exp(G_ic - G_jc),  dy_jc = sum_i dP_ij x_ic exp(G_ic - G_jc),
    dG_ic += x_ic dx_ic,  dG_jc -= y_jc dy_jc,
    with the same sub-chunk exponent rebasing as the forward scores. These are per channel, so the
    kernel tiles K across programs.
"""

import triton
import triton.language as tl

from .tiles import decay, load_gate_row, load_gates, load_tile, load_vec, state_offsets, store_tile


@triton.jit
def state_bwd_kernel(q_ptr, k_ptr, gcum_ptr, w_ptr, aqk_ptr, do_ptr, dht_ptr, d_states_ptr, du_new_ptr,
                     dh0_ptr, bounds_ptr, doc_chunks_ptr, scale, H: tl.constexpr, K: tl.constexpr,
                     V: tl.constexpr, BT: tl.constexpr, BKP: tl.constexpr, BV: tl.constexpr,
                     HAS_DHT: tl.constexpr, STORE_DH0: tl.constexpr):
    i_v, i_h, i_n = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    ks = tl.arange(0, BKP)
    vs = i_v * BV + tl.arange(0, BV)
    cs = tl.arange(0, BT)
    k_ok, v_ok = ks < K, vs < V
    state_mask = k_ok[:, None] & v_ok[None, :]
    d_state = tl.zeros([BKP, BV], dtype=tl.float32)
    if HAS_DHT:
        d_state += tl.load(dht_ptr + state_offsets(i_n, i_h, ks, vs, H, K, V), mask=state_mask, other=0.0)
    c_begin, c_end = tl.load(doc_chunks_ptr + i_n), tl.load(doc_chunks_ptr + i_n + 1)
    for i in range(0, c_end - c_begin):
        c = c_end - 1 - i
        t0, t1 = tl.load(bounds_ptr + 2 * c), tl.load(bounds_ptr + 2 * c + 1)
        rows = t0 + tl.arange(0, BT)
        row_ok = rows < t1
        tl.store(d_states_ptr + state_offsets(c, i_h, ks, vs, H, K, V), d_state, mask=state_mask)
        g = load_gates(gcum_ptr, rows, row_ok, ks, k_ok, i_h, H, K)
        g_last = load_gate_row(gcum_ptr, t1 - 1, ks, k_ok, i_h, H, K)
        k_to_end = load_tile(k_ptr, rows, row_ok, ks, k_ok, i_h, H, K) * decay(g_last[None, :] - g)
        aqk = load_tile(aqk_ptr, rows, row_ok, cs, cs < BT, i_h, H, BT)
        do = load_tile(do_ptr, rows, row_ok, vs, v_ok, i_h, H, V)
        du_new = (tl.dot(tl.trans(aqk), do, input_precision="ieee")
                  + tl.dot(k_to_end, d_state, input_precision="ieee"))
        store_tile(du_new_ptr, du_new, rows, row_ok, vs, v_ok, i_h, H, V)
        q_decayed = load_tile(q_ptr, rows, row_ok, ks, k_ok, i_h, H, K) * decay(g) * scale
        w = load_tile(w_ptr, rows, row_ok, ks, k_ok, i_h, H, K)
        d_state = (d_state * decay(g_last)[:, None] + tl.dot(tl.trans(q_decayed), do, input_precision="ieee")
                   - tl.dot(tl.trans(w), du_new, input_precision="ieee"))
    if STORE_DH0:
        tl.store(dh0_ptr + state_offsets(i_n, i_h, ks, vs, H, K, V), d_state, mask=state_mask)


@triton.jit
def chunk_grads_kernel(q_ptr, k_ptr, gcum_ptr, states_ptr, d_states_ptr, u_new_ptr, du_new_ptr, do_ptr,
                       dq_ptr, dk_ptr, dgcum_ptr, dw_ptr, daqk_ptr, bounds_ptr, scale,
                       H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                       BK: tl.constexpr, BV: tl.constexpr):
    """One chunk and K-block; the K-block-0 program also writes dAqk (it does not depend on K)."""
    i_t, i_k, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    t0, t1 = tl.load(bounds_ptr + 2 * i_t), tl.load(bounds_ptr + 2 * i_t + 1)
    rows = t0 + tl.arange(0, BT)
    row_ok = rows < t1
    ks = i_k * BK + tl.arange(0, BK)
    k_ok = ks < K
    dq_decayed = tl.zeros([BT, BK], dtype=tl.float32)
    dk_to_end = tl.zeros([BT, BK], dtype=tl.float32)
    dw = tl.zeros([BT, BK], dtype=tl.float32)
    state_dstate = tl.zeros([BK], dtype=tl.float32)  # sum_v S * dS_end, for d exp(G_last)
    for i_v in range(0, tl.cdiv(V, BV)):
        vs = i_v * BV + tl.arange(0, BV)
        v_ok = vs < V
        state_mask = k_ok[:, None] & v_ok[None, :]
        state = tl.load(states_ptr + state_offsets(i_t, i_h, ks, vs, H, K, V), mask=state_mask, other=0.0)
        d_state = tl.load(d_states_ptr + state_offsets(i_t, i_h, ks, vs, H, K, V), mask=state_mask, other=0.0)
        do = load_tile(do_ptr, rows, row_ok, vs, v_ok, i_h, H, V)
        u_new = load_tile(u_new_ptr, rows, row_ok, vs, v_ok, i_h, H, V)
        du_new = load_tile(du_new_ptr, rows, row_ok, vs, v_ok, i_h, H, V)
        dq_decayed += tl.dot(do, tl.trans(state), input_precision="ieee")
        dk_to_end += tl.dot(u_new, tl.trans(d_state), input_precision="ieee")
        dw -= tl.dot(du_new, tl.trans(state), input_precision="ieee")
        state_dstate += tl.sum(state * d_state, axis=1)
    q = load_tile(q_ptr, rows, row_ok, ks, k_ok, i_h, H, K)
    k = load_tile(k_ptr, rows, row_ok, ks, k_ok, i_h, H, K)
    g = load_gates(gcum_ptr, rows, row_ok, ks, k_ok, i_h, H, K)
    g_last = load_gate_row(gcum_ptr, t1 - 1, ks, k_ok, i_h, H, K)
    dq = dq_decayed * decay(g) * scale
    dk = dk_to_end * decay(g_last[None, :] - g)
    dg_last = tl.sum(k * dk, axis=0) + state_dstate * decay(g_last)
    dg = q * dq - k * dk + tl.where(rows[:, None] == t1 - 1, dg_last[None, :], 0.0)
    store_tile(dq_ptr, dq, rows, row_ok, ks, k_ok, i_h, H, K)
    store_tile(dk_ptr, dk, rows, row_ok, ks, k_ok, i_h, H, K)
    store_tile(dgcum_ptr, dg, rows, row_ok, ks, k_ok, i_h, H, K)
    store_tile(dw_ptr, dw, rows, row_ok, ks, k_ok, i_h, H, K)
    if i_k == 0:
        cs = tl.arange(0, BT)
        daqk = tl.zeros([BT, BT], dtype=tl.float32)
        for i_v in range(0, tl.cdiv(V, BV)):
            vs = i_v * BV + tl.arange(0, BV)
            do = load_tile(do_ptr, rows, row_ok, vs, vs < V, i_h, H, V)
            u_new = load_tile(u_new_ptr, rows, row_ok, vs, vs < V, i_h, H, V)
            daqk += tl.dot(do, tl.trans(u_new), input_precision="ieee")
        daqk = tl.where(cs[:, None] >= cs[None, :], daqk * scale, 0.0)
        store_tile(daqk_ptr, daqk, rows, row_ok, cs, cs < BT, i_h, H, BT)


@triton.jit
def wy_bwd_kernel(k_ptr, v_ptr, gcum_ptr, beta_ptr, b_ptr, tm_ptr, dw_ptr, du_ptr,
                  dk_ptr, dv_ptr, dgcum_ptr, dbeta_ptr, db_ptr, bounds_ptr,
                  H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                  BK: tl.constexpr, BV: tl.constexpr):
    i_t, i_h = tl.program_id(0), tl.program_id(1)
    t0, t1 = tl.load(bounds_ptr + 2 * i_t), tl.load(bounds_ptr + 2 * i_t + 1)
    rows = t0 + tl.arange(0, BT)
    row_ok = rows < t1
    cs = tl.arange(0, BT)
    beta = load_vec(beta_ptr, rows, row_ok, i_h, H)
    tm = load_tile(tm_ptr, rows, row_ok, cs, cs < BT, i_h, H, BT)
    d_tm = tl.zeros([BT, BT], dtype=tl.float32)
    dbeta = tl.zeros([BT], dtype=tl.float32)
    for i_k in range(0, tl.cdiv(K, BK)):
        ks = i_k * BK + tl.arange(0, BK)
        k_ok = ks < K
        k_gated = load_tile(k_ptr, rows, row_ok, ks, k_ok, i_h, H, K) * decay(
            load_gates(gcum_ptr, rows, row_ok, ks, k_ok, i_h, H, K))
        dw = load_tile(dw_ptr, rows, row_ok, ks, k_ok, i_h, H, K)
        d_tm += tl.dot(dw, tl.trans(beta[:, None] * k_gated), input_precision="ieee")
        dk_beta = tl.dot(tl.trans(tm), dw, input_precision="ieee")
        dbeta += tl.sum(dk_beta * k_gated, axis=1)
        dk_gated = dk_beta * beta[:, None]
        store_tile(dk_ptr, dk_gated * decay(load_gates(gcum_ptr, rows, row_ok, ks, k_ok, i_h, H, K)),
                   rows, row_ok, ks, k_ok, i_h, H, K)
        store_tile(dgcum_ptr, dk_gated * k_gated, rows, row_ok, ks, k_ok, i_h, H, K)
    for i_v in range(0, tl.cdiv(V, BV)):
        vs = i_v * BV + tl.arange(0, BV)
        v_ok = vs < V
        v = load_tile(v_ptr, rows, row_ok, vs, v_ok, i_h, H, V)
        du = load_tile(du_ptr, rows, row_ok, vs, v_ok, i_h, H, V)
        d_tm += tl.dot(du, tl.trans(beta[:, None] * v), input_precision="ieee")
        dv_beta = tl.dot(tl.trans(tm), du, input_precision="ieee")
        dbeta += tl.sum(dv_beta * v, axis=1)
        store_tile(dv_ptr, dv_beta * beta[:, None], rows, row_ok, vs, v_ok, i_h, H, V)
    tm_t = tl.trans(tm)
    d_a = -tl.dot(tl.dot(tm_t, d_tm, input_precision="ieee"), tm_t, input_precision="ieee")
    d_a = tl.where(cs[:, None] > cs[None, :], d_a, 0.0)
    b = load_tile(b_ptr, rows, row_ok, cs, cs < BT, i_h, H, BT)
    dbeta += tl.sum(d_a * b, axis=1)
    tl.store(dbeta_ptr + rows.to(tl.int64) * H + i_h, dbeta, mask=row_ok)
    store_tile(db_ptr, d_a * beta[:, None], rows, row_ok, cs, cs < BT, i_h, H, BT)


@triton.jit
def pair_grads_kernel(q_ptr, k_ptr, gcum_ptr, daqk_ptr, db_ptr, dq_ptr, dk_ptr, dgcum_ptr, bounds_ptr,
                      H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
                      BK: tl.constexpr):
    """Gradients through Aqk and B for the rows of one sub-chunk and one K-block."""
    i_t, i_ik, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    n_k: tl.constexpr = (K + BK - 1) // BK
    i_i, i_k = i_ik // n_k, i_ik % n_k
    t0, t1 = tl.load(bounds_ptr + 2 * i_t), tl.load(bounds_ptr + 2 * i_t + 1)
    r0 = t0 + i_i * BC
    if r0 < t1:
        sub = tl.arange(0, BC)
        rows = r0 + sub
        row_ok = rows < t1
        ks = i_k * BK + tl.arange(0, BK)
        k_ok = ks < K
        q_i = load_tile(q_ptr, rows, row_ok, ks, k_ok, i_h, H, K)
        k_i = load_tile(k_ptr, rows, row_ok, ks, k_ok, i_h, H, K)
        g_i = load_gates(gcum_ptr, rows, row_ok, ks, k_ok, i_h, H, K)
        g_ref = load_gate_row(gcum_ptr, r0, ks, k_ok, i_h, H, K)
        # Row side (this sub-chunk as i) from earlier sub-chunks j, rebased on row r0.
        dq = tl.zeros([BC, BK], dtype=tl.float32)
        dk_row = tl.zeros([BC, BK], dtype=tl.float32)
        for i_j in range(0, i_i):
            cols = t0 + i_j * BC + sub
            k_j = load_tile(k_ptr, cols, cols < t1, ks, k_ok, i_h, H, K) * decay(
                g_ref[None, :] - load_gates(gcum_ptr, cols, cols < t1, ks, k_ok, i_h, H, K))
            daqk = load_tile(daqk_ptr, rows, row_ok, i_j * BC + sub, sub < BC, i_h, H, BT)
            db = load_tile(db_ptr, rows, row_ok, i_j * BC + sub, sub < BC, i_h, H, BT)
            dq += tl.dot(daqk, k_j, input_precision="ieee")
            dk_row += tl.dot(db, k_j, input_precision="ieee")
        row_decay = decay(g_i - g_ref[None, :])
        dq *= row_decay
        dk_row *= row_decay
        # Diagonal block, both sides; the stored dAqk / dB are already causally masked.
        causal = sub[:, None] >= sub[None, :]
        pair_decay = decay(tl.where(causal[:, :, None], g_i[:, None, :] - g_i[None, :, :], float("-inf")))
        daqk = load_tile(daqk_ptr, rows, row_ok, i_i * BC + sub, sub < BC, i_h, H, BT)
        db = load_tile(db_ptr, rows, row_ok, i_i * BC + sub, sub < BC, i_h, H, BT)
        dq += tl.sum(daqk[:, :, None] * k_i[None, :, :] * pair_decay, axis=1)
        dk_row += tl.sum(db[:, :, None] * k_i[None, :, :] * pair_decay, axis=1)
        dk_col = tl.sum((daqk[:, :, None] * q_i[:, None, :] + db[:, :, None] * k_i[:, None, :]) * pair_decay,
                        axis=0)
        # Column side (this sub-chunk as j) from later sub-chunks i, rebased on their first row.
        for i_l in range(i_i + 1, tl.cdiv(t1 - t0, BC)):
            r_l = t0 + i_l * BC
            rows_l = r_l + sub
            ok_l = rows_l < t1
            g_ref_l = load_gate_row(gcum_ptr, r_l, ks, k_ok, i_h, H, K)
            decay_l = decay(load_gates(gcum_ptr, rows_l, ok_l, ks, k_ok, i_h, H, K) - g_ref_l[None, :])
            q_l = load_tile(q_ptr, rows_l, ok_l, ks, k_ok, i_h, H, K) * decay_l
            k_l = load_tile(k_ptr, rows_l, ok_l, ks, k_ok, i_h, H, K) * decay_l
            daqk_l = load_tile(daqk_ptr, rows_l, ok_l, i_i * BC + sub, sub < BC, i_h, H, BT)
            db_l = load_tile(db_ptr, rows_l, ok_l, i_i * BC + sub, sub < BC, i_h, H, BT)
            dk_col += decay(g_ref_l[None, :] - g_i) * (
                tl.dot(tl.trans(daqk_l), q_l, input_precision="ieee")
                + tl.dot(tl.trans(db_l), k_l, input_precision="ieee"))
        dg = q_i * dq + k_i * dk_row - k_i * dk_col
        store_tile(dq_ptr, dq, rows, row_ok, ks, k_ok, i_h, H, K)
        store_tile(dk_ptr, dk_row + dk_col, rows, row_ok, ks, k_ok, i_h, H, K)
        store_tile(dgcum_ptr, dg, rows, row_ok, ks, k_ok, i_h, H, K)
