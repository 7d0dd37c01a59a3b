r"""Test kit for plugin authors: fresh plugin managers, temporary registration, conformance suites.

Typical plugin test::

    from megaseq_testkit.attention import AttentionConformance

    class TestMyAttention(AttentionConformance):
        name = "my-attention"
        config = {"n_heads": 2}

The suites are the executable definition of "a working plugin", one per kind:

- ``megaseq_testkit.attention.AttentionConformance`` (kind ``attention``),
- ``megaseq_testkit.ffn.FeedForwardConformance`` (``ffn``),
- ``megaseq_testkit.moe.MoEConformance`` (``moe``),
- ``megaseq_testkit.tiling.SequenceTilingConformance`` (attention components that tile),
- ``megaseq_testkit.memory_policy.MemoryPolicyConformance`` (``memory_policy``),
- ``megaseq_testkit.rl.RLAlgorithmConformance`` (``rl_algorithm``),
- ``megaseq_testkit.engine.EngineConformance`` (``inference_engine``),
- ``megaseq_testkit.data_source.DataSourceConformance`` (``data_source``),
- ``megaseq_testkit.baseline.BaselineConformance`` (``baseline``),
- ``megaseq_testkit.eval_analysis.EvalAnalysisConformance`` (``eval_analysis``),
- ``megaseq_testkit.data_transform.DataTransformConformance`` (``data_transform``).

They build components by name through the installed entry points, so they also check that registration
works. Their building blocks are in ``megaseq_testkit.checks``. Every suite takes its settings as class
attributes, the same names for the same things (docs/writing-a-plugin.md holds this table too):

| knob | suites | default | meaning |
|---|---|---|---|
| `name` | all | (required) | the component's registered name |
| `config` | attention, ffn, moe, tiling, memory policy, rl, engine, data source, baseline, eval analysis, data transform | `{}` | its config, as its recipe section would give it |
| `factory` | attention, ffn, moe, tiling, memory policy, rl, engine, data source, baseline, eval analysis, data transform | `None` | `"module:attr"` or `"/path/file.py:attr"` of a builder to test instead of the installed plugin (a module not yet packaged; the kit's own wrong components): `build(config_dict, dims, layer_idx)`, for a memory policy, an RL algorithm or a data transform `build(config_dict)`, for an engine `build(config_dict, recipe, plugins)`, for a baseline `build(config_dict, train)` (`train`: a `megaseq.data.Corpus`), for an eval analysis `build(config_dict, info)`; for a data source the `DataSourceSpec` record itself, registered in a fresh plugin manager |
| `memory` | attention, ffn, moe, tiling, memory policy | `None` | with `factory`: `"module:attr"` of its `estimate(config_dict, dims, seq_len) -> MemoryEstimate`; for a memory policy of its `effect(config_dict) -> MemoryEffect` |
| `kind` | attention, ffn, moe, tiling | `"attention"`; `"ffn"`, `"moe"`; tiling `"attention"` | the kind to build (set by the suite class) |
| `recipe` | memory policy, engine | a small `sdpa` model | TOML-shaped `[model]` and component tables of the model trained (memory policy: 3 layers of `sdpa` and the suite's probe feed-forward) or served (engine: 2 layers of `sdpa`) |
| `d_model` | attention, ffn, moe, tiling | 32 | model width |
| `tolerance` | attention, ffn, moe, tiling, memory policy, rl, engine, baseline, eval analysis | 1e-5; memory policy, baseline 1e-6; rl 1e-10; engine 1e-4; eval analysis 1e-9 | the error bound: `max \|actual - expected\| <= tolerance * max(1, max \|expected\|)` for the float32 comparisons, float64 for rl; eval analysis: each number of two results, relative to its size; memory policy with `exact = False`: the bound the policy states on the relative error of the loss, each auxiliary loss and metric, and the whole gradient vector; engine: the largest \|engine - training forward\| log-probability |
| `grad_tolerance` | attention, ffn, moe | 1e-6 | error bound of the float64 finite-difference gradient check, relative to `max(1, \|derivative\|)` |
| `invariance_tolerance` | rl | 1e-4 | shift and scale invariance of advantages, relative to the largest advantage |
| `memory_tolerance` | attention, ffn, moe, tiling | 0.25 | largest difference of the memory estimate from what autograd saves (tiling: from what the tiles carry), relative to the measurement; the most `MemoryEstimate.temporary` may fall below the measured transient working set, relative to it |
| `temporary_ratio` | attention, ffn, moe | 4.0 | the most `MemoryEstimate.temporary` may exceed the measured transient working set, as a multiple of it |
| `effect_ratio` | memory policy | 2.0 | what the policy saves of what the layers keep, measured, within this factor either way of what its `MemoryEffect` saves in the plan (give or take a tenth of what the layers keep without it) |
| `memory_lengths` | attention, ffn, moe, tiling | `(64, 256)` | sequence lengths at which the estimate is checked (tiling: in four tiles) |
| `seq_len` | attention, ffn, moe, tiling, memory policy, eval analysis, data transform | 48; ffn, moe 13; tiling 45; memory policy 67; eval analysis 701; data transform 150 | tokens per row (memory policy: per micro-batch; eval analysis: targets per window; data transform: per window, at least its `min_length`) |
| `grad_seq_len` | attention, ffn, moe | 10; ffn, moe 5 | tokens per row of the gradient check (each parameter costs two forwards) |
| `batch` | ffn, moe, engine, data transform | 2; engine 3; data transform 16 | rows (engine: prompts; data transform: windows per micro-batch) |
| `doc_lengths` | attention, tiling, memory policy | `(5, 17, 0, 1, 25)`; tiling `(12, 4, 13, 0, 16)`; memory policy `(20, 1, 29, 17)` | documents of the packed tests (an empty one included; tiling: one starts on a tile edge) |
| `prefill` | attention | 19 | tokens decoded as one prefill before the decoding steps |
| `decode_steps` | attention | `(3, 1, 5, 2)` | token counts of the decoding steps after the prefill, cycled, beside single-token steps |
| `capabilities` | attention, ffn, moe, tiling, memory policy | `None` | with `factory`: the capabilities the component or policy would declare on its record (`megaseq.records.CAPABILITIES`); the suites verify what is declared and check the one-line refusal of what is not |
| `cp_world_sizes` | attention, memory policy | `(2, 4)`; memory policy `(2,)` | context-parallel sizes to check when `context_parallel` is declared (memory policy: and the config does not tile sequences) |
| `cp_seq_len` | attention, memory policy | 32; memory policy 68 | tokens of the context-parallel sequence (a multiple of `2 x` every size) |
| `chunk_sizes` | moe | `(7, 1)` | `chunk_tokens` values compared with unchunked |
| `tile_sizes` | tiling | `(1, 7, 16, 45)` | tile lengths compared with the untiled forward |
| `packed_tile_sizes` | tiling | `(5, 16)` | tile lengths of the packed test |
| `exact` | memory policy | `True` | results must be bitwise those without the policy (it keeps the order of operations); `False` for a lossy policy, held to `tolerance` |
| `micro_batches`, `steps` | memory policy | 2, 2 | gradient accumulation and optimizer steps |
| `probe_noise` | memory policy | `True` | the probe draws from the global RNG once per call (`False` for tiling, which calls it per tile) |
| `shift_invariant` | rl | `True` | adding a constant to a group's rewards leaves its advantages unchanged |
| `scale_invariant` | rl | `False` | so does multiplying them by a positive constant |
| `clip_range` | rl | `(0.2, 0.2)` | `(eps_low, eps_high)` of a PPO-style trust region: just outside `[1 - eps_low, 1 + eps_high]` on the side the advantage pushes a token gets no gradient, just inside it does; `None`: no trust region |
| `groups`, `group_size`, `tokens` | rl | 5, 4, 7 | prompts, completions per prompt, tokens per completion |
| `prompt_len`, `new_tokens` | engine | 11, 9 | prompt length and tokens generated |
| `train` | baseline | `"excerpt-chr20"` | what the baseline is fitted on (a data source or FASTA path); its alphabet is the one the suite scores |
| `baselines`, `windows` | eval analysis | `("base-a", "base-b")`, 5 | the labels of the baselines scored beside the model, and the held-out windows fed |
| `alphabet` | eval analysis | `"dna"` | the alphabet of the windows fed (a name of `megaseq.alphabets.ALPHABETS` or an `Alphabet`) |
| `random` | data transform | `True` | the transform draws from its generator, so different seeds must give different batches; `False` (one that draws nothing, or is configured to, e.g. a probability of 0): they must not |
| `cache_dir` | data source | `None` | where to fetch to; `None`: megaseq's cache (`$MEGASEQ_CACHE`, else ~/.cache/megaseq) |
| `records` | data source | `None` | the sequences the test's input holds, read without the source (its test wrote the input): the records fetched, both parts together, must be exactly these; `None`: the record's declared `bases` are the check, and a record that declares none fails |
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, ClassVar

import pytest
from torch import Tensor, nn

from megaseq.contracts import ForwardContext
from megaseq.plugins import Plugins, get_plugins
from megaseq.records import MemoryEstimate, ModelDims, load_target
from megaseq_testkit.checks import (
    assert_close,
    call_transients,
    check_deterministic,
    check_gradients,
    check_saved_estimate,
    check_temporary_estimate,
    count_collective_bytes,
    count_host_syncs,
    saved_bytes,
    watch_host_syncs,
)


def fresh_plugins(autoload: bool = False) -> Plugins:
    """A new plugin manager: core's built-ins only, or (``autoload=True``) plus the installed entry points.

    Autoload honours ``MEGASEQ_PLUGINS`` and ``MEGASEQ_DISABLE_PLUGIN_AUTOLOAD`` like a real run.
    """
    plugins = Plugins()
    if autoload:
        plugins.load_entrypoints()
    return plugins


@contextmanager
def registered(plugin: object, plugins: Plugins, name: str | None = None) -> Iterator[Plugins]:
    """Register ``plugin`` (a module or an object with ``@hookimpl`` methods) for the duration of a block."""
    name = name or getattr(plugin, "__name__", None) or type(plugin).__name__
    plugins.register(plugin, name=name)
    try:
        yield plugins
    finally:
        plugins.unregister(name)


@functools.cache
def installed_plugins() -> Plugins:
    """The installed plugins, loaded once per process (conformance suites build many components)."""
    return get_plugins()


def build_component(
    kind: str,
    name: str,
    config: dict[str, Any],
    dims: ModelDims,
    layer_idx: int = 0,
    plugins: Plugins | None = None,
    factory: str | None = None,
) -> nn.Module:
    """Build one component by name (from the installed plugins unless ``plugins`` is given), validating
    ``config`` with its schema. With ``factory`` (see :func:`load_factory`) the component is not looked up:
    ``factory(config, dims, layer_idx)`` builds it from the plain ``config`` dict."""
    if factory is not None:
        return load_factory(factory)(dict(config), dims, layer_idx)
    plugins = plugins or installed_plugins()
    provided = plugins.get(kind, name)
    return provided.load()(provided.spec.config(**config), dims, layer_idx)


def memory_estimator(
    kind: str,
    name: str,
    config: dict[str, Any],
    dims: ModelDims,
    factory: str | None = None,
    memory: str | None = None,
) -> Callable[[int], MemoryEstimate] | None:
    """``seq_len -> MemoryEstimate`` of a component: its record's ``memory`` target (installed plugins), or
    with ``factory`` the ``memory`` target ``estimate(config_dict, dims, seq_len)`` given beside it; ``None``
    when there is none (the planner then cannot plan the component)."""
    if factory is not None:
        if memory is None:
            return None
        estimate = load_factory(memory)
        return lambda seq_len: estimate(dict(config), dims, seq_len)
    provided = installed_plugins().get(kind, name)
    fn = provided.spec.load_memory()
    if fn is None:
        return None
    validated = provided.spec.config(**config)
    return lambda seq_len: fn(validated, dims, seq_len)


def declared_capabilities(
    kind: str, name: str, factory: str | None = None, knob: frozenset[str] | None = None, plugins: Plugins | None = None
) -> frozenset[str]:
    """The capabilities a suite verifies (``megaseq.records.CAPABILITIES``): the record's, from the installed
    plugins (or ``plugins``); with ``factory`` the component has no record, and the suite's ``capabilities``
    knob (``knob``, default none) says what it would declare."""
    if factory is not None:
        return frozenset(knob or ())
    return (plugins or installed_plugins()).get(kind, name).spec.capabilities


class ComponentSuite:
    """What every suite of a model component (attention, feed-forward, MoE, sequence tiling) shares: the knobs
    that name and build the component and bound its checks (each suite adds its own; the module docstring's
    table lists them all), and the component's declared capabilities."""

    kind: ClassVar[str]
    name: ClassVar[str]
    config: ClassVar[dict[str, Any]] = {}
    factory: ClassVar[str | None] = None
    memory: ClassVar[str | None] = None
    d_model: ClassVar[int] = 32
    tolerance: ClassVar[float] = 1e-5
    memory_lengths: ClassVar[tuple[int, ...]] = (64, 256)
    memory_tolerance: ClassVar[float] = 0.25
    capabilities: ClassVar[frozenset[str] | None] = None  # with factory: what the component would declare

    def declared(self) -> frozenset[str]:
        return declared_capabilities(self.kind, self.name, self.factory, self.capabilities)

    def dims(self) -> ModelDims:
        """The model dimensions the suite builds the component with."""
        return ModelDims(d_model=self.d_model, n_layers=2, vocab_size=8)

    def estimator(self) -> Callable[[int], MemoryEstimate] | None:
        """The component's ``seq_len -> MemoryEstimate`` (:func:`memory_estimator`), None when it has none."""
        return memory_estimator(self.kind, self.name, self.config, self.dims(), self.factory, self.memory)

    def build(self, seed: int = 0) -> nn.Module:
        """The module under test (each suite builds its own kind)."""
        raise NotImplementedError

    def check_saved_per_token(self, batch: int, inputs: Callable[[int], Tensor]) -> None:
        """The estimate's ``saved_per_token`` times the tokens of ``inputs(length)`` (``[batch, length, d_model]``)
        within ``memory_tolerance`` of the bytes autograd saves in a forward, at each of ``memory_lengths``
        (skipped when the component has no estimate)."""
        estimate = self.estimator()
        if estimate is None:
            pytest.skip(f"{self.name}: no memory estimate (the record's memory target, or the suite's memory knob)")
        module = self.build()

        def measure(length: int) -> int:
            x = inputs(length).requires_grad_(True)
            count, _ = saved_bytes(lambda: module(x, ForwardContext()), (x,), tuple(module.parameters()))
            return count

        tokens = lambda length: batch * length * estimate(length).saved_per_token  # noqa: E731
        check_saved_estimate(measure, tokens, self.memory_lengths, self.memory_tolerance, f"{self.name} saved_per_token")

    def check_temporary(self, batch: int, inputs: Callable[[int, int], Tensor]) -> None:
        """The estimate's ``temporary`` (one sequence's, times ``batch`` rows as the planner counts it) against the
        largest transient working set of one forward or backward on ``inputs(length, seed)``, at each of
        ``memory_lengths``: at least ``1 - memory_tolerance`` of it, at most ``temporary_ratio`` times it."""
        estimate = self.estimator()
        if estimate is None:
            pytest.skip(f"{self.name}: no memory estimate (the record's memory target, or the suite's memory knob)")
        module = self.build()

        def measure(length: int) -> tuple[int, str]:
            return call_transients(module, inputs(length, 1), inputs(length, 3), ForwardContext())

        check_temporary_estimate(measure, lambda length: batch * estimate(length).temporary, self.memory_lengths,
                                 self.memory_tolerance, self.temporary_ratio, f"{self.name} temporary")


def load_factory(target: str) -> Any:
    """``"package.module:attr"`` or ``"/path/to/file.py:attr"``: a builder that is not a registered plugin.

    Conformance suites use it (their ``factory`` knob) to test a module before it is packaged, and core's
    own tests use it for deliberately wrong components. A file is imported once per process under a name
    derived from its path, so multi-process suites can rebuild the component in every rank."""
    path, _, attr = target.rpartition(":")
    if not path.endswith(".py"):
        return load_target(target)
    file = Path(path).resolve()
    module_name = "megaseq_factory_" + hashlib.sha1(str(file).encode()).hexdigest()[:12]
    if module_name not in sys.modules:
        spec = importlib.util.spec_from_file_location(module_name, file)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot import {file}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        spec.loader.exec_module(module)
    obj: Any = sys.modules[module_name]
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


@contextmanager
def env(**values: str) -> Iterator[None]:
    """Set environment variables for a block (e.g. ``MEGASEQ_PLUGINS``)."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


__all__ = [
    "assert_close",
    "build_component",
    "check_deterministic",
    "check_gradients",
    "count_collective_bytes",
    "count_host_syncs",
    "env",
    "fresh_plugins",
    "installed_plugins",
    "load_factory",
    "memory_estimator",
    "registered",
    "watch_host_syncs",
]
