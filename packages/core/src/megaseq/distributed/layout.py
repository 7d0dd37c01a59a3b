"""The process layout of a run: data, context and expert parallelism, and the checks that it can work.

Layout (megatron-core's, with tensor and pipeline parallelism 1): ``workers = dp x cp``. Each of the ``dp``
data-parallel replicas reads ``train.batch_size / dp`` windows of every micro-batch; the ``cp`` ranks of a
replica share those windows, each holding its zig-zag shard (``megaseq.parallel.zigzag_shard``). Expert
parallelism does not add processes: the ``dp x cp`` ranks are cut into groups of ``ep`` consecutive ranks
that share each MoE layer's experts (rank ``r`` of a group holds experts ``[r E/ep, (r+1) E/ep)``), and
the ranks holding the same experts form the expert-data-parallel group.

Everything here is checked before any worker starts, and every failure is one line naming the key.
"""

from __future__ import annotations

from dataclasses import dataclass

from megaseq.config import Recipe
from megaseq.errors import UserError


@dataclass(frozen=True)
class Layout:
    dp: int = 1
    cp: int = 1
    ep: int = 1

    @property
    def world_size(self) -> int:
        return self.dp * self.cp

    def __str__(self) -> str:
        return f"dp={self.dp},cp={self.cp},ep={self.ep}"

    @classmethod
    def of(cls, recipe: Recipe) -> Layout:
        p = recipe.parallel
        return cls(dp=p.dp, cp=p.cp, ep=p.ep)


def parse_parallel(text: str) -> dict[str, int]:
    """``"dp=2,cp=2"`` -> ``{"dp": 2, "cp": 2}`` (keys not named keep the recipe's ``[parallel]`` values)."""
    out: dict[str, int] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or key not in ("dp", "cp", "ep"):
            raise UserError(f"--parallel {text!r}: expected comma-separated dp=N, cp=N, ep=N (e.g. dp=2,cp=2,ep=2)")
        if not value.strip().isdigit() or int(value) < 1:
            raise UserError(f"--parallel {text!r}: {key} must be a positive integer, got {value.strip()!r}")
        out[key] = int(value)
    return out


def resolve_layout(recipe: Recipe, workers: int | None) -> Layout:
    """The layout to run: the recipe's ``[parallel]`` section, with ``--workers N`` alone meaning ``dp=N``."""
    layout = Layout.of(recipe)
    if workers is None:
        return layout
    if workers < 1:
        raise UserError(f"--workers {workers}: must be at least 1")
    if layout == Layout():
        return Layout(dp=workers)
    if layout.world_size != workers:
        raise UserError(
            f"{recipe.source}: parallel dp x cp = {layout.dp} x {layout.cp} = {layout.world_size} ranks, "
            f"but --workers is {workers}; make them equal (ep shares those ranks, it adds none)"
        )
    return layout


def check_layout(recipe: Recipe, layout: Layout) -> None:
    """Every rule a layout must meet for this recipe, as one-line errors (nothing is started here)."""
    where = f"{recipe.source}: parallel ({layout})"
    if recipe.train.batch_size % layout.dp:
        raise UserError(
            f"{where}: train.batch_size {recipe.train.batch_size} is not a multiple of dp {layout.dp} "
            f"(it is the global batch; each data-parallel rank reads an equal share)"
        )
    if layout.cp > 1 and recipe.data.seq_len % (2 * layout.cp):
        raise UserError(
            f"{where}: data.seq_len {recipe.data.seq_len} is not a multiple of 2 x cp = {2 * layout.cp} "
            f"(zig-zag context parallelism cuts each window into 2 x cp equal segments)"
        )
    if layout.world_size % layout.ep:
        raise UserError(
            f"{where}: ep {layout.ep} does not divide dp x cp = {layout.world_size} "
            f"(expert-parallel groups are cut from the data- and context-parallel ranks)"
        )
    if layout.ep > 1 and recipe.train.optimizer_shard:
        raise UserError(
            f"{where}: train.optimizer_shard cannot shard expert-parallel parameters (each ep rank holds different "
            f"experts); set train.optimizer_shard = false or parallel.ep = 1"
        )
    if layout.ep > 1 and recipe.model.moe is None:
        raise UserError(f"{where}: ep {layout.ep} > 1 but model.moe is not set: there are no experts to share")

