"""Expert-parallel collectives. ``group=None`` means one rank: every helper is then the identity.

Rows move with core's ``megaseq.parallel.all_to_all`` (``all_to_all_single`` with explicit split sizes, which
gloo implements with uneven splits too).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from megaseq.parallel import all_to_all, collectives


def group_size(group: Any | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def exchange_rows(rows: Tensor, send_counts: list[int], recv_counts: list[int], group: Any | None) -> Tensor:
    """Send ``send_counts[r]`` consecutive rows to rank r; receive ``recv_counts[r]`` rows from rank r (core's
    ``megaseq.parallel.all_to_all``; the layer's own autograd function calls it without a graph)."""
    return rows if group is None else all_to_all(rows, send_counts, recv_counts, group)


def exchange_counts(counts: Tensor, group: Any | None) -> Tensor:
    """``counts [ranks, ...]``: row r goes to rank r; returns what each rank sent here, same shape."""
    if group is None:
        return counts
    return collectives.exchange(counts, group)


def agree_max(value: int, group: Any | None, device: torch.device) -> int:
    """The largest ``value`` over the group (so every rank runs the same number of collective rounds)."""
    if group is None:
        return value
    return int(collectives.all_reduce(torch.tensor([value], dtype=torch.int64, device=device), group, op="max").item())


def sum_over(t: Tensor, group: Any | None) -> Tensor:
    """Sum of ``t`` over the group (a new tensor)."""
    t = t.clone()
    return t if group is None else collectives.all_reduce(t, group)
