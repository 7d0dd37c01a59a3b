"""Expert- and tensor-sharded state: which tensors expert and tensor parallelism split, and how to split and
join them.

A component built with ``ModelDims(ep_rank=r, ep_size=n)`` holds only its local experts (the contract of
``ModelDims``), stacked along one dimension of each expert tensor. So the expert tensors are found without
asking the component: build the model once for one rank and once for ``n`` ranks (on the meta device, no
memory) and compare shapes. A tensor whose shape differs in exactly one dimension, by a factor ``n``, is
expert-sharded along that dimension; EP rank ``r`` holds its ``r``-th block. Every other tensor is the
same on every rank.

Tensor parallelism is found the same way: a component built with ``ModelDims(tp_rank=r, tp_size=n)`` holds
the ``r``-th contiguous block of each split tensor along one dimension (``megaseq.contracts.TensorParallel``),
and so is expert tensor parallelism (``ModelDims(etp_rank=r, etp_size=n)``: a block of each routed expert's
hidden width, along another dimension of the expert tensors than the experts' own).

The same split serves three purposes: giving every layout the same initial weights (:func:`build_local_model`:
the local model built on the meta device, filled from the one-process model's initialisation one block at a
time, each cut to the local block), checkpoints (each block written by one of its holders) and resuming under
another layout (each rank reads the parts of the written blocks that overlap its own:
``megaseq.distributed.sharded``).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from megaseq.config import Recipe
from megaseq.errors import UserError
from megaseq.model import LanguageModel, build_block, build_model
from megaseq.plugins import Plugins
from megaseq.records import ModelDims

if TYPE_CHECKING:
    from megaseq.distributed.groups import Parallel
    from megaseq.distributed.sharded import Placement


def model_dims(recipe: Recipe, ep_rank: int = 0, ep_size: int = 1, tp_rank: int = 0, tp_size: int = 1,
               etp_rank: int = 0, etp_size: int = 1) -> ModelDims:
    m = recipe.model
    return ModelDims(d_model=m.d_model, n_layers=m.n_layers, vocab_size=m.vocab_size, ep_rank=ep_rank, ep_size=ep_size,
                     tp_rank=tp_rank, tp_size=tp_size, etp_rank=etp_rank, etp_size=etp_size)


def build_on_meta(recipe: Recipe, plugins: Plugins, ep_size: int, tp_size: int = 1, etp_size: int = 1) -> LanguageModel:
    """The model as rank 0 of ``ep_size`` (and of ``tp_size``, ``etp_size``) builds it, without memory; a
    component's refusal is a one-line error."""
    try:
        with torch.device("meta"):
            return build_model(recipe, plugins, model_dims(recipe, 0, ep_size, 0, tp_size, 0, etp_size))
    except ValueError as exc:
        where = f"ep={ep_size}" + (f",tp={tp_size}" if tp_size > 1 else "") + (f",etp={etp_size}" if etp_size > 1 else "")
        raise UserError(f"{recipe.source}: parallel {where}: {exc}") from None


def split_dims(full: Mapping[str, Tensor], local: Mapping[str, Tensor], n: int, what: str = "ep") -> dict[str, int]:
    """``{name: dim}`` of the tensors of ``local`` (one of ``n`` ranks of ``what``: ep, etp or tp) that hold a block
    of ``full``."""
    out: dict[str, int] = {}
    for name, tensor in local.items():
        whole = full[name]
        if whole.shape == tensor.shape:
            continue
        differing = [d for d, (a, b) in enumerate(zip(whole.shape, tensor.shape, strict=True)) if a != b]
        if len(differing) == 1:
            part, length = tensor.shape[differing[0]], whole.shape[differing[0]]
            # tensor parallelism may pad a length that tp does not divide (the vocabulary): blocks of ceil(length / n)
            is_block = part == -(-length // n) if what == "tp" else part * n == length
        if len(differing) != 1 or not is_block:
            rule = {"ep": "an expert-parallel component must stack its local experts along one dimension",
                    "etp": "an expert-tensor-parallel component must split each expert tensor's hidden width along one dimension",
                    }.get(what, "a tensor-parallel component must split each tensor along one dimension")
            raise ValueError(
                f"{name}: shape {tuple(tensor.shape)} under {what}={n} is not one 1/{n} block of {tuple(whole.shape)}; {rule}"
            )
        out[name] = differing[0]
    return out


def expert_dims(full: Mapping[str, Tensor], local: Mapping[str, Tensor], ep_size: int) -> dict[str, int]:
    """``{name: dim}`` of the tensors of ``local`` (one of ``ep_size`` EP ranks) that hold a block of ``full``."""
    return split_dims(full, local, ep_size, "ep")


def block(t: Tensor, dim: int, rank: int, size: int) -> Tensor:
    """Block ``rank`` of ``size`` of ``t`` along ``dim`` (a copy); a length that ``size`` does not divide is
    first padded with zeros at its end (the vocabulary under tensor parallelism)."""
    length = t.shape[dim]
    per = -(-length // size)
    if per * size != length:
        t = torch.cat([t, t.new_zeros(*t.shape[:dim], per * size - length, *t.shape[dim + 1 :])], dim)
    return t.narrow(dim, rank * per, per).clone()


def join(blocks: list[Tensor], dim: int, length: int | None = None) -> Tensor:
    """The blocks (in rank order) joined along ``dim``, cut back to ``length`` (padding dropped)."""
    whole = torch.cat(blocks, dim=dim)
    return whole if length is None else whole.narrow(dim, 0, length)


def initial_parts(
    recipe: Recipe, plugins: Plugins, ep_rank: int = 0, ep_size: int = 1, etp_rank: int = 0, etp_size: int = 1
) -> Iterator[tuple[str, nn.Module]]:
    """The one-process model's initial weights, one part at a time: ``(prefix, module)``, each block and then the
    embedding, final norm and head, with the module's tensors named as the whole model's less ``prefix``. The
    parts draw from the global generator in the order :func:`megaseq.model.build_model` does, so together they
    are its model and leave the generator where it leaves it.

    With ``ep_size`` or ``etp_size`` above 1 each MoE is built as that expert-parallel (and expert-tensor-parallel)
    rank's: only its experts, with their one-process values (the contract of ``expert_parallel`` and of an MoE's
    ``tensor_parallel``, ``megaseq.records.CAPABILITIES``), so no part holds every expert."""
    dims = model_dims(recipe)
    experts = model_dims(recipe, ep_rank, ep_size, etp_rank=etp_rank, etp_size=etp_size)
    for layer in range(recipe.model.n_layers):
        yield f"blocks.{layer}.", build_block(recipe, plugins, experts, layer)
    yield "", build_model(recipe, plugins, dims, blocks=False)


@dataclass(frozen=True)
class Splits:
    """Which tensors a layout splits, found once: ``{name: dim}`` for expert (``ep``), expert-tensor (``etp``) and
    tensor (``tp``) parallelism, and every tensor's shape in the whole (one-process) model."""

    shapes: dict[str, tuple[int, ...]]
    ep: dict[str, int]
    etp: dict[str, int]
    tp: dict[str, int]


def layout_splits(recipe: Recipe, plugins: Plugins, ep_size: int = 1, tp_size: int = 1, etp_size: int = 1) -> Splits:
    """:class:`Splits` of the recipe's model under the layout: the whole model is built on the meta device once,
    and once more per dimension above 1."""
    full = build_on_meta(recipe, plugins, 1).state_dict()

    def split(n: int, what: str, **sizes: int) -> dict[str, int]:
        return {} if n == 1 else split_dims(full, build_on_meta(recipe, plugins, **sizes).state_dict(), n, what)

    return Splits(
        shapes={name: tuple(t.shape) for name, t in full.items()},
        ep=split(ep_size, "ep", ep_size=ep_size),
        etp=split(etp_size, "etp", ep_size=1, etp_size=etp_size),
        tp=split(tp_size, "tp", ep_size=1, tp_size=tp_size),
    )


@dataclass
class RankModel:
    """The model as one rank holds it (:func:`build_local_model`), with where its tensors sit in the whole model."""

    model: LanguageModel
    splits: Splits

    @property
    def tp_lengths(self) -> dict[str, int]:
        """The whole length of every tensor-parallel dimension (a rank's blocks may be padded)."""
        return {name: self.splits.shapes[name][dim] for name, dim in self.splits.tp.items()}

    @property
    def expert_params(self) -> set[nn.Parameter]:
        """Parameters that expert or expert-tensor parallelism splits (reduced over their own groups)."""
        s = self.splits
        return {param for name, param in self.model.named_parameters() if name in s.ep or name in s.etp}

    @property
    def tp_params(self) -> set[nn.Parameter]:
        return {param for name, param in self.model.named_parameters() if name in self.splits.tp}

    def placement(self, parallel: Parallel) -> Placement:
        """Where this rank's tensors sit in the whole model and which blocks it writes (``Parallel.placement``)."""
        s = self.splits
        return parallel.placement(s.shapes, s.ep, s.etp, s.tp)


def build_rank_model(recipe: Recipe, plugins: Plugins, device: torch.device | str, parallel: Parallel) -> RankModel:
    """This rank's model on ``device`` under ``parallel``'s layout: the trainer's and the engines' one way to it."""
    p, layout = parallel, parallel.layout
    splits = layout_splits(recipe, plugins, layout.ep, layout.tp, layout.etp)
    model = build_local_model(recipe, plugins, device, p.ep_rank, layout.ep, p.tp_rank, layout.tp, p.etp_rank,
                              layout.etp, splits=splits)
    return RankModel(model, splits)


def build_local_model(
    recipe: Recipe, plugins: Plugins, device: torch.device | str = "cpu", ep_rank: int = 0, ep_size: int = 1,
    tp_rank: int = 0, tp_size: int = 1, etp_rank: int = 0, etp_size: int = 1, splits: Splits | None = None,
) -> LanguageModel:
    """The model of EP rank ``ep_rank``, TP rank ``tp_rank`` and ETP rank ``etp_rank`` on ``device``, holding only
    its blocks of the split tensors, with the initial weights of the one-process model cut to them.

    The local model is built on the meta device (no memory) and materialised on ``device``; its tensors are then
    filled part by part from :func:`initial_parts`, so besides the local model a rank holds one part (one block,
    with only its own experts) at a time, never the whole model, and cuts the tensor-parallel blocks from it.
    Every rank draws the same numbers from the global generator as one process building the whole model: every
    layout starts from its weights and leaves the generator as it does.
    """
    with torch.device("meta"):
        local = build_model(recipe, plugins, model_dims(recipe, ep_rank, ep_size, tp_rank, tp_size, etp_rank, etp_size))
    local = local.to_empty(device=device)
    splits = splits or layout_splits(recipe, plugins, ep_size, tp_size, etp_size)
    by_ep, by_tp, by_etp = splits.ep, splits.tp, splits.etp
    where = f"{recipe.source}: parallel ep={ep_size},tp={tp_size},etp={etp_size}"
    if both := sorted((set(by_ep) | set(by_etp)) & set(by_tp)):
        raise UserError(f"{where}: {both[0]} is split by both tensor and expert parallelism")
    if same := sorted(n for n in set(by_ep) & set(by_etp) if by_ep[n] == by_etp[n]):
        raise UserError(f"{where}: {same[0]} is split along dimension {by_ep[same[0]]} by both ep and etp")
    targets = {**dict(local.named_parameters(remove_duplicate=False)), **dict(local.named_buffers(remove_duplicate=False))}
    filled: set[str] = set()
    with torch.no_grad():
        for prefix, part in initial_parts(recipe, plugins, ep_rank, ep_size, etp_rank, etp_size):
            for name, value in [*part.named_parameters(remove_duplicate=False), *part.named_buffers(remove_duplicate=False)]:
                name = prefix + name
                if name in by_tp:
                    value = block(value, by_tp[name], tp_rank, tp_size)
                if value.shape != targets[name].shape:  # copy_ would broadcast
                    raise RuntimeError(f"{name}: the initial part holds {list(value.shape)}, the local model "
                                       f"{list(targets[name].shape)}")
                targets[name].copy_(value)
                filled.add(name)
            del part
    if missing := sorted(set(targets) - filled):
        raise RuntimeError(f"{missing[0]} of the local model is in no part of the initial model")
    return local
