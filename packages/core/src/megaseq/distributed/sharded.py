"""Checkpoint contents under any layout: what each rank writes, and reading it back under another layout.

A checkpoint directory (published whole, with its manifest, by ``megaseq.train.checkpoint.commit``) holds:

- ``model.safetensors``: every weight that all ranks hold alike (all of them without expert parallelism);
- ``state.pt``: the run's state (sampler position, RNG, plugin state, ...) and the optimizer state of those
  weights with their names (``optimizer_param_names``): written by rank 0;
- under expert parallelism, ``experts/ep{r}.safetensors`` and ``experts/ep{r}.pt``: the expert blocks of
  EP rank ``r`` and their optimizer state by name, written by one rank holding them;
- with ``train.optimizer_shard`` (ZeRO-1, ``megaseq.train.optimizer``), ``optimizer/rank{r}.pt``: rank ``r``'s
  optimizer state with its parameter names, and ``state.pt`` holds no optimizer state but the number of shards;
- ``meta.json`` records the ``layout`` and the ``expert_dims`` (``megaseq.distributed.experts``).

Reading joins the expert blocks (and the optimizer shards) into the whole model's state and cuts it for the
reader's layout, so a run saved with ``ep=2`` resumes with ``ep=1`` (or any other layout), a sharded optimizer
state resumes under any number of ranks, sharded or not, and ``megaseq eval`` reads any checkpoint.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file, save_model
from torch import Tensor, nn

from megaseq.distributed.experts import shard, unshard


def expert_files(ep_rank: int) -> tuple[str, str]:
    """Names (inside a checkpoint) of EP rank ``ep_rank``'s expert weights and their optimizer state."""
    return f"experts/ep{ep_rank}.safetensors", f"experts/ep{ep_rank}.pt"


def optimizer_shard_file(rank: int) -> str:
    """Name (inside a checkpoint) of rank ``rank``'s optimizer shard (``train.optimizer_shard``)."""
    return f"optimizer/rank{rank}.pt"


def _saved_layout(meta: Mapping[str, Any]) -> tuple[int, dict[str, int]]:
    return int(meta.get("layout", {}).get("ep", 1)), dict(meta.get("expert_dims", {}))


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
    expert_dims: Mapping[str, int],
    ep_rank: int,
    writes_experts: bool,
    shard: tuple[int, int] | None = None,
) -> list[str]:
    """Write this rank's files into the staging directory; returns their names (for the manifest).

    ``run_state`` is given to the one rank that writes ``model.safetensors`` and ``state.pt`` (rank 0);
    ``writes_experts`` to one rank of each EP rank's holders. ``shard = (rank, ranks)``: ``optimizer`` holds
    only this rank's share of the state (ZeRO-1, no expert parallelism), written to its own file.
    """
    written = []
    saved = optimizer.state_dict()
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
    if run_state is not None:
        if expert_dims:
            replicated = {n: t.detach().contiguous() for n, t in model.state_dict().items() if n not in expert_dims}
            save_file(replicated, str(staged / "model.safetensors"))
        else:
            save_model(model, str(staged / "model.safetensors"))  # handles tied tensors
        experts_at = {index_of[n] for n in expert_dims if n in index_of}
        replicated_optimizer = {**saved, "state": {i: v for i, v in saved["state"].items() if i not in experts_at}}
        torch.save({**run_state, "optimizer": replicated_optimizer, "optimizer_param_names": param_names}, staged / "state.pt")
        written += ["model.safetensors", "state.pt"]
    if writes_experts and expert_dims:
        weights_file, optimizer_file = expert_files(ep_rank)
        (staged / "experts").mkdir(exist_ok=True)
        state = model.state_dict()
        save_file({n: state[n].detach().contiguous() for n in expert_dims}, str(staged / weights_file))
        torch.save({n: saved["state"][index_of[n]] for n in expert_dims if index_of.get(n) in saved["state"]}, staged / optimizer_file)
        written += [weights_file, optimizer_file]
    return written


# -- reading under any layout -------------------------------------------------------------------------------
def read_full_weights(path: Path, meta: Mapping[str, Any]) -> dict[str, Tensor]:
    """The whole model's weights, expert blocks joined."""
    weights = load_file(str(path / "model.safetensors"))
    ep, dims = _saved_layout(meta)
    if ep > 1:
        weights.update(unshard([load_file(str(path / expert_files(r)[0])) for r in range(ep)], dims))
    return weights


def read_local_weights(path: Path, meta: Mapping[str, Any], dims: Mapping[str, int], ep_rank: int, ep_size: int) -> dict[str, Tensor]:
    """EP rank ``ep_rank`` of ``ep_size``'s weights (expert dims ``dims``) from a checkpoint of any layout."""
    return shard(read_full_weights(path, meta), dims, ep_rank, ep_size)


def local_optimizer_state(
    path: Path, meta: Mapping[str, Any], state: Mapping[str, Any], dims: Mapping[str, int], ep_rank: int, ep_size: int
) -> tuple[dict[str, Any], list[list[str]]]:
    """``(optimizer state dict, its parameter names)`` as ``megaseq.train.checkpoint.load_optimizer`` takes
    them, with every expert tensor's state joined from the saved blocks and cut for EP rank ``ep_rank``, and
    the shards of a sharded optimizer state joined."""
    if "optimizer_shards" in state:
        return _join_optimizer_shards(path, state["optimizer_shards"])
    saved, names = copy.copy(state["optimizer"]), state["optimizer_param_names"]
    saved["state"] = dict(saved["state"])
    index_of = {name: i for group, group_names in zip(saved["param_groups"], names, strict=True)
                for i, name in zip(group["params"], group_names, strict=True)}
    saved_ep, saved_dims = _saved_layout(meta)
    if saved_ep > 1:
        blocks = [torch.load(path / expert_files(r)[1], weights_only=False) for r in range(saved_ep)]
        for name, dim in saved_dims.items():
            per_rank = [b[name] for b in blocks if name in b]
            if per_rank and name in index_of:
                saved["state"][index_of[name]] = {
                    key: torch.cat([s[key] for s in per_rank], dim=dim) if _blocked(value) else value
                    for key, value in per_rank[0].items()
                }
    for name, dim in dims.items():
        if index_of.get(name) in saved["state"]:
            saved["state"][index_of[name]] = {
                key: value.chunk(ep_size, dim=dim)[ep_rank].clone() if _blocked(value) else value
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
