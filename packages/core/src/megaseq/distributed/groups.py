"""This process's place in the layout, its process groups, and the few collectives the trainer needs.

The groups come from megatron-core's ``parallel_state`` (pipeline parallelism 1; its rank order puts the
``tp`` ranks of a context-parallel rank next to each other, then the ``cp`` ranks of a replica; the expert
groups lay the same ranks out as ``etp x ep x edp``, expert-tensor-parallel ranks next to each other). ``torch.distributed`` must already be initialised by the launcher (Ray Train, torchrun, or
``megaseq_testkit.distributed.run_gloo``). ``Parallel()`` is the single process: no group, no collective,
no import of torch.distributed machinery or megatron-core.

What the trainer asks of a ``Parallel``, and why each rule makes every layout equal the single process:

- ``local_batch``: each data-parallel rank keeps its contiguous share of the global micro-batch's windows,
  each context-parallel rank the zig-zag shard of them; the tensor-parallel ranks of a context-parallel
  rank all take that shard (the model splits it along the sequence, and each holds the losses of its
  chunk). The loss is normalised by the weight of the global micro-batch, so the shares of all ranks add
  up to the single-process loss.
- the gradient sums (``megaseq.distributed.gradients`` reduces over these groups): gradients are summed over
  all ranks (data, context, tensor and expert parallel alike: an expert-parallel group is made of
  data/context ranks, so the router and shared experts see every token once, and under sequence parallelism
  each tensor-parallel rank's norms see its chunk), except expert-sharded parameters, which already received
  every token of their expert-parallel group through the dispatch and are summed over the
  expert-data-parallel group only (so are expert weights split by ``etp`` alone: the gather over the
  expert-tensor-parallel group gave each block every token of that group, and with ``ep = etp = 1`` that
  group is every rank), and tensor-split parameters, which received every token of their window and are
  summed over the ranks holding the same block (data and context parallel).
- ``grad_norm``: the norm of the whole model's gradient: replicated parameters counted once, expert
  blocks summed over the expert-tensor-and-expert-parallel group, tensor-split blocks over the
  tensor-parallel group.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterable, Mapping, Set
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from megaseq.contracts import ContextParallel, ForwardContext, TensorParallel
from megaseq.data.windows import Batch
from megaseq.distributed.layout import Layout, LayoutError
from megaseq.errors import UserError
from megaseq.parallel import collectives, zigzag_shard
from megaseq.records import ModelDims

if TYPE_CHECKING:
    from megaseq.distributed.sharded import Placement

EXTRA_HINT = "pip install 'megaseq-core[distributed]' (megatron-core and ray[train])"


@dataclass
class Parallel:
    layout: Layout = field(default_factory=Layout)
    rank: int = 0
    dp_rank: int = 0
    cp_rank: int = 0
    ep_rank: int = 0
    expert_dp_rank: int = 0
    tp_rank: int = 0
    etp_rank: int = 0
    world_group: Any = None
    cp_group: Any = None
    ep_group: Any = None
    etp_group: Any = None
    expert_group: Any = None  # every rank holding a different expert block: expert-tensor x expert parallel
    expert_dp_group: Any = None
    tp_group: Any = None
    tp_data_group: Any = None  # the ranks holding the same tensor-parallel block: data x context parallel

    @property
    def distributed(self) -> bool:
        return self.layout.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    # -- what components are handed ---------------------------------------------------------------------
    def model_dims(self, dims: ModelDims) -> ModelDims:
        return replace(dims, ep_rank=self.ep_rank, ep_size=self.layout.ep, tp_rank=self.tp_rank, tp_size=self.layout.tp,
                       etp_rank=self.etp_rank, etp_size=self.layout.etp)

    def forward_context(self, seq_len: int, sequence_parallel: bool = True) -> ForwardContext:
        """The context of a forward over windows of ``seq_len`` tokens; ``sequence_parallel=False``: tensor
        parallelism without sequence parallelism (decoding, ``megaseq.contracts.TensorParallel``)."""
        cp = tp = None
        if self.layout.cp > 1:
            cp = ContextParallel(group=self.cp_group, rank=self.cp_rank, world_size=self.layout.cp, seq_len=seq_len)
        if self.layout.tp > 1:
            tp = TensorParallel(group=self.tp_group, rank=self.tp_rank, world_size=self.layout.tp,
                                sequence_parallel=sequence_parallel)
        return ForwardContext(cp=cp, ep_group=self.ep_group if self.layout.ep > 1 else None, tp=tp,
                              etp_group=self.etp_group if self.layout.etp > 1 else None)

    def window_losses(self, model: nn.Module, inputs: Tensor, targets: Tensor, chunk: int) -> Tensor:
        """Per-token losses ``[B, T]`` of whole windows, by the training forward of this layout (each rank its
        zig-zag shard, its tensor-parallel blocks and chunk, its experts), gathered back so that every rank holds
        all of them: how a model whose experts and blocks are spread over the ranks is evaluated."""
        from megaseq.model import chunked_token_losses
        from megaseq.parallel import gather_sequence, tp_gather

        ctx = self.forward_context(inputs.shape[1])
        if ctx.cp is not None:
            inputs, targets = (zigzag_shard(t, self.cp_rank, self.layout.cp, dim=1) for t in (inputs, targets))
        hidden = model(inputs, ctx)
        losses = chunked_token_losses(hidden, model.head_weight, targets, chunk, ctx.tp, model.dims.vocab_size)
        if ctx.tp is not None:
            losses = tp_gather(losses, ctx.tp)
        return losses if ctx.cp is None else gather_sequence(losses, ctx.cp)

    def placement(
        self, shapes: Mapping[str, tuple[int, ...]], expert_dims: Mapping[str, int], etp_dims: Mapping[str, int],
        tp_dims: Mapping[str, int],
    ) -> Placement:
        """Where this rank's tensors sit in the whole model (whole ``shapes``; the tensors expert, expert-tensor and
        tensor parallelism split) and which blocks it writes into a checkpoint: one holder of each (the first
        expert-data-parallel rank of an expert block, the first data- and context-parallel rank of a
        tensor-parallel one)."""
        from megaseq.distributed.sharded import Placement, Split

        expert_writer = self.expert_dp_rank == 0
        return Placement.of(shapes, [
            Split("ep", expert_dims, self.ep_rank, self.layout.ep, writes=expert_writer),
            Split("etp", etp_dims, self.etp_rank, self.layout.etp, writes=expert_writer),
            Split("tp", tp_dims, self.tp_rank, self.layout.tp, writes=self.dp_rank == 0 and self.cp_rank == 0),
        ])

    def local_batch(self, batch: Batch) -> Batch:
        """This rank's part of a global micro-batch: its data-parallel share of the windows, zig-zag sharded."""
        share = batch.inputs.shape[0] // self.layout.dp
        rows = slice(self.dp_rank * share, (self.dp_rank + 1) * share)
        parts = [t[rows] for t in (batch.inputs, batch.targets, batch.weights)]
        if self.layout.cp > 1:
            parts = [zigzag_shard(t, self.cp_rank, self.layout.cp, dim=1) for t in parts]
        return Batch(*parts)

    # -- collectives (identities in one process; megaseq.parallel.collectives puts buffers on the device) ---
    def sum(self, t: Tensor) -> Tensor:
        """``t`` summed over all ranks (in place)."""
        return collectives.all_reduce(t, self.world_group) if self.distributed else t

    def max(self, t: Tensor) -> Tensor:
        """``t`` maximised over all ranks (in place)."""
        return collectives.all_reduce(t, self.world_group, op="max") if self.distributed else t

    def any(self, flag: bool) -> bool:
        """Whether ``flag`` holds on some rank (every rank gets the same answer)."""
        return bool(self.max(torch.tensor([float(flag)]))[0] > 0)

    def gather_on_main(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (picklable), in rank order, on rank 0; ``[]`` elsewhere."""
        return collectives.gather_object(obj, self.world_group) if self.distributed else [obj]

    def broadcast_from_main(self, obj: Any) -> Any:
        """Rank 0's ``obj`` (picklable) on every rank; the other ranks' ``obj`` is ignored."""
        return collectives.broadcast_object(obj, self.world_group) if self.distributed else obj

    def sum_values(self, values: Mapping[str, float]) -> dict[str, float]:
        """Named numbers summed over ranks; a name some rank lacks counts 0 there (a rank may hold no rows)."""
        if not self.distributed:
            return dict(values)
        gathered = collectives.all_gather_object(dict(values), self.world_group)
        names = sorted(set().union(*gathered))
        return {name: sum(rank.get(name, 0.0) for rank in gathered) for name in names}

    def ranks_on_host(self) -> int:
        """How many ranks run on this rank's machine (itself included): the processes that share its memory and
        cores. Every rank must call it (a gather of host names)."""
        import socket

        if not self.distributed:
            return 1
        host = socket.gethostname()
        return collectives.all_gather_object(host, self.world_group).count(host)

    def barrier(self) -> None:
        if self.distributed:
            collectives.barrier(self.world_group)

    def grad_norm(
        self, params: Iterable[nn.Parameter], experts: set[nn.Parameter], tp_split: Set[nn.Parameter] = frozenset()
    ) -> Tensor:
        """The 2-norm of the whole model's gradient (fp32), equal on every rank."""
        grads = [(p.grad, 1 if p in experts else 2 if p in tp_split else 0) for p in params if p.grad is not None]
        squares = torch.zeros(3, device=grads[0][0].device if grads else None)
        for grad, kind in grads:
            squares[kind] += grad.detach().float().pow(2).sum()
        if self.distributed and self.layout.ep * self.layout.etp > 1:
            collectives.all_reduce(squares[1:2], self.expert_group)
        if self.distributed and self.layout.tp > 1:
            collectives.all_reduce(squares[2:], self.tp_group)
        return squares.sum().sqrt()

    def gather_experts(
        self, state: Mapping[str, Tensor], dims: Mapping[str, int], etp_dims: Mapping[str, int] | None = None
    ) -> dict[str, Tensor]:
        """The whole model's state from this rank's: expert blocks gathered over the expert-parallel group
        (``dims``) and over the expert-tensor-parallel group (``etp_dims``)."""
        state = self.gather_expert_tensor_parallel(state, etp_dims or {})
        return _gather_blocks(state, dims, self.ep_group) if self.layout.ep > 1 else dict(state)

    def gather_expert_tensor_parallel(self, state: Mapping[str, Tensor], etp_dims: Mapping[str, int]) -> dict[str, Tensor]:
        """``state`` with the experts' hidden-width blocks (``etp_dims``) gathered over the expert-tensor-parallel
        group: this rank's expert-parallel block of each expert tensor, whole."""
        return _gather_blocks(state, etp_dims, self.etp_group) if self.layout.etp > 1 else dict(state)

    def gather_tensor_parallel(
        self, state: Mapping[str, Tensor], dims: Mapping[str, int], lengths: Mapping[str, int] | None = None
    ) -> dict[str, Tensor]:
        """The whole model's state from this rank's: tensor-split blocks gathered over the tensor-parallel group
        (and cut to ``lengths``: padding dropped)."""
        return _gather_blocks(state, dims, self.tp_group, lengths) if self.layout.tp > 1 else dict(state)


def _gather_blocks(
    state: Mapping[str, Tensor], dims: Mapping[str, int], group: Any, lengths: Mapping[str, int] | None = None
) -> dict[str, Tensor]:
    from megaseq.distributed.experts import join

    full = dict(state)
    for name, dim in dims.items():
        full[name] = join(collectives.all_gather_tensor(state[name], group), dim, (lengths or {}).get(name))
    return full


def import_parallel_state() -> Any:
    # Its FSDP modules log at import which implementation they chose, at info level; a Ray worker's root logger
    # shows info lines, so every worker printed them at every start. A level the user set stays.
    megatron_log = logging.getLogger("megatron")
    if megatron_log.level == logging.NOTSET:
        megatron_log.setLevel(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # megatron-core warns at import that Transformer Engine / Apex are absent
            from megatron.core import parallel_state
    except ImportError:
        raise UserError(f"a distributed layout needs megatron-core: {EXTRA_HINT}") from None
    return parallel_state


def megatron_sizes(layout: Layout) -> dict[str, int]:
    """The arguments of megatron-core's ``initialize_model_parallel`` for ``layout`` (pipeline parallelism 1):
    what :func:`init_process_groups` creates and :func:`rank_groups` describes."""
    return {"tensor_model_parallel_size": layout.tp, "context_parallel_size": layout.cp,
            "expert_model_parallel_size": layout.ep, "expert_tensor_parallel_size": layout.etp}


# The groups a run uses, by the name megaseq gives them: (megatron's rank generator, its group token).
GROUP_TOKENS = {
    "tp": ("decoder", "tp"),
    "cp": ("decoder", "cp"),
    "dp": ("decoder", "dp"),
    "dp x cp": ("decoder", "dp-cp"),  # the ranks holding the same tensor-parallel block
    "ep": ("expert", "ep"),
    "etp": ("expert", "tp"),
    "expert dp": ("expert", "dp"),  # the ranks holding the same experts
}


def rank_groups(layout: Layout, order: str = "tp-cp-ep-dp-pp") -> dict[str, list[list[int]]]:
    """Every group of ``layout`` as lists of global ranks, computed as megatron-core's
    ``initialize_model_parallel`` computes them (its ``RankGenerator``, default ``order``), without
    ``torch.distributed``: what the launch prints before any worker starts."""
    world = layout.world_size
    if world % (layout.ep * layout.etp):
        raise LayoutError(f"parallel ({layout}): ep x etp = {layout.ep * layout.etp} does not divide the "
                          f"{world} ranks (dp x cp x tp)")
    ps = import_parallel_state()
    expert_dp = world // (layout.ep * layout.etp)
    generators = {
        "decoder": ps.RankGenerator(tp=layout.tp, ep=1, dp=layout.dp, pp=1, cp=layout.cp, order=order),
        "expert": ps.RankGenerator(tp=layout.etp, ep=layout.ep, dp=expert_dp, pp=1, cp=1, order=order),
    }
    return {name: generators[which].get_ranks(token) for name, (which, token) in GROUP_TOKENS.items()}


def init_process_groups(layout: Layout) -> Parallel:
    """Create the layout's groups with megatron-core's ``parallel_state`` on the running ``torch.distributed``."""
    import torch.distributed as dist

    if not dist.is_initialized():
        raise RuntimeError("init_process_groups: torch.distributed is not initialised (start workers with a launcher)")
    if dist.get_world_size() != layout.world_size:
        raise UserError(
            f"parallel {layout}: dp x cp x tp = {layout.world_size} ranks, but {dist.get_world_size()} processes were started"
        )
    ps = import_parallel_state()
    ps.initialize_model_parallel(**megatron_sizes(layout))
    return Parallel(
        layout=layout,
        rank=dist.get_rank(),
        dp_rank=ps.get_data_parallel_rank(),
        cp_rank=ps.get_context_parallel_rank(),
        ep_rank=ps.get_expert_model_parallel_rank(),
        expert_dp_rank=ps.get_expert_data_parallel_rank(),
        tp_rank=ps.get_tensor_model_parallel_rank(),
        etp_rank=ps.get_expert_tensor_parallel_rank(),
        world_group=dist.group.WORLD,
        cp_group=ps.get_context_parallel_group(),
        ep_group=ps.get_expert_model_parallel_group(),
        etp_group=ps.get_expert_tensor_parallel_group(),
        expert_group=ps.get_expert_tensor_and_model_parallel_group(),
        expert_dp_group=ps.get_expert_data_parallel_group(),
        tp_group=ps.get_tensor_model_parallel_group(),
        tp_data_group=ps.get_data_parallel_group(with_context_parallel=True),
    )


def destroy_process_groups() -> None:
    import_parallel_state().destroy_model_parallel()
