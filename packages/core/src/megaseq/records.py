"""Typed records that plugins return from their registration hooks.

A record names a component and points at its factory lazily (``"module:attr"``), so listing plugins
never imports a component's implementation (and so never touches CUDA, Triton or flash-attn). The config
schema is a pydantic model: keep the module that defines it light.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict


class ComponentConfig(BaseModel):
    """Base class of every component's config schema: unknown keys are errors, values are validated."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class NoConfig(ComponentConfig):
    """Schema of a component that takes no options."""


@dataclass(frozen=True)
class MemoryEstimate:
    """What one component instance costs for a given sequence length, all in bytes.

    ``parameters``: the parameters at their stored dtype; ``saved_per_token``: what autograd keeps alive per
    token between forward and backward; ``temporary``: the largest transient buffer inside one forward or
    backward call. The memory planner (next: the offload package) sums these over a recipe's layers.
    """

    parameters: int
    saved_per_token: float
    temporary: int = 0


@dataclass(frozen=True)
class ModelDims:
    """The model-wide sizes a component is built against.

    ``ep_rank`` / ``ep_size``: this process's place in the expert-parallel group, so an MoE component
    builds only its local experts (the group itself arrives in ``ForwardContext.ep_group``).
    """

    d_model: int
    n_layers: int
    vocab_size: int
    ep_rank: int = 0
    ep_size: int = 1


def load_target(target: str) -> Any:
    """Import ``"package.module:attr"`` and return the attribute."""
    module_name, _, attr = target.partition(":")
    if not module_name or not attr:
        raise ValueError(f"target {target!r} is not of the form 'module:attr'")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


@dataclass(frozen=True)
class Component:
    """A named, configurable building block provided by a plugin.

    ``target`` resolves to ``build(config, dims, layer_idx) -> torch.nn.Module`` for model components, or to
    ``build(config) -> object`` for the other kinds. ``memory`` optionally resolves to
    ``estimate(config, dims, seq_len) -> MemoryEstimate`` for the memory planner.
    """

    kind: ClassVar[str] = ""
    name: str
    target: str
    config: type[ComponentConfig] = NoConfig
    summary: str = ""
    memory: str | None = None
    extras: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        if not self.name or not self.name.replace("-", "_").replace(".", "_").isidentifier():
            raise ValueError(f"{self.kind} name {self.name!r} must be a non-empty identifier (letters, digits, -, _)")
        if ":" not in self.target:
            raise ValueError(f"{self.kind} {self.name!r}: target {self.target!r} is not 'module:attr'")
        if not (isinstance(self.config, type) and issubclass(self.config, ComponentConfig)):
            raise ValueError(f"{self.kind} {self.name!r}: config must be a megaseq.records.ComponentConfig subclass")

    def load(self) -> Any:
        return load_target(self.target)

    def load_memory(self) -> Any | None:
        return load_target(self.memory) if self.memory else None


@dataclass(frozen=True)
class AttentionSpec(Component):
    """A token mixer: see ``megaseq.contracts.Attention``."""

    kind: ClassVar[str] = "attention"


@dataclass(frozen=True)
class FFNSpec(Component):
    """A dense per-token feed-forward block: see ``megaseq.contracts.FeedForward``."""

    kind: ClassVar[str] = "ffn"


@dataclass(frozen=True)
class MoESpec(Component):
    """A mixture-of-experts strategy: see ``megaseq.contracts.MoE``."""

    kind: ClassVar[str] = "moe"


@dataclass(frozen=True)
class MemoryPolicySpec(Component):
    """A memory policy (recompute, offload, ...): see ``megaseq.contracts.MemoryPolicy``."""

    kind: ClassVar[str] = "memory_policy"


@dataclass(frozen=True)
class RLAlgorithmSpec(Component):
    """An RL objective (GRPO, DAPO, ...): see ``megaseq.contracts.RLAlgorithm``."""

    kind: ClassVar[str] = "rl_algorithm"


@dataclass(frozen=True)
class InferenceEngineSpec(Component):
    """An inference engine (generate with log-probabilities, score, take new weights): see
    ``megaseq.inference.InferenceEngine``. ``target`` resolves to ``build(config, recipe, plugins)``: the
    engine for the model ``recipe`` describes, its components built through ``plugins``."""

    kind: ClassVar[str] = "inference_engine"


@dataclass(frozen=True)
class CommandSpec(Component):
    """A subcommand of the ``megaseq`` command line. ``target`` resolves to ``main(argv: list[str]) -> int``,
    called with the arguments after the command's name; ``summary`` is its line in ``megaseq --help``.
    Its module is imported only when the command runs. ``config`` is unused."""

    kind: ClassVar[str] = "command"


SPEC_TYPES: dict[str, type[Component]] = {
    cls.kind: cls
    for cls in (AttentionSpec, FFNSpec, MoESpec, MemoryPolicySpec, RLAlgorithmSpec, InferenceEngineSpec, CommandSpec)
}
