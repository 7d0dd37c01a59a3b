"""Chunked KDA on CPU with its intra-chunk steps by C kernels (``grams.c``, ``solve.c``): the ``native`` backend.

``chunk_kda_native`` is ``megaseq_kda.ops.chunk_kda`` (same arguments, results and memory) except for two
steps of each chunk: the gated Grams, which ``grams.c`` forms from their definition, forward and backward,
instead of ``_GatedGrams``' rebased blocks, and the unit lower-triangular solve, by substitution in
``solve.c`` instead of LAPACK's (the files' comments say why); their errors against float64 are the same order
(tests/test_native.py). fp32 only: float64 inputs take ``_GatedGrams`` (the op computes in fp32 for bf16
inputs). The library is built on first use by core's ``megaseq.native.NativeLibrary``. Chunks are independent:
``torch.get_num_threads()`` threads of core's pool split them (``megaseq.native.run_at_once``; ctypes releases
the GIL).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path
from typing import Any

import torch

from megaseq.native import NativeLibrary, ranges, run_at_once
from megaseq_kda.ops.chunk import IntraChunkKernels, _GatedGrams, chunk_kda_with


def _declare(lib: ctypes.CDLL) -> None:
    size, pointer = ctypes.c_int64, ctypes.c_void_p
    lib.kda_grams_forward.restype = None
    lib.kda_grams_forward.argtypes = [size] * 4 + [pointer] * 5
    lib.kda_grams_backward.restype = None
    lib.kda_grams_backward.argtypes = [size] * 4 + [pointer] * 9
    for name in ("kda_unit_lower_solve", "kda_unit_lower_solve_adjoint"):
        getattr(lib, name).restype = None
        getattr(lib, name).argtypes = [size] * 4 + [pointer] * 3


LIBRARY = NativeLibrary("megaseq-kda", list(Path(__file__).parent.glob("*.c")), _declare)
unavailable = LIBRARY.unavailable


def _over_chunks(n: int, run: Any) -> None:
    """``run(first, end)`` over contiguous ranges of the ``n`` chunks, one per thread, at once."""
    run_at_once([functools.partial(run, a, b) for a, b in ranges(n, torch.get_num_threads())])


class NativeGrams(torch.autograd.Function):
    """``_GatedGrams`` by ``grams.c``: ``(k, q [..., L, K] fp32, G [..., L, K] float64)`` -> ``(A_kk, A_qk)
    [..., L, L]``."""

    @staticmethod
    def forward(ctx: Any, k: torch.Tensor, q: torch.Tensor, G: torch.Tensor):  # type: ignore[override]
        k, q, G = (x.contiguous() for x in (k, q, G))
        *lead, L, K = k.shape
        n = k[..., 0, 0].numel()
        A_kk, A_qk = (k.new_empty(*lead, L, L) for _ in range(2))
        lib = LIBRARY.load()
        _over_chunks(n, lambda a, b: lib.kda_grams_forward(
            a, b, L, K, k.data_ptr(), q.data_ptr(), G.data_ptr(), A_kk.data_ptr(), A_qk.data_ptr()))
        ctx.save_for_backward(k, q, G)
        return A_kk, A_qk

    @staticmethod
    def backward(ctx: Any, d_kk: torch.Tensor, d_qk: torch.Tensor):  # type: ignore[override]
        k, q, G = ctx.saved_tensors
        *_, L, K = k.shape
        n = k[..., 0, 0].numel()
        d_kk, d_qk = d_kk.contiguous(), d_qk.contiguous()
        dk, dq, dG = torch.zeros_like(k), torch.zeros_like(q), torch.zeros_like(G)
        lib = LIBRARY.load()

        def run(a: int, b: int) -> None:
            scratch = torch.empty(4 * K)  # a row's gradients: 2 K floats and K doubles
            lib.kda_grams_backward(a, b, L, K, k.data_ptr(), q.data_ptr(), G.data_ptr(), d_kk.data_ptr(),
                                   d_qk.data_ptr(), dk.data_ptr(), dq.data_ptr(), dG.data_ptr(), scratch.data_ptr())

        _over_chunks(n, run)
        return dk, dq, dG


class NativeSolve(torch.autograd.Function):
    """``solve_triangular(A, B, upper=False, unitriangular=True)`` by ``solve.c``: ``(A [..., L, L], B [..., L,
    N])`` fp32 -> X = (I + strict_lower(A))^{-1} B; backward dB = (I + strict_lower(A))^{-T} dX and
    dA = -strict_lower(dB X^T)."""

    @staticmethod
    def forward(ctx: Any, A: torch.Tensor, B: torch.Tensor):  # type: ignore[override]
        A, B = A.contiguous(), B.contiguous()
        *_, L, N = B.shape
        X = torch.empty_like(B)
        lib = LIBRARY.load()
        _over_chunks(A[..., 0, 0].numel(), lambda a, b: lib.kda_unit_lower_solve(
            a, b, L, N, A.data_ptr(), B.data_ptr(), X.data_ptr()))
        ctx.save_for_backward(A, X)
        return X

    @staticmethod
    def backward(ctx: Any, dX: torch.Tensor):  # type: ignore[override]
        A, X = ctx.saved_tensors
        dX = dX.contiguous()
        *_, L, N = X.shape
        dB = torch.empty_like(dX)
        lib = LIBRARY.load()
        _over_chunks(A[..., 0, 0].numel(), lambda a, b: lib.kda_unit_lower_solve_adjoint(
            a, b, L, N, A.data_ptr(), dX.data_ptr(), dB.data_ptr()))
        dA = (dB @ X.mT).tril_(-1).neg_() if ctx.needs_input_grad[0] else None
        return dA, dB


def unit_lower_solve(A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    """(I + strict_lower(A))^{-1} B: by the kernels for fp32, else by ``torch.linalg.solve_triangular``."""
    if A.dtype == B.dtype == torch.float32:
        return NativeSolve.apply(A, B)
    return torch.linalg.solve_triangular(A, B, upper=False, unitriangular=True)


def gated_grams(k: torch.Tensor, q: torch.Tensor, G: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The Grams of every chunk: by the kernels for fp32 rows, by ``_GatedGrams`` otherwise."""
    if k.dtype == q.dtype == torch.float32 and G.dtype == torch.float64:
        return NativeGrams.apply(k, q, G)
    return _GatedGrams.apply(k, q, G)


NATIVE_KERNELS = IntraChunkKernels(grams=gated_grams, solve=unit_lower_solve)


def chunk_kda_native(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``megaseq_kda.ops.chunk_kda`` (same arguments) with the Grams and the triangular solves by the kernels."""
    return chunk_kda_with(NATIVE_KERNELS, *args, **kwargs)


__all__ = [
    "LIBRARY", "NATIVE_KERNELS", "NativeGrams", "NativeSolve", "chunk_kda_native", "gated_grams", "unavailable",
    "unit_lower_solve",
]
