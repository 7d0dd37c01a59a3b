"""Checkpoint contents under any layout: what each rank writes, and reading it back under another layout.

A checkpoint directory (published whole, with its manifest, by ``megaseq.train.checkpoint.commit``) holds:

- ``model.safetensors``: every weight that all ranks hold alike (all of them without expert or tensor
  parallelism);
- ``state.pt``: the run's state (sampler position, RNG, plugin state, ...) and the optimizer state of those
  weights with their names (``optimizer_param_names``): written by rank 0;
- under expert, expert-tensor or tensor parallelism, ``shards/rank{r}.safetensors`` and
  ``shards/rank{r}.optimizer.safetensors``: the blocks of the split tensors that rank ``r`` writes (one holder of
  each block writes it, none is joined with another rank's first) and their optimizer state (``NAME/KEY``);
- with ``train.optimizer_shard`` (ZeRO-1, ``megaseq.train.optimizer``), ``optimizer/rank{r}.pt``: rank ``r``'s
  optimizer state with its parameter names, and ``state.pt`` holds no optimizer state but the number of shards;
- ``meta.json`` records the ``layout``, the whole ``shapes`` of the split tensors and the ``shards``: for each
  shard file, where each of its tensors sits in the whole tensor (``[start, stop)`` per dimension). A block
  padded past the whole length (the vocabulary under tensor parallelism) is written without its padding.

Reading is by slices: a rank copies, for each tensor it holds, only the parts of the written blocks that overlap
its own block into that tensor (``safetensors`` memory-maps each file and ``state.pt`` is memory-mapped too, so
only the pages a slice touches are read, into the page cache), so a run saved with any ``ep``/``etp``/``tp``
resumes with any other layout without any rank holding more than its own part, and ``megaseq eval`` reads every
tensor whole, one at a time. A sharded optimizer state (ZeRO-1) resumes under any
number of ranks, sharded or not.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file, save_model
from torch import Tensor, nn

from megaseq.train.checkpoint import CheckpointError, ShapeMismatch

SHARDS = "shards"
Slices = list[tuple[int, int]]  # per dimension, [start, stop) in the whole tensor


@dataclass(frozen=True)
class Split:
    """How one kind of parallelism (``kind``: "ep", "etp" or "tp") splits the model on this rank: the split
    tensors' dimensions, this rank's block ``rank`` of ``size``, and whether this rank writes its blocks (one of
    their holders does; a tensor split by several kinds is written where every one of them says so)."""

    kind: str
    dims: Mapping[str, int]
    rank: int = 0
    size: int = 1
    writes: bool = True


@dataclass(frozen=True)
class Placement:
    """Where a rank's tensors sit in the whole model: the whole ``shapes`` of every tensor and the ``slices`` of
    those it holds a block of (``[start, stop)`` per dimension; ``stop`` may pass the whole length: padding).
    ``writes``: the split tensors whose blocks this rank writes into a checkpoint."""

    shapes: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    slices: Mapping[str, Slices] = field(default_factory=dict)
    writes: frozenset[str] = frozenset()

    @classmethod
    def of(cls, shapes: Mapping[str, Sequence[int]], splits: Sequence[Split]) -> Placement:
        slices: dict[str, Slices] = {}
        kinds: dict[str, list[Split]] = {}
        for split in splits:
            if split.size == 1:
                continue
            for name, dim in split.dims.items():
                cut = slices.setdefault(name, [(0, n) for n in shapes[name]])
                per = -(-shapes[name][dim] // split.size)
                cut[dim] = (split.rank * per, (split.rank + 1) * per)
                kinds.setdefault(name, []).append(split)
        writes = frozenset(name for name, by in kinds.items() if all(split.writes for split in by))
        return cls({n: tuple(s) for n, s in shapes.items()}, slices, writes)


def shard_files(rank: int) -> tuple[str, str]:
    """Names (inside a checkpoint) of rank ``rank``'s blocks and of their optimizer state."""
    return f"{SHARDS}/rank{rank}.safetensors", f"{SHARDS}/rank{rank}.optimizer.safetensors"


def optimizer_shard_file(rank: int) -> str:
    """Name (inside a checkpoint) of rank ``rank``'s optimizer shard (``train.optimizer_shard``)."""
    return f"optimizer/rank{rank}.pt"


def _blocked(value: Any) -> bool:
    """Optimizer state that has the parameter's shape (moments), as opposed to scalars (the step count)."""
    return isinstance(value, Tensor) and value.dim() > 0


def _within(slices: Slices, shape: Sequence[int]) -> Slices:
    """``slices`` cut to the whole tensor (the padding of a last block dropped)."""
    return [(start, min(stop, length)) for (start, stop), length in zip(slices, shape, strict=True)]


def _narrowed(t: Tensor, slices: Slices, shape: Sequence[int]) -> Tensor:
    """The part of a block ``t`` (at ``slices``) inside the whole tensor."""
    for dim, (start, stop) in enumerate(_within(slices, shape)):
        if stop - start != t.shape[dim]:
            t = t.narrow(dim, 0, stop - start)
    return t.detach().contiguous()


# -- writing: each rank its part ----------------------------------------------------------------------------
def write_shard(
    staged: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    param_names: list[list[str]],
    run_state: Mapping[str, Any] | None,
    placement: Placement = Placement(),
    rank: int = 0,
    shard: tuple[int, int] | None = None,
) -> tuple[list[str], dict[str, dict[str, Slices]]]:
    """Write this rank's files into the staging directory; returns their names (for the manifest) and the
    description of its shard file (``{file: {tensor: slices}}``, for ``meta.json``'s ``shards``).

    ``run_state`` is given to the one rank that writes ``model.safetensors`` and ``state.pt`` (rank 0); the
    blocks of ``placement.writes`` go to ``shards/rank{rank}.*``. ``shard = (rank, ranks)``: ``optimizer`` holds
    only this rank's share of the state (ZeRO-1, no expert or tensor parallelism), written to its own file.
    """
    written: list[str] = []
    state, saved = model.state_dict(), optimizer.state_dict()
    if shard is not None:
        rank, ranks = shard
        (staged / "optimizer").mkdir(exist_ok=True)
        torch.save({"optimizer": saved, "optimizer_param_names": param_names}, staged / optimizer_shard_file(rank))
        written.append(optimizer_shard_file(rank))
        if run_state is not None:
            save_model(model, str(staged / "model.safetensors"))
            torch.save({**run_state, "optimizer_shards": ranks}, staged / "state.pt")
            written += ["model.safetensors", "state.pt"]
        return written, {}
    index_of = {name: i for group, names in zip(saved["param_groups"], param_names, strict=True)
                for i, name in zip(group["params"], names, strict=True)}
    if run_state is not None:
        if placement.slices:
            save_file({n: t.detach().contiguous() for n, t in state.items() if n not in placement.slices},
                      str(staged / "model.safetensors"))
        else:
            save_model(model, str(staged / "model.safetensors"))  # handles tied tensors
        split_at = {index_of[n] for n in placement.slices if n in index_of}
        replicated = {**saved, "state": {i: v for i, v in saved["state"].items() if i not in split_at}}
        torch.save({**run_state, "optimizer": replicated, "optimizer_param_names": param_names}, staged / "state.pt")
        written += ["model.safetensors", "state.pt"]
    weights, moments, described = {}, {}, {}
    for name in sorted(placement.writes):
        slices, shape = placement.slices[name], placement.shapes[name]
        if any(start >= stop for start, stop in _within(slices, shape)):
            continue  # a block of padding only
        weights[name] = _narrowed(state[name], slices, shape)
        for key, value in saved["state"].get(index_of.get(name), {}).items():
            moments[f"{name}/{key}"] = _narrowed(value, slices, shape) if _blocked(value) else value.detach().clone()
        described[name] = _within(slices, shape)
    if described:
        weights_file, optimizer_file = shard_files(rank)
        (staged / SHARDS).mkdir(exist_ok=True)
        save_file(weights, str(staged / weights_file))
        save_file(moments, str(staged / optimizer_file))
        written += [weights_file, optimizer_file]
        return written, {weights_file: described}
    return written, {}


def shards_meta(described: Sequence[Mapping[str, Mapping[str, Slices]]], placement: Placement) -> dict[str, Any]:
    """The ``meta.json`` entries of a sharded checkpoint: every rank's description (:func:`write_shard`) and the
    whole shapes of the split tensors."""
    shards = {file: {n: [list(s) for s in slices] for n, slices in names.items()} for d in described for file, names in d.items()}
    return {"shards": shards, "shapes": {n: list(placement.shapes[n]) for n in sorted(placement.slices)}} if shards else {}


# -- reading under any layout -------------------------------------------------------------------------------
def _pieces(meta: Mapping[str, Any]) -> dict[str, list[tuple[str, Slices]]]:
    """``{tensor: [(shard file, slices)]}`` of the checkpoint's split tensors."""
    pieces: dict[str, list[tuple[str, Slices]]] = {}
    for file, names in meta.get("shards", {}).items():
        for name, slices in names.items():
            pieces.setdefault(name, []).append((file, [tuple(s) for s in slices]))
    return pieces


def _assemble(target: Slices, shape: Sequence[int], pieces: Sequence[tuple[Slices, Any]], what: str) -> Tensor:
    """The block at ``target`` of a whole tensor of ``shape`` from the ``pieces`` that hold parts of it
    (``(slices, sliceable)``: a safetensors slice or a tensor), reading only their overlap with the block; what
    lies past the whole length (padding) is zero. Parts of the block that no piece holds are a CheckpointError."""
    first = pieces[0][1]
    out = first[tuple(slice(0, 0) for _ in target)].new_zeros([b - a for a, b in target])  # the pieces' dtype
    covered = 0
    for slices, piece in pieces:
        overlap = [(max(a, c), min(b, d)) for (a, b), (c, d) in zip(target, slices, strict=True)]
        if any(lo >= hi for lo, hi in overlap):
            continue
        part = piece[tuple(slice(lo - c, hi - c) for (lo, hi), (c, _) in zip(overlap, slices, strict=True))]
        out[tuple(slice(lo - a, hi - a) for (lo, hi), (a, _) in zip(overlap, target, strict=True))] = part
        covered += part.numel()
    needed = math.prod(max(0, hi - lo) for lo, hi in _within(target, shape))
    if covered != needed:
        raise CheckpointError(f"{what}: the checkpoint's blocks hold {covered:,} of the {needed:,} values this rank "
                              f"needs; its shards are incomplete")
    return out


class _Files(ExitStack):
    """The checkpoint's safetensors files, each opened (its header read) once, on first use: ``opened(file)``."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path, self.files = path, {}

    def __enter__(self):
        super().__enter__()
        return self

    def __call__(self, file: str) -> Any:
        if file not in self.files:
            self.files[file] = self.enter_context(safe_open(str(self.path / file), framework="pt"))
        return self.files[file]


def read_local_weights(path: Path, meta: Mapping[str, Any], placement: Placement | None = None) -> dict[str, Tensor]:
    """This rank's weights from a checkpoint of any layout: its block of each tensor ``placement`` splits, every
    other tensor whole, read one tensor at a time from only the parts of the files it needs. Without a
    ``placement`` every tensor is read whole (one process: ``megaseq eval``, export). A tensor whose whole shape
    differs from the placement's is a :class:`ShapeMismatch`."""
    placement = placement or Placement()
    pieces, saved_shapes = _pieces(meta), {n: tuple(s) for n, s in meta.get("shapes", {}).items()}
    out: dict[str, Tensor] = {}
    with _Files(path) as opened:
        replicated = opened("model.safetensors")
        shapes = {n: tuple(replicated.get_slice(n).get_shape()) for n in replicated.keys()} | saved_shapes
        differ = [f"{n} {list(shapes[n])} -> {list(want)}"  # in the model's order
                  for n, want in placement.shapes.items() if n in shapes and shapes[n] != want]
        if differ:
            more = f" and {len(differ) - 3} more" if len(differ) > 3 else ""
            raise ShapeMismatch(path, f"shapes differ: {', '.join(differ[:3])}{more}")
        for name, shape in shapes.items():
            held = pieces.get(name) or [("model.safetensors", [(0, n) for n in shape])]
            target = placement.slices.get(name, [(0, n) for n in shape])
            out[name] = _assemble(target, shape, [(s, opened(f).get_slice(name)) for f, s in held], f"{path}: {name}")
    return out


def local_part(weights: Mapping[str, Tensor], placement: Placement) -> dict[str, Tensor]:
    """This rank's part of a whole model's ``weights`` (held in memory, e.g. handed over by a trainer): each
    tensor ``placement`` splits cut to its block (zeros past the whole length: the padding of a last block),
    the others as they are. A split tensor of another whole shape is a one-line ``ValueError``."""
    out = dict(weights)
    for name, slices in placement.slices.items():
        if name not in weights:
            continue
        t, shape = weights[name], placement.shapes[name]
        if tuple(t.shape) != tuple(shape):
            raise ValueError(f"{name} has shape {tuple(t.shape)}, the whole model's is {tuple(shape)}")
        out[name] = _assemble(slices, shape, [([(0, n) for n in shape], t)], name)  # the whole tensor as one piece
    return out


def read_full_weights(path: Path, meta: Mapping[str, Any]) -> dict[str, Tensor]:
    """The whole model's weights (every tensor read whole, one at a time)."""
    return read_local_weights(path, meta)


def local_optimizer_state(
    path: Path, meta: Mapping[str, Any], state: Mapping[str, Any], placement: Placement
) -> tuple[dict[str, Any], list[list[str]]]:
    """``(optimizer state dict, its parameter names)`` as ``megaseq.train.checkpoint.load_optimizer`` takes
    them, with every tensor's moments cut to this rank's block: read by slices from the shard files of the
    tensors the checkpoint split, cut from ``state``'s (memory-mapped, ``checkpoint.load_state``) for the others.
    The shards of a sharded optimizer state (ZeRO-1) are joined."""
    if "optimizer_shards" in state:
        return _join_optimizer_shards(path, state["optimizer_shards"])
    saved, names = copy.copy(state["optimizer"]), state["optimizer_param_names"]
    saved["state"] = dict(saved["state"])
    pieces = _pieces(meta)
    saved_shapes = {n: tuple(s) for n, s in meta.get("shapes", {}).items()}
    with _Files(path) as opened:
        moment_keys: dict[str, list[str]] = {}  # tensor -> its state's keys (``NAME/KEY``) in the files scanned
        scanned: set[str] = set()
        for group, group_names in zip(saved["param_groups"], names, strict=True):
            for index, name in zip(group["params"], group_names, strict=True):
                if name in pieces:  # moments in the shard files, beside the blocks
                    held = [(_optimizer_file(f), s) for f, s in pieces[name]]
                    first = opened(held[0][0])
                    if held[0][0] not in scanned:
                        scanned.add(held[0][0])
                        for key in first.keys():
                            moment_keys.setdefault(key.rsplit("/", 1)[0], []).append(key)
                    if not moment_keys.get(name):
                        continue  # not trained
                    shape, target = saved_shapes[name], placement.slices.get(name, [(0, n) for n in saved_shapes[name]])
                    saved["state"][index] = {
                        key.rsplit("/", 1)[1]: _assemble(target, shape, [(s, opened(f).get_slice(key)) for f, s in held],
                                                         f"{path}: {key}")
                        if first.get_slice(key).get_shape() else first.get_tensor(key)  # a scalar: the step count
                        for key in moment_keys[name]
                    }
                elif name in placement.slices and index in saved["state"]:  # saved whole, held in part
                    shape = placement.shapes[name]
                    saved["state"][index] = {
                        key: _assemble(placement.slices[name], shape, [([(0, n) for n in shape], value)], f"{path}: {name} {key}")
                        if _blocked(value) else value
                        for key, value in saved["state"][index].items()
                    }
    return saved, names


def _optimizer_file(weights_file: str) -> str:
    """The optimizer state's file beside a shard's weights file (:func:`shard_files`)."""
    return weights_file.removesuffix(".safetensors") + ".optimizer.safetensors"


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


def saved_shapes(path: Path, meta: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """The whole shapes of a checkpoint's tensors (from ``meta.json`` and the file headers; nothing is read), after
    checking that its shard files hold every value of each split tensor exactly once (CheckpointError if not)."""
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        shapes = {n: tuple(f.get_slice(n).get_shape()) for n in f.keys()}
    split = {n: tuple(s) for n, s in meta.get("shapes", {}).items()}
    for name, held in _pieces(meta).items():
        if name not in split:
            raise CheckpointError(f"{path}: meta.json describes blocks of {name} but not its whole shape")
        values = sum(math.prod(b - a for a, b in slices) for _, slices in held)
        if values != math.prod(split[name]):
            raise CheckpointError(f"{path}: the blocks of {name} hold {values:,} values, its shape "
                                  f"{list(split[name])} has {math.prod(split[name]):,}; the checkpoint cannot be re-laid")
    return shapes | split
