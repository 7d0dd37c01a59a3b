"""Expert-sharded state: which tensors expert parallelism splits, and how to split and join them.

A component built with ``ModelDims(ep_rank=r, ep_size=n)`` holds only its local experts (the contract of
``ModelDims``), stacked along one dimension of each expert tensor. So the expert tensors are found without
asking the component: build the model once for one rank and once for ``n`` ranks (on the meta device, no
memory) and compare shapes. A tensor whose shape differs in exactly one dimension, by a factor ``n``, is
expert-sharded along that dimension; EP rank ``r`` holds its ``r``-th block. Every other tensor is the
same on every rank.

The same split serves three purposes: giving every layout the same initial weights (initialise the full
model, keep the local block), checkpoints (each EP rank writes its block) and resuming under another
layout (join the blocks, cut them again).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from megaseq.config import Recipe
from megaseq.errors import UserError
from megaseq.model import LanguageModel, build_model
from megaseq.plugins import Plugins
from megaseq.records import ModelDims


def model_dims(recipe: Recipe, ep_rank: int = 0, ep_size: int = 1) -> ModelDims:
    m = recipe.model
    return ModelDims(d_model=m.d_model, n_layers=m.n_layers, vocab_size=m.vocab_size, ep_rank=ep_rank, ep_size=ep_size)


def build_on_meta(recipe: Recipe, plugins: Plugins, ep_size: int) -> LanguageModel:
    """The model as EP rank 0 of ``ep_size`` builds it, without memory; a component's refusal is a one-line error."""
    try:
        with torch.device("meta"):
            return build_model(recipe, plugins, model_dims(recipe, 0, ep_size))
    except ValueError as exc:
        raise UserError(f"{recipe.source}: parallel ep={ep_size}: {exc}") from None


def expert_dims(full: Mapping[str, Tensor], local: Mapping[str, Tensor], ep_size: int) -> dict[str, int]:
    """``{name: dim}`` of the tensors of ``local`` (one of ``ep_size`` EP ranks) that hold a block of ``full``."""
    out: dict[str, int] = {}
    for name, tensor in local.items():
        whole = full[name]
        if whole.shape == tensor.shape:
            continue
        differing = [d for d, (a, b) in enumerate(zip(whole.shape, tensor.shape, strict=True)) if a != b]
        if len(differing) != 1 or whole.shape[differing[0]] != tensor.shape[differing[0]] * ep_size:
            raise ValueError(
                f"{name}: shape {tuple(tensor.shape)} under ep={ep_size} is not one 1/{ep_size} block of "
                f"{tuple(whole.shape)}; an expert-parallel component must stack its local experts along one dimension"
            )
        out[name] = differing[0]
    return out


def layout_expert_dims(recipe: Recipe, plugins: Plugins, ep_size: int) -> dict[str, int]:
    """:func:`expert_dims` of the recipe's model under ``ep_size`` (empty for ``ep_size`` 1)."""
    if ep_size == 1:
        return {}
    full = build_on_meta(recipe, plugins, 1).state_dict()
    return expert_dims(full, build_on_meta(recipe, plugins, ep_size).state_dict(), ep_size)


def shard(full: Mapping[str, Tensor], dims: Mapping[str, int], ep_rank: int, ep_size: int) -> dict[str, Tensor]:
    """EP rank ``ep_rank``'s view of a full state: expert tensors cut to their block, the rest as they are."""
    return {
        name: t.chunk(ep_size, dim=dims[name])[ep_rank].clone() if name in dims else t for name, t in full.items()
    }


def unshard(blocks: list[Mapping[str, Tensor]], dims: Mapping[str, int]) -> dict[str, Tensor]:
    """The full state from every EP rank's block (in EP rank order): expert tensors joined, the rest from rank 0."""
    return {
        name: torch.cat([b[name] for b in blocks], dim=dims[name]) if name in dims else t
        for name, t in blocks[0].items()
    }


def build_layout_model(recipe: Recipe, plugins: Plugins, ep_rank: int, ep_size: int) -> LanguageModel:
    """The local model of EP rank ``ep_rank`` with the initial weights of the single-rank model.

    Under expert parallelism the full model is initialised (so every layout starts from the same weights and
    leaves the random generators where a single-rank run leaves them) and the local blocks are kept.
    """
    if ep_size == 1:
        return build_model(recipe, plugins)
    with torch.random.fork_rng(devices=[]):
        local = build_model(recipe, plugins, model_dims(recipe, ep_rank, ep_size))
    full = build_model(recipe, plugins).state_dict()
    dims = expert_dims(full, local.state_dict(), ep_size)
    local.load_state_dict(shard(full, dims, ep_rank, ep_size))
    return local
