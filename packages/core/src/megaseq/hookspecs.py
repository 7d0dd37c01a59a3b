"""Every hook a megaseq plugin can implement. All are prefixed ``megaseq_``.

Registration hooks return a list of records (``megaseq.records``); core calls each plugin's
implementation separately so that a failure is pinned on the plugin that caused it. Lifecycle hooks let a
plugin keep its own state (an MoE bias, a host-memory pool) without the trainer knowing about it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    import torch

    from megaseq.records import (
        AttentionSpec,
        CommandSpec,
        FFNSpec,
        InferenceEngineSpec,
        MemoryPolicySpec,
        MoESpec,
        RLAlgorithmSpec,
    )
    from megaseq.train.state import StepInfo

PROJECT = "megaseq"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def megaseq_attention() -> list[AttentionSpec]:
    """Attention components (token mixers) this plugin provides."""


@hookspec
def megaseq_ffn() -> list[FFNSpec]:
    """Dense feed-forward components this plugin provides."""


@hookspec
def megaseq_moe() -> list[MoESpec]:
    """Mixture-of-experts strategies this plugin provides."""


@hookspec
def megaseq_memory_policy() -> list[MemoryPolicySpec]:
    """Memory policies (recompute, offload, ...) this plugin provides."""


@hookspec
def megaseq_rl_algorithm() -> list[RLAlgorithmSpec]:
    """RL algorithms this plugin provides."""


@hookspec
def megaseq_inference_engine() -> list[InferenceEngineSpec]:
    """Inference engines this plugin provides (see ``megaseq.inference.InferenceEngine``).

    Called once per plugin when the registry is first read (``megaseq plugins``, a recipe naming an
    engine). Return a list of :class:`megaseq.records.InferenceEngineSpec`; each record's ``target``
    (imported only when the engine is used) is ``build(config, recipe, plugins) -> InferenceEngine``.
    An exception marks this plugin broken; the other plugins' engines stay available. Core provides
    ``cached`` (decoding with the components' own caches).
    """


@hookspec
def megaseq_command() -> list[CommandSpec]:
    """Subcommands of the ``megaseq`` command line this plugin provides (e.g. ``megaseq rl``).

    Called once per plugin when the command line starts. Return a list of
    :class:`megaseq.records.CommandSpec`; ``megaseq NAME ARGS...`` imports the record's ``target``,
    ``main(argv: list[str]) -> int``, and calls it with ``ARGS``; its return value is the exit status.
    A :class:`megaseq.errors.UserError` it raises is printed as one line with exit status 2, like core's
    own commands. A name that is one of core's commands (``train``, ``eval``, ``plugins``, ``data``) is
    never dispatched to the plugin: core warns and keeps its own. Two plugins with one name are an error
    naming both. An exception in this hook marks the plugin broken.
    """


@hookspec
def megaseq_step_start(step: StepInfo, model: torch.nn.Module) -> None:
    """Called before each optimizer step's first micro-batch."""


@hookspec
def megaseq_step_end(step: StepInfo, model: torch.nn.Module, metrics: dict[str, float]) -> None:
    """Called after each optimizer step. Update plugin state from the step (e.g. MoE balancing bias),
    release per-step resources, and add metrics to ``metrics`` (prefix keys with the plugin's name)."""


@hookspec
def megaseq_checkpoint_save(model: torch.nn.Module) -> dict[str, Any] | None:
    """Plugin state that is not in the model's parameters or buffers, to be checkpointed.

    Return ``{plugin_name: state}`` (tensors, numbers, strings, lists, dicts) or ``None``."""


@hookspec
def megaseq_checkpoint_load(model: torch.nn.Module, state: dict[str, Any]) -> None:
    """Restore plugin state; ``state`` is the union of what every plugin returned on save."""
