"""The optimizer of every training loop: AdamW, weight decay on matrices only, its state where the recipe says.

Two recipe keys decide where Adam's state lives (``[train]``):

- ``optimizer_state = "device"``: ``torch.optim.AdamW`` beside the parameters. ``"host"``: :class:`HostAdamW`,
  whose moments and fp32 master weights live in host memory and whose update runs on the CPU; the device
  keeps only the parameters and their gradients. On a CPU run both are the same memory (and the same numbers).
- ``optimizer_shard = true``: ZeRO stage 1 (``torch.distributed.optim.ZeroRedundancyOptimizer``): each of the
  ``dp x cp`` ranks, which all hold the same parameters, keeps the state of its share of them, updates that
  share and broadcasts it. Expert-parallel parameters differ between ranks, so it refuses ``ep > 1``.

Both are exact: the host update is AdamW's own (``torch.optim.adamw.adamw``, its multi-tensor ``foreach`` path:
one kernel per operation over all of a bucket's tensors instead of one per tensor), so the weights after any
number of steps are those of ``torch.optim.AdamW`` on one process (``packages/core/tests/test_optimizer.py``;
``tests/test_optimizer_dist.py`` under dp=2).

The host is shared by the training processes that run on it (:class:`HostShare`, found by
:func:`make_optimizer`): the check that the host can hold the state counts every one of them (a rank's need
times the ranks on its machine: each passing alone does not mean they fit together), and on an accelerator the
update uses the threads ``megaseq.threads.host_update_threads`` gives each process (its share of the
machine's cores; its own intra-op threads are one, its work being on the device).

Checkpoints (``megaseq.distributed.sharded``): a whole optimizer's state is saved in ``state.pt`` by
parameter name (the moments of expert- or tensor-split parameters beside their blocks); a sharded one as
``optimizer/rank{r}.pt`` per rank, each by name, so that either resumes under any number of ranks, sharded or
not. :class:`HostAdamW`'s state dict has ``torch.optim.AdamW``'s format, so
switching ``optimizer_state`` between runs keeps the moments.
"""

from __future__ import annotations

import contextlib
import fnmatch
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim.adamw import adamw as adamw_update

from megaseq.config import TrainConfig
from megaseq.distributed.groups import Parallel
from megaseq.errors import UserError

# Parameters per bucket of the CUDA path's copies (fp32 elements: 64 MiB): large enough that a copy's latency
# is small beside its transfer, small enough that the first bucket's update starts early.
BUCKET_ELEMENTS = 2**24


def freeze_except(model: nn.Module, patterns: list[str], source: str) -> None:
    """Train only parameters whose names match one of ``patterns`` (fnmatch globs); freeze the rest."""
    names = [name for name, _ in model.named_parameters()]
    for pattern in patterns:
        if not fnmatch.filter(names, pattern):
            raise UserError(f"{source}: train.trainable: {pattern!r} matches no parameter; e.g. {names[:3]}")
    for name, p in model.named_parameters():
        if not any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns):
            p.requires_grad_(False)


def param_groups(model: nn.Module, train: TrainConfig) -> list[dict[str, Any]]:
    """Group 0 the trained matrices (decayed), group 1 the rest (norms, biases, gates: not decayed)."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    return [{"params": decay, "weight_decay": train.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


@dataclass(frozen=True)
class HostShare:
    """What a :class:`HostAdamW` shares its machine with: ``ranks``, the training processes on the machine (each
    holding host state of its own size); ``threads``, the intra-op threads its update may use (None: the
    process's own count, e.g. a CPU run, whose threads ``megaseq.threads.CoreShare`` decides)."""

    ranks: int = 1
    threads: int | None = None


def host_share(model: nn.Module, parallel: Parallel | None) -> HostShare:
    """The :class:`HostShare` of this process (every rank must call it: the ranks find their machines)."""
    from megaseq import threads

    ranks = parallel.ranks_on_host() if parallel is not None else 1
    on_accelerator = any(p.device.type != "cpu" for p in model.parameters())
    return HostShare(ranks, threads.host_update_threads(ranks) if on_accelerator else None)


def make_optimizer(model: nn.Module, train: TrainConfig, parallel: Parallel | None = None) -> torch.optim.Optimizer:
    """AdamW over the trained parameters (:func:`param_groups`), placed and sharded as ``train`` says."""
    cls: Any = torch.optim.AdamW
    if train.optimizer_state == "host":
        cls = partial(HostAdamW, share=host_share(model, parallel))
    groups = param_groups(model, train)
    if train.optimizer_shard and parallel is not None and parallel.distributed:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(
            groups, optimizer_class=cls, process_group=parallel.world_group, lr=train.lr, betas=train.betas
        )
    return cls(groups, lr=train.lr, betas=train.betas)


def local_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer holding this rank's state: ZeRO's local one, or ``optimizer`` itself."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer


class HostAdamW(torch.optim.Optimizer):
    """AdamW whose state and update live in host memory (module docstring).

    Per parameter, in host memory: the two moments, the step count and, unless the parameter is already an
    fp32 CPU tensor (then it is its own master), an fp32 master copy and a buffer for its gradient. A step:
    gradients to the host, AdamW on the masters, masters back into the parameters (cast to their dtype).
    A host without the memory for these buffers, for every training process on it (``share``: :class:`HostShare`),
    is refused in one line when the optimizer is built. The update runs with ``share.threads`` intra-op threads.

    On CUDA the host buffers are two flat fp32 tensors page-locked with ``cudaHostRegister`` (sized exactly,
    not rounded up by PyTorch's caching host allocator) and the step runs in buckets of
    :data:`BUCKET_ELEMENTS`: every bucket's gradients are queued for copying on a side stream at once, the CPU
    updates bucket ``k`` while later buckets are still arriving, and bucket ``k``'s new weights go back on the
    side stream while the CPU updates bucket ``k + 1``; the current stream waits for the last copy.
    """

    def __init__(
        self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
        weight_decay: float = 1e-2, share: HostShare = HostShare(),
    ) -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        self.share = share
        self._masters: dict[Tensor, Tensor] = {}
        self._grads: dict[Tensor, Tensor] = {}
        self._flat: list[Tensor] = []
        copied = [p for g in self.param_groups for p in g["params"] if not _own_master(p)]
        if copied:
            total = sum(p.numel() for p in copied)
            check_host_memory(HOST_BYTES_PER_PARAMETER * total, share.ranks)
            masters, grads = torch.empty(total, dtype=torch.float32), torch.empty(total, dtype=torch.float32)
            if any(p.is_cuda for p in copied):
                for flat in (masters, grads):
                    _register(flat)
                self._flat = [masters, grads]
            offset = 0
            for p in copied:
                n = p.numel()
                self._masters[p] = masters[offset : offset + n].view(p.shape)
                self._masters[p].copy_(p.detach())
                self._grads[p] = grads[offset : offset + n].view(p.shape)
                offset += n

    def __del__(self) -> None:
        for flat in getattr(self, "_flat", []):
            torch.cuda.cudart().cudaHostUnregister(flat.data_ptr())

    def master(self, p: Tensor) -> Tensor:
        """The fp32 host tensor the update acts on for parameter ``p``."""
        return self._masters.get(p, p)

    @staticmethod
    def _process_value_according_to_param_policy(
        param: Tensor, value: Tensor, param_id: int, param_groups: list[dict[Any, Any]], key: Any = None
    ) -> Tensor:
        # loaded state stays in host memory in fp32, whatever the parameter's device and dtype
        return value.to("cpu", torch.float32) if key != "step" else value.to("cpu")

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self.sync_masters()

    def sync_masters(self) -> None:
        """Copy the parameters into their masters (after weights were loaded into the model)."""
        for p, master in self._masters.items():
            master.copy_(p.detach())

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        work = [(group, p) for group in self.param_groups for p in group["params"] if p.grad is not None]
        cuda = [p for _, p in work if p.is_cuda]
        stream = None
        if cuda:  # the side stream starts after the backward that produced the gradients
            stream = torch.cuda.Stream(device=cuda[0].device)
            stream.wait_stream(torch.cuda.current_stream(cuda[0].device))
        buckets = _buckets(work)
        arrived = [self._fetch_gradients(bucket, stream) for bucket in buckets]
        with _intra_op_threads(self.share.threads):
            for bucket, event in zip(buckets, arrived, strict=True):
                if event is not None:
                    event.synchronize()
                self._update(bucket)
                self._send_weights(bucket, stream)
        if stream is not None:
            torch.cuda.current_stream(cuda[0].device).wait_stream(stream)
        return loss

    def _fetch_gradients(self, bucket: list[tuple[dict[str, Any], Tensor]], stream: Any) -> Any:
        """Queue the copy of the bucket's gradients to their host buffers; returns the event that marks its end
        (None when nothing ran on a CUDA stream)."""
        event = None
        for _, p in bucket:
            if p not in self._grads:
                continue
            if p.is_cuda:
                with torch.cuda.stream(stream):
                    self._grads[p].copy_(p.grad, non_blocking=True)
                    p.grad.record_stream(stream)
                event = event or torch.cuda.Event()
            else:
                self._grads[p].copy_(p.grad)
        if event is not None:
            event.record(stream)
        return event

    def _update(self, bucket: list[tuple[dict[str, Any], Tensor]]) -> None:
        by_group: dict[int, list[Tensor]] = {}
        for group, p in bucket:
            by_group.setdefault(id(group), []).append(p)
        for group in self.param_groups:
            params = by_group.get(id(group), [])
            if not params:
                continue
            masters, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
            for p in params:
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros(p.shape, dtype=torch.float32)
                    state["exp_avg_sq"] = torch.zeros(p.shape, dtype=torch.float32)
                masters.append(self.master(p))
                grads.append(self._grads[p] if p in self._grads else p.grad)
                exp_avgs.append(state["exp_avg"])
                exp_avg_sqs.append(state["exp_avg_sq"])
                steps.append(state["step"])
            beta1, beta2 = group["betas"]
            adamw_update(
                masters, grads, exp_avgs, exp_avg_sqs, [], steps, foreach=True, amsgrad=False, beta1=beta1,
                beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"], maximize=False,
            )

    def _send_weights(self, bucket: list[tuple[dict[str, Any], Tensor]], stream: Any) -> None:
        for _, p in bucket:
            if p not in self._masters:
                continue
            if p.is_cuda:
                with torch.cuda.stream(stream):
                    p.detach().copy_(self._masters[p], non_blocking=True)
            else:
                p.detach().copy_(self._masters[p])


# Host bytes per copied parameter: two fp32 moments, an fp32 master and an fp32 gradient buffer.
HOST_BYTES_PER_PARAMETER = 16


def available_host_memory() -> int:
    """Bytes of host memory the kernel can give this process without swapping (``MemAvailable``)."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def check_host_memory(need: int, ranks_on_host: int = 1) -> None:
    """A one-line UserError, before any step, when the host cannot hold ``need`` bytes of optimizer state for each
    of the ``ranks_on_host`` training processes on it."""
    free, total = available_host_memory(), need * ranks_on_host
    if total > free:
        who = ("this process's optimizer state" if ranks_on_host == 1 else
               f"the optimizer state of the {ranks_on_host} training processes on this machine "
               f"({need / 2**30:.2f} GiB each)")
        raise UserError(
            f"train.optimizer_state = 'host': {who} needs {total / 2**30:.2f} GiB of host memory, "
            f"{free / 2**30:.2f} GiB are available; set train.optimizer_shard = true, run fewer processes per "
            "machine, or use optimizer_state = 'device'"
        )


@contextlib.contextmanager
def _intra_op_threads(threads: int | None) -> Iterator[None]:
    """torch's intra-op threads set to ``threads`` for a block (None: left as they are), then restored."""
    before = torch.get_num_threads()
    if threads is None or threads == before:
        yield
        return
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _own_master(p: Tensor) -> bool:
    return p.device.type == "cpu" and p.dtype == torch.float32


def _register(flat: Tensor) -> None:
    """Page-lock ``flat`` in place (exactly its size), so that copies to and from the device run asynchronously."""
    err = torch.cuda.cudart().cudaHostRegister(flat.data_ptr(), flat.numel() * flat.element_size(), 0)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister of {flat.numel() * 4} bytes for the host optimizer failed: {err}")


def _buckets(work: list[tuple[dict[str, Any], Tensor]]) -> list[list[tuple[dict[str, Any], Tensor]]]:
    """``work`` cut in consecutive buckets of about :data:`BUCKET_ELEMENTS` parameters."""
    buckets: list[list[tuple[dict[str, Any], Tensor]]] = [[]]
    size = 0
    for item in work:
        if size >= BUCKET_ELEMENTS:
            buckets.append([])
            size = 0
        buckets[-1].append(item)
        size += item[1].numel()
    return [b for b in buckets if b]


__all__ = ["BUCKET_ELEMENTS", "HostAdamW", "HostShare", "host_share", "local_optimizer", "make_optimizer", "param_groups"]
