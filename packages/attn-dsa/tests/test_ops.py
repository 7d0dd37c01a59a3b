"""The blocked DSA operations against their dense oracles, on random inputs of awkward sizes.

Tolerance for fp32 fast paths: max |fast - oracle| <= 1e-5 * max(1, max |oracle|), oracle in float64.
Index selections are compared exactly: select_topk and select_topk_reference share one tie rule (equal scores
go to the earlier key), so the exact-zero ties relu makes on normal inputs must be broken identically.
Keys may outnumber queries (decoding, context parallelism): then each query sits at a given key position.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

import megaseq_dsa.ops.indexer as indexer_module
from megaseq_dsa.ops import (
    indexer_scores_reference,
    select_topk,
    select_topk_reference,
    selected_slots,
    sparse_attention,
    sparse_attention_reference,
    sparse_attention_with_lse,
)
from megaseq_dsa.ops.sparse import values_are_key_columns

TOL = 1e-5
SMALL_BLOCKS = {"query_block": 7, "key_block": 5}  # many blocks, none aligned with T, documents or pools


def assert_close(fast: torch.Tensor, oracle: torch.Tensor) -> None:
    assert not torch.isnan(fast).any()
    bound = TOL * oracle.abs().max().clamp_min(1).item()
    err = (fast.double() - oracle.double()).abs().max().item()
    assert err <= bound, f"max abs error {err:.3g} > {bound:.3g}"


def indexer_inputs(
    seq_len: int,
    batch: int = 1,
    heads: int = 3,
    dim: int = 8,
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seq_len, heads, dim, generator=gen, dtype=dtype)
    k = torch.randn(batch, seq_len, dim, generator=gen, dtype=dtype)
    w = torch.randn(batch, seq_len, heads, generator=gen, dtype=dtype)
    return q, k, w


def visible_tokens(t: int, doc_start: int) -> list[int]:
    return list(range(doc_start, t + 1))


def row_tokens(row: torch.Tensor) -> list[int]:
    """The selected tokens of one output row, checking the layout: ascending, then only -1."""
    count = int((row >= 0).sum())
    assert (row[count:] == -1).all(), "padding must be -1 and at the end"
    tokens = row[:count].tolist()
    assert tokens == sorted(set(tokens)), "selected tokens must be ascending and distinct"
    return tokens


# ----------------------------------------------------------------------------------------------- indexer


def test_indexer_scores_reference_is_the_formula():
    q, k, w = indexer_inputs(9, batch=2)
    cu = None
    scores = indexer_scores_reference(q, k, w, cu)
    for b in range(2):
        for t in range(9):
            for s in range(9):
                want = (
                    sum(w[b, t, j] * torch.relu(q[b, t, j] @ k[b, s]) for j in range(3))
                    if s <= t
                    else -torch.inf
                )
                assert scores[b, t, s].item() == pytest.approx(float(want), rel=1e-12, abs=1e-12)


def test_indexer_scores_reference_masks_other_documents():
    q, k, w = indexer_inputs(10)
    scores = indexer_scores_reference(q, k, w, torch.tensor([0, 4, 10]))
    assert torch.isinf(scores[0, 4:, :4]).all() and torch.isinf(scores[0, :4, 4:]).all()
    assert torch.isfinite(scores[0, 5, 4:6]).all()


@pytest.mark.parametrize("pool", [1, 4])
@pytest.mark.parametrize("seq_len,topk", [(1, 16), (37, 64), (64, 64), (100, 16), (131, 24)])
def test_select_topk_equals_reference_exactly(seq_len: int, topk: int, pool: int):
    q, k, w = indexer_inputs(seq_len, batch=2)
    fast = select_topk(q, k, w, topk, pool=pool, **SMALL_BLOCKS)
    oracle = select_topk_reference(q, k, w, topk, pool=pool)
    assert fast.dtype == torch.int32 and fast.shape == (2, seq_len, selected_slots(topk, pool))
    assert torch.equal(fast, oracle)


@pytest.mark.parametrize("pool", [1, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_select_topk_packed_inputs_equal_reference(pool: int, dtype: torch.dtype):
    """Normal inputs (many exact-zero relu ties), documents, both dtypes: the same rows as the oracle."""
    seq_len, topk, cu = 123, 20, torch.tensor([0, 50, 51, 123])
    q, k, w = indexer_inputs(seq_len, dtype=dtype, seed=1)
    fast = select_topk(q, k, w, topk, cu, pool=pool, **SMALL_BLOCKS)
    assert torch.equal(fast, select_topk_reference(q, k, w, topk, cu, pool=pool))


@pytest.mark.parametrize("pool", [1, 4])
def test_ties_go_to_the_earlier_key(pool: int):
    """Every score equal (weights 0): each query keeps its earliest complete blocks, plus its tail."""
    seq_len, topk = 40, 8
    q, k, w = indexer_inputs(seq_len)
    w = torch.zeros_like(w)
    for select in (select_topk, select_topk_reference):
        out = select(q, k, w, topk, pool=pool)
        for t in range(seq_len):
            tail = t // pool * pool if (t + 1) % pool else t + 1
            want = list(range(min(topk, tail))) + list(range(tail, t + 1))
            assert row_tokens(out[0, t]) == want, f"{select.__name__} row {t}"


def key_positions(n_keys: int, n_queries: int, batch: int, seed: int) -> torch.Tensor:
    """Distinct random key positions [B, Tq] per sequence, ascending in row 0 and shuffled in the others."""
    gen = torch.Generator().manual_seed(seed)
    rows = [torch.randperm(n_keys, generator=gen)[:n_queries] for _ in range(batch)]
    rows[0] = rows[0].sort().values
    return torch.stack(rows)


@pytest.mark.parametrize("pool", [1, 4])
@pytest.mark.parametrize("n_keys,n_queries,topk", [(53, 17, 8), (97, 1, 16), (130, 41, 24), (70, 70, 64)])
def test_select_topk_keys_longer_than_queries(n_keys: int, n_queries: int, topk: int, pool: int):
    """Queries at given key positions ([B, Tq] and [Tq]) equal the oracle and the matching rows of the
    selection for every key position."""
    q, k, w = indexer_inputs(n_keys, batch=2, seed=n_keys + pool)
    positions = key_positions(n_keys, n_queries, 2, seed=n_queries)
    rows = torch.arange(2)[:, None], positions
    fast = select_topk(q[rows], k, w[rows], topk, pool=pool, query_positions=positions, **SMALL_BLOCKS)
    assert fast.shape == (2, n_queries, selected_slots(topk, pool))
    oracle = select_topk_reference(q[rows], k, w[rows], topk, pool=pool, query_positions=positions)
    assert torch.equal(fast, oracle)
    assert torch.equal(fast, select_topk(q, k, w, topk, pool=pool)[rows])
    shared = positions[0]  # one [Tq] for the whole batch
    fast = select_topk(q[:, shared], k, w[:, shared], topk, pool=pool, query_positions=shared, **SMALL_BLOCKS)
    want = select_topk_reference(q[:, shared], k, w[:, shared], topk, pool=pool, query_positions=shared)
    assert torch.equal(fast, want)


@pytest.mark.parametrize("pool", [1, 4])
def test_select_topk_query_positions_with_documents(pool: int):
    """Zig-zag-like query subsets over packed documents (keys on the whole sequence, cu_seqlens over keys)."""
    cu = torch.tensor([0, 13, 14, 61, 90])
    q, k, w = indexer_inputs(90, seed=20 + pool)
    positions = torch.cat([torch.arange(10, 20), torch.arange(55, 90)])  # two runs, crossing documents
    fast = select_topk(q[:, positions], k, w[:, positions], 12, cu, pool, positions, **SMALL_BLOCKS)
    oracle = select_topk_reference(q[:, positions], k, w[:, positions], 12, cu, pool, positions)
    assert torch.equal(fast, oracle)
    assert torch.equal(fast, select_topk(q, k, w, 12, cu, pool)[:, positions])
    decode = select_topk(q[:, 89:], k, w[:, 89:], 12, cu, pool, torch.tensor([89]))  # one new token
    assert torch.equal(decode, oracle[:, -1:])


def test_indexer_scores_reference_at_query_positions():
    q, k, w = indexer_inputs(30, batch=2)
    cu, positions = torch.tensor([0, 11, 30]), torch.tensor([3, 10, 11, 29])
    full = indexer_scores_reference(q[:1], k[:1], w[:1], cu)
    part = indexer_scores_reference(q[:1, positions], k[:1], w[:1, positions], cu, positions)
    assert part.shape == (1, 4, 30) and torch.equal(torch.isinf(part), torch.isinf(full[:, positions]))
    assert_close(part.nan_to_num(neginf=0.0), full[:, positions].nan_to_num(neginf=0.0))


@pytest.mark.parametrize("pool", [1, 4])
def test_select_topk_documents_are_independent(pool: int):
    lengths = [13, 1, 40, 6, 70]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    q, k, w = indexer_inputs(sum(lengths), seed=2)
    topk = 12
    packed = select_topk(q, k, w, topk, cu, pool=pool, **SMALL_BLOCKS)
    assert torch.equal(packed, select_topk_reference(q, k, w, topk, cu, pool=pool))
    for start, end in itertools.pairwise(cu.tolist()):
        alone = select_topk(
            q[:, start:end], k[:, start:end], w[:, start:end], topk, pool=pool, **SMALL_BLOCKS
        )
        want = torch.where(alone >= 0, alone + start, -1)
        assert torch.equal(packed[:, start:end], want)
        inside = packed[0, start:end]
        assert ((inside == -1) | ((inside >= start) & (inside < end))).all()


@pytest.mark.parametrize("pool", [1, 4])
@pytest.mark.parametrize("seq_len,topk", [(45, 64), (64, 64), (64, 128)])
def test_select_topk_short_sequences_select_every_visible_key(seq_len: int, topk: int, pool: int):
    """T <= topk: the selection is exactly dense causal attention (complete blocks + tail = all visible)."""
    cu = torch.tensor([0, 20, seq_len])
    q, k, w = indexer_inputs(seq_len, seed=3)
    out = select_topk(q, k, w, topk, cu, pool=pool, **SMALL_BLOCKS)
    for t in range(seq_len):
        assert row_tokens(out[0, t]) == visible_tokens(t, 0 if t < 20 else 20)


def test_select_topk_pooling_tail_rule_and_slot_count():
    seq_len, topk, pool, cu = 150, 16, 4, torch.tensor([0, 71, 150])  # 71 and 79: documents end mid-block
    q, k, w = indexer_inputs(seq_len, seed=4)
    out = select_topk(q, k, w, topk, cu, pool=pool, **SMALL_BLOCKS)
    assert out.shape[-1] == selected_slots(topk, pool) == 64
    assert selected_slots(2048, 4) == 2112 and selected_slots(2048) == 2048 and selected_slots(100) == 128
    for t in range(seq_len):
        start = 0 if t < 71 else 71
        own_block = start + (t - start) // pool * pool
        tail = list(range(own_block, t + 1)) if t - own_block + 1 < pool else []
        tokens = row_tokens(out[0, t])
        assert tokens[len(tokens) - len(tail) :] == tail
        blocks = tokens[: len(tokens) - len(tail)]
        # Complete blocks only, aligned to the document start, all keys <= t.
        assert len(blocks) % pool == 0 and all(s <= t for s in blocks)
        for i in range(0, len(blocks), pool):
            assert (blocks[i] - start) % pool == 0 and blocks[i : i + pool] == list(
                range(blocks[i], blocks[i] + pool)
            )
        complete_visible = (t - start + 1) // pool
        assert len(blocks) == pool * min(complete_visible, topk // pool)
        assert len(tokens) <= topk + pool - 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_kth_largest_equals_torch_kthvalue(dtype: torch.dtype):
    """The CPU selection (numpy) against torch.kthvalue, with ties, zeros of both signs and -inf."""
    gen = torch.Generator().manual_seed(18)
    scores = torch.randn(37, 101, generator=gen, dtype=dtype).relu() * torch.randint(
        -1, 2, (37, 101), generator=gen
    )
    scores[:, ::7] = float("-inf")
    for k in (1, 5, 60, 101):
        want = scores.kthvalue(101 - k + 1, dim=-1, keepdim=True).values
        assert torch.equal(indexer_module._kth_largest(scores, k), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("width", [61, 300, 1031])
def test_kth_and_kept_equals_selection_over_whole_rows(dtype: torch.dtype, width: int, monkeypatch: pytest.MonkeyPatch):
    """The bound from group maxima keeps exactly what a selection over whole rows keeps: ties at the k-th
    score, rows whose best scores are many zeros (all head weights negative), -inf (hidden) runs, rows with
    at most k visible scores, and widths that leave a partial group."""
    monkeypatch.setattr(indexer_module, "MIN_GROUP", 2)
    gen = torch.Generator().manual_seed(20)
    scores = torch.randn(29, width, generator=gen, dtype=dtype)
    scores[1] = scores[1].round()  # many ties
    scores[2] = -scores[2].abs().relu() * (scores[2] > 0)  # best score 0, shared by half the keys
    scores[3, width // 3 :] = float("-inf")
    scores[4, 5:] = float("-inf")  # 5 visible keys: not full
    scores[:, ::11] = float("-inf")
    visible = torch.isfinite(scores).sum(-1)
    lowest = torch.finfo(dtype).min
    for k in (1, 3, 7):
        full = visible > k
        kth, kept = indexer_module._kth_and_kept(scores, k, full)
        want = torch.full((29, 1), lowest, dtype=dtype)
        want[full] = scores[full].kthvalue(width - k + 1, dim=-1, keepdim=True).values
        assert torch.equal(kth, want), k
        assert torch.equal(kept, (scores >= want).view(-1).nonzero()[:, 0]), k


def test_flat_positions_at_least_equals_torch_nonzero():
    gen = torch.Generator().manual_seed(19)
    values = torch.randn(23, 57, generator=gen).relu()
    values[3] = float("-inf")
    bound = torch.randn(23, 1, generator=gen).clamp_min(0)
    want = (values >= bound).view(-1).nonzero()[:, 0]
    assert torch.equal(indexer_module._flat_positions_at_least(values, bound), want)


@pytest.mark.parametrize("pool", [1, 4])
def test_select_topk_with_group_bound_equals_reference(pool: int, monkeypatch: pytest.MonkeyPatch):
    """The group-maxima bound on every block (as on long rows) selects what the oracle selects, also where most
    queries' head weights are all negative (their best score 0 is tied by many keys, as on a trained indexer)."""
    monkeypatch.setattr(indexer_module, "MIN_GROUP", 2)
    q, k, w = indexer_inputs(203, batch=2, seed=21)
    cu = torch.tensor([0, 150, 203], dtype=torch.int32)
    negative = w.clone()
    negative[:, torch.arange(203) % 3 > 0] = -negative[:, torch.arange(203) % 3 > 0].abs()
    for topk, weights in itertools.product((4, 12), (w, negative)):
        for docs in (None, cu[None].expand(1, -1)[0]):
            rows = (q[:1], k[:1], weights[:1]) if docs is not None else (q, k, weights)
            fast = select_topk(*rows, topk, docs, pool=pool, **SMALL_BLOCKS)
            assert torch.equal(fast, select_topk_reference(*rows, topk, docs, pool=pool))


@pytest.mark.parametrize("pool", [1, 4])
def test_select_topk_small_score_blocks(pool: int, monkeypatch: pytest.MonkeyPatch):
    """A tiny score-block budget shrinks the query blocks (down to one query) without changing the result."""
    monkeypatch.setattr(indexer_module, "SCORE_BLOCK_BYTES", 8 * 50)
    n_keys, topk = 90, 12
    q, k, w = indexer_inputs(n_keys, batch=2, seed=17)
    positions = torch.arange(20, 90)
    rows = q[:, positions], k, w[:, positions], topk
    fast = select_topk(*rows, pool=pool, query_positions=positions, key_block=16)
    assert torch.equal(fast, select_topk_reference(*rows, pool=pool, query_positions=positions))


def test_select_topk_glm_slot_count():
    q, k, w = indexer_inputs(5, dtype=torch.float32)
    assert select_topk(q, k, w, 2048, pool=4).shape == (1, 5, 2112)


def test_select_topk_block_sizes_do_not_change_the_result():
    q, k, w = indexer_inputs(90, batch=2, seed=5)
    want = select_topk(q, k, w, 10, pool=4)
    for query_block, key_block in [(1, 1), (90, 90), (16, 33)]:
        got = select_topk(q, k, w, 10, pool=4, query_block=query_block, key_block=key_block)
        assert torch.equal(got, want)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"topk": 0}, "topk"),
        ({"topk": 2, "pool": 4}, "topk"),
        ({"topk": 8, "cu_seqlens": torch.tensor([0, 3, 7])}, "cu_seqlens"),
        ({"topk": 8, "query_block": 0}, "query_block"),
    ],
)
def test_select_topk_rejects_bad_arguments(kwargs: dict, message: str):
    q, k, w = indexer_inputs(6, dtype=torch.float32)
    with pytest.raises(ValueError, match=message):
        select_topk(q, k, w, **kwargs)


@pytest.mark.parametrize(
    "n_queries,n_keys,positions,message",
    [
        (3, 6, None, "query_positions is required"),
        (3, 6, torch.tensor([0, 1, 6]), r"\[0, Tk-1\]"),
        (3, 6, torch.tensor([-1, 1, 2]), r"\[0, Tk-1\]"),
        (3, 6, torch.tensor([0, 1]), "query_positions must be"),
        (3, 6, torch.tensor([[0, 1, 2]] * 3), "query_positions must be"),
        (3, 6, torch.tensor([0.0, 1.0, 2.0]), "integer"),
        (6, 3, None, "Tk >= Tq"),
    ],
)
def test_select_topk_rejects_bad_query_positions(
    n_queries: int, n_keys: int, positions: torch.Tensor | None, message: str
):
    q, k, w = indexer_inputs(6, batch=2, dtype=torch.float32)
    with pytest.raises(ValueError, match=message):
        select_topk(q[:, :n_queries], k[:, :n_keys], w[:, :n_queries], 4, query_positions=positions)


def test_select_topk_rejects_batched_documents():
    q, k, w = indexer_inputs(6, batch=2, dtype=torch.float32)
    with pytest.raises(ValueError, match="batch of 1"):
        select_topk(q, k, w, 8, torch.tensor([0, 3, 6]))


# ---------------------------------------------------------------------------------------- sparse attention


def attention_inputs(
    seq_len: int, batch: int = 2, heads: int = 3, dim: int = 16, dim_v: int = 12, seed: int = 0
):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seq_len, heads, dim, generator=gen)
    k = torch.randn(batch, seq_len, dim, generator=gen)
    v = torch.randn(batch, seq_len, dim_v, generator=gen)
    return q, k, v


def random_indices(
    batch: int, seq_len: int, slots: int, seed: int = 0, n_keys: int | None = None
) -> torch.Tensor:
    """Distinct random keys (of n_keys, default seq_len) per query row (not causal: the op does not care),
    ragged -1 padding, empty rows."""
    n_keys = n_keys or seq_len
    gen = torch.Generator().manual_seed(seed)
    rows = torch.stack([torch.randperm(n_keys, generator=gen)[:slots] for _ in range(batch * seq_len)])
    counts = torch.randint(0, slots + 1, (batch * seq_len, 1), generator=gen)
    rows = torch.where(torch.arange(slots) < counts, rows, -1)
    rows[0] = -1  # at least one row with nothing selected
    return rows.view(batch, seq_len, slots).int()


def forward_and_grads(fn, q, k, v, indices, scale, grad_out, **kwargs):
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    out = fn(q, k, v, indices, scale, **kwargs)
    grads = torch.autograd.grad(out, (q, k, v), grad_out.to(out.dtype))
    return (out, *grads)


def assert_matches_reference(q, k, v, indices, grad_out, chunk_size):
    """fp32 sparse_attention's output and gradients against the float64 reference."""
    fast = forward_and_grads(sparse_attention, q, k, v, indices, 0.3, grad_out, chunk_size=chunk_size)
    oracle = forward_and_grads(
        sparse_attention_reference, q.double(), k.double(), v.double(), indices, 0.3, grad_out
    )
    for got, want in zip(fast, oracle, strict=True):
        assert got.dtype == torch.float32
        assert_close(got, want)


@pytest.mark.parametrize("chunk_size", [1, 7, None])
def test_sparse_attention_matches_reference(chunk_size: int | None):
    seq_len, slots = 53, 19
    q, k, v = attention_inputs(seq_len)
    indices = random_indices(2, seq_len, slots)
    grad_out = torch.randn(2, seq_len, 3, 12, generator=torch.Generator().manual_seed(9))
    assert_matches_reference(q, k, v, indices, grad_out, chunk_size)


@pytest.mark.parametrize("chunk_size", [1, 3, None])
def test_sparse_attention_with_holes_and_cut_columns_matches_reference(chunk_size: int | None):
    """A chunk gathers its index columns up to the last valid one only: rows with -1 holes between valid
    indices, rows whose valid indices end at different columns, a chunk whose columns all end early, and one
    row with its only index in the last slot, against the float64 reference."""
    seq_len, slots = 11, 8
    q, k, v = attention_inputs(seq_len)
    indices = random_indices(2, seq_len, slots, seed=3)
    indices[:, 1:4, 5:] = -1  # an early chunk whose columns end at 5
    indices[:, 5] = torch.arange(slots, dtype=indices.dtype)
    indices[:, 5, 1:4] = -1  # holes inside full rows: five valid indices, the last in the last slot
    indices[:, 7] = -1
    indices[:, 7, -1] = 2  # a single index, in the last slot
    grad_out = torch.randn(2, seq_len, 3, 12, generator=torch.Generator().manual_seed(9))
    assert_matches_reference(q, k, v, indices, grad_out, chunk_size)


@pytest.mark.parametrize("chunk_size", [3, None])
def test_sparse_attention_keys_longer_than_queries(chunk_size: int | None):
    n_queries, n_keys, slots = 23, 61, 13
    q, _, _ = attention_inputs(n_queries, seed=1)
    _, k, v = attention_inputs(n_keys, seed=2)
    indices = random_indices(2, n_queries, slots, seed=4, n_keys=n_keys)
    grad_out = torch.randn(2, n_queries, 3, 12, generator=torch.Generator().manual_seed(5))
    assert_matches_reference(q, k, v, indices, grad_out, chunk_size)


@pytest.mark.parametrize("pool", [1, 4])
def test_query_subset_equals_rows_of_the_whole_sequence(pool: int):
    """Selection + attention of some queries over all keys (a context-parallel rank, a decoding step) equals
    the whole-sequence computation at those rows, in outputs and in the gradients their loss gives."""
    seq_len, topk, cu = 75, 16, torch.tensor([0, 20, 21, 75])
    positions = torch.cat([torch.arange(9, 18), torch.arange(57, 66)])  # two zig-zag-like segments
    qi, ki, wi = indexer_inputs(seq_len, dtype=torch.float32, seed=14)
    q, k, v = attention_inputs(seq_len, batch=1, seed=15)
    grad_out = torch.randn(1, len(positions), 3, 12, generator=torch.Generator().manual_seed(16))
    full_indices = select_topk(qi, ki, wi, topk, cu, pool)
    indices = select_topk(qi[:, positions], ki, wi[:, positions], topk, cu, pool, positions)
    assert torch.equal(indices, full_indices[:, positions])

    def whole(q, k, v, indices, scale):
        return sparse_attention(q, k, v, full_indices, scale, chunk_size=8)[:, positions]

    def subset(q, k, v, indices, scale):
        return sparse_attention(q[:, positions], k, v, indices, scale, chunk_size=8)

    want = forward_and_grads(whole, q, k, v, None, 0.3, grad_out)
    got = forward_and_grads(subset, q, k, v, indices, 0.3, grad_out)
    for a, b in zip(got, want, strict=True):
        assert_close(a, b)


def test_sparse_attention_empty_rows_give_zero_and_no_nan():
    q, k, v = attention_inputs(10)
    indices = torch.full((2, 10, 64), -1, dtype=torch.int32)
    indices[1, 4, 0] = 2
    out, dq, dk, dv = forward_and_grads(sparse_attention, q, k, v, indices, 0.25, torch.ones(2, 10, 3, 12))
    assert (out[0] == 0).all() and (out[1, :4] == 0).all() and (out[1, 5:] == 0).all()
    torch.testing.assert_close(out[1, 4], v[1, 2].expand(3, -1))
    assert not any(torch.isnan(x).any() for x in (dq, dk, dv))
    assert (dq[0] == 0).all() and (dk[0] == 0).all() and (dv[0] == 0).all()
    _, lse = sparse_attention_with_lse(q, k, v, indices, 0.25)
    assert torch.isinf(lse[0]).all() and (lse[0] < 0).all()


def test_sparse_attention_lse_is_the_logsumexp_of_selected_scores():
    seq_len = 21
    q, k, v = attention_inputs(seq_len)
    indices = random_indices(2, seq_len, 9, seed=3)
    _, lse = sparse_attention_with_lse(q, k, v, indices, 0.5, chunk_size=4)
    scores = torch.einsum("bthd,bsd->bths", q.double(), k.double()) * 0.5
    allowed = torch.zeros(2, seq_len, seq_len + 1, dtype=torch.bool)
    allowed.scatter_(2, indices.long().masked_fill(indices < 0, seq_len), True)
    want = scores.masked_fill(~allowed[:, :, None, :seq_len], -torch.inf).logsumexp(-1)
    finite = torch.isfinite(want)
    assert torch.equal(finite, torch.isfinite(lse))
    assert_close(lse[finite], want[finite])


@pytest.mark.parametrize("pool", [1, 4])
def test_all_visible_indices_equal_causal_sdpa(pool: int):
    """select_topk with T <= topk selects every visible key; sparse attention is then causal attention."""
    seq_len, heads, dim = 70, 4, 16
    qi, ki, wi = indexer_inputs(seq_len, batch=2, dtype=torch.float32, seed=6)
    indices = select_topk(qi, ki, wi, 128, pool=pool)
    q, k, v = attention_inputs(seq_len, heads=heads, dim=dim, dim_v=dim, seed=7)
    grad_out = torch.randn(2, seq_len, heads, dim, generator=torch.Generator().manual_seed(8))
    fast = forward_and_grads(sparse_attention, q, k, v, indices, dim**-0.5, grad_out, chunk_size=16)

    def causal_sdpa(q, k, v, indices, scale):
        expand = lambda x: x[:, None].expand(-1, heads, -1, -1)  # noqa: E731  (MQA: one key for all heads)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), expand(k), expand(v), is_causal=True, scale=scale
        )
        return out.transpose(1, 2)

    dense = forward_and_grads(causal_sdpa, q.double(), k.double(), v.double(), indices, dim**-0.5, grad_out)
    for got, want in zip(fast, dense, strict=True):
        assert_close(got, want)


def test_sparse_attention_on_selected_indices_with_documents():
    """The whole pipeline on packed documents equals running each document alone."""
    topk = 16
    cu = torch.tensor([0, 30, 39, 80])
    qi, ki, wi = indexer_inputs(80, dtype=torch.float32, seed=10)
    q, k, v = attention_inputs(80, batch=1, seed=11)
    packed = sparse_attention(q, k, v, select_topk(qi, ki, wi, topk, cu, pool=4), 0.3, chunk_size=6)
    for start, end in itertools.pairwise(cu.tolist()):
        piece = slice(start, end)
        indices = select_topk(qi[:, piece], ki[:, piece], wi[:, piece], topk, pool=4)
        alone = sparse_attention(q[:, piece], k[:, piece], v[:, piece], indices, 0.3)
        assert_close(packed[:, piece], alone)


def test_sparse_attention_bfloat16_keeps_dtype():
    q, k, v = attention_inputs(24)
    indices = random_indices(2, 24, 8, seed=12)
    args = [x.bfloat16().requires_grad_() for x in (q, k, v)]
    out = sparse_attention(*args, indices, 0.3, chunk_size=5)
    out.sum().backward()
    assert out.dtype == torch.bfloat16 and all(x.grad.dtype == torch.bfloat16 for x in args)
    want = sparse_attention_reference(q.double(), k.double(), v.double(), indices, 0.3)
    assert (out.double() - want).abs().max() < 3e-2


@pytest.mark.parametrize(
    "indices,message",
    [
        (torch.full((1, 5, 8), 5, dtype=torch.int32), r"\[-1, Tk-1\]"),
        (torch.full((1, 5, 8), -2, dtype=torch.int32), r"\[-1, Tk-1\]"),
        (torch.zeros(1, 5, 8), "integer"),
        (torch.zeros(1, 4, 8, dtype=torch.int32), "indices"),
    ],
)
def test_sparse_attention_rejects_bad_indices(indices: torch.Tensor, message: str):
    q, k, v = attention_inputs(5, batch=1)
    with pytest.raises(ValueError, match=message):
        sparse_attention(q, k, v, indices, 0.3)


def test_sparse_attention_rejects_fewer_keys_than_queries():
    q, k, v = attention_inputs(5, batch=1)
    with pytest.raises(ValueError, match="Tk >= Tq"):
        sparse_attention(q, k[:, :4], v[:, :4], torch.zeros(1, 5, 8, dtype=torch.int32), 0.3)


@pytest.mark.parametrize("dim_v", [16, 12])
@pytest.mark.parametrize("chunk_size", [5, None])
def test_sparse_attention_with_values_inside_the_keys_matches_reference(dim_v: int, chunk_size: int | None):
    """MLA's shared latent, v = k[..., :Dv]: rows are gathered once and k's gradient carries dK and dV."""
    seq_len = 53
    q, k, _ = attention_inputs(seq_len)
    indices = random_indices(2, seq_len, 19, seed=6)
    grad_out = torch.randn(2, seq_len, 3, dim_v, generator=torch.Generator().manual_seed(7))

    def run(fn, dtype, **kwargs):
        q_, k_ = (x.detach().to(dtype).requires_grad_() for x in (q, k))
        out = fn(q_, k_, k_[..., :dim_v], indices, 0.3, **kwargs)
        return (out, *torch.autograd.grad(out, (q_, k_), grad_out.to(out.dtype)))

    fast = run(sparse_attention, torch.float32, chunk_size=chunk_size)
    oracle = run(sparse_attention_reference, torch.float64)
    for got, want in zip(fast, oracle, strict=True):
        assert_close(got, want)


def test_shared_values_survive_saved_tensor_hooks_that_copy():
    """Offloading hands back each saved tensor as its own copy, so v no longer shares k's storage in backward:
    the op must still treat the values as k's columns (bitwise the gradients without hooks; a backward that
    re-detected the sharing from storage took the separate-values path and differed in rounding)."""
    q, k, _ = attention_inputs(41)
    indices = random_indices(2, 41, 13, seed=3)
    grad_out = torch.randn(2, 41, 3, 12, generator=torch.Generator().manual_seed(4))

    def run(hooks: bool) -> tuple[torch.Tensor, ...]:
        q_, k_ = (x.detach().clone().requires_grad_() for x in (q, k))
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t.clone() if hooks else t, lambda t: t):
            out = sparse_attention(q_, k_, k_[..., :12], indices, 0.3, chunk_size=5)
        return (out, *torch.autograd.grad(out, (q_, k_), grad_out))

    for got, want in zip(run(True), run(False), strict=True):
        assert torch.equal(got, want)


def test_values_are_key_columns_only_for_a_leading_view():
    k = torch.randn(2, 9, 8)
    assert values_are_key_columns(k, k) and values_are_key_columns(k, k[..., :5])
    assert not values_are_key_columns(k, k[..., 1:6])  # not the leading columns
    assert not values_are_key_columns(k, k[..., :5].clone())  # a copy: gradients must go to v itself
    assert not values_are_key_columns(k, k[:, 1:, :5])  # other rows


def test_bf16_autocast_does_not_reach_inside_selection_or_attention():
    """Scores, softmax statistics and products stay fp32 under a caller's bf16 autocast: selection, outputs
    and gradients are bitwise those of the fp32 run."""
    qi, ki, wi = indexer_inputs(70, dtype=torch.float32, seed=3)
    q, k, _ = attention_inputs(70, batch=1, seed=4)
    grad_out = torch.randn(1, 70, 3, 16, generator=torch.Generator().manual_seed(5))

    def run():
        indices = select_topk(qi, ki, wi, 16, pool=4)
        q_, k_ = q.clone().requires_grad_(), k.clone().requires_grad_()
        out = sparse_attention(q_, k_, k_, indices, 0.3)
        return indices, out, *torch.autograd.grad(out, (q_, k_), grad_out)

    plain = run()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under_autocast = run()
    for a, b in zip(under_autocast, plain, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("shared", [True, False], ids=["values-in-keys", "separate-values"])
def test_attention_with_indexer_kl_equals_the_two_operations(shared: bool):
    """One pass for attention and indexer loss equals sparse_attention plus indexer_kl (float64, 1e-12):
    outputs, loss, and every gradient, with ragged padding, an empty row, two batch rows and more keys than
    queries; the loss's gradient reaches the indexer's inputs only."""
    from megaseq_dsa.indexer import indexer_kl
    from megaseq_dsa.ops import sparse_attention_with_indexer_kl

    n_queries, n_keys, slots = 23, 41, 9
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(2, n_queries, 3, 16, generator=gen, dtype=torch.float64)
    k = torch.randn(2, n_keys, 16, generator=gen, dtype=torch.float64)
    v = torch.randn(2, n_keys, 12, generator=gen, dtype=torch.float64)
    q_idx = torch.randn(2, n_queries, 2, 8, generator=gen, dtype=torch.float64)
    k_idx = torch.randn(2, n_keys, 8, generator=gen, dtype=torch.float64)
    weights = torch.randn(2, n_queries, 2, generator=gen, dtype=torch.float64)
    indices = random_indices(2, n_queries, slots, seed=8, n_keys=n_keys)
    grad_out = torch.randn(2, n_queries, 3, 16 if shared else 12, generator=gen, dtype=torch.float64)
    positions = torch.arange(n_keys - n_queries, n_keys)

    def run(fused: bool):
        leaves = [x.clone().requires_grad_() for x in (q, k, v, q_idx, k_idx, weights)]
        q_, k_, v_, qi, ki, w = leaves
        values = k_[..., :16] if shared else v_
        if fused:
            out, kl = sparse_attention_with_indexer_kl(q_, k_, values, indices, 0.3, qi, ki, w, chunk_size=5)
        else:
            out = sparse_attention(q_, k_, values, indices, 0.3, chunk_size=5)
            kl = indexer_kl(qi, ki, w, q_, k_, 0.3, positions, torch.zeros(n_keys, dtype=torch.long), indices, 4)
        kl_grads = torch.autograd.grad(kl, leaves, allow_unused=True, retain_graph=True)
        out_grads = torch.autograd.grad(out, leaves, grad_out, allow_unused=True)
        return out, kl, kl_grads, out_grads

    def assert_close(got, want):
        assert (got - want).abs().max() <= 1e-12 * max(1.0, want.abs().max().item())

    (out, kl, kl_grads, out_grads), (want_out, want_kl, want_kl_grads, want_out_grads) = run(True), run(False)
    assert torch.isfinite(kl) and kl > 0
    assert_close(out, want_out)
    assert_close(kl, want_kl)
    assert all(g is None for g in kl_grads[:3]), "the indexer loss reached the attention's inputs"
    for got, want in zip((*kl_grads[3:], *out_grads), (*want_kl_grads[3:], *want_out_grads), strict=True):
        assert (got is None) == (want is None)
        if got is not None:
            assert_close(got, want)


# ------------------------------------------------------------------------------------- bf16 index scores


@pytest.mark.parametrize("pool", [1, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_bf16_scores_with_the_exact_pass_equal_the_reference(pool: int, dtype: torch.dtype):
    """bf16 operands, then the exact pass over the candidates: the oracle's rows exactly (documents, keys that
    outnumber queries, awkward blocks), exact-zero relu ties broken to the earlier key as the oracle does."""
    seq_len, topk, cu = 301, 24, torch.tensor([0, 150, 151, 301])
    q, k, w = indexer_inputs(seq_len, dtype=dtype, seed=3)
    fast = select_topk(q, k, w, topk, cu, pool=pool, scores="bf16", **SMALL_BLOCKS)
    assert torch.equal(fast, select_topk_reference(q, k, w, topk, cu, pool=pool))
    positions = key_positions(seq_len, 40, 1, seed=4)
    fast = select_topk(q[:, :40], k, w[:, :40], topk, pool=pool, query_positions=positions, scores="bf16")
    assert torch.equal(fast, select_topk_reference(q[:, :40], k, w[:, :40], topk, pool=pool, query_positions=positions))


@pytest.mark.parametrize("pool", [1, 4])
def test_bf16_scores_ties_go_to_the_earlier_key(pool: int):
    """Every score equal: the candidates tie far beyond k + margin and the earliest blocks still win."""
    seq_len, topk = 300, 8
    q, k, w = indexer_inputs(seq_len)
    out = select_topk(q, k, torch.zeros_like(w), topk, pool=pool, scores="bf16", rescore_margin=2)
    assert torch.equal(out, select_topk_reference(q, k, torch.zeros_like(w), topk, pool=pool))


def test_selection_recall_counts_shared_keys():
    a = torch.tensor([[[0, 2, 5, -1], [1, 3, -1, -1]]], dtype=torch.int32)
    b = torch.tensor([[[0, 3, 5, -1], [1, 3, -1, -1]]], dtype=torch.int32)
    assert indexer_module.selection_recall(a, b) == 4 / 5
    assert indexer_module.selection_recall(b, b) == 1.0


def test_bf16_scores_alone_miss_keys_that_the_exact_pass_recovers():
    """The wrong selection the exact pass exists for: bf16 scores' own choice (margin 0) over a thousand keys
    differs from the fp32 choice at the top-k boundary; the recall check catches it, and the default margin
    gives the fp32 rows back."""
    q, k, w = indexer_inputs(1500, heads=4, dim=32, seed=5, dtype=torch.float32)
    exact = select_topk(q, k, w, 64)
    plain = select_topk(q, k, w, 64, scores="bf16", rescore_margin=0)
    assert indexer_module.selection_recall(plain, exact) < 1.0
    assert torch.equal(select_topk(q, k, w, 64, scores="bf16"), exact)


def test_select_topk_rejects_unknown_scores():
    q, k, w = indexer_inputs(10)
    with pytest.raises(ValueError, match="scores must be one of fp32, bf16, got 'fp8'"):
        select_topk(q, k, w, 4, scores="fp8")
    with pytest.raises(ValueError, match="rescore_margin must be >= 0"):
        select_topk(q, k, w, 4, scores="bf16", rescore_margin=-1)
