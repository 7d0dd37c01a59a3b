"""The ``native`` backend's C kernels against the float64 oracles, on awkward sizes.

Selection: integer-valued inputs (small integers: every score, with pooled keys' quarter means, is exact in
fp32, so the choice must equal the oracle's key for key, ties included: relu's zeros and equal sums are
common), at the index sizes compiled with constants (4 heads of 32) and at run-time sizes, with pooling, its
tails, documents, queries at given key positions, rows long enough for the tile-maxima bound (more than 16 k
visible blocks) and rows shorter than k.

Tolerance as in test_ops.py: max |native - oracle| <= 1e-5 * max(1, max |oracle|), the oracle in float64.
Shapes: run-time sizes (3 heads of 16, values of 12 beside or inside the keys, 2 index heads of 8) and the
sizes the kernels are compiled for with constants (4 heads of 64 with the values inside the keys, 4 index
heads of 32: the default recipe's); rows with -1 holes, ragged padding, empty rows, more keys than queries,
two batch rows; one thread and two (whose per-thread copies of the key rows' gradients must be summed).
"""

from __future__ import annotations

import logging

import pytest
import torch

from megaseq.backends import Backend, Backends
from megaseq_dsa import backends as dsa_backends
from megaseq_dsa.indexer import indexer_kl
from megaseq_dsa.ops import native, select_topk, select_topk_reference, selection_recall, sparse_attention_reference
from megaseq_dsa.ops import sparse as pytorch_path
from megaseq_dsa.ops.native import build as native_build

pytestmark = pytest.mark.skipif(native_build.unavailable() is not None, reason="no C compiler builds the kernels")

TOL = 1e-5

# (heads, dim, dim_v, index heads, index dim, values inside the keys)
SHAPES = {
    "run-time-sizes": (3, 16, 12, 2, 8, False),
    "run-time-sizes-shared": (3, 16, 12, 2, 8, True),
    "compiled-sizes": (4, 64, 64, 4, 32, True),
}


def assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert not torch.isnan(got).any()
    bound = TOL * want.abs().max().clamp_min(1).item()
    err = (got.double() - want.double()).abs().max().item()
    assert err <= bound, f"max abs error {err:.3g} > {bound:.3g}"


def awkward_indices(batch: int, n_queries: int, n_keys: int, slots: int, seed: int) -> torch.Tensor:
    """Distinct keys per row with ragged -1 padding, -1 holes inside rows, an empty row and a row whose only
    index is in the last slot."""
    gen = torch.Generator().manual_seed(seed)
    rows = torch.stack([torch.randperm(n_keys, generator=gen)[:slots] for _ in range(batch * n_queries)])
    counts = torch.randint(0, slots + 1, (batch * n_queries, 1), generator=gen)
    rows = torch.where(torch.arange(slots) < counts, rows, -1).view(batch, n_queries, slots)
    rows[:, 2, 1:slots:3] = -1  # holes
    rows[0, 0] = -1  # nothing selected
    rows[-1, 3] = -1
    rows[-1, 3, -1] = 1  # a single index, in the last slot
    return rows.int()


def inputs(shape: str, n_queries: int = 37, n_keys: int = 53, slots: int = 23, seed: int = 0):
    heads, dim, dim_v, index_heads, index_dim, shared = SHAPES[shape]
    gen = torch.Generator().manual_seed(seed)

    def randn(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=gen, dtype=torch.float64)

    tensors = {
        "q": randn(2, n_queries, heads, dim),
        "k": randn(2, n_keys, dim),
        "v": randn(2, n_keys, dim_v),
        "q_idx": randn(2, n_queries, index_heads, index_dim),
        "k_idx": randn(2, n_keys, index_dim),
        "weights": randn(2, n_queries, index_heads),
        "grad_out": randn(2, n_queries, heads, dim_v),
    }
    return tensors, awkward_indices(2, n_queries, n_keys, slots, seed + 1), shared, dim_v


def run_attention(fn, tensors, indices, shared: bool, dim_v: int, dtype: torch.dtype):
    """Output and gradients of q, k, v (v's inside k's when shared)."""
    q, k, v = (tensors[name].to(dtype).requires_grad_() for name in ("q", "k", "v"))
    values = k[..., :dim_v] if shared else v
    out = fn(q, k, values, indices, 0.3)
    grads = torch.autograd.grad(out, (q, k) if shared else (q, k, v), tensors["grad_out"].to(dtype))
    return out, *grads


@pytest.mark.parametrize("shape", SHAPES)
def test_native_attention_matches_the_reference(shape: str, intra_op_threads: int):
    tensors, indices, shared, dim_v = inputs(shape)
    got = run_attention(native.sparse_attention, tensors, indices, shared, dim_v, torch.float32)
    want = run_attention(sparse_attention_reference, tensors, indices, shared, dim_v, torch.float64)
    for a, b in zip(got, want, strict=True):
        assert a.dtype == torch.float32
        assert_close(a, b)


@pytest.mark.parametrize("shape", SHAPES)
def test_native_attention_with_indexer_kl_matches_the_reference(shape: str, intra_op_threads: int):
    """Outputs, the summed KL and every gradient (the attention's from the output, the indexer's from the
    loss) against sparse_attention_reference and indexer_kl in float64, with more keys than queries."""
    tensors, indices, shared, dim_v = inputs(shape, seed=4)
    n_queries, n_keys = tensors["q"].shape[1], tensors["k"].shape[1]
    positions = torch.arange(n_keys - n_queries, n_keys)

    def run(fused: bool, dtype: torch.dtype):
        leaves = {name: tensors[name].to(dtype).requires_grad_() for name in ("q", "k", "v", "q_idx", "k_idx", "weights")}
        q, k, v, qi, ki, w = leaves.values()
        values = k[..., :dim_v] if shared else v
        if fused:
            out, kl = native.sparse_attention_with_indexer_kl(q, k, values, indices, 0.3, qi, ki, w)
        else:
            out = sparse_attention_reference(q, k, values, indices, 0.3)
            kl = indexer_kl(qi, ki, w, q, k, 0.3, positions, torch.zeros(n_keys, dtype=torch.long), indices, 4)
        kl_grads = torch.autograd.grad(kl, (qi, ki, w), retain_graph=True)
        out_grads = torch.autograd.grad(out, (q, k) if shared else (q, k, v), tensors["grad_out"].to(dtype))
        return out, kl, *kl_grads, *out_grads

    got, want = run(True, torch.float32), run(False, torch.float64)
    assert want[1] > 0
    for a, b in zip(got, want, strict=True):
        assert_close(a, b)


def test_native_empty_rows_give_zero_and_no_nan():
    tensors, _, _, _ = inputs("compiled-sizes", n_queries=10, n_keys=10, slots=8)
    indices = torch.full((2, 10, 64), -1, dtype=torch.int32)
    indices[1, 4, 5] = 2
    out, dq, dk = run_attention(native.sparse_attention, tensors, indices, True, 64, torch.float32)
    assert (out[0] == 0).all() and (out[1, :4] == 0).all() and (out[1, 5:] == 0).all()
    torch.testing.assert_close(out[1, 4], tensors["k"][1, 2].float().expand(4, -1))
    assert (dq[0] == 0).all() and (dk[0] == 0).all() and not dq.isnan().any() and not dk.isnan().any()


def test_native_bf16_keeps_dtype_and_float64_runs_the_pytorch_path():
    tensors, indices, shared, dim_v = inputs("run-time-sizes")
    out = run_attention(native.sparse_attention, tensors, indices, shared, dim_v, torch.bfloat16)
    assert all(x.dtype == torch.bfloat16 for x in out)
    want = sparse_attention_reference(*(tensors[n] for n in ("q", "k", "v")), indices, 0.3)
    assert (out[0].double() - want).abs().max() < 3e-2
    got = run_attention(native.sparse_attention, tensors, indices, shared, dim_v, torch.float64)
    same = run_attention(pytorch_path.sparse_attention, tensors, indices, shared, dim_v, torch.float64)
    for a, b in zip(got, same, strict=True):
        assert torch.equal(a, b)


def test_native_bounds_the_copies_of_row_gradients(monkeypatch: pytest.MonkeyPatch, intra_op_threads: int):
    """A pass takes one thread when an extra thread's copy of the key rows' gradients would pass the bound,
    and gives the same results."""
    assert native._threads(1000, 64) == intra_op_threads
    monkeypatch.setattr(native, "ROW_GRADIENT_BYTES", 4 * 1000 * 64 - 1)
    assert native._threads(1000, 64) == 1
    tensors, indices, shared, dim_v = inputs("compiled-sizes")
    got = run_attention(native.sparse_attention, tensors, indices, shared, dim_v, torch.float32)
    want = run_attention(sparse_attention_reference, tensors, indices, shared, dim_v, torch.float64)
    for a, b in zip(got, want, strict=True):
        assert_close(a, b)


def test_a_failed_build_says_why(monkeypatch: pytest.MonkeyPatch, tmp_path):
    monkeypatch.setenv("MEGASEQ_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "false")
    with pytest.raises(RuntimeError, match="false could not build select.c, sparse.c"):
        native_build.LIBRARY.build()
    assert not list(tmp_path.rglob("*.so"))


def test_auto_takes_native_on_cpu_and_passes_it_over_when_it_cannot_build(caplog: pytest.LogCaptureFixture):
    assert dsa_backends.BACKENDS.select("auto", "cpu").name == "native"
    broken = [
        Backend(b.name, b.load, b.requires, b.install, b.devices, b.interpretable,
                (lambda: "no C compiler") if b.name == "native" else b.unavailable)
        for b in dsa_backends.BACKENDS.backends.values()
    ]
    backends = Backends("attention.dsa", broken, dsa_backends.BACKENDS.auto)
    with caplog.at_level(logging.INFO, logger="megaseq.backends"):
        assert backends.select("auto", "cpu").name == "torch"
    assert "native: no C compiler" in caplog.text
    with pytest.raises(ValueError, match="backend 'native' cannot run here: no C compiler"):
        backends.select("native", "cpu")


def integer_indexer_inputs(n_keys: int, n_queries: int, heads: int, dim: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-2, 3, (2, n_queries, heads, dim), generator=gen).float()
    k = torch.randint(-2, 3, (2, n_keys, dim), generator=gen).float()
    w = torch.randint(-2, 3, (2, n_queries, heads), generator=gen).float()
    return q, k, w


@pytest.mark.parametrize("heads,dim", [(4, 32), (3, 8)], ids=["compiled-sizes", "run-time-sizes"])
@pytest.mark.parametrize("pool,topk", [(1, 8), (4, 24), (4, 512)])
def test_native_selection_equals_the_reference_exactly(heads: int, dim: int, pool: int, topk: int, intra_op_threads: int):
    n = 700
    q, k, w = integer_indexer_inputs(n, n, heads, dim, seed=pool + topk)
    got = native.select_topk(q, k, w, topk, pool=pool)
    assert torch.equal(got, select_topk_reference(q.double(), k.double(), w.double(), topk, pool=pool))
    # queries at given key positions, over packed documents (batch 1)
    cu = torch.tensor([0, 13, 14, 400, n])
    positions = torch.cat([torch.arange(10, 20), torch.arange(380, 700, 3)])
    rows = (slice(0, 1), positions)
    got = native.select_topk(q[rows], k[:1], w[rows], topk, cu, pool, positions)
    want = select_topk_reference(q[rows].double(), k[:1].double(), w[rows].double(), topk, cu, pool, positions)
    assert torch.equal(got, want)
    # a block of queries scored together whose ranges start at different blocks: a query of the second document
    # then has scores before its first whole tile, which the bound must also search
    cu = torch.tensor([0, 100, n])
    positions = torch.stack([torch.arange(60, 100), torch.arange(500, 700, 5)], dim=1).flatten()
    rows = (slice(0, 1), positions)
    got = native.select_topk(q[rows], k[:1], w[rows], topk, cu, pool, positions)
    want = select_topk_reference(q[rows].double(), k[:1].double(), w[rows].double(), topk, cu, pool, positions)
    assert torch.equal(got, want)


@pytest.mark.parametrize("pool", [1, 4])
def test_native_selection_over_more_candidates_than_a_key_tile(pool: int, intra_op_threads: int):
    """Queries late in a sequence whose candidates span several of select.c's key tiles (2,048 blocks) and a
    tile boundary inside a group's union of ranges, against the oracle."""
    n_keys = 4 * 2048 + 300 if pool == 4 else 2048 + 300
    q, k, w = integer_indexer_inputs(n_keys, 1, 4, 32, seed=pool)
    positions = torch.cat([torch.arange(n_keys - 70, n_keys), torch.tensor([5, 2047, 2049])])
    q, w = (x[:, :1].expand(2, len(positions), *x.shape[2:]).clone() for x in (q, w))
    q += torch.arange(len(positions)).view(1, -1, 1, 1) % 3 - 1  # different queries, still small integers
    got = native.select_topk(q, k, w, 64, pool=pool, query_positions=positions)
    want = select_topk_reference(q.double(), k.double(), w.double(), 64, pool=pool, query_positions=positions)
    assert torch.equal(got, want)


def test_native_selection_of_random_scores_agrees_with_the_pytorch_path():
    """fp32 scores summed in another order than the PyTorch path's matmul: the same keys but where two scores
    tie to fp32 rounding."""
    gen = torch.Generator().manual_seed(3)
    q, k, w = torch.randn(1, 900, 4, 32, generator=gen), torch.randn(1, 900, 32, generator=gen), torch.randn(1, 900, 4, generator=gen)
    assert selection_recall(native.select_topk(q, k, w, 64, pool=4), select_topk(q, k, w, 64, pool=4)) > 0.999


def test_native_selection_takes_the_pytorch_path_for_bf16_scores_and_other_dtypes():
    q, k, w = integer_indexer_inputs(90, 90, 3, 8, seed=1)
    assert torch.equal(native.select_topk(q, k, w, 16, pool=4, scores="bf16"), select_topk(q, k, w, 16, pool=4, scores="bf16"))
    q, k, w = (x.double() for x in (q, k, w))
    assert torch.equal(native.select_topk(q, k, w, 16, pool=4), select_topk(q, k, w, 16, pool=4))
