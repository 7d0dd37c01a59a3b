"""Triton DSA kernels against the dense torch references.

Without CUDA the kernels run in the Triton CPU interpreter, in fp32 (the interpreter's bf16 tl.dot is wrong).
TRITON_INTERPRET is read when a jit function is decorated (triton's own library functions: when triton is
first imported) and again while a kernel runs, so this module sets it before it imports triton and the
kernels, restores it afterwards so later test modules keep their own setting, and sets it again (autouse
fixture) while its own tests run. Sizes are small because the interpreter is slow.
"""

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

ON_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if ON_CUDA else "cpu"
_INTERPRET = {} if ON_CUDA else {"TRITON_INTERPRET": "1"}
_saved_env = {name: os.environ.get(name) for name in _INTERPRET}
os.environ.update(_INTERPRET)
import triton  # noqa: E402

from megaseq_dsa.ops import (  # noqa: E402
    select_topk_reference,
    selected_slots,
    sparse_attention_reference,
)
from megaseq_dsa.ops.triton import select_topk_triton, sparse_attention_triton  # noqa: E402
from megaseq_dsa.ops.triton.indexer import _indexer_topk_kernel  # noqa: E402

# without CUDA every kernel runs in the Triton interpreter: minutes on CPU, outside the fast lane
pytestmark = pytest.mark.slow

for _name, _value in _saved_env.items():
    if _value is None:
        os.environ.pop(_name)
    else:
        os.environ[_name] = _value

if not ON_CUDA:
    from triton.runtime.interpreter import InterpretedFunction

    # triton.language's own jit functions are decorated when triton is first imported.
    if not all(isinstance(f, InterpretedFunction) for f in (triton.language.sum, _indexer_topk_kernel)):
        raise RuntimeError(
            "triton was imported in this process before TRITON_INTERPRET=1 was set; "
            "run packages/attn-dsa/tests/test_triton.py in its own pytest process"
        )

LENGTHS = [1, 37, 64, 100, 200]


def batch_for(length: int) -> int:
    # Two sequences where it is cheap; one for the long lengths to keep the interpreter time down.
    return 2 if length <= 64 else 1


TOPKS = [16, 64]
RAGGED = torch.tensor([0, 83, 84, 200])  # three documents, one of a single token


@pytest.fixture(autouse=True)
def triton_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in _INTERPRET.items():
        monkeypatch.setenv(name, value)


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    # fp32 kernels vs a float64 oracle: measured errors stay below 1e-6 of the reference max; bound 1e-5.
    error = (actual.double() - expected.double()).abs().max().item()
    bound = 1e-5 * expected.abs().max().clamp_min(1).item()
    assert error <= bound, f"max abs error {error:.3e} > {bound:.3e}"


def indexer_inputs(batch: int, length: int, heads: int = 3, dim: int = 20, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    q_idx = torch.randn(batch, length, heads, dim, generator=generator)
    k_idx = torch.randn(batch, length, dim, generator=generator)
    weights = torch.randn(batch, length, heads, generator=generator)
    return q_idx, k_idx, weights


def assert_same_selection(got: torch.Tensor, expected: torch.Tensor) -> None:
    """The kernel and the reference share the tie rule (equal scores go to the earlier key), so even the
    exact-zero ties relu makes must be resolved identically."""
    assert got.dtype == torch.int32
    assert torch.equal(got.cpu(), expected)


@pytest.mark.parametrize("topk", TOPKS)
@pytest.mark.parametrize("length", LENGTHS)
def test_select_topk_matches_reference(length: int, topk: int) -> None:
    q_idx, k_idx, weights = indexer_inputs(batch_for(length), length, seed=length + topk)
    got = select_topk_triton(q_idx.to(DEVICE), k_idx.to(DEVICE), weights.to(DEVICE), topk)
    assert_same_selection(got, select_topk_reference(q_idx, k_idx, weights, topk))


@pytest.mark.parametrize("topk", TOPKS)
def test_select_topk_ragged_documents(topk: int) -> None:
    q_idx, k_idx, weights = indexer_inputs(1, 200, heads=5, dim=33, seed=topk)
    got = select_topk_triton(q_idx.to(DEVICE), k_idx.to(DEVICE), weights.to(DEVICE), topk, RAGGED)
    assert_same_selection(got, select_topk_reference(q_idx, k_idx, weights, topk, RAGGED))


def test_select_topk_without_ties_equals_reference_exactly() -> None:
    # Positive inputs: no ReLU zeros, so no ties; every row must equal the reference. topk = 100 is not a
    # power of two and keeps a 128-entry running list, wider than one 64-key block.
    q_idx, k_idx, weights = (x.abs() for x in indexer_inputs(1, 200, heads=4, dim=24, seed=7))
    got = select_topk_triton(q_idx.to(DEVICE), k_idx.to(DEVICE), weights.to(DEVICE), 100, RAGGED)
    expected = select_topk_reference(q_idx, k_idx, weights, 100, RAGGED)
    assert got.shape == (1, 200, selected_slots(100))
    assert torch.equal(got.cpu(), expected)


@pytest.mark.parametrize("topk", TOPKS)
def test_select_topk_keys_longer_than_queries(topk: int) -> None:
    # Queries at two runs of key positions over ragged documents (like a zig-zag shard), then per-sequence
    # positions [B, Tq] in arbitrary order (one of them a lone last token, like a decoding step).
    q_idx, k_idx, weights = indexer_inputs(1, 200, heads=5, dim=33, seed=topk + 1)
    positions = torch.cat([torch.arange(70, 100), torch.arange(180, 200)])
    q_rows, w_rows = q_idx[:, positions], weights[:, positions]
    got = select_topk_triton(
        q_rows.to(DEVICE), k_idx.to(DEVICE), w_rows.to(DEVICE), topk, RAGGED, query_positions=positions.to(DEVICE)
    )
    assert_same_selection(got, select_topk_reference(q_rows, k_idx, w_rows, topk, RAGGED, 1, positions))

    q_idx, k_idx, weights = indexer_inputs(2, 100, seed=topk + 2)
    positions = torch.tensor([[99, 3, 64, 65], [0, 98, 50, 17]])
    rows = torch.arange(2)[:, None], positions
    got = select_topk_triton(
        q_idx[rows].to(DEVICE),
        k_idx.to(DEVICE),
        weights[rows].to(DEVICE),
        topk,
        query_positions=positions.to(DEVICE),
    )
    expected = select_topk_reference(q_idx[rows], k_idx, weights[rows], topk, query_positions=positions)
    assert_same_selection(got, expected)


@pytest.mark.parametrize("pool", [2, 4])
def test_pooled_select_topk_matches_reference(pool: int) -> None:
    # Documents of 83 (not a multiple of the pool: a 3-token tail), 1 (a tail only) and 116 tokens; topk 16
    # keeps 16 // pool blocks, fewer than most rows see, so the cut, relu's exact-zero ties, the own-tail
    # block and the -1 padding of short rows all occur. Then queries at chosen key positions (a zig-zag share
    # and decoding steps), one of them completing its block (no tail).
    q_idx, k_idx, weights = indexer_inputs(1, 200, heads=3, dim=20, seed=pool)
    got = select_topk_triton(q_idx.to(DEVICE), k_idx.to(DEVICE), weights.to(DEVICE), 16, RAGGED, pool)
    expected = select_topk_reference(q_idx, k_idx, weights, 16, RAGGED, pool)
    assert got.shape == (1, 200, selected_slots(16, pool))
    assert (expected == -1).any() and ((expected >= 0).sum(-1) % pool).bool().any()  # padding and tails
    assert_same_selection(got, expected)

    positions = torch.cat([torch.arange(60, 84), torch.tensor([87, 199])])
    q_rows, w_rows = q_idx[:, positions], weights[:, positions]
    got = select_topk_triton(
        q_rows.to(DEVICE), k_idx.to(DEVICE), w_rows.to(DEVICE), 16, RAGGED, pool, positions.to(DEVICE)
    )
    assert_same_selection(got, select_topk_reference(q_rows, k_idx, w_rows, 16, RAGGED, pool, positions))


def test_select_topk_rejects_bad_inputs() -> None:
    q_idx, k_idx, weights = indexer_inputs(2, 8)
    with pytest.raises(ValueError, match="batch of 1"):
        select_topk_triton(q_idx.to(DEVICE), k_idx.to(DEVICE), weights.to(DEVICE), 4, torch.tensor([0, 8]))
    with pytest.raises(ValueError, match="topk"):
        select_topk_triton(q_idx.to(DEVICE), k_idx.to(DEVICE), weights.to(DEVICE), 0)


def attention_inputs(
    indices: torch.Tensor, heads: int, dim: int, dim_v: int, seed: int, n_keys: int | None = None
):
    batch, n_queries = indices.shape[:2]
    n_keys = n_keys or n_queries
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, n_queries, heads, dim, generator=generator)
    k = torch.randn(batch, n_keys, dim, generator=generator)
    v = torch.randn(batch, n_keys, dim_v, generator=generator)
    grad_out = torch.randn(batch, n_queries, heads, dim_v, generator=generator)
    return q, k, v, grad_out


def check_sparse_attention(
    indices: torch.Tensor, heads: int, dim: int, dim_v: int, seed: int, n_keys: int | None = None
) -> None:
    q, k, v, grad_out = attention_inputs(indices, heads, dim, dim_v, seed, n_keys)
    scale = dim**-0.5
    leaves = [x.detach().to(DEVICE).requires_grad_() for x in (q, k, v)]
    out = sparse_attention_triton(*leaves, indices.to(DEVICE), scale)
    out.backward(grad_out.to(DEVICE))
    oracle_leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    expected = sparse_attention_reference(*oracle_leaves, indices, scale)
    expected.backward(grad_out.double())
    assert out.dtype == q.dtype and out.shape == expected.shape
    assert_close(out, expected)
    for leaf, oracle_leaf in zip(leaves, oracle_leaves, strict=True):
        assert_close(leaf.grad, oracle_leaf.grad)


@pytest.mark.parametrize("length", LENGTHS)
def test_sparse_attention_matches_reference(length: int) -> None:
    topk = TOPKS[length % 2]  # both top-k sizes across the lengths, both below and above T
    q_idx, k_idx, weights = indexer_inputs(batch_for(length), length, seed=length)
    indices = select_topk_reference(q_idx, k_idx, weights, topk)
    indices[:, length // 2] = -1  # a row with nothing selected outputs 0 and gets no gradient
    # 5 heads pad to 16 tl.dot rows; D = 40 is one partial 64-wide chunk.
    check_sparse_attention(indices, heads=5, dim=40, dim_v=24, seed=length)


def test_sparse_attention_ragged_documents_holes_and_wide_heads() -> None:
    # topk = 100 gives 128 slots (two index blocks); D = 144 is three head-dim chunks and Dv = 100 two
    # value-dim chunks (the backward's), the last of each partial; -1 holes sit in the middle of rows, not only
    # at the end.
    q_idx, k_idx, weights = indexer_inputs(1, 120, seed=3)
    cu_seqlens = torch.tensor([0, 47, 48, 120])
    indices = select_topk_reference(q_idx, k_idx, weights, 100, cu_seqlens)
    holes = torch.rand(indices.shape, generator=torch.Generator().manual_seed(3)) < 0.2
    indices = indices.masked_fill(holes, -1)
    check_sparse_attention(indices, heads=3, dim=144, dim_v=100, seed=3)


def test_sparse_attention_keys_longer_than_queries() -> None:
    # 30 queries at key positions 90..119 of 120 keys (the tail of a decode), indices into the keys.
    q_idx, k_idx, weights = indexer_inputs(1, 120, seed=5)
    positions = torch.arange(90, 120)
    indices = select_topk_reference(q_idx[:, positions], k_idx, weights[:, positions], 64, None, 1, positions)
    check_sparse_attention(indices, heads=3, dim=40, dim_v=24, seed=5, n_keys=120)


def test_sparse_attention_rejects_bad_inputs() -> None:
    q, k, v, _ = attention_inputs(torch.zeros(1, 4, 64), heads=2, dim=16, dim_v=16, seed=0)
    q, k, v = q.to(DEVICE), k.to(DEVICE), v.to(DEVICE)
    indices = torch.zeros(1, 4, 64, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="int32"):
        sparse_attention_triton(q, k, v, indices.long(), 0.25)
    with pytest.raises(ValueError, match="k must be"):
        sparse_attention_triton(q, k[:, :3], v, indices, 0.25)


@pytest.mark.skipif(ON_CUDA, reason="checks the CPU error path, which needs a machine without CUDA")
def test_cpu_tensors_without_interpreter_give_one_line_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET")
    q_idx, k_idx, weights = indexer_inputs(1, 4)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        select_topk_triton(q_idx, k_idx, weights, 4)


def test_importing_megaseq_dsa_does_not_import_triton() -> None:
    code = "import sys, megaseq_dsa, megaseq_dsa.ops; assert 'triton' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
