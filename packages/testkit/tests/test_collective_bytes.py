"""``count_collective_bytes`` counts what a rank hands to each collective, through megaseq's collectives and
torch.distributed alike, and leaves the functions as they were after its block."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megaseq.parallel import collectives
from megaseq_testkit import count_collective_bytes


class _Bucket:
    def __init__(self, buffer: torch.Tensor) -> None:
        self._buffer = buffer

    def buffer(self) -> torch.Tensor:
        return self._buffer


def test_bytes_per_collective_and_nothing_after_the_block():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        group = dist.group.WORLD
        originals = (dist.all_reduce, collectives._all_gather_single)
        with count_collective_bytes() as sent:
            collectives.all_reduce(torch.zeros(10), group)  # float32: 40 bytes
            collectives.all_gather_tensor(torch.zeros(3, dtype=torch.int32), group)  # 12
            collectives.exchange(torch.zeros(1, 4, dtype=torch.float64), group)  # 32
            collectives.all_gather(torch.zeros(2, 5), group)  # the single-tensor alias: 40
            collectives.sum_bucket(group, _Bucket(torch.zeros(2))).wait()  # DDP's hook: 8
        assert sent == {"all_reduce": 48, "all_gather": 12, "all_to_all_single": 32, "all_gather_into_tensor": 40}
        assert (dist.all_reduce, collectives._all_gather_single) == originals
    finally:
        dist.destroy_process_group()
