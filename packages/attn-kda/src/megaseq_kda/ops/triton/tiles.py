"""Tile load/store helpers shared by the KDA Triton kernels.

Every per-token tensor is stored token-major as ``[T_total, H, D]`` (all documents packed along T), so a
tile is addressed by a vector of token rows, a head and a vector of feature columns. Offsets are formed
in int64 because ``T_total * H * D`` exceeds 2**31 at million-token lengths. Loads return fp32 so every
kernel accumulates in fp32 whatever the input dtype, except the cumulative gates: ``load_gates`` keeps them
in float64, so that the difference of two cumulative sums (an exponent) is exact before it is rounded.
"""

import triton
import triton.language as tl


@triton.jit
def load_tile(ptr, rows, row_ok, cols, col_ok, i_h, H: tl.constexpr, D: tl.constexpr):
    offs = (rows.to(tl.int64)[:, None] * H + i_h) * D + cols[None, :]
    return tl.load(ptr + offs, mask=row_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)


@triton.jit
def store_tile(ptr, value, rows, row_ok, cols, col_ok, i_h, H: tl.constexpr, D: tl.constexpr):
    offs = (rows.to(tl.int64)[:, None] * H + i_h) * D + cols[None, :]
    tl.store(ptr + offs, value.to(ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def load_gates(ptr, rows, row_ok, cols, col_ok, i_h, H: tl.constexpr, D: tl.constexpr):
    """A tile of the float64 cumulative gates, kept in float64."""
    offs = (rows.to(tl.int64)[:, None] * H + i_h) * D + cols[None, :]
    return tl.load(ptr + offs, mask=row_ok[:, None] & col_ok[None, :], other=0.0)


@triton.jit
def load_gate_row(ptr, row, cols, col_ok, i_h, H: tl.constexpr, D: tl.constexpr):
    """One token's float64 cumulative gates, e.g. at a sub-chunk's first row (the rebasing point)."""
    offs = (row.to(tl.int64) * H + i_h) * D + cols
    return tl.load(ptr + offs, mask=col_ok, other=0.0)


@triton.jit
def load_vec(ptr, rows, row_ok, i_h, H: tl.constexpr):
    """A per-token scalar (beta) for a vector of rows, from a ``[T_total, H]`` tensor."""
    return tl.load(ptr + rows.to(tl.int64) * H + i_h, mask=row_ok, other=0.0).to(tl.float32)


@triton.jit
def state_offsets(i_s, i_h, ks, vs, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr):
    """Offsets of a [K-block, V-block] tile of state ``i_s`` in a ``[N_states, H, K, V]`` tensor."""
    return ((i_s.to(tl.int64) * H + i_h) * K + ks[:, None]) * V + vs[None, :]


@triton.jit
def decay(log_ratio):
    """exp of a log-decay ratio (a float64 difference of cumulative gates), which is <= 0 wherever the result
    is used, evaluated in fp32.

    Cumulative gates are non-increasing, so the ratio is positive only on padding rows (loaded as 0)
    whose other factor is 0; clamping there keeps 0 * exp(big) from turning into NaN.
    """
    return tl.exp(tl.minimum(log_ratio, 0.0).to(tl.float32))
