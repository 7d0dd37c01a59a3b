"""The process layout of a run: data, context, tensor and expert parallelism, and the checks that it can work.

Layout (megatron-core's, with pipeline parallelism 1): ``workers = dp x cp x tp``. The ``tp`` ranks of a
context-parallel rank share its shard of every window: each holds ``1/tp`` of the heads, hidden widths and
vocabulary, and (sequence parallelism) ``1/tp`` of the shard's tokens between those regions. Each of the ``dp``
data-parallel replicas reads ``train.batch_size / dp`` windows of every micro-batch; the ``cp`` ranks of a
replica share those windows, each holding its zig-zag shard (``megaseq.parallel.zigzag_shard``). Expert
parallelism does not add processes: megatron-core lays the workers out a second time as ``etp x ep x edp``
(``etp`` fastest). Each MoE layer routes the tokens a rank holds (its sequence chunk under tensor
parallelism); the ``ep`` ranks of an expert-parallel group share the experts (rank ``r`` holds experts
``[r E/ep, (r+1) E/ep)``), the ``etp`` ranks of an expert-tensor-parallel group each hold ``1/etp`` of those
experts' hidden width (and see each other's tokens for them), and the ranks holding the same expert blocks
form the expert-data-parallel group.

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
    """Ranks per parallel dimension: data, context, tensor, expert and expert-tensor parallelism."""

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
        return cls(dp=p.dp, cp=p.cp, ep=p.ep, tp=p.tp, etp=p.etp)

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


def window_lengths(recipe: Recipe) -> list[tuple[str, int]]:
    """``(recipe key, length)`` of every window length training uses: the schedule's stages, then data.seq_len."""
    stages = [(f"data.schedule[{i}].seq_len", s.seq_len) for i, s in enumerate(recipe.data.schedule)]
    return [*stages, ("data.seq_len", recipe.data.seq_len)]


def check_run_layout(recipe: Recipe, layout: Layout) -> None:
    """The trainer's layout stage: the process groups must be laid out as the recipe says, and the layout must
    meet every rule of :func:`check_layout`."""
    if layout != Layout.of(recipe):
        raise ValueError(f"the process groups are laid out as {layout}, the recipe as {Layout.of(recipe)}")
    check_layout(recipe, layout)  # e.g. a batch that does not split evenly would lose windows


def check_layout(recipe: Recipe, layout: Layout) -> None:
    """Every rule a layout must meet for this recipe, as one-line errors (nothing is started here)."""
    where = f"{recipe.source}: parallel ({layout})"
    if recipe.train.batch_size % layout.dp:
        raise LayoutError(
            f"{where}: train.batch_size {recipe.train.batch_size} is not a multiple of dp {layout.dp} "
            f"(it is the global batch; each data-parallel rank reads an equal share)"
        )
    for key, length in window_lengths(recipe):
        check_zigzag_length(length, layout.cp, f"{where}: {key}")
        if (length // layout.cp) % layout.tp:
            raise LayoutError(
                f"{where}: {key} {length} / cp {layout.cp} is not a multiple of tp {layout.tp} "
                f"(sequence parallelism gives each tensor-parallel rank an equal share of a rank's tokens)"
            )
    check_expert_layout(recipe, layout)
    if (layout.ep > 1 or layout.etp > 1) and recipe.train.optimizer_shard:
        raise LayoutError(
            f"{where}: train.optimizer_shard cannot shard expert-parallel parameters (each ep or etp rank holds "
            f"different expert blocks); set train.optimizer_shard = false or parallel.ep = parallel.etp = 1"
        )
    if layout.tp > 1 and recipe.train.optimizer_shard:
        raise LayoutError(f"{where}: train.optimizer_shard shards over data- and context-parallel ranks only; "
                        f"set train.optimizer_shard = false or parallel.tp = 1")


def check_expert_layout(recipe: Recipe, layout: Layout) -> None:
    """The expert groups can be cut from the workers, and there are experts to share."""
    where = f"{recipe.source}: parallel ({layout})"
    if layout.world_size % (layout.ep * layout.etp):
        raise LayoutError(
            f"{where}: ep x etp = {layout.ep} x {layout.etp} does not divide the {layout.world_size} workers "
            f"(dp x cp x tp; the expert groups are cut from them)"
        )
    for name in ("ep", "etp"):
        if getattr(layout, name) > 1 and recipe.model.moe is None:
            raise LayoutError(f"{where}: {name} {getattr(layout, name)} > 1 but model.moe is not set: there are no "
                              f"experts to share")

