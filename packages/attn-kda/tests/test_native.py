"""The ``native`` backend: each chunk's gated Grams and triangular solve by C kernels, against their float64
definitions (LAPACK's solver for the solve), and the whole op against the token-loop oracle.

Tolerances as in test_ops.py (fp32 against float64, relative to the largest value). Sizes: the chunk the
kernels are compiled for (64 rows of 64) and run-time ones (rows of 5 and 24), gates from -1e-3 to -60 per
token (exponents far below fp32's range), one thread and two (which split the chunks).
"""

from __future__ import annotations

import math

import pytest
import torch

from megaseq_kda.backends import BACKENDS
from megaseq_kda.ops import chunk_kda, naive_recurrent_kda
from megaseq_kda.ops.native import LIBRARY, NativeGrams, NativeSolve, chunk_kda_native, gated_grams

pytestmark = pytest.mark.skipif(LIBRARY.unavailable() is not None, reason="no C compiler builds the kernels")


def by_definition(k: torch.Tensor, q: torch.Tensor, G: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A_kk (j < s) and A_qk (j <= s) of every chunk, formed directly from the definition."""
    decay = torch.exp((G[..., :, None, :] - G[..., None, :, :]).clamp_max(0))  # [.., s, j, K]
    lower = torch.ones(G.shape[-2], G.shape[-2], dtype=torch.bool).tril()
    A_kk = torch.einsum("...sd,...jd,...sjd->...sj", k, k, decay).masked_fill(~lower, 0).tril(-1)
    A_qk = torch.einsum("...sd,...jd,...sjd->...sj", q, k, decay).masked_fill(~lower, 0)
    return A_kk, A_qk


def assert_close(got: torch.Tensor, want: torch.Tensor, what: str, tol: float = 2e-6) -> None:
    err = ((got.double() - want.double()).abs().max() / want.abs().max().clamp_min(1e-30)).item()
    assert err <= tol, f"{what}: relative error {err:.3g} > {tol:g}"


def grams_inputs(rows: int, dim: int, chunks: int, seed: int, lowest: float = 5.0):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(2, chunks, rows, dim, generator=gen) for _ in range(2))
    g = -torch.logspace(-3, math.log10(lowest), 2 * chunks * rows * dim, dtype=torch.float64)
    g = g[torch.randperm(len(g), generator=gen)].view(2, chunks, rows, dim)
    return k, q, g.cumsum(-2)


@pytest.mark.parametrize("rows,dim", [(64, 64), (5, 3), (24, 16)], ids=["compiled-sizes", "tiny", "run-time-sizes"])
@pytest.mark.parametrize("lowest", [5.0, 60.0])
def test_native_grams_and_their_gradients_equal_the_definition(rows: int, dim: int, lowest: float, intra_op_threads: int):
    k, q, G = grams_inputs(rows, dim, chunks=3, seed=rows + dim)
    weights = [torch.randn(2, 3, rows, rows, generator=torch.Generator().manual_seed(7)) for _ in range(2)]

    def run(grams, dtype):
        leaves = [x.detach().to(dtype).clone().requires_grad_() for x in (k, q)] + [G.clone().requires_grad_()]
        out = grams(*leaves)
        sum((w.to(dtype) * a).sum() for w, a in zip(weights, out, strict=True)).backward()
        return (*out, *(x.grad for x in leaves))

    got, want = run(NativeGrams.apply, torch.float32), run(by_definition, torch.float64)
    for name, a, b in zip(["A_kk", "A_qk", "dk", "dq", "dG"], got, want, strict=True):
        assert_close(a, b, name)
    assert got[-1].dtype == torch.float64


@pytest.mark.parametrize("rows,columns", [(64, 128), (16, 7), (5, 64)], ids=["compiled-sizes", "run-time-sizes", "tiny"])
def test_native_solve_and_its_gradients_equal_lapack(rows: int, columns: int, intra_op_threads: int):
    """X = (I + strict_lower(A))^{-1} B, with garbage on and above A's diagonal (never read), and the gradients
    of A (its strict lower part; zero elsewhere) and B, against torch.linalg.solve_triangular in float64."""
    gen = torch.Generator().manual_seed(rows + columns)
    A = torch.randn(2, 3, rows, rows, generator=gen) * 0.3
    B = torch.randn(2, 3, rows, columns, generator=gen)
    weight = torch.randn(2, 3, rows, columns, generator=gen)

    def run(solve, dtype):
        a, b = (x.detach().to(dtype).clone().requires_grad_() for x in (A, B))
        x = solve(a, b)
        (weight.to(dtype) * x).sum().backward()
        return x, a.grad, b.grad

    def lapack(a, b):
        return torch.linalg.solve_triangular(a, b, upper=False, unitriangular=True)

    got, want = run(NativeSolve.apply, torch.float32), run(lapack, torch.float64)
    for name, a, b in zip(["X", "dA", "dB"], got, want, strict=True):
        assert_close(a, b, name)
    assert (got[1].triu() == 0).all()


def test_native_grams_take_the_pytorch_path_for_float64():
    k, q, G = grams_inputs(16, 4, chunks=2, seed=1)
    k, q = k.double(), q.double()
    from megaseq_kda.ops.chunk import _GatedGrams

    for a, b in zip(gated_grams(k, q, G), _GatedGrams.apply(k, q, G), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("documents", [None, [0, 37, 38, 150]], ids=["one-sequence", "packed"])
def test_native_op_equals_the_oracle_and_the_pytorch_op(documents: list[int] | None, intra_op_threads: int):
    """The whole op, outputs, final states and every gradient, with the initial state, against the float64
    token loop; and within fp32 rounding of the PyTorch op."""
    gen = torch.Generator().manual_seed(3)
    T, H, K, V = 150, 2, 16, 8
    batch = 1 if documents else 2
    n_seqs = len(documents) - 1 if documents else batch
    cu = torch.tensor(documents) if documents else None
    q = torch.randn(batch, T, H, K, generator=gen)
    k = torch.nn.functional.normalize(torch.randn(batch, T, H, K, generator=gen), dim=-1)
    v = torch.randn(batch, T, H, V, generator=gen)
    g = -torch.rand(batch, T, H, K, generator=gen) * 2
    beta = torch.rand(batch, T, H, generator=gen)
    h0 = torch.randn(n_seqs, H, K, V, generator=gen)
    d_o = torch.randn(batch, T, H, V, generator=gen)

    def run(op, dtype):
        leaves = [x.detach().to(dtype).clone().requires_grad_() for x in (q, k, v, g, beta, h0)]
        o, final = op(*leaves[:5], initial_state=leaves[5], output_final_state=True, cu_seqlens=cu)
        ((o * d_o.to(dtype)).sum() + final.square().sum()).backward()
        return (o, final, *(x.grad for x in leaves))

    got = run(chunk_kda_native, torch.float32)
    for want, tol in ((run(naive_recurrent_kda, torch.float64), 1e-5), (run(chunk_kda, torch.float32), 1e-5)):
        for a, b in zip(got, want, strict=True):
            assert_close(a, b, "op", tol)


def test_auto_takes_native_on_cpu():
    assert BACKENDS.select("auto", "cpu").name == "native"
