"""Every hook a megaseq plugin can implement. All are prefixed ``megaseq_``.

Implement them as module-level functions (or methods of a registered object) marked with :data:`hookimpl`,
using only the argument names you need (pluggy passes arguments by name). A misspelt hook name is an error
when the plugin is registered, not a silent no-op.

Two families:

- **Registration hooks** (``megaseq_attention``, ``megaseq_ffn``, ``megaseq_moe``, ``megaseq_memory_policy``,
  ``megaseq_rl_algorithm``, ``megaseq_inference_engine``, ``megaseq_command``, ``megaseq_data_source``,
  ``megaseq_baseline``, ``megaseq_eval_analysis``, ``megaseq_hf_layout``, ``megaseq_data_transform``) return
  the plugin's components as records (``megaseq.records``). Core calls each plugin's implementation
  separately, once per plugin manager, when the registry is first needed (listing plugins, validating a
  recipe, building a model), so that a failure is pinned on the plugin that caused it:
  an exception, a record of the wrong type or a record whose target does not exist makes that plugin
  ``broken`` (all of its components become unavailable, with the reason in ``megaseq plugins``, and the
  plugin is blocked: none of its hooks, lifecycle hooks included, runs again) and leaves the other
  plugins alone. They must be cheap and import nothing heavy: they run whenever plugins are listed.
- **Lifecycle hooks** (``megaseq_step_start``, ``megaseq_step_end``, ``megaseq_checkpoint_save``,
  ``megaseq_checkpoint_load``) let a plugin keep its own state (an MoE bias, a host-memory pool) without the
  trainer knowing about it. Every registered plugin's implementation is called, in pluggy's order (the plugin
  registered last is called first; core's built-ins are registered first). An exception raised by one stops
  the call and propagates to the trainer, which stops: lifecycle hooks must not fail for recoverable reasons.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    import torch

    from megaseq.records import (
        AttentionSpec,
        BaselineSpec,
        CommandSpec,
        DataSourceSpec,
        DataTransformSpec,
        EvalAnalysisSpec,
        FFNSpec,
        HFLayoutSpec,
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
    """The attention components (token mixers) this plugin provides.

    Returns a list of ``megaseq.records.AttentionSpec``; each target resolves to
    ``build(config, dims: ModelDims, layer_idx: int) -> nn.Module`` implementing ``megaseq.contracts.Attention``.
    Called once per plugin manager, for every plugin separately; a failure makes this plugin broken.
    """


@hookspec
def megaseq_ffn() -> list[FFNSpec]:
    """The dense feed-forward components this plugin provides.

    Returns a list of ``megaseq.records.FFNSpec``; each target resolves to
    ``build(config, dims: ModelDims, layer_idx: int) -> nn.Module`` implementing
    ``megaseq.contracts.FeedForward``. Called like :func:`megaseq_attention`.
    """


@hookspec
def megaseq_moe() -> list[MoESpec]:
    """The mixture-of-experts strategies this plugin provides.

    Returns a list of ``megaseq.records.MoESpec``; each target resolves to
    ``build(config, dims: ModelDims, layer_idx: int) -> nn.Module`` implementing ``megaseq.contracts.MoE``
    (``dims.ep_rank`` / ``dims.ep_size`` say which experts to build). Called like :func:`megaseq_attention`.
    """


@hookspec
def megaseq_memory_policy() -> list[MemoryPolicySpec]:
    """The memory policies (activation recomputation, offloading of saved tensors, ...) this plugin provides.

    Returns a list of ``megaseq.records.MemoryPolicySpec``; each target resolves to ``build(config) -> object``
    implementing ``megaseq.contracts.MemoryPolicy``. Called like :func:`megaseq_attention`.
    """


@hookspec
def megaseq_rl_algorithm() -> list[RLAlgorithmSpec]:
    """The RL algorithms this plugin provides.

    Returns a list of ``megaseq.records.RLAlgorithmSpec``; each target resolves to ``build(config) -> object``
    implementing ``megaseq.contracts.RLAlgorithm``. Called like :func:`megaseq_attention`.
    """


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
    """Subcommands of the ``megaseq`` command line this plugin provides (``megaseq NAME ARGS...``).

    Called once per plugin when the command line starts. Return a list of
    :class:`megaseq.records.CommandSpec`; ``megaseq NAME ARGS...`` imports the record's ``target``,
    ``main(argv: list[str]) -> int``, and calls it with ``ARGS``; its return value is the exit status.
    A :class:`megaseq.errors.UserError` it raises is printed as one line with exit status 2, like core's
    own commands. Core's own commands are records of this hook too (core's built-in plugin registers them
    from ``megaseq.commands``); a plugin's command with one of their names is never dispatched: core warns
    and keeps its own. Two plugins with one name are an error
    naming both. An exception in this hook marks the plugin broken.
    """


@hookspec
def megaseq_data_source() -> list[DataSourceSpec]:
    """The named corpora this plugin provides (what ``data.train``, ``data.heldout`` and ``megaseq data
    fetch`` name).

    Returns a list of ``megaseq.records.DataSourceSpec``; each target resolves to
    ``fetch(request: megaseq.records.FetchRequest) -> Path``, the corpus as a local FASTA file (the request
    names the record, carries its validated ``[data_source.NAME]`` config, the cache directory and, for a
    record that declares ``parts``, the part). Core tokenises it in the record's alphabet into its cache and
    checks the record's declared counts. Called like :func:`megaseq_attention`; core provides the two DNA
    excerpts ``excerpt-chr20`` and ``excerpt-chrX``.
    """


@hookspec
def megaseq_baseline() -> list[BaselineSpec]:
    """The baselines (reference predictors scored beside the model, ``eval.baselines``) this plugin provides.

    Returns a list of ``megaseq.records.BaselineSpec``; each target resolves to
    ``build(config, train: str) -> Baseline`` implementing ``megaseq.contracts.Baseline``. Called like
    :func:`megaseq_attention`.
    """


@hookspec
def megaseq_eval_analysis() -> list[EvalAnalysisSpec]:
    """The eval analyses (``eval.analyses``: what the held-out evaluation reports beyond loss by position, from
    every scorer's per-target losses) this plugin provides.

    Returns a list of ``megaseq.records.EvalAnalysisSpec``; each target resolves to
    ``build(config, info: EvalInfo) -> EvalAnalysis`` implementing ``megaseq.contracts.EvalAnalysis``. Called
    like :func:`megaseq_attention`.
    """


@hookspec
def megaseq_hf_layout() -> list[HFLayoutSpec]:
    """The published Hugging Face model layouts (a model family's tensor names and ``config.json``) this plugin
    provides: what ``megaseq import`` reads (found by ``config.json``'s ``model_type``) and ``megaseq export
    --layout NAME`` writes.

    Returns a list of ``megaseq.records.HFLayoutSpec``; each target resolves to a
    ``megaseq.interop.layouts.Layout``. A layout names the components of its layers (a recipe's names, which
    may be another plugin's) and carries the mappings of those that do not map themselves to it; core's
    walker takes a component's mapping from the layout where it has one, else from the component's record.
    Called like :func:`megaseq_attention`.
    """


@hookspec
def megaseq_data_transform() -> list[DataTransformSpec]:
    """The data transforms (``data.transforms``: augmentations, planted repeats; changes made to every training
    micro-batch, never to held-out windows) this plugin provides.

    Returns a list of ``megaseq.records.DataTransformSpec``; each target resolves to
    ``build(config) -> DataTransform`` implementing ``megaseq.contracts.DataTransform``, and each record declares
    ``changes_distribution``. Called like :func:`megaseq_attention`.
    """


@hookspec
def megaseq_step_start(step: StepInfo, model: torch.nn.Module) -> None:
    """Called before the first micro-batch of each optimizer step, before any forward of that step.

    ``step``: ``megaseq.train.state.StepInfo`` of the step about to run (``step`` counts from 1; ``tokens``
    trained before it; ``lr`` it will use; ``total_steps``). ``model``: the whole model (find your modules
    with ``megaseq.contracts.iter_modules``). Returns nothing. Every plugin's implementation runs, last
    registered first; an exception stops training.
    """


@hookspec
def megaseq_step_end(step: StepInfo, model: torch.nn.Module, metrics: dict[str, float]) -> None:
    """Called after each optimizer step (after ``optimizer.step()`` and ``zero_grad``), before the step's
    metrics are logged and before a checkpoint of that step is saved.

    ``step``: ``StepInfo`` of the step just taken (``tokens`` now includes it). ``metrics``: this step's
    metrics, to which the hook may add scalars (prefix keys with the plugin's name, e.g. ``"moe/max_load"``).
    Update plugin state from the step here (an MoE balancing bias) and release per-step resources. Returns
    nothing. Every plugin's implementation runs, last registered first; an exception stops training.
    """


@hookspec
def megaseq_checkpoint_save(model: torch.nn.Module) -> dict[str, Any] | None:
    """Plugin state that is not in the model's parameters or buffers, to be saved with each checkpoint.

    Called once per checkpoint, after the step's ``megaseq_step_end``. Return ``{plugin_name: state}``
    (tensors, numbers, strings, lists, dicts: what ``torch.save`` stores) or ``None``. The results of all
    plugins are merged into one dict; a key that two plugins return is an error naming both. An exception
    stops training.
    """


@hookspec
def megaseq_checkpoint_load(model: torch.nn.Module, state: dict[str, Any]) -> None:
    """Called when training resumes, after the model's weights and the optimizer are loaded: restore plugin state.

    ``state``: the merged dict every plugin returned from ``megaseq_checkpoint_save`` (take your own key;
    it is absent when the checkpoint was written without your plugin). Returns nothing. An exception stops
    the resume.
    """
