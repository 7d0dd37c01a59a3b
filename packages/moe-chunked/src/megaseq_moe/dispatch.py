"""Sort-based, dropless dispatch of one chunk's (token, slot) pairs to the experts that own them.

Experts are split into contiguous blocks, one per expert-parallel rank. The chunk's ``n * k`` pairs are
sorted by expert id (stable), which also sorts them by destination rank; each rank receives its rows
ordered by (source rank, local expert) and regroups them by local expert with one more stable sort, so the
experts see contiguous row blocks. Nothing is sized in advance: however skewed the routing, every pair is
sent (the receive buffer of a chunk is at most ``ranks * n * k`` rows).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from megaseq_moe.ep import exchange_counts, exchange_rows, group_size


@dataclass(frozen=True)
class DispatchPlan:
    """Where each (token, slot) pair of a chunk goes and how received rows are grouped.

    ``order``: flat pair indices (``token * k + slot``) sorted by expert; sent rows follow this order.
    ``send_counts`` / ``recv_counts``: rows to / from each rank. ``grouping``: permutation that groups
    received rows by local expert. ``expert_counts``: rows per local expert after grouping.
    """

    order: Tensor
    top_k: int
    send_counts: list[int]
    recv_counts: list[int]
    grouping: Tensor
    expert_counts: Tensor
    group: Any | None

    @property
    def tokens(self) -> Tensor:
        """Token (row of the chunk) of each sent pair, in send order."""
        return self.order // self.top_k

    def send(self, rows: Tensor) -> Tensor:
        """Rows in send order (one per pair) -> this rank's received rows grouped by local expert."""
        return exchange_rows(rows, self.send_counts, self.recv_counts, self.group)[self.grouping]

    def send_back(self, grouped: Tensor) -> Tensor:
        """Inverse of :meth:`send`: rows grouped by local expert -> the origin's rows in send order."""
        received_order = torch.empty_like(grouped)
        received_order[self.grouping] = grouped
        return exchange_rows(received_order, self.recv_counts, self.send_counts, self.group)


def plan_dispatch(indices: Tensor, n_experts: int, group: Any | None) -> DispatchPlan:
    """Plan the dispatch of a chunk whose tokens chose experts ``indices [n, k]`` (global expert ids)."""
    ranks = group_size(group)
    per_rank = n_experts // ranks
    flat = indices.reshape(-1)
    sent = torch.bincount(flat, minlength=n_experts).view(ranks, per_rank)
    received = exchange_counts(sent, group)  # [source rank, local expert]
    row_expert = (
        torch.arange(per_rank, device=flat.device).repeat(ranks).repeat_interleave(received.reshape(-1))
    )
    return DispatchPlan(
        order=torch.argsort(flat, stable=True),
        top_k=indices.shape[1],
        send_counts=sent.sum(1).tolist(),
        recv_counts=received.sum(1).tolist(),
        grouping=torch.argsort(row_expert, stable=True),
        expert_counts=received.sum(0),
        group=group,
    )
