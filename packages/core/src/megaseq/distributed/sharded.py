"""Checkpoint contents under any layout: what each rank writes, and reading it back under another layout.

A checkpoint directory (published whole, with its manifest, by ``megaseq.train.checkpoint.commit``) holds:

- ``model.safetensors``: every weight that all ranks hold alike (all of them without expert or tensor
  parallelism);
- ``state.pt``: the run's state (sampler position, RNG, plugin state, ...) and the optimizer state of those
  weights with their names (``optimizer_param_names``): written by rank 0;
- under expert parallelism, ``experts/ep{r}.safetensors`` and ``experts/ep{r}.pt``: the expert blocks of
  EP rank ``r`` and their optimizer state by name, written by one rank holding them; under tensor
  parallelism, ``tensor/tp{r}.safetensors`` and ``tensor/tp{r}.pt`` the same for TP rank ``r``'s blocks;
  expert-tensor-parallel blocks are joined over their group before writing (the writer passes ``joined``),
  so they are stored as the expert-parallel blocks or the replicated weights they are parts of;
- with ``train.optimizer_shard`` (ZeRO-1, ``megaseq.train.optimizer``), ``optimizer/rank{r}.pt``: rank ``r``'s
  optimizer state with its parameter names, and ``state.pt`` holds no optimizer state but the number of shards;
- ``meta.json`` records the ``layout``, the ``expert_dims`` and the ``tp_dims``
  (``megaseq.distributed.experts``).

Reading joins the blocks (and the optimizer shards) into the whole model's state and cuts it for the reader's
layout, so a run saved with ``ep=2`` or ``tp=2`` resumes with any other layout, a sharded optimizer state
resumes under any number of ranks, sharded or not, and ``megaseq eval`` reads any checkpoint.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file, save_model
from torch import Tensor, nn

from megaseq.distributed.experts import block, join, shard, unshard

FOLDERS = {"ep": "experts", "tp": "tensor"}


@dataclass(frozen=True)
class Split:
    """How one kind of parallelism (``kind``: "ep" or "tp") splits the model on this rank: the split tensors'
    dimensions, this rank's block ``rank`` of ``size``, and whether this rank writes that block (one of its
    holders does)."""

    kind: str
    dims: Mapping[str, int]
    rank: int = 0
    size: int = 1
    writes: bool = True
    lengths: Mapping[str, int] = field(default_factory=dict)  # whole lengths of padded split tensors


def block_files(kind: str, rank: int) -> tuple[str, str]:
    """Names (inside a checkpoint) of ``kind`` rank ``rank``'s blocks and their optimizer state."""
    return f"{FOLDERS[kind]}/{kind}{rank}.safetensors", f"{FOLDERS[kind]}/{kind}{rank}.pt"


def optimizer_shard_file(rank: int) -> str:
    """Name (inside a checkpoint) of rank ``rank``'s optimizer shard (``train.optimizer_shard``)."""
    return f"optimizer/rank{rank}.pt"


def _saved_splits(meta: Mapping[str, Any]) -> list[tuple[str, int, dict[str, int], dict[str, int]]]:
    """``(kind, size, dims, lengths)`` of every split the checkpoint was written with (size > 1)."""
    layout = meta.get("layout", {})
    found = [("ep", int(layout.get("ep", 1)), dict(meta.get("expert_dims", {})), {}),
             ("tp", int(layout.get("tp", 1)), dict(meta.get("tp_dims", {})), dict(meta.get("tp_lengths", {})))]
    return [split for split in found if split[1] > 1 and split[2]]


def _blocked(value: Any) -> bool:
    """Optimizer state that has the parameter's shape (moments), as opposed to scalars (the step count)."""
    return isinstance(value, Tensor) and value.dim() > 0


# -- writing: each rank its part ----------------------------------------------------------------------------
def write_shard(
    staged: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    param_names: list[list[str]],
    run_state: Mapping[str, Any] | None,
    splits: Sequence[Split] = (),
    shard: tuple[int, int] | None = None,
    joined: tuple[Mapping[str, Tensor], dict[str, Any]] | None = None,
) -> list[str]:
    """Write this rank's files into the staging directory; returns their names (for the manifest).

    ``run_state`` is given to the one rank that writes ``model.safetensors`` and ``state.pt`` (rank 0);
    each split with ``writes`` makes this rank write its block of that split. ``shard = (rank, ranks)``:
    ``optimizer`` holds only this rank's share of the state (ZeRO-1, no expert or tensor parallelism),
    written to its own file. ``joined``: the model's and the optimizer's state dicts to write instead of their
    own (with the blocks of a split that is not written joined).
    """
    written = []
    state, saved = joined if joined is not None else (model.state_dict(), optimizer.state_dict())
    if shard is not None:
        rank, ranks = shard
        (staged / "optimizer").mkdir(exist_ok=True)
        torch.save({"optimizer": saved, "optimizer_param_names": param_names}, staged / optimizer_shard_file(rank))
        written.append(optimizer_shard_file(rank))
        if run_state is not None:
            save_model(model, str(staged / "model.safetensors"))
            torch.save({**run_state, "optimizer_shards": ranks}, staged / "state.pt")
            written += ["model.safetensors", "state.pt"]
        return written
    index_of = {name: i for group, names in zip(saved["param_groups"], param_names, strict=True)
                for i, name in zip(group["params"], names, strict=True)}
    split_names = {n for split in splits if split.size > 1 for n in split.dims}
    if run_state is not None:
        if split_names or joined is not None:
            replicated = {n: t.detach().contiguous() for n, t in state.items() if n not in split_names}
            save_file(replicated, str(staged / "model.safetensors"))
        else:
            save_model(model, str(staged / "model.safetensors"))  # handles tied tensors
        split_at = {index_of[n] for n in split_names if n in index_of}
        replicated_optimizer = {**saved, "state": {i: v for i, v in saved["state"].items() if i not in split_at}}
        torch.save({**run_state, "optimizer": replicated_optimizer, "optimizer_param_names": param_names}, staged / "state.pt")
        written += ["model.safetensors", "state.pt"]
    for split in splits:
        if not (split.writes and split.size > 1 and split.dims):
            continue
        weights_file, optimizer_file = block_files(split.kind, split.rank)
        (staged / FOLDERS[split.kind]).mkdir(exist_ok=True)
        save_file({n: state[n].detach().contiguous() for n in split.dims}, str(staged / weights_file))
        torch.save({n: saved["state"][index_of[n]] for n in split.dims if index_of.get(n) in saved["state"]}, staged / optimizer_file)
        written += [weights_file, optimizer_file]
    return written


# -- reading under any layout -------------------------------------------------------------------------------
def read_full_weights(path: Path, meta: Mapping[str, Any]) -> dict[str, Tensor]:
    """The whole model's weights, every split's blocks joined."""
    weights = load_file(str(path / "model.safetensors"))
    for kind, size, dims, lengths in _saved_splits(meta):
        weights.update(unshard([load_file(str(path / block_files(kind, r)[0])) for r in range(size)], dims, lengths))
    return weights


def _cut(full: Mapping[str, Any], splits: Sequence[Split], cut) -> dict[str, Any]:
    out = dict(full)
    for split in splits:
        if split.size > 1:
            out = cut(out, split)
    return out


def read_local_weights(path: Path, meta: Mapping[str, Any], splits: Sequence[Split]) -> dict[str, Tensor]:
    """This rank's weights (its block of every split) from a checkpoint of any layout."""
    return _cut(read_full_weights(path, meta), splits, lambda state, sp: shard(state, sp.dims, sp.rank, sp.size))


def local_optimizer_state(
    path: Path, meta: Mapping[str, Any], state: Mapping[str, Any], splits: Sequence[Split]
) -> tuple[dict[str, Any], list[list[str]]]:
    """``(optimizer state dict, its parameter names)`` as ``megaseq.train.checkpoint.load_optimizer`` takes
    them, with every split tensor's state joined from the saved blocks and cut for this rank's blocks, and the
    shards of a sharded optimizer state joined."""
    if "optimizer_shards" in state:
        return _join_optimizer_shards(path, state["optimizer_shards"])
    saved, names = copy.copy(state["optimizer"]), state["optimizer_param_names"]
    saved["state"] = dict(saved["state"])
    index_of = {name: i for group, group_names in zip(saved["param_groups"], names, strict=True)
                for i, name in zip(group["params"], group_names, strict=True)}
    for kind, size, saved_dims, lengths in _saved_splits(meta):
        blocks = [torch.load(path / block_files(kind, r)[1], weights_only=False) for r in range(size)]
        for name, dim in saved_dims.items():
            per_rank = [b[name] for b in blocks if name in b]
            if per_rank and name in index_of:
                saved["state"][index_of[name]] = {
                    key: join([s[key] for s in per_rank], dim, lengths.get(name)) if _blocked(value) else value
                    for key, value in per_rank[0].items()
                }
    for split in splits:
        if split.size == 1:
            continue
        for name, dim in split.dims.items():
            if index_of.get(name) in saved["state"]:
                saved["state"][index_of[name]] = {
                    key: block(value, dim, split.rank, split.size) if _blocked(value) else value
                    for key, value in saved["state"][index_of[name]].items()
                }
    return saved, names


def _join_optimizer_shards(path: Path, ranks: int) -> tuple[dict[str, Any], list[list[str]]]:
    """The whole optimizer state (and its parameter names) from the ``ranks`` files of a sharded one."""
    parts = [torch.load(path / optimizer_shard_file(r), weights_only=False) for r in range(ranks)]
    groups = parts[0]["optimizer"]["param_groups"]
    names: list[list[str]] = [[] for _ in groups]
    state: dict[int, Any] = {}
    index = 0
    for g in range(len(groups)):
        for part in parts:
            saved = part["optimizer"]
            for i, name in zip(saved["param_groups"][g]["params"], part["optimizer_param_names"][g], strict=True):
                names[g].append(name)
                if i in saved["state"]:
                    state[index] = saved["state"][i]
                index += 1
    start = [sum(len(n) for n in names[:g]) for g in range(len(groups))]
    joined = [{**{k: v for k, v in group.items() if k != "params"}, "params": list(range(s, s + len(n)))}
              for group, s, n in zip(groups, start, names, strict=True)]
    return {"state": state, "param_groups": joined}, names
