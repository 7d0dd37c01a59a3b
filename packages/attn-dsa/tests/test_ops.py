"""The blocked DSA operations against their dense oracles, on random inputs of awkward sizes.

Tolerance for fp32 fast paths: max |fast - oracle| <= 1e-5 * max(1, max |oracle|), oracle in float64.
Index selections are compared exactly where ties are impossible (positive q/k make every score distinct), and
otherwise by the multiset of selected scores (relu makes exact-zero ties likely; any of them is a valid pick).
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from megaseq_dsa.ops import (
    indexer_scores_reference,
    select_topk,
    select_topk_reference,
    selected_slots,
    sparse_attention,
    sparse_attention_reference,
    sparse_attention_with_lse,
)
from megaseq_dsa.ops.indexer import SAMPLE_STRIDE

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
    positive: bool = False,
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seq_len, heads, dim, generator=gen, dtype=dtype)
    k = torch.randn(batch, seq_len, dim, generator=gen, dtype=dtype)
    w = torch.randn(batch, seq_len, heads, generator=gen, dtype=dtype)
    if positive:  # relu is the identity and scores are distinct with probability 1
        q, k = q.abs(), k.abs()
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


def pooled_scores(q, k, w, start: int, end: int, pool: int) -> torch.Tensor:
    """Scores of the complete blocks of document [start, end) for its queries: [end - start, n_blocks]."""
    n_blocks = (end - start) // pool
    keys = k[0, start : start + n_blocks * pool].reshape(n_blocks, pool, k.shape[-1]).mean(1)
    return torch.einsum(
        "thn,th->tn", torch.einsum("thd,nd->thn", q[0, start:end], keys).relu(), w[0, start:end]
    )


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
    q, k, w = indexer_inputs(seq_len, batch=2, positive=True)
    fast = select_topk(q, k, w, topk, pool=pool, **SMALL_BLOCKS)
    oracle = select_topk_reference(q, k, w, topk, pool=pool)
    assert fast.dtype == torch.int32 and fast.shape == (2, seq_len, selected_slots(topk, pool))
    assert torch.equal(fast, oracle)


@pytest.mark.parametrize("pool", [1, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_select_topk_general_inputs_pick_the_best_scores(pool: int, dtype: torch.dtype):
    """Normal inputs: relu ties at 0 are common, so compare the multiset of selected (block) scores."""
    seq_len, topk, cu = 123, 20, torch.tensor([0, 50, 51, 123])
    q, k, w = indexer_inputs(seq_len, dtype=dtype, seed=1)
    fast = select_topk(q, k, w, topk, cu, pool=pool, **SMALL_BLOCKS)
    oracle = select_topk_reference(q, k, w, topk, cu, pool=pool)
    q, k, w = q.double(), k.double(), w.double()
    for start, end in [(0, 50), (50, 51), (51, 123)]:
        scores = pooled_scores(q, k, w, start, end, pool)
        for t in range(start, end):
            got, want = row_tokens(fast[0, t]), row_tokens(oracle[0, t])
            assert len(got) == len(want)
            own_block = start + (t - start) // pool * pool
            tail = own_block if t - own_block + 1 < pool else t + 1  # first tail token (none: t + 1)
            # Tail tokens are the same in both; compare the complete blocks by their scores.
            assert [s for s in got if s >= tail] == [s for s in want if s >= tail]
            got_blocks = [(s - start) // pool for s in got if s < tail]
            want_blocks = [(s - start) // pool for s in want if s < tail]
            got_scores = scores[t - start, sorted(set(got_blocks))].sort().values
            want_scores = scores[t - start, sorted(set(want_blocks))].sort().values
            torch.testing.assert_close(got_scores, want_scores, rtol=TOL, atol=TOL)


@pytest.mark.parametrize("pool", [1, 4])
def test_select_topk_documents_are_independent(pool: int):
    lengths = [13, 1, 40, 6, 70]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    q, k, w = indexer_inputs(sum(lengths), positive=True, seed=2)
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


@pytest.mark.parametrize("pool", [1, 4])
def test_select_topk_exact_when_the_sampled_threshold_misleads(pool: int):
    """Keys on the sampling stride score far above the rest: the sampled threshold then drops keys that belong
    to the top-k, and the block must fall back to the exact selection."""
    seq_len, topk = 300, 32
    q, k, w = indexer_inputs(seq_len, positive=True, seed=13)
    w = w.abs()
    on_stride = torch.arange(seq_len // pool) % SAMPLE_STRIDE == 0
    k = k * torch.where(on_stride, 10.0, 1.0).repeat_interleave(pool)[:seq_len, None]
    blocks = {"query_block": 50, "key_block": 64}
    assert torch.equal(
        select_topk(q, k, w, topk, pool=pool, **blocks), select_topk_reference(q, k, w, topk, pool=pool)
    )


def test_select_topk_glm_slot_count():
    q, k, w = indexer_inputs(5, dtype=torch.float32)
    assert select_topk(q, k, w, 2048, pool=4).shape == (1, 5, 2112)


def test_select_topk_block_sizes_do_not_change_the_result():
    q, k, w = indexer_inputs(90, batch=2, positive=True, seed=5)
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


def random_indices(batch: int, seq_len: int, slots: int, seed: int = 0) -> torch.Tensor:
    """Distinct random keys per row (not causal: the op does not care), ragged -1 padding, empty rows."""
    gen = torch.Generator().manual_seed(seed)
    rows = torch.stack([torch.randperm(seq_len, generator=gen)[:slots] for _ in range(batch * seq_len)])
    counts = torch.randint(0, slots + 1, (batch * seq_len, 1), generator=gen)
    rows = torch.where(torch.arange(slots) < counts, rows, -1)
    rows[0] = -1  # at least one row with nothing selected
    return rows.view(batch, seq_len, slots).int()


def forward_and_grads(fn, q, k, v, indices, scale, grad_out, **kwargs):
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    out = fn(q, k, v, indices, scale, **kwargs)
    grads = torch.autograd.grad(out, (q, k, v), grad_out.to(out.dtype))
    return (out, *grads)


@pytest.mark.parametrize("chunk_size", [1, 7, None])
def test_sparse_attention_matches_reference(chunk_size: int | None):
    seq_len, slots = 53, 19
    q, k, v = attention_inputs(seq_len)
    indices = random_indices(2, seq_len, slots)
    grad_out = torch.randn(2, seq_len, 3, 12, generator=torch.Generator().manual_seed(9))
    fast = forward_and_grads(sparse_attention, q, k, v, indices, 0.3, grad_out, chunk_size=chunk_size)
    oracle = forward_and_grads(
        sparse_attention_reference, q.double(), k.double(), v.double(), indices, 0.3, grad_out
    )
    for got, want in zip(fast, oracle, strict=True):
        assert got.dtype == torch.float32
        assert_close(got, want)


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
        (torch.full((1, 5, 8), 5, dtype=torch.int32), r"\[-1, T-1\]"),
        (torch.full((1, 5, 8), -2, dtype=torch.int32), r"\[-1, T-1\]"),
        (torch.zeros(1, 5, 8), "integer"),
        (torch.zeros(1, 4, 8, dtype=torch.int32), "indices"),
    ],
)
def test_sparse_attention_rejects_bad_indices(indices: torch.Tensor, message: str):
    q, k, v = attention_inputs(5, batch=1)
    with pytest.raises(ValueError, match=message):
        sparse_attention(q, k, v, indices, 0.3)
