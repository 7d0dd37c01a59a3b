"""The process layout of a run: data, context, tensor and expert parallelism, and the checks that it can work.

Layout (megatron-core's, with pipeline parallelism 1): ``workers = dp x cp x tp``. The ``tp`` ranks of a
context-parallel rank share its shard of every window: each holds ``1/tp`` of the heads, hidden widths and
vocabulary, and (sequence parallelism) ``1/tp`` of the shard's tokens between those regions. Each of the ``dp``
data-parallel replicas reads ``train.batch_size / dp`` windows of every micro-batch; the ``cp`` ranks of a
replica share those windows, each holding its zig-zag shard (``megaseq.parallel.zigzag_shard``). Expert
parallelism does not add processes: the ``dp x cp`` ranks are cut into groups of ``ep`` consecutive ranks
that share each MoE layer's experts (rank ``r`` of a group holds experts ``[r E/ep, (r+1) E/ep)``), and
the ranks holding the same experts form the expert-data-parallel group.

Everything here is checked before any worker starts, and every failure is one line naming the key.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from megaseq.config import Recipe
from megaseq.errors import UserError


class LayoutError(UserError):
    """A layout that cannot work for this recipe (one line naming the key)."""


@dataclass(frozen=True)
class Layout:
    """Ranks per parallel dimension: data, context, tensor and expert parallelism train; expert-tensor
    (``etp``) parallelism is modelled by the planner only, and a training run refuses it."""

    dp: int = 1
    cp: int = 1
    ep: int = 1
    tp: int = 1
    etp: int = 1

    @property
    def world_size(self) -> int:
        return self.dp * self.cp * self.tp

    def __str__(self) -> str:
        return ",".join(f"{k}={v}" for k, v in asdict(self).items() if k in ("dp", "cp", "ep") or v != 1)

    @classmethod
    def of(cls, recipe: Recipe) -> Layout:
        p = recipe.parallel
        return cls(dp=p.dp, cp=p.cp, ep=p.ep, tp=p.tp)

    @classmethod
    def parse(cls, text: str | None, base: Layout | None = None) -> Layout:
        """``--parallel "dp=2,cp=2"``: any subset of dp, cp, ep, tp, etp; the others come from ``base``."""
        values = asdict(base or cls())
        for item in filter(None, (part.strip() for part in (text or "").split(","))):
            key, sep, value = (s.strip() for s in item.partition("="))
            if not sep or key not in values:
                raise LayoutError(f"--parallel {text!r}: expected NAME=N items separated by commas, NAME one of "
                                  f"{', '.join(values)} (e.g. dp=2,cp=2,ep=2)")
            if not value.isdigit() or int(value) < 1:
                raise LayoutError(f"--parallel {text!r}: {key} must be a positive integer, got {value!r}")
            values[key] = int(value)
        return cls(**values)


def check_zigzag_length(seq_len: int, cp: int, what: str) -> None:
    """Zig-zag context parallelism cuts each sequence into ``2 x cp`` equal segments (``what`` names the
    length in the error: a recipe key or a flag)."""
    if cp > 1 and seq_len % (2 * cp):
        raise LayoutError(
            f"{what} {seq_len} is not a multiple of 2 x cp = {2 * cp} "
            f"(zig-zag context parallelism cuts each window into 2 x cp equal segments)"
        )


def resolve_layout(recipe: Recipe, layout: Layout, workers: int | None) -> Layout:
    """The layout to train with: ``layout`` (the recipe's ``[parallel]`` with ``--parallel`` on top), with
    ``--workers N`` alone meaning ``dp=N``."""
    if layout.etp > 1:
        raise LayoutError(f"--parallel {layout}: etp is for planning (megaseq plan); training runs etp=1")
    if workers is None:
        return layout
    if workers < 1:
        raise LayoutError(f"--workers {workers}: must be at least 1")
    if layout == Layout():
        return Layout(dp=workers)
    if layout.world_size != workers:
        raise LayoutError(
            f"{recipe.source}: parallel dp x cp x tp = {layout.dp} x {layout.cp} x {layout.tp} = {layout.world_size} ranks, "
            f"but --workers is {workers}; make them equal (ep shares those ranks, it adds none)"
        )
    return layout


def check_layout(recipe: Recipe, layout: Layout) -> None:
    """Every rule a layout must meet for this recipe, as one-line errors (nothing is started here)."""
    where = f"{recipe.source}: parallel ({layout})"
    if recipe.train.batch_size % layout.dp:
        raise LayoutError(
            f"{where}: train.batch_size {recipe.train.batch_size} is not a multiple of dp {layout.dp} "
            f"(it is the global batch; each data-parallel rank reads an equal share)"
        )
    check_zigzag_length(recipe.data.seq_len, layout.cp, f"{where}: data.seq_len")
    if (layout.dp * layout.cp) % layout.ep:
        raise LayoutError(
            f"{where}: ep {layout.ep} does not divide dp x cp = {layout.dp * layout.cp} "
            f"(expert-parallel groups are cut from the data- and context-parallel ranks)"
        )
    if layout.ep > 1 and recipe.train.optimizer_shard:
        raise LayoutError(
            f"{where}: train.optimizer_shard cannot shard expert-parallel parameters (each ep rank holds different "
            f"experts); set train.optimizer_shard = false or parallel.ep = 1"
        )
    if (recipe.data.seq_len // layout.cp) % layout.tp:
        raise LayoutError(
            f"{where}: data.seq_len {recipe.data.seq_len} / cp {layout.cp} is not a multiple of tp {layout.tp} "
            f"(sequence parallelism gives each tensor-parallel rank an equal share of a rank's tokens)"
        )
    if layout.tp > 1 and layout.ep > 1:
        raise LayoutError(f"{where}: tp {layout.tp} with ep {layout.ep}: tensor parallelism runs without expert parallelism; "
                        f"use tp=1 or ep=1")
    if layout.tp > 1 and recipe.train.optimizer_shard:
        raise LayoutError(f"{where}: train.optimizer_shard shards over data- and context-parallel ranks only; "
                        f"set train.optimizer_shard = false or parallel.tp = 1")
    if layout.ep > 1 and recipe.model.moe is None:
        raise LayoutError(f"{where}: ep {layout.ep} > 1 but model.moe is not set: there are no experts to share")

