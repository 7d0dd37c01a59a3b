"""The plain collectives of ``megaseq.parallel.collectives`` on two gloo ranks, against what each must return."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from megaseq.parallel import collectives
from megaseq_testkit.distributed import run_gloo

pytestmark = pytest.mark.slow  # starts gloo ranks


def _worker(rank: int, world: int) -> dict[str, Any]:
    group = dist.group.WORLD
    squares = torch.tensor([0.0, 1.0 + rank, 5.0])
    collectives.all_reduce(squares[1:2], group)  # a view: reduced in place, the rest untouched
    return {
        "device": collectives.group_device(group),
        "sum": squares,
        "max": collectives.all_reduce(torch.tensor([rank, -rank]), group, op="max"),
        "min": collectives.all_reduce(torch.tensor([rank, -rank]), group, op="min"),
        "gathered": collectives.all_gather_tensor(torch.full((2,), float(rank)), group),
        "exchanged": collectives.exchange(torch.tensor([[10 * rank + 0], [10 * rank + 1]]), group),
        "objects": collectives.all_gather_object({"rank": rank}, group),
        "on_main": collectives.gather_object(rank, group),
        "broadcast": collectives.broadcast_object(f"from {rank}", group),
    }


def test_plain_collectives_on_two_ranks():
    results = run_gloo(2, _worker)
    for rank, got in enumerate(results):
        assert got["device"] == torch.device("cpu")
        torch.testing.assert_close(got["sum"], torch.tensor([0.0, 3.0, 5.0]))
        assert got["max"].tolist() == [1, 0] and got["min"].tolist() == [0, -1]
        assert [g.tolist() for g in got["gathered"]] == [[0.0, 0.0], [1.0, 1.0]]
        assert got["exchanged"].tolist() == [[rank], [10 + rank]]
        assert got["objects"] == [{"rank": 0}, {"rank": 1}]
        assert got["on_main"] == ([0, 1] if rank == 0 else [])
        assert got["broadcast"] == "from 0"
