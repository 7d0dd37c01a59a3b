"""What a layout asks of the components a recipe uses, read from the capabilities their records declare
(``megaseq.records.CAPABILITIES``). One check serves the launch, the trainer and the planner, so a component
that lacks what a layout needs is one line before anything runs; the conformance suites verify that each
declared capability holds.

- ``cp > 1``: every attention and every memory policy must declare ``context_parallel``, and no memory
  policy may tile sequences (a tile is a share of the whole sequence, which no rank holds).
- ``ep > 1``: the MoE must declare ``expert_parallel``.
- ``tp > 1``: every attention, dense FFN and MoE must declare ``tensor_parallel``, and no memory policy may
  tile sequences (a rank holds a chunk of the sequence between components).
"""

from __future__ import annotations

from typing import Any

from megaseq.config import Recipe
from megaseq.distributed.layout import Layout
from megaseq.errors import UserError
from megaseq.plugins import Plugins
from megaseq.records import Component, MemoryEffect


def used_components(recipe: Recipe, policies: list[str] | None = None) -> list[tuple[str, str]]:
    """``(kind, name)`` of every component the recipe's model uses, and of ``policies`` (default: the
    recipe's memory policies when it names them)."""
    m = recipe.model
    used = {("attention", m.attention_of(i)) for i in range(m.n_layers)} | {m.ffn_of(i) for i in range(m.n_layers)}
    if policies is None:
        policies = [] if recipe.train.memory_policy == "auto" else list(recipe.train.memory_policy)
    return sorted(used | {("memory_policy", name) for name in policies})


def policy_effect(spec: Component, config: Any) -> MemoryEffect | None:
    """A memory policy's modelled effect under ``config`` (``None``: its record has no ``memory`` target)."""
    effect_fn = spec.load_memory()
    return None if effect_fn is None else effect_fn(config)


def policy_runs_under(spec: Component, effect: MemoryEffect | None, cp: int, tp: int = 1) -> bool:
    """Whether a memory policy with this effect keeps a step under ``cp`` context-parallel and ``tp``
    tensor-parallel ranks equal to the step without it: under ``cp > 1`` it declares ``context_parallel``, and
    under either it does not tile sequences."""
    tiles = effect is not None and effect.tile_tokens is not None
    if cp > 1 and "context_parallel" not in spec.capabilities:
        return False
    return not (tiles and (cp > 1 or tp > 1))


def check_components(recipe: Recipe, plugins: Plugins, layout: Layout, policies: list[str] | None = None) -> None:
    """Every component the recipe uses (and ``policies``, see :func:`used_components`) has what ``layout``
    needs; otherwise a one-line error naming the component, its plugin and the capability."""
    where = f"{recipe.source}: parallel ({layout})"
    for kind, name in used_components(recipe, policies):
        provided = plugins.get(kind, name)
        declared = provided.spec.capabilities
        label = f"{kind} {name!r} ({provided.plugin.label})"
        if layout.cp > 1 and kind in ("attention", "memory_policy") and "context_parallel" not in declared:
            raise UserError(f"{where}: {label} does not declare context_parallel; use cp=1 or another {kind}")
        if layout.ep > 1 and kind == "moe" and "expert_parallel" not in declared:
            raise UserError(f"{where}: {label} does not declare expert_parallel; use ep=1 or another moe")
        if layout.tp > 1 and kind in ("attention", "ffn", "moe") and "tensor_parallel" not in declared:
            raise UserError(f"{where}: {label} does not declare tensor_parallel; use tp=1 or another {kind}")
        if kind == "memory_policy" and layout.tp > 1:
            config = recipe.components.get(kind, {}).get(name) or provided.spec.config()
            effect = policy_effect(provided.spec, config)
            if effect is not None and effect.tile_tokens is not None:
                raise UserError(f"{recipe.source}: memory_policy.{name}.tile_tokens cannot run under tensor "
                                f"parallelism (tp={layout.tp}: each rank holds a chunk of the sequence); remove "
                                f"tile_tokens or use tp=1")
        if kind == "memory_policy" and layout.cp > 1:
            config = recipe.components.get(kind, {}).get(name) or provided.spec.config()
            effect = policy_effect(provided.spec, config)
            if not policy_runs_under(provided.spec, effect, layout.cp):
                raise UserError(f"{recipe.source}: memory_policy.{name}.tile_tokens cannot run under context "
                                f"parallelism (cp={layout.cp}: each rank holds a share of the sequence); remove "
                                f"tile_tokens or use cp=1")


__all__ = ["check_components", "policy_effect", "policy_runs_under", "used_components"]
