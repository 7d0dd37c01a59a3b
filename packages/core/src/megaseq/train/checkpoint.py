"""Checkpoints that fail safe: published whole, verified on load, pruned, never half-read.

Layout of ``OUT/checkpoints/``::

    step_0000100/             one directory per saved step
        model.safetensors     weights
        state.pt              optimizer, RNG states, data position, plugin state
        meta.json             step, tokens, the recipe, the active plugins and versions
        manifest.json         written last: the size and SHA-256 of every other file in the directory
    latest                    the name of the newest published checkpoint, for people and ``megaseq eval``

Saving. Files are written into a staging directory ``.tmp-step_0000100`` beside the checkpoints;
:func:`commit` then hashes every file there, writes ``manifest.json`` last, renames the directory to
``step_0000100`` (atomic on POSIX) and updates ``latest``. A process killed before the rename leaves only a
``.tmp-*`` directory, which :func:`remove_leftovers` deletes at the next start. A checkpoint whose files
were damaged later (a full disk, a power cut between the rename and the data reaching the disk, a copy cut
short) fails verification, so nothing here needs ``fsync``: what it would protect is checked instead.

Loading. :func:`newest_verified` checks the step directories newest first (the ``latest`` pointer is only
advisory: a crash between the rename and the pointer update must not hide a complete checkpoint) and
returns the first whose files all match the manifest, with one line per newer checkpoint it skipped and why.

Several files per rank. The manifest lists whatever files the staging directory holds, so a sharded
checkpoint (``model.rank3.safetensors``, ``optimizer.rank3.pt``, ...) follows the same rules: every rank
writes its files into ``staging_dir(root, step)`` (and may describe them with :func:`file_entries`, so that
hashing runs on every rank at once), and after a barrier one rank calls :func:`commit` with the gathered
descriptions.

API: :func:`save_checkpoint` (one process), :func:`staging_dir` + :func:`file_entries` + :func:`commit`
(several writers),
:func:`load_for_resume` (all the checks a resume needs, then the weights), :func:`verify`, :func:`upgrade`
(manifests for checkpoints written before them), :func:`newest_verified`, :func:`set_aside`, :func:`read_meta`, :func:`load_weights`,
:func:`load_state`, :func:`load_optimizer`, :func:`recipe_changes`, :func:`prune`, :func:`remove_leftovers`,
and the RNG helpers :func:`rng_state` / :func:`set_rng_state`.
Every problem a user can meet is a :class:`CheckpointError`: one line naming the checkpoint and the file.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_model, save_model

from megaseq.__about__ import __version__
from megaseq.errors import UserError

if TYPE_CHECKING:
    from megaseq.plugins import Plugins

MANIFEST = "manifest.json"
MANIFEST_FORMAT = 1
STAGING_PREFIX = ".tmp-"
_STEP_DIR = re.compile(r"step_(\d{7,})")


class CheckpointError(UserError):
    """A checkpoint that is damaged, missing or does not fit the model; the message is one line."""


class ShapeMismatch(CheckpointError):
    """A checkpoint whose tensors do not fit the model's (``mismatch``: what differs, as :func:`weight_mismatch`
    says it), found while reading it."""

    def __init__(self, path: Path, mismatch: str) -> None:
        super().__init__(f"{path}: does not fit the model: {mismatch}")
        self.mismatch = mismatch


def step_name(step: int) -> str:
    return f"step_{step:07d}"


def rng_state() -> dict[str, Any]:
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])


def _sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


# -- saving ------------------------------------------------------------------------------------------
def staging_dir(root: Path, step: int) -> Path:
    """The directory the files of step ``step`` are written into before :func:`commit` publishes them."""
    path = root / f"{STAGING_PREFIX}{step_name(step)}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def file_entries(directory: Path, names: list[str]) -> dict[str, dict[str, Any]]:
    """Manifest entries (size, SHA-256) of the files ``names`` in ``directory``.

    With several writers, each can describe its own files (hashing in parallel) and pass the gathered
    entries to :func:`commit`.
    """
    return {name: {"bytes": (directory / name).stat().st_size, "sha256": _sha256(directory / name)} for name in names}


def commit(root: Path, step: int, meta: dict[str, Any], described: dict[str, dict[str, Any]] | None = None) -> Path:
    """Publish the staged files of ``step``: write ``meta.json``, the manifest (last), rename, point ``latest``.

    Every staged file is in the manifest: those in ``described`` (from :func:`file_entries`) as given, the
    others hashed here. An existing checkpoint of the same step is replaced. Returns the published directory.
    """
    staged = root / f"{STAGING_PREFIX}{step_name(step)}"
    meta = {"step": step, "megaseq_version": __version__, "time": time.time(), **meta}
    (staged / "meta.json").write_text(json.dumps(meta, indent=2))
    described = described or {}
    names = sorted(str(p.relative_to(staged)) for p in staged.rglob("*") if p.is_file() and p.name != MANIFEST)
    missing = sorted(set(described) - set(names))
    if missing:
        raise CheckpointError(f"{staged}: described files were never written: {', '.join(missing)}")
    files = {**file_entries(staged, [n for n in names if n not in described]), **described}
    files = {name: files[name] for name in names}
    manifest = {"format": MANIFEST_FORMAT, "step": step, "files": files}
    _write_atomic(staged / MANIFEST, json.dumps(manifest, indent=2))
    final = root / step_name(step)
    if final.exists():
        shutil.rmtree(final)
    os.replace(staged, final)
    _write_atomic(root / "latest", final.name + "\n")
    return final


def save_checkpoint(root: Path, step: int, model: torch.nn.Module, state: dict[str, Any], meta: dict[str, Any]) -> Path:
    """Save one process's checkpoint of ``step``: weights, ``state`` (torch.save) and ``meta`` (JSON)."""
    staged = staging_dir(root, step)
    try:
        save_model(model, str(staged / "model.safetensors"))  # handles tied embedding / head weights
        torch.save(state, staged / "state.pt")
        return commit(root, step, meta)
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        raise


def remove_leftovers(root: Path) -> list[str]:
    """Delete the staging directories of saves that never finished; returns their names."""
    if not root.is_dir():
        return []
    removed = []
    for path in sorted(root.iterdir()):
        if path.name.startswith(STAGING_PREFIX):
            shutil.rmtree(path) if path.is_dir() else path.unlink()
            removed.append(path.name)
    return removed


def checkpoints(root: Path) -> list[Path]:
    """Published step directories, newest first (verified or not)."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _STEP_DIR.fullmatch(p.name))]
    return [p for _, p in sorted(found, reverse=True)]


def prune(root: Path, keep: int) -> list[str]:
    """Delete all but the ``keep`` newest checkpoints (``keep`` <= 0 keeps all); returns the deleted names."""
    if keep <= 0:
        return []
    doomed = checkpoints(root)[keep:]
    for path in doomed:
        shutil.rmtree(path)
    return [p.name for p in doomed]


# -- verifying ---------------------------------------------------------------------------------------
def verify(path: Path) -> dict[str, Any]:
    """The manifest of ``path`` after checking every listed file's size and SHA-256; else CheckpointError."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        files = manifest["files"]
        if manifest.get("format") != MANIFEST_FORMAT or not isinstance(files, dict):
            raise ValueError
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no {MANIFEST} (the save was interrupted, or an older megaseq wrote it: "
                              f"megaseq checkpoint upgrade {path})") from None
    except (ValueError, KeyError, TypeError):
        raise CheckpointError(f"{path}: {MANIFEST} is unreadable") from None
    for name, expected in files.items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"{path}: {name} is missing")
        size = file.stat().st_size
        if size != expected["bytes"]:
            raise CheckpointError(f"{path}: {name} has {size:,} bytes, the manifest says {expected['bytes']:,}")
        if _sha256(file) != expected["sha256"]:
            raise CheckpointError(f"{path}: {name} does not match its SHA-256 in the manifest")
    for required in ("meta.json",):
        if required not in files:
            raise CheckpointError(f"{path}: the manifest lists no {required}")
    return manifest


@dataclass
class Found:
    """The result of :func:`newest_verified`: the checkpoint to load (or None) and what was skipped, and why."""

    path: Path | None
    skipped: list[str] = field(default_factory=list)
    latest_note: str | None = None

    def report(self) -> str | None:
        """One line for the user when anything was skipped or ``latest`` disagrees; None when all is well."""
        notes = ([self.latest_note] if self.latest_note else []) + self.skipped
        if not notes:
            return None
        where = f"resuming from {self.path.name}" if self.path is not None else "no usable checkpoint"
        return "; ".join(notes) + f"; {where}"


def _latest_note(root: Path, chosen: Path | None) -> str | None:
    pointer = root / "latest"
    if not pointer.exists():
        return None if chosen is None else f"{root}/latest is missing"
    name = pointer.read_text().strip()
    if not name:
        return f"{root}/latest is empty"
    if chosen is not None and name == chosen.name:
        return None
    if not (root / name).is_dir():
        return f"{root}/latest names {name}, which does not exist"
    return None  # it names a damaged checkpoint: that one's own note says why


def newest_verified(root: Path) -> Found:
    """The newest checkpoint under ``root`` whose files match its manifest, and a note for each newer one."""
    skipped = []
    for path in checkpoints(root):
        try:
            verify(path)
        except CheckpointError as exc:
            skipped.append(f"{path.name} is damaged ({str(exc).removeprefix(f'{path}: ')})")
            continue
        return Found(path, skipped, _latest_note(root, path))
    return Found(None, skipped, _latest_note(root, None) if skipped else None)


def upgrade(path: Path) -> list[Path]:
    """Write the manifest of each checkpoint without one (written before manifests existed): ``path`` is a
    checkpoint, or a run directory / checkpoint root (each of its checkpoints). Returns those upgraded.

    A manifest can only vouch for the files as they are now, so each is first read whole the way a resume
    reads it (``meta.json`` with its step, every ``*.safetensors`` tensor, every ``*.pt`` file): a file cut
    short by the old, non-atomic save is a one-line error and gets no manifest."""
    root = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    targets = [path] if (path / "meta.json").exists() else checkpoints(root)
    if not targets:
        raise CheckpointError(f"{path}: not a megaseq checkpoint, run directory or checkpoint directory")
    upgraded = []
    for target in targets:
        if (target / MANIFEST).exists():
            continue
        meta = read_meta(target)
        if not isinstance(meta.get("step"), int):
            raise CheckpointError(f"{target}: meta.json has no step; not a checkpoint megaseq wrote")
        names = sorted(str(p.relative_to(target)) for p in target.rglob("*") if p.is_file())
        for name in names:
            try:
                if name.endswith(".safetensors"):
                    with safe_open(str(target / name), "pt") as f:
                        for key in f.keys():
                            f.get_tensor(key)
                elif name.endswith(".pt"):
                    torch.load(target / name, map_location="cpu", weights_only=False)
            except Exception as exc:
                raise CheckpointError(f"{target}: {name} cannot be read ({type(exc).__name__}); no manifest written") from None
        manifest = {"format": MANIFEST_FORMAT, "step": meta["step"], "files": file_entries(target, names)}
        _write_atomic(target / MANIFEST, json.dumps(manifest, indent=2))
        upgraded.append(target)
    return upgraded


# -- loading -----------------------------------------------------------------------------------------
def resolve(path: Path) -> Path:
    """The verified checkpoint ``path`` names: a run directory (its newest verified checkpoint, a skipped one
    reported as a warning) or a checkpoint directory; anything else is a one-line CheckpointError."""
    if (path / "checkpoints").is_dir():
        found = newest_verified(path / "checkpoints")
        if found.path is None:
            raise CheckpointError(f"no usable checkpoint in {path / 'checkpoints'}" + (f": {found.report()}" if found.skipped else ""))
        if found.report():
            warnings.warn(found.report(), stacklevel=2)
        return found.path
    if not (path / "meta.json").exists():
        raise CheckpointError(f"{path}: not a megaseq checkpoint or run directory (no meta.json, no checkpoints/)")
    verify(path)
    return path


def read_meta(path: Path) -> dict[str, Any]:
    """``meta.json`` of a checkpoint (unverified: call :func:`verify` first when the files matter). Its recipe
    is as written: ``megaseq.config.validate_recipe`` reads it in the current keys
    (``megaseq.config.stored_recipe``)."""
    try:
        return json.loads((path / "meta.json").read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: not a megaseq checkpoint (no meta.json)") from None
    except ValueError:
        raise CheckpointError(f"{path}: meta.json is not valid JSON") from None


def _shape(shape: Any) -> str:
    return "[" + ", ".join(str(s) for s in shape) + "]"


def _first_three(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def weight_mismatch(path: Path, model: torch.nn.Module, weights: dict[str, torch.Tensor] | None = None) -> str | None:
    """What differs between the checkpoint's tensors and the model's (shapes, missing, unexpected), or None.

    ``weights``: the tensors to compare (read from a sharded checkpoint, ``megaseq.distributed.sharded``);
    default ``model.safetensors``."""
    state = model.state_dict()
    if weights is not None:
        stored = {name: tuple(t.shape) for name, t in weights.items()}
    else:
        with safe_open(str(path / "model.safetensors"), framework="pt") as f:
            stored = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    # save_model keeps one name of tensors that share memory (tied embedding and head): the others are not missing
    saved_storage = {state[n].untyped_storage().data_ptr() for n in stored if n in state}
    shapes = [f"{n} {_shape(stored[n])} -> {_shape(t.shape)}" for n, t in state.items() if n in stored and stored[n] != tuple(t.shape)]
    missing = [n for n, t in state.items() if n not in stored and t.untyped_storage().data_ptr() not in saved_storage]
    unexpected = sorted(set(stored) - set(state))
    parts = [
        f"{what}: {_first_three(names)}"
        for what, names in (("shapes differ", shapes), ("not in the checkpoint", missing), ("not in the model", unexpected))
        if names
    ]
    return "; ".join(parts) or None


def load_weights(path: Path, model: torch.nn.Module, weights: dict[str, torch.Tensor] | None = None) -> None:
    """Load the weights (``weights`` read from ``path``, default its ``model.safetensors``) into ``model``; a
    checkpoint of another shape is a one-line CheckpointError."""
    mismatch = weight_mismatch(path, model, weights)
    if mismatch:
        raise CheckpointError(f"{path}: does not fit the model: {mismatch}")
    if weights is None:
        load_model(model, str(path / "model.safetensors"), strict=True)
    else:
        model.load_state_dict(weights, strict=True)


def load_state(path: Path) -> dict[str, Any]:
    """``state.pt``, memory-mapped: a rank that holds a part of a tensor reads only that part of its moments."""
    return torch.load(path / "state.pt", weights_only=False, mmap=True)


@dataclass
class Resumed:
    """What :func:`load_for_resume` restored and found: the trainer restores the rest from ``state``."""

    path: Path
    meta: dict[str, Any]
    state: dict[str, Any]
    recipe_changes: list[str]
    warning: str | None  # one line: damaged checkpoints skipped and set aside, or ``latest`` disagreeing


def load_for_resume(
    root: Path,
    model: torch.nn.Module,
    recipe: dict[str, Any],
    read_weights: Callable[[Path, dict[str, Any]], dict[str, torch.Tensor]] | None = None,
    *,
    plugins: Plugins,
) -> Resumed | None:
    """Load the weights of the newest verified checkpoint under ``root`` into ``model``; None if there is none.

    ``recipe``: the run's recipe (``Recipe.to_dict()``), compared with the checkpoint's, which is read in the
    current keys of the installed ``plugins`` (``megaseq.config.stored_recipe``). ``read_weights(path, meta)``: this process's tensors of a checkpoint (``megaseq.distributed.sharded`` reads
    a rank's blocks; it raises :class:`ShapeMismatch` for a checkpoint of another model); default
    ``model.safetensors``.

    Damaged newer checkpoints are renamed ``*.damaged`` and reported in ``warning``. One-line CheckpointErrors: no usable checkpoint among several damaged ones,
    a model that does not fit (naming the tensors and the recipe keys that changed), non-finite weights.
    """
    found = newest_verified(root)
    if found.path is None:
        if found.skipped:
            raise CheckpointError(f"no usable checkpoint in {root}: {found.report()}; start over with --overwrite")
        return None
    path = found.path
    warning = found.report()
    if found.skipped:
        for damaged in checkpoints(root)[: len(found.skipped)]:
            set_aside(damaged)
        warning += " (the damaged ones are renamed *.damaged)"
    from megaseq.config import stored_recipe  # config imports the plugin manager; checkpoints need it only here

    meta = read_meta(path)
    changes = recipe_changes(stored_recipe(meta["recipe"], plugins, f"{path}/meta.json"), recipe)
    try:
        weights = read_weights(path, meta) if read_weights is not None else None
        mismatch = weight_mismatch(path, model, weights)
    except ShapeMismatch as exc:
        weights, mismatch = None, exc.mismatch
    if mismatch:
        shaping = [c for c in changes if c.split(".")[0] in ("model", "attention", "ffn", "moe", "memory")]
        raise CheckpointError(
            f"{path}: the recipe's model does not fit this checkpoint ({', '.join(shaping) or 'no recipe key changed'}): "
            f"{mismatch}; resume with the checkpoint's values or start over with --overwrite"
        )
    load_weights(path, model, weights)
    not_finite = [n for n, v in model.state_dict().items() if v.is_floating_point() and not v.isfinite().all()]
    if not_finite:
        raise CheckpointError(
            f"{path}: non-finite weights ({', '.join(not_finite[:3])}): the run diverged before this checkpoint; "
            f"delete it to resume from an earlier one, or start over with --overwrite"
        )
    return Resumed(path, meta, load_state(path), changes, warning)


def set_aside(path: Path) -> Path:
    """Rename a damaged checkpoint to ``<name>.damaged`` (kept for inspection, no longer a candidate)."""
    target = path.with_name(path.name + ".damaged")
    if target.exists():
        shutil.rmtree(target)
    os.replace(path, target)
    return target


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def recipe_changes(saved: dict[str, Any], current: dict[str, Any], ignore: tuple[str, ...] = ("run.out_dir",)) -> list[str]:
    """``"train.lr 0.003 -> 0.001"`` for every recipe value that differs from the checkpoint's."""
    old, new = _flatten(saved), _flatten(current)
    changes = []
    for key in sorted(set(old) | set(new)):
        if key in ignore or old.get(key, "<unset>") == new.get(key, "<unset>"):
            continue
        changes.append(f"{key} {old.get(key, '<unset>')!r} -> {new.get(key, '<unset>')!r}")
    return changes


def optimizer_param_names(optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> list[list[str]]:
    """The parameter names of each optimizer group, in order: saved beside the optimizer state."""
    names = {id(p): n for n, p in model.named_parameters()}
    return [[names[id(p)] for p in group["params"]] for group in optimizer.param_groups]


def load_optimizer(optimizer: torch.optim.Optimizer, saved: dict[str, Any], saved_names: list[list[str]], names: list[list[str]]) -> int | None:
    """Load a saved optimizer state matching tensors by name (not by position).

    When the trained parameters are the same, this is ``optimizer.load_state_dict``. When they differ
    (``train.trainable`` changed), each tensor still trained keeps its moments and a newly trained one
    starts fresh; returns how many tensors kept theirs (None when nothing differed). The groups'
    hyperparameters are the checkpoint's afterwards: the caller sets the recipe's.
    """
    if saved_names == names:
        optimizer.load_state_dict(saved)
        return None
    by_name = {}
    for group, group_names in zip(saved["param_groups"], saved_names, strict=True):
        for index, name in zip(group["params"], group_names, strict=True):
            if index in saved["state"]:
                by_name[name] = saved["state"][index]
    state, groups, index = {}, [], 0
    for group, group_names in zip(optimizer.param_groups, names, strict=True):
        ids = list(range(index, index + len(group_names)))
        index += len(group_names)
        state.update({i: by_name[n] for i, n in zip(ids, group_names, strict=True) if n in by_name})
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": ids})
    optimizer.load_state_dict({"state": state, "param_groups": groups})
    return len(state)


def resume_on_ranks(
    root: Path,
    model: torch.nn.Module,
    recipe: dict[str, Any],
    parallel: Any,
    notes: list[str],
    read_weights: Callable[[Path, dict[str, Any]], dict[str, torch.Tensor]] | None = None,
    *,
    plugins: Plugins,
) -> Resumed | None:
    """:func:`load_for_resume` on every rank of ``parallel`` (a ``megaseq.distributed.groups.Parallel``), the
    trainer's and the RL loop's one way to it: rank 0 first removes what an interrupted save left (a line in
    ``notes`` for each) and sets damaged checkpoints aside, so that the others then find the same newest good
    one; rank 0 prints the warning, if any."""
    if parallel.is_main:
        notes += [f"removed {name}, left by an interrupted save" for name in remove_leftovers(root)]

    def load() -> Resumed | None:
        return load_for_resume(root, model, recipe, read_weights, plugins=plugins)

    resumed = load() if parallel.is_main else None
    parallel.barrier()
    if not parallel.is_main:
        resumed = load()
    if resumed is not None and resumed.warning and parallel.is_main:
        print(f"megaseq: warning: {resumed.warning}", file=sys.stderr)
    return resumed


__all__ = [
    "CheckpointError",
    "Found",
    "Resumed",
    "ShapeMismatch",
    "checkpoints",
    "commit",
    "file_entries",
    "load_for_resume",
    "load_optimizer",
    "load_state",
    "load_weights",
    "newest_verified",
    "optimizer_param_names",
    "prune",
    "read_meta",
    "recipe_changes",
    "remove_leftovers",
    "resume_on_ranks",
    "rng_state",
    "save_checkpoint",
    "set_aside",
    "set_rng_state",
    "staging_dir",
    "step_name",
    "verify",
    "weight_mismatch",
]
