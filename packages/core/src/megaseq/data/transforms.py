"""The recipe's data transforms in training: built from ``data.transforms``, each call seeded on its own,
applied to every training micro-batch in order (the contract is ``megaseq.contracts.DataTransform``).

Each call gets a fresh CPU generator seeded from (run seed, step, micro-batch index, position in
``data.transforms``) through numpy's ``SeedSequence``, which mixes the four numbers so that no two calls share
a stream. A transform's draws therefore depend on where in training it runs and on nothing else: a resumed run
draws what the straight run drew with no transform state in the checkpoint, and the global generators (the
model's initialisation, anything a component draws) are never touched.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from megaseq.contracts import DataTransform
from megaseq.data.tokenizer import N_ID
from megaseq.data.windows import Batch
from megaseq.errors import ConfigError
from megaseq.records import ComponentConfig

if TYPE_CHECKING:
    from megaseq.config import Recipe
    from megaseq.plugins import Plugins


@dataclass(frozen=True)
class BuiltTransform:
    """One entry of ``data.transforms``: its name, its validated config, the transform and what its record
    declares about the distribution."""

    name: str
    config: ComponentConfig
    transform: DataTransform
    changes_distribution: bool

    def describe(self) -> str:
        options = ", ".join(f"{k}={v}" for k, v in self.config.model_dump().items())
        effect = "changes the distribution" if self.changes_distribution else "keeps the distribution"
        return f"{self.name}({options}) {effect}"


def transform_generator(seed: int, step: int, micro_batch: int, position: int) -> torch.Generator:
    """The generator of one call: the transform at ``position`` in ``data.transforms`` on micro-batch
    ``micro_batch`` (from 0) of optimizer step ``step`` (from 1) of a run seeded ``run.seed``."""
    words = [seed % 2**64, step, micro_batch, position]  # SeedSequence takes non-negative integers
    (state,) = np.random.SeedSequence(words).generate_state(1, np.uint64)
    return torch.Generator().manual_seed(int(state))


def build_transforms(recipe: Recipe, plugins: Plugins) -> list[BuiltTransform]:
    """The transforms ``data.transforms`` names, in order, each built from its ``[data_transform.NAME]``. A
    config a transform refuses (its ``megaseq.errors.ConfigError``, naming the key) and a window of the recipe
    (``data.seq_len``, a ``data.schedule`` stage) shorter than a transform acts on are one line here, naming the
    recipe and the section, before training."""
    from megaseq.distributed.layout import window_lengths

    built = []
    for position, name in enumerate(recipe.data.transforms):
        provided = plugins.get("data_transform", name, where=f"{recipe.source}: data.transforms[{position}]")
        config = recipe.component("data_transform", name)
        try:
            transform = provided.load()(config)
        except ConfigError as exc:  # a config its schema admits but the transform cannot serve
            raise ConfigError(f"{recipe.source}: [data_transform.{name}] {exc}") from None
        if not isinstance(transform, DataTransform):
            raise TypeError(f"data transform {name!r}: its target built a {type(transform).__name__}, which does not "
                            "implement megaseq.contracts.DataTransform (min_length and __call__)")
        for key, length in window_lengths(recipe):
            if length < transform.min_length:
                raise ConfigError(f"{recipe.source}: {key} {length}: data transform {name!r} ([data_transform.{name}]) "
                                  f"acts on windows of at least {transform.min_length} tokens")
        built.append(BuiltTransform(name, config, transform, bool(provided.spec.changes_distribution)))
    return built


def _check_output(name: str, before: Batch, after: Batch) -> None:
    """What the trainer relies on of a transform's result (the suite checks the rest of the contract)."""
    if not isinstance(after, Batch):
        raise TypeError(f"data transform {name!r} returned a {type(after).__name__}, not a megaseq.data.windows.Batch")
    for field in ("inputs", "targets", "weights"):
        old, new = getattr(before, field), getattr(after, field)
        if new.shape != old.shape or new.dtype != old.dtype:
            raise ValueError(f"data transform {name!r} returned {field} {new.dtype} {tuple(new.shape)}, it was given "
                             f"{old.dtype} {tuple(old.shape)}: a transform keeps the batch's shapes and dtypes")
    for field in ("inputs", "targets"):
        ids = getattr(after, field)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) > N_ID):
            raise ValueError(f"data transform {name!r} returned {field} outside the data's ids 0..{N_ID} (A C G T N)")


def apply_transforms(transforms: list[BuiltTransform], batch: Batch, seed: int, step: int, micro_batch: int) -> Batch:
    """``batch`` (one global training micro-batch, the data's ids) through every transform, in order."""
    for position, built in enumerate(transforms):
        out = built.transform(batch, step=step, generator=transform_generator(seed, step, micro_batch, position))
        _check_output(built.name, batch, out)
        batch = out
    return batch
