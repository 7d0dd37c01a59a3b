"""Sort-based, dropless dispatch of one chunk's (token, slot) pairs to the experts that own them.

Experts are split into contiguous blocks, one per expert-parallel rank. The chunk's ``n * k`` pairs are
sorted by expert id (stable), which also sorts them by destination rank; each rank receives its rows
ordered by (source rank, local expert) and regroups them by local expert with one more stable sort, so the
experts see contiguous row blocks. Nothing is sized in advance: however skewed the routing, every pair is
sent (the receive buffer of a chunk is at most ``ranks * n * k`` rows).

Under expert tensor parallelism the ranks of an expert-tensor-parallel group hold the same experts, each a
block of their hidden width (megatron-core's layout). After the dispatch, :class:`TensorGather` gives every
rank of the group the rows all of them received (an all-gather), each computes its block's partial outputs
for all those rows, and the partial outputs of each row are summed on the rank that received it (a
reduce-scatter); the exchange with the origin ranks is unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from megaseq.dtypes import compute_dtype
from megaseq.parallel import collectives
from megaseq_moe.ep import exchange_counts, exchange_rows, group_size


@dataclass(frozen=True)
class DispatchPlan:
    """Where each (token, slot) pair of a chunk goes and how received rows are grouped.

    ``order``: flat pair indices (``token * k + slot``) sorted by expert; sent rows follow this order.
    ``send_counts`` / ``recv_counts``: rows to / from each rank (host integers: the exchange's split sizes, read
    from the device once per chunk; empty with one rank, where nothing is exchanged and nothing is read).
    ``grouping``: permutation that groups received rows by local expert (None with one rank: the sent order
    is already grouped). ``expert_counts``: rows per local expert after grouping.
    """

    order: Tensor
    top_k: int
    send_counts: list[int]
    recv_counts: list[int]
    grouping: Tensor | None
    expert_counts: Tensor
    group: Any | None

    @property
    def tokens(self) -> Tensor:
        """Token (row of the chunk) of each sent pair, in send order."""
        return self.order // self.top_k

    def send(self, rows: Tensor) -> Tensor:
        """Rows in send order (one per pair) -> this rank's received rows grouped by local expert."""
        if self.grouping is None:
            return rows
        return exchange_rows(rows, self.send_counts, self.recv_counts, self.group)[self.grouping]

    def send_back(self, grouped: Tensor) -> Tensor:
        """Inverse of :meth:`send`: rows grouped by local expert -> the origin's rows in send order."""
        if self.grouping is None:
            return grouped
        received_order = torch.empty_like(grouped)
        received_order[self.grouping] = grouped
        return exchange_rows(received_order, self.recv_counts, self.send_counts, self.group)


def count_ids(ids: Tensor, n: int) -> Tensor:
    """Occurrences of each id in ``[0, n)`` among ``ids`` (int64 ``[n]``), without reading anything back to the
    host: on CUDA ``torch.bincount`` reads the largest id to size its output, a synchronisation."""
    ids = ids.reshape(-1)
    return torch.zeros(n, dtype=torch.int64, device=ids.device).index_add_(0, ids, torch.ones_like(ids, dtype=torch.int64))


def plan_dispatch(indices: Tensor, n_experts: int, group: Any | None) -> DispatchPlan:
    """Plan the dispatch of a chunk whose tokens chose experts ``indices [n, k]`` (global expert ids)."""
    ranks = group_size(group)
    per_rank = n_experts // ranks
    flat = indices.reshape(-1)
    sent = count_ids(flat, n_experts).view(ranks, per_rank)
    order = torch.argsort(flat, stable=True)
    if group is None:  # every pair stays here, already grouped by expert: no exchange, no host read
        return DispatchPlan(order=order, top_k=indices.shape[1], send_counts=[], recv_counts=[], grouping=None,
                            expert_counts=sent[0], group=None)
    received = exchange_counts(sent, group)  # [source rank, local expert]
    # the exchange's split sizes in one read; the row of every received pair is computed on the device
    send_counts, recv_counts = torch.stack([sent.sum(1), received.sum(1)]).tolist()
    row_expert = torch.arange(per_rank, device=flat.device).repeat(ranks).repeat_interleave(
        received.reshape(-1), output_size=sum(recv_counts))
    return DispatchPlan(
        order=order,
        top_k=indices.shape[1],
        send_counts=send_counts,
        recv_counts=recv_counts,
        grouping=torch.argsort(row_expert, stable=True),
        expert_counts=received.sum(0),
        group=group,
    )


@dataclass(frozen=True)
class TensorGather:
    """Rows grouped by local expert, shared over an expert-tensor-parallel group (module docstring).

    ``sizes``: rows of each rank of the group; ``grouping``: permutation that groups the gathered rows (in
    rank order) by local expert; ``expert_counts``: gathered rows per local expert."""

    sizes: list[int]
    grouping: Tensor
    expert_counts: Tensor
    group: Any

    def gather(self, rows: Tensor) -> Tensor:
        """This rank's rows -> the rows of every rank of the group, grouped by local expert."""
        n, mine = len(self.sizes), rows.shape[0]
        return exchange_rows(rows.repeat(n, 1), [mine] * n, self.sizes, self.group)[self.grouping]

    def reduce(self, partial: Tensor) -> Tensor:
        """Partial outputs of the gathered rows (same order) -> this rank's rows, summed over the group."""
        n, mine = len(self.sizes), self.sizes[dist.get_rank(self.group)]
        by_rank = torch.empty_like(partial)
        by_rank[self.grouping] = partial
        back = exchange_rows(by_rank, self.sizes, [mine] * n, self.group)
        return back.view(n, mine, -1).to(compute_dtype(partial.dtype)).sum(0).to(partial.dtype)


def plan_tensor_gather(expert_counts: Tensor, group: Any) -> TensorGather:
    """Plan :class:`TensorGather` for this rank's received rows, ``expert_counts[e]`` of them for local expert e."""
    every = collectives.all_gather_tensor(expert_counts, group)
    sizes = torch.stack(every).sum(1).tolist()  # the exchange's split sizes, in one read
    row_expert = torch.cat([torch.arange(len(c), device=c.device).repeat_interleave(c, output_size=n)
                            for c, n in zip(every, sizes, strict=True)])
    return TensorGather(
        sizes=sizes,
        grouping=torch.argsort(row_expert, stable=True),
        expert_counts=torch.stack(every).sum(0),
        group=group,
    )
