"""Typed records that plugins return from their registration hooks.

A record names a component and points at its factory lazily (``"module:attr"``), so listing plugins
never imports a component's implementation (and so never touches CUDA, Triton or flash-attn). The config
schema is a pydantic model: keep the module that defines it light.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Annotated, Any, ClassVar, get_args

from pydantic import AfterValidator, BaseModel, ConfigDict, model_validator
from pydantic.fields import FieldInfo

from megaseq.alphabets import ALPHABETS, DNA, Alphabet, alphabet_named


def absolute_path(value: str) -> str:
    """``value`` (``~`` expanded) made absolute against this process's working directory."""
    return str(Path(value).expanduser().absolute())


_ABSOLUTE = AfterValidator(absolute_path)
LocalPath = Annotated[str, _ABSOLUTE]
"""A config field that names a file or folder on this machine (``path: LocalPath``, ``LocalPath | None``).

A relative value, its default included, is made absolute against the working directory when the config is
validated, as it is read by the process that reads the recipe: the launcher of a distributed run hands its
workers, whose working directory may differ, the absolute path, and a checkpoint stores it."""


def _is_local_path(info: FieldInfo) -> bool:
    """Whether the field is declared a :data:`LocalPath` (also inside ``Optional``/``Annotated``)."""
    stack: list[Any] = [info.annotation]
    found = any(meta is _ABSOLUTE for meta in info.metadata)
    while stack and not found:
        annotation = stack.pop()
        found = any(meta is _ABSOLUTE for meta in getattr(annotation, "__metadata__", ()))
        stack.extend(get_args(annotation))
    return found


class ComponentConfig(BaseModel):
    """Base class of every component's config schema: unknown keys are errors, values are validated, and a
    :data:`LocalPath` field is absolute."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    @model_validator(mode="after")
    def _absolute_defaults(self) -> ComponentConfig:
        # pydantic validates given values only: a relative default would reach a worker as written and be made
        # absolute against the worker's working directory, not the launcher's
        for name, info in type(self).model_fields.items():
            value = getattr(self, name)
            if name not in self.model_fields_set and isinstance(value, str) and _is_local_path(info):
                self.__dict__[name] = absolute_path(value)  # the model is frozen; this is its own validation
        return self


class NoConfig(ComponentConfig):
    """Schema of a component that takes no options."""


@dataclass(frozen=True)
class TileCarry:
    """What a component that runs in sequence tiles (``megaseq.contracts.SequenceTiling``) hands to later
    tiles, in bytes: ``per_token`` for every token of the earlier tiles (softmax attention: its keys and
    values), ``per_tile`` once per tile boundary (linear attention: the recurrent state and the convolution's tail);
    ``temporary``: the transient working set of one tile's call beyond the component's ``temporary`` at the
    tile's length, which a tile that attends to the earlier tiles' keys adds (softmax attention: its mask)."""

    per_token: float = 0.0
    per_tile: int = 0
    temporary: int = 0


@dataclass(frozen=True)
class MemoryEstimate:
    """What one component instance costs on one device for a given sequence length, all in bytes.

    All of it is for one rank of the layout in ``dims``: its share of the experts (``ep_size``, ``etp_size``)
    and, for a component that declares ``tensor_parallel``, its block of heads or hidden width (``tp_size``),
    run over the sequence it gathers. ``parameters``: the parameters at their stored dtype;
    ``saved_per_token``: what autograd keeps alive per token (of the sequence the component runs on) between
    forward and backward, including the component's input; ``temporary``: the transient working set of one
    forward or one backward call over one sequence of ``seq_len`` tokens, whichever is larger: the most bytes
    live at once, during the call, of the buffers it allocates and frees before it returns (not its inputs,
    what autograd keeps, its output, nor the gradients it returns or accumulates into parameters, which the
    planner counts as such; several buffers alive together count together). The planner adds it beside
    everything the layers keep, so it must not fall short of the real working set (an out-of-memory step),
    and is multiplied by the sequences of a micro-batch; ``megaseq_testkit.checks.transient_bytes`` measures
    it; ``tiling``: for an attention component that declares ``sequence_tiling``
    (:data:`CAPABILITIES`), what it carries from tile to tile (required then, ignored otherwise);
    ``kept_per_token``: what the component keeps per token with ``ForwardContext.keep`` (at its own dtype, e.g.
    int32 indices) when it is recomputed, from the forward to the end of the re-run's backward. The memory
    planner (``megaseq plan``) sums these over a recipe's layers and applies the memory policies' effects to
    them, so a third-party component is planned like a built-in one.
    """

    parameters: int
    saved_per_token: float
    temporary: int = 0
    tiling: TileCarry | None = None
    kept_per_token: float = 0.0


@dataclass(frozen=True)
class MemoryEffect:
    """What a memory policy does, in the terms the memory planner models (returned by the ``memory`` target
    of a ``MemoryPolicySpec``: ``effect(config) -> MemoryEffect``).

    ``recompute``: which part of each layer keeps only its input and is re-run in backward (``"block"``,
    ``"attention"``, ``"ffn"``; ``None``: nothing); ``layers``: ``(first, stop)`` of the layers it acts on
    (``None``: all); ``tile_tokens``: with ``recompute = "block"``, the blocks run in sequence tiles of this
    many tokens where the attention can tile; ``reuses_kept``: the recomputed components' re-runs take back what
    they kept (``ForwardContext.keep``, ``MemoryEstimate.kept_per_token``), held from forward to backward;
    ``offload_min_bytes``: saved tensors of at least this size
    leave device memory between forward and backward (to pinned host memory on CUDA, to a scratch file on
    local disk on CPU); ``maps_allocations_from``: on CPU the policy serves allocations of at least this many
    bytes by their own memory maps (``megaseq.memory.heap.map_large_allocations``), so the C library's heap
    keeps none of them resident once freed. ``time_cost``: the extra step time as a fraction of a step
    without policies, which the planner uses to rank the sets that fit; ``time_costs``: the same per device kind (``"cpu"``,
    ``"cuda"``), where it differs by machine (state where each figure comes from: a measurement, a report or
    an estimate). The planner takes ``time_costs[kind]`` where given, else ``time_cost``; a calibration
    measured on the machine overrides both (``megaseq.memory.plan.plan(time_costs=...)``).
    """

    recompute: str | None = None
    layers: tuple[int, int] | None = None
    tile_tokens: int | None = None
    reuses_kept: bool = False
    offload_min_bytes: int | None = None
    maps_allocations_from: int | None = None
    time_cost: float = 0.0
    time_costs: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.recompute not in (None, "block", "attention", "ffn"):
            raise ValueError(f"MemoryEffect.recompute must be 'block', 'attention', 'ffn' or None, got {self.recompute!r}")
        if self.tile_tokens is not None and (self.recompute != "block" or self.tile_tokens < 1):
            raise ValueError("MemoryEffect.tile_tokens needs recompute = 'block' and a positive tile length")

    def acts_on(self, layer: int) -> bool:
        return self.layers is None or self.layers[0] <= layer < self.layers[1]


@dataclass(frozen=True)
class ModelDims:
    """The model-wide sizes a component is built against.

    ``ep_rank`` / ``ep_size``: this process's place in the expert-parallel group, so an MoE component
    builds only its local experts (the group itself arrives in ``ForwardContext.ep_group``).
    ``tp_rank`` / ``tp_size``: this process's place in the tensor-parallel group, so a component that
    supports tensor parallelism builds only its block of heads or hidden width (``ForwardContext.tp``) and its
    memory estimate is that block's (``MemoryEstimate``).
    ``etp_rank`` / ``etp_size``: this process's place in the expert-tensor-parallel group, so an MoE
    component builds only its block of each routed expert's hidden width (``ForwardContext.etp_group``).
    """

    d_model: int
    n_layers: int
    vocab_size: int
    ep_rank: int = 0
    ep_size: int = 1
    tp_rank: int = 0
    tp_size: int = 1
    etp_rank: int = 0
    etp_size: int = 1


def load_target(target: str) -> Any:
    """Import ``"package.module:attr"`` and return the attribute."""
    module_name, _, attr = target.partition(":")
    if not module_name or not attr:
        raise ValueError(f"target {target!r} is not of the form 'module:attr'")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


# The optional capabilities a record may declare, per kind: the one declaration that the launch, the
# planner, memory policies and the conformance suites read (``megaseq.capabilities``). A kind not listed
# declares none.
#   context_parallel  attention: runs on a zig-zag shard (``ctx.cp``); memory policy: keeps a step under
#                     context parallelism equal to the step without it (except while it tiles sequences,
#                     which needs the whole sequence)
#   sequence_tiling   attention: implements ``megaseq.contracts.SequenceTiling`` (``forward_tile``) and its
#                     ``MemoryEstimate.tiling``
#   expert_parallel   moe: builds only its ``ModelDims.ep_rank`` share of the experts, stacked along one
#                     dimension of each expert tensor, with the one-process layer's values from the same seed
#                     (drawing from the global generator what one process draws: ``check_local_experts``)
#   tensor_parallel   attention, ffn, moe: builds its ``ModelDims.tp_rank`` block of heads or hidden width (an
#                     moe: its ``ModelDims.etp_rank`` block of each expert's, with the one-process values as
#                     under expert_parallel) and runs on its sequence chunk (``ctx.tp``,
#                     ``megaseq.contracts.TensorParallel``)
#   pool_sizing       memory policy: has a ``pool_bytes`` option that the planner sets to the bytes it moves
CAPABILITIES: dict[str, frozenset[str]] = {
    "attention": frozenset({"context_parallel", "sequence_tiling", "tensor_parallel"}),
    "ffn": frozenset({"tensor_parallel"}),
    "moe": frozenset({"expert_parallel", "tensor_parallel"}),
    "memory_policy": frozenset({"context_parallel", "pool_sizing"}),
}


# What a component's ``mapping`` target must provide (``megaseq.interop.ComponentMapping``).
MAPPING_METHODS = ("config_from_hf", "config_to_hf", "tensors_from_hf", "tensors_to_hf")


def mapping_problem(mapping: Any) -> str | None:
    """Which of :data:`MAPPING_METHODS` ``mapping`` lacks, as one phrase; None when it has them all."""
    lacking = [m for m in MAPPING_METHODS if not callable(getattr(mapping, m, None))]
    return f"lacks {', '.join(lacking)}" if lacking else None


@dataclass(frozen=True)
class Record:
    """What every registration hook returns: a name and a lazy ``"module:attr"`` target, imported only
    when used (listing plugins never imports it), and a one-line ``summary`` for listings."""

    kind: ClassVar[str] = ""
    name: str
    target: str
    summary: str = ""

    def __post_init__(self) -> None:
        if not self.name or not self.name.replace("-", "_").replace(".", "_").isidentifier():
            raise ValueError(f"{self.kind} name {self.name!r} must be a non-empty identifier (letters, digits, -, _)")
        if ":" not in self.target:
            raise ValueError(f"{self.kind} {self.name!r}: target {self.target!r} is not 'module:attr'")

    def targets(self) -> dict[str, str]:
        """``{field: "module:attr"}`` of every target the record names (checked at discovery)."""
        return {"target": self.target}

    def load(self) -> Any:
        return load_target(self.target)

    def loaded_problem(self, field_name: str, obj: Any) -> str | None:
        """Why ``obj``, the loaded target of ``field_name``, is not what the record promises (``megaseq
        plugins --check``); None when it is."""
        return None if callable(obj) else f"{type(obj).__name__} is not callable"


def _replaced_key_problem(key: str, config_field: str, config: type[ComponentConfig]) -> str | None:
    """Why ``Component.replaces`` may not map ``key`` to ``config_field``; None when it may."""
    from megaseq.config import CORE_TABLES, is_recipe_key  # config imports this module: only once records are made

    table, _, name = key.partition(".")
    if table not in CORE_TABLES or not name.isidentifier():
        return f"not 'TABLE.KEY' with TABLE one of core's recipe tables ({', '.join(CORE_TABLES)})"
    if is_recipe_key(table, name):
        return "it is a current recipe key"
    if config_field not in config.model_fields:
        return f"its config has no field {config_field!r} (fields: {', '.join(config.model_fields) or 'none'})"
    return None


@dataclass(frozen=True)
class Component(Record):
    """A named, configurable building block provided by a plugin.

    ``target`` resolves to ``build(config, dims, layer_idx) -> torch.nn.Module`` for model components, or to
    ``build(config) -> object`` for the other kinds. ``memory`` optionally resolves, for the memory planner,
    to ``estimate(config, dims, seq_len) -> MemoryEstimate`` (model components) or to
    ``effect(config) -> MemoryEffect`` (memory policies). ``capabilities``: the optional capabilities it
    has, from :data:`CAPABILITIES` for its kind; its conformance suite verifies each one it declares.
    ``mapping`` optionally resolves to the component's Hugging Face name and layout mapping (an object with
    :data:`MAPPING_METHODS`, ``megaseq.interop.ComponentMapping``) for the published layouts that know the
    component, which ``megaseq import`` and ``megaseq export`` use. A layout may carry the mapping of a
    component that does not know it (``megaseq.interop.layouts.Layout.mappings``), and that one is used
    instead; a component mapped by neither is refused there in one line. ``megaseq_testkit.hf`` checks it.
    ``replaces``: keys of core's recipe tables that this component took over, ``{"TABLE.KEY": FIELD}``: a
    stored recipe (a checkpoint's) holding ``TABLE.KEY = V`` reads as selecting this component with ``FIELD =
    V`` in its section, and a recipe file holding it is refused in one line that says so
    (``megaseq.config.stored_recipe``). ``FIELD`` is a field of ``config``; ``TABLE.KEY`` is no current key.
    """

    config: type[ComponentConfig] = NoConfig
    memory: str | None = None
    capabilities: frozenset[str] = frozenset()
    mapping: str | None = None
    replaces: Mapping[str, str] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not (isinstance(self.config, type) and issubclass(self.config, ComponentConfig)):
            raise ValueError(f"{self.kind} {self.name!r}: config must be a megaseq.records.ComponentConfig subclass")
        object.__setattr__(self, "capabilities", frozenset(self.capabilities))
        object.__setattr__(self, "replaces", MappingProxyType(dict(self.replaces)))
        allowed = CAPABILITIES.get(self.kind, frozenset())
        unknown = sorted(self.capabilities - allowed)
        if unknown:
            raise ValueError(f"{self.kind} {self.name!r}: capabilities {unknown} are not among those of kind "
                             f"{self.kind!r}: {sorted(allowed) or 'none'}")
        if "pool_sizing" in self.capabilities and "pool_bytes" not in self.config.model_fields:
            raise ValueError(f"{self.kind} {self.name!r} declares pool_sizing but its config has no pool_bytes field")
        for key, config_field in self.replaces.items():
            problem = _replaced_key_problem(key, config_field, self.config)
            if problem:
                raise ValueError(f"{self.kind} {self.name!r}: replaces {key!r}: {problem}")

    def targets(self) -> dict[str, str]:
        optional = {"memory": self.memory, "mapping": self.mapping}
        return {"target": self.target, **{k: v for k, v in optional.items() if v}}

    def loaded_problem(self, field_name: str, obj: Any) -> str | None:
        if field_name == "mapping":
            return mapping_problem(obj)
        return super().loaded_problem(field_name, obj)

    def load_memory(self) -> Any | None:
        return load_target(self.memory) if self.memory else None

    def load_mapping(self) -> Any | None:
        return load_target(self.mapping) if self.mapping else None


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
    """A memory policy (activation recomputation, offloading of saved tensors, ...): see
    ``megaseq.contracts.MemoryPolicy``.

    ``presets``: configs (partial tables of ``[memory_policy.NAME]``) that ``megaseq plan`` and
    ``train.memory_policy = "auto"`` may choose from, each modelled through the ``memory`` target's
    ``effect(config)``. A policy that moves saved tensors to host memory may declare ``pool_sizing``: the
    planner then sets its ``pool_bytes`` option to the bytes it predicts the policy moves per step.
    """

    kind: ClassVar[str] = "memory_policy"
    presets: tuple[dict[str, Any], ...] = field(default=(), compare=False, hash=False)


@dataclass(frozen=True)
class RLAlgorithmSpec(Component):
    """An RL objective (a policy gradient over groups of completions): see ``megaseq.contracts.RLAlgorithm``."""

    kind: ClassVar[str] = "rl_algorithm"


@dataclass(frozen=True)
class InferenceEngineSpec(Component):
    """An inference engine (generate with log-probabilities, score, take new weights): see
    ``megaseq.inference.InferenceEngine``. ``target`` resolves to ``build(config, recipe, plugins)``: the
    engine for the model ``recipe`` describes, its components built through ``plugins``."""

    kind: ClassVar[str] = "inference_engine"


@dataclass(frozen=True)
class CommandSpec(Record):
    """A subcommand of the ``megaseq`` command line. ``target`` resolves to ``main(argv: list[str]) -> int``,
    called with the arguments after the command's name; ``summary`` is its line in ``megaseq --help``.
    Its module is imported only when the command runs."""

    kind: ClassVar[str] = "command"


PARTS = ("train", "heldout")  # the parts of a data source that declares ``parts`` (``FetchRequest.part``)


@dataclass(frozen=True)
class FetchRequest:
    """What a data source's ``fetch`` target is asked for: the corpus of the record ``name`` (one function may
    serve several records) configured by ``config`` (its ``[data_source.NAME]`` section, validated by the
    record's ``config`` schema; the schema's defaults where the recipe has none), obtained into
    ``cache_dir / name``; ``part``: ``"train"`` or ``"heldout"`` for a record that declares ``parts`` (the part
    of its corpus the recipe reads there: the two must share no record), ``None`` otherwise."""

    name: str
    config: ComponentConfig
    cache_dir: Path
    part: str | None = None


@dataclass(frozen=True)
class DataSourceSpec(Record):
    """A named corpus that ``data.train`` / ``data.heldout`` (and ``megaseq data fetch NAME``) can name.

    ``target`` resolves to ``fetch(request: FetchRequest) -> Path``: the local path of the corpus as one FASTA
    file (plain or gzip), obtained into ``request.cache_dir / request.name`` first if needed and reused after
    (a second fetch of the same request returns the same file, not rewritten). ``config``: the schema of its
    ``[data_source.NAME]`` recipe section (a ``ComponentConfig``; ``NoConfig``: it takes none), so one record
    serves any number of user files. ``alphabet``: what its letters are (a ``megaseq.alphabets.Alphabet`` or the name of one of core's;
    DNA by default);
    core tokenises the file in it and sizes the model's vocabulary from it. ``parts``: the source splits its
    corpus into a training and a held-out part, and ``request.part`` says which one to return (a recipe may
    then name it as both ``data.train`` and ``data.heldout``); without parts it is one corpus, which a recipe
    may not name as both.

    ``bases`` and ``n_bases``, checked when the file is tokenised (``None``: not checked; a source whose
    corpus depends on its config cannot know them and leaves them ``None``): ``bases`` counts every letter of
    the sequence lines of all its records together, the unknown symbol (N) and ambiguity codes included;
    ``n_bases`` counts those of them that are the unknown symbol after tokenising (N and ambiguity codes).
    Neither counts the one N that core puts between two records when it joins them into one token stream
    (``megaseq.data.token_metadata``'s ``separators``). ``summary`` is its line in ``megaseq data list``."""

    kind: ClassVar[str] = "data_source"
    config: type[ComponentConfig] = NoConfig
    alphabet: Alphabet = DNA
    parts: bool = False
    bases: int | None = None
    n_bases: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if not (isinstance(self.config, type) and issubclass(self.config, ComponentConfig)):
            raise ValueError(f"data_source {self.name!r}: config must be a megaseq.records.ComponentConfig subclass")
        if not isinstance(self.alphabet, Alphabet | str):
            raise ValueError(f"data_source {self.name!r}: alphabet must be a megaseq.alphabets.Alphabet or the name of "
                             f"one of core's ({', '.join(ALPHABETS)}); got {self.alphabet!r}")
        object.__setattr__(self, "alphabet", alphabet_named(self.alphabet, f"data_source {self.name!r}"))
        for field_name in ("bases", "n_bases"):
            value = getattr(self, field_name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
                raise ValueError(f"data_source {self.name!r}: {field_name} must be None or a count >= 0, got {value!r}")
        if self.bases is not None and self.n_bases is not None and self.n_bases > self.bases:
            raise ValueError(f"data_source {self.name!r}: n_bases {self.n_bases:,} exceeds bases {self.bases:,}")


def _check_alphabets(record: Record, alphabets: frozenset[str]) -> frozenset[str]:
    alphabets = frozenset(alphabets)
    if not alphabets or not all(isinstance(a, str) and a for a in alphabets):
        raise ValueError(f"{record.kind} {record.name!r}: alphabets must name the alphabets it handles, e.g. "
                         "frozenset({'dna'})")
    return alphabets


@dataclass(frozen=True)
class BaselineSpec(Component):
    """A reference predictor scored beside the model (``eval.baselines``, configured in
    ``[baseline.NAME]``): see ``megaseq.contracts.Baseline``. ``target`` resolves to
    ``build(config, train: megaseq.data.Corpus) -> Baseline``. ``alphabets``: the names of the alphabets
    (``megaseq.alphabets``) it can score; a recipe whose data is in another is refused in one line."""

    kind: ClassVar[str] = "baseline"
    alphabets: frozenset[str] = frozenset({"dna"})

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "alphabets", _check_alphabets(self, self.alphabets))


@dataclass(frozen=True)
class EvalAnalysisSpec(Component):
    """An analysis of every scorer's per-target losses on the held-out windows (``eval.analyses``, configured
    in ``[eval_analysis.NAME]``): see ``megaseq.contracts.EvalAnalysis``. ``target`` resolves to
    ``build(config, info: megaseq.contracts.EvalInfo) -> EvalAnalysis``. ``alphabets``: the names of the
    alphabets (``megaseq.alphabets``) it can analyse; a recipe whose data is in another is refused in one line."""

    kind: ClassVar[str] = "eval_analysis"
    alphabets: frozenset[str] = frozenset({"dna"})

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "alphabets", _check_alphabets(self, self.alphabets))


@dataclass(frozen=True)
class HFLayoutSpec(Record):
    """A published Hugging Face model layout (a model family's tensor names and ``config.json``), which
    ``megaseq import`` reads and ``megaseq export --layout NAME`` writes. ``target`` resolves to a
    ``megaseq.interop.layouts.Layout``: the model-level tensor names and config fields, which component each
    layer is, and the mappings of the components it uses that do not map themselves to it.
    ``model_type``: the ``config.json`` ``model_type`` of the layout's models (how ``megaseq import``
    recognises them without loading any layout). ``default``: ``megaseq export`` writes this layout when
    ``--layout`` is not given, provided no other installed layout declares the same."""

    kind: ClassVar[str] = "hf_layout"
    model_type: str = ""
    default: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.model_type:
            raise ValueError(f"hf_layout {self.name!r}: model_type (config.json's) must be given")

    def loaded_problem(self, field_name: str, obj: Any) -> str | None:
        from megaseq.interop.layouts import Layout  # the check imports the target anyway

        if not isinstance(obj, Layout):
            return f"{type(obj).__name__} is not a megaseq.interop.layouts.Layout"
        for (kind, name), mapping in obj.mappings.items():
            problem = mapping_problem(mapping)
            if problem:
                return f"its mapping of {kind} {name!r} {problem}"
        return None


@dataclass(frozen=True)
class DataTransformSpec(Component):
    """A change made to every training micro-batch (``data.transforms``, applied in order, each configured in
    ``[data_transform.NAME]``): see ``megaseq.contracts.DataTransform``. ``target`` resolves to
    ``build(config) -> DataTransform``. ``changes_distribution`` (required): whether the transformed windows
    are drawn from another distribution than the data's (planted repeats do; the reverse complement of DNA,
    the genome's other strand, does not); the run header says it beside each transform."""

    kind: ClassVar[str] = "data_transform"
    changes_distribution: bool | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.changes_distribution, bool):
            raise ValueError(f"data_transform {self.name!r}: declare changes_distribution = True or False (whether "
                             "the transformed windows are drawn from another distribution than the data's)")


SPEC_TYPES: dict[str, type[Record]] = {
    cls.kind: cls
    for cls in (
        AttentionSpec, FFNSpec, MoESpec, MemoryPolicySpec, RLAlgorithmSpec, InferenceEngineSpec, CommandSpec,
        DataSourceSpec, BaselineSpec, EvalAnalysisSpec, HFLayoutSpec, DataTransformSpec,
    )
}
