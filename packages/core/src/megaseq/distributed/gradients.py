"""Gradients summed over the ranks by torch's ``DistributedDataParallel``, in buckets overlapped with backward.

Which ranks a gradient is summed over depends on the parameter (``megaseq.distributed.groups``): replicated
parameters over every rank, expert-parallel shards over the expert-data-parallel group, tensor-parallel blocks
over the ranks holding the same block (``tp_data_group``). A DDP instance takes one process group, so each of
these sets whose group has more than one rank gets a DDP of its own over the same model, every other
parameter ignored (``_set_params_and_buffers_to_ignore_for_model``). Each DDP launches the all-reduce of a
bucket (25 MiB, torch's default) from autograd hooks as soon as all its gradients are ready, while backward
goes on through the layers below; the last bucket's reduction is waited for at the end of backward.

The settings, and why:

- a communication hook that sums (``megaseq.parallel.collectives.sum_bucket``) instead of DDP's mean: each
  rank's loss is already its share of the global batch's mean, so the sum is the one-process gradient;
- ``no_sync`` for every micro-batch but the last: gradients accumulate on each rank and the last backward
  reduces their sum once;
- ``find_unused_parameters``: a parameter may get no gradient on some ranks. DDP sums zeros for it there,
  and leaves ``grad`` None where no rank had one in the whole step, as one process does (the optimizer then
  leaves it alone). Its price is a walk over the autograd graph per synchronised forward, on the host. A step
  that finds no such parameter would make DDP print once per rank that the flag could be turned off, which
  here it cannot: each DDP holds a scalar that no objective uses, so there always is one;
- an anchor per DDP, a scalar parameter of its own that every objective carries times zero: DDP launches
  its first all-reduce (and learns which parameters went unused) from the first gradient hook it sees, so a
  rank on which none of its parameters got a gradient would never join the all-reduces the others wait in;
- ``gradient_as_bucket_view``: after the reduction each ``grad`` is a view of its bucket, not a copy;
- ``init_sync=False``, ``forward_sync_buffers=False``: every layout builds the one-process initial weights
  on every rank (``megaseq.distributed.experts``), and the buffers are either the same everywhere or a
  rank's own (the MoE's load counters), so nothing is broadcast.

Memory: the buckets hold the gradients of the parameters they reduce (in the parameters' dtype) from the
moment the DDP is built. In a synchronised backward each gradient autograd produces is copied into its bucket
and freed at once, so the buckets take the gradients' place; under gradient accumulation (``train.grad_accum >
1``) the earlier micro-batches' gradients accumulate beside the buckets. ``megaseq.memory.plan`` counts that
(``Estimate.reduction``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Set
from functools import partial
from typing import TypeVar

import torch
from torch import Tensor, nn

from megaseq.distributed.groups import Parallel

T = TypeVar("T")


class _Objective(nn.Module):
    """What one DDP wraps: the model (for its parameters), an anchor and a scalar never used (module
    docstring); its forward runs a function that returns the objective to differentiate."""

    def __init__(self, model: nn.Module, device: torch.device) -> None:
        super().__init__()
        self.model = model
        self.anchor = nn.Parameter(torch.zeros((), device=device))
        self.unused = nn.Parameter(torch.zeros((), device=device))

    def forward(self, run: Callable[[], Tensor]) -> Tensor:
        return run() + self.anchor * 0


class GradientReduction:
    """The DDPs of one model under one layout (module docstring). ``expert_params``: the expert-parallel shards;
    ``tp_params``: the tensor-parallel blocks; every other trained parameter is replicated. In one process, or
    where every group has one rank, there is nothing to reduce and :meth:`forward` only runs the function."""

    def __init__(
        self, model: nn.Module, parallel: Parallel, expert_params: Set[nn.Parameter] = frozenset(),
        tp_params: Set[nn.Parameter] = frozenset(),
    ) -> None:
        self.ddps: list[nn.Module] = []
        self.reduced: list[nn.Parameter] = []  # the model's parameters some DDP reduces
        self._reduce_pending = True  # no synchronised backward since the last update
        if not parallel.distributed:
            return
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        from megaseq.parallel import collectives

        named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        device = named[0][1].device if named else torch.device("cpu")
        sets = [
            (parallel.world_group, [(n, p) for n, p in named if p not in expert_params and p not in tp_params]),
            (parallel.expert_dp_group, [(n, p) for n, p in named if p in expert_params]),
            (parallel.tp_data_group, [(n, p) for n, p in named if p in tp_params]),
        ]
        for group, members in sets:
            if not members or dist.get_world_size(group) == 1:
                continue
            wrapped = _Objective(model, device)
            kept = {name for name, _ in members}
            ignored = [f"model.{name}" for name, _ in model.named_parameters() if name not in kept]
            DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(wrapped, ignored)
            ddp = DistributedDataParallel(
                wrapped, process_group=group, find_unused_parameters=True, gradient_as_bucket_view=True,
                init_sync=False, forward_sync_buffers=False,
            )
            ddp.register_comm_hook(group, collectives.sum_bucket)
            self.ddps.append(ddp)
            self.reduced += [p for _, p in members]

    def forward(self, run: Callable[[], tuple[Tensor, T]], sync: bool) -> tuple[Tensor, T]:
        """``run()``: ``(objective, anything)``, the objective being what backward differentiates; runs it through
        every DDP, so that the objective's backward accumulates this rank's gradients and, with ``sync``, sums
        them (with those accumulated since the last sum) over the ranks while it runs."""
        if not self.ddps:
            return run()
        rest: list[T] = []

        def objective() -> Tensor:
            value, other = run()
            rest.append(other)
            return value

        call: Callable[[], Tensor] = objective
        for ddp in reversed(self.ddps):
            call = partial(ddp, call)
        with contextlib.ExitStack() as stack:
            if not sync:
                for ddp in self.ddps:
                    stack.enter_context(ddp.no_sync())
            value = call()
        self._reduce_pending &= not sync
        return value, rest[0]

    def finish(self) -> None:
        """After the micro-batches of one update: a rank that ran none with ``sync`` (it had no rows) joins the
        other ranks' reduction with an empty one. Clears the anchors' gradients."""
        if self.ddps and self._reduce_pending:
            objective, _ = self.forward(lambda: (torch.zeros(()), None), sync=True)
            objective.backward()
        for ddp in self.ddps:
            ddp.module.anchor.grad = None
        self._reduce_pending = True

    @property
    def bucket_bytes(self) -> int:
        """Bytes of the gradients the DDPs' buckets hold (the model's parameters they reduce)."""
        return sum(p.numel() * p.element_size() for p in self.reduced)


__all__ = ["GradientReduction"]
