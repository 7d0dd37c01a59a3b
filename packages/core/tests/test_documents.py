"""Core's shared component utilities: the document layout, the dtype rule, the autograd-aware collectives."""

from __future__ import annotations

import pytest
import torch

from megaseq.contracts import ForwardContext
from megaseq.documents import Documents, as_documents
from megaseq.dtypes import compute_dtype
from megaseq.parallel import all_gather, all_to_all, gather_sequence, zigzag_shard
from megaseq_testkit import watch_host_syncs
from megaseq_testkit.distributed import run_gloo

CU = [0, 3, 8, 8, 12, 20]  # an empty document at 8


def test_layout_facts_against_a_loop():
    docs = Documents(torch.tensor(CU, dtype=torch.int32))
    assert docs.length == 20 and docs.n_docs == 5 and docs.lengths == [3, 5, 0, 4, 8]
    doc_of, start_of, end_of = [], [], []
    for d, (s, e) in enumerate(docs.bounds):
        doc_of += [d] * (e - s)
        start_of += [s] * (e - s)
        end_of += [e] * (e - s)
    assert docs.doc_ids("cpu").tolist() == doc_of
    assert docs.starts("cpu").tolist() == start_of
    assert docs.ends("cpu").tolist() == end_of
    assert docs.positions_in_doc("cpu").tolist() == [p - s for p, s in enumerate(start_of)]


def test_windows_of_a_layout():
    docs = Documents.from_offsets(CU)
    window, continues = docs.window(0, 4)  # a document starts at 0, another at 3
    assert window.offsets == (0, 3, 4) and not continues
    window, continues = docs.window(4, 8)  # continues the document begun at 3
    assert window.offsets == (0, 4) and continues
    window, continues = docs.window(8, 16)  # the empty document and the one at 8 start here, one at 12
    assert window.offsets == (0, 4, 8) and not continues
    assert docs.window(8, 16)[0] is window  # memoized


def test_one_host_read_per_context_and_memoized_derivations():
    cu, reads = watch_host_syncs(torch.tensor(CU, dtype=torch.int32))
    ctx = ForwardContext(cu_seqlens=cu)
    assert reads() == 0  # nothing is read until a component asks
    for _ in range(3):  # three layers
        docs = ctx.documents
        docs.doc_ids("cpu"), docs.positions_in_doc("cpu"), docs.window(4, 12)
        assert docs.derive(("test", 1), list) is docs.derive(("test", 1), list)
    assert reads() == 1
    assert ForwardContext().documents is None


@pytest.mark.parametrize(
    ("cu", "kwargs", "message"),
    [
        ([0, 5, 3, 10], {}, "rise from 0 without decreasing"),
        ([1, 10], {}, "rise from 0"),
        ([0], {}, r"\[N \+ 1\], N >= 1"),
        ([0, 9], {"length": 10}, "end at the sequence length 10"),
        ([0, 10], {"batch": 2}, "batch of 1"),
    ],
)
def test_validation_errors_are_one_line(cu, kwargs, message):
    with pytest.raises(ValueError, match=message) as raised:
        as_documents(torch.tensor(cu), **kwargs)
    assert "\n" not in str(raised.value)


def test_validation_rejects_float_and_2d():
    with pytest.raises(ValueError, match="1-D int32/int64"):
        Documents(torch.tensor([0.0, 4.0]))
    with pytest.raises(ValueError, match="1-D int32/int64"):
        Documents(torch.tensor([[0, 4]]))


def test_compute_dtype():
    assert compute_dtype(torch.bfloat16) == compute_dtype(torch.float16) == compute_dtype(torch.float32) == torch.float32
    assert compute_dtype(torch.float64) == torch.float64


def _collectives(rank: int, world: int) -> dict[str, torch.Tensor]:
    """all_gather, gather_sequence and an uneven all_to_all, each differentiated on this rank."""
    import torch.distributed as dist

    from megaseq.contracts import ContextParallel

    x = torch.arange(6.0).reshape(2, 3).add(10 * rank).requires_grad_(True)
    gathered = all_gather(x, dist.group.WORLD)
    (gathered * (torch.arange(world) + 1)[:, None, None]).sum().backward()  # rank r's copy weighted r + 1
    seq = torch.arange(8.0).reshape(1, 8, 1)[:, :, :].repeat(1, 1, 2)
    local = zigzag_shard(seq, rank, world).requires_grad_(True)
    cp = ContextParallel(group=dist.group.WORLD, rank=rank, world_size=world, seq_len=8)
    full = gather_sequence(local, cp)
    full.sum().backward()
    rows = torch.arange(5.0 + rank).reshape(-1, 1).requires_grad_(True)  # rank r has 5 + r rows
    send = [2, 3 + rank] if rank == 0 else [1, 4 + rank]
    recv = [2, 1] if rank == 0 else [3, 5]  # what rank 0 / rank 1 send to this rank
    moved = all_to_all(rows, send, recv, dist.group.WORLD)
    (moved * torch.arange(1.0, moved.shape[0] + 1)[:, None]).sum().backward()
    return {"x_grad": x.grad, "full": full.detach(), "local_grad": local.grad, "moved": moved.detach(), "rows_grad": rows.grad}


def test_collectives_over_two_gloo_ranks():
    world = 2
    results = run_gloo(world, _collectives)
    for rank, r in enumerate(results):
        # every rank weighs rank r's copy by r + 1; the gradient sums over the ranks that used it
        assert torch.equal(r["x_grad"], torch.full((2, 3), float(world * (rank + 1))))
        assert torch.equal(r["full"], torch.arange(8.0).reshape(1, 8, 1).repeat(1, 1, 2))
        assert torch.equal(r["local_grad"], torch.full_like(r["local_grad"], float(world)))
    # rank 0 sends rows [0, 1] to itself and [2, 3, 4] to rank 1; rank 1 sends [0] to rank 0 and [1..5] to itself
    assert results[0]["moved"].flatten().tolist() == [0, 1, 0]
    assert results[1]["moved"].flatten().tolist() == [2, 3, 4, 1, 2, 3, 4, 5]
    # backward returns each row's weight (its 1-based slot at the receiver) to its sender
    assert results[0]["rows_grad"].flatten().tolist() == [1, 2, 1, 2, 3]
    assert results[1]["rows_grad"].flatten().tolist() == [3, 4, 5, 6, 7, 8]
