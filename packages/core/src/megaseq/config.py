"""Recipes: TOML files that compose a run from components, validated before anything is built.

Sections: ``[run]``, ``[data]``, ``[model]``, ``[train]``, ``[eval]``, ``[parallel]``, and one section per component used,
``[attention.NAME]``, ``[ffn.NAME]``, ``[moe.NAME]``, ``[memory_policy.NAME]``, ``[baseline.NAME]``,
``[eval_analysis.NAME]``, ``[data_transform.NAME]``, ``[data_source.NAME]`` (a data source that ``data.train`` or ``data.heldout`` names),
validated by that component's own schema. Every mistake is one line naming the file, the key path and what is
allowed.

The data's alphabet (what its data source declares, DNA for a FASTA path) is the recipe's
(:attr:`Recipe.alphabet`): ``data.train`` and ``data.heldout`` must share it, ``model.vocab_size`` defaults to
its size, and every baseline and eval analysis used must declare that it handles it.
"""

from __future__ import annotations

import copy
import itertools
import json
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, model_validator

from megaseq.alphabets import DNA, Alphabet
from megaseq.errors import ConfigError
from megaseq.plugins import Plugins, Provided
from megaseq.records import ComponentConfig

MAX_SEQ_LEN = 2**30  # beyond any memory; a bound keeps a typo from reaching the planner's arithmetic
CORE_TABLES = ("run", "data", "model", "train", "eval", "parallel")
COMPONENT_SECTIONS = {
    "attention": "attention", "ffn": "ffn", "moe": "moe", "memory_policy": "memory_policy", "baseline": "baseline",
    "eval_analysis": "eval_analysis", "data_source": "data_source", "data_transform": "data_transform",
}


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class RunConfig(Section):
    name: str = "run"
    seed: int = 0
    out_dir: str = Field("runs/{name}", description="'{name}' is replaced by run.name")
    device: Literal["auto", "cpu", "cuda"] = "auto"
    trim_heap: bool | Literal["auto"] = Field(
        "auto",
        description="on CPU with glibc: give the heap's freed pages back at every block boundary of forward and "
        "backward, so peak RSS follows live memory; auto: from 32,768 tokens per device (megaseq/memory/heap.py)",
    )

    @property
    def out_path(self) -> Path:
        """The run directory: ``out_dir`` with ``{name}`` replaced by ``name``."""
        return Path(self.out_dir.replace("{name}", self.name))


class LengthStage(Section):
    """One stage of a window-length schedule (``data.schedule``): windows of ``seq_len`` bases until a step or
    a number of tokens seen (one of the two)."""

    seq_len: int = Field(ge=2, description="bases per training window in this stage; divides data.seq_len")
    until_step: int | None = Field(None, ge=1, description="the last step of the stage")
    until_tokens: int | None = Field(None, ge=1, description="the stage runs while fewer tokens than this were seen")

    @model_validator(mode="after")
    def _one_end(self) -> LengthStage:
        if (self.until_step is None) == (self.until_tokens is None):
            raise ValueError("a stage ends at until_step or at until_tokens: give exactly one")
        return self


class DataConfig(Section):
    train: str = Field("excerpt-chr20", description="dataset name (megaseq data list) or FASTA path")
    heldout: str = Field("excerpt-chrX", description="dataset name or FASTA path")
    seq_len: int = Field(1024, ge=2, le=MAX_SEQ_LEN, description="bases per training window")
    max_n_fraction: float = Field(0.5, ge=0, le=1, description="skip windows with more N than this")
    softmask_weight: float = Field(1.0, ge=0, le=1, description="loss weight of soft-masked (lower-case) bases")
    token_ids: list[int] | None = Field(
        None,
        min_length=5,
        max_length=5,
        description="the model's token ids of A, C, G, T, N (an imported model's tokenizer; megaseq import writes "
        "them); None: megaseq's own vocabulary, 0..4",
    )
    schedule: list[LengthStage] = Field(
        [],
        description="a window-length curriculum: stages of shorter windows before data.seq_len, e.g. [{seq_len = 128, "
        "until_step = 500}, {seq_len = 1024, until_tokens = 4e6}]; each step reads the same data.seq_len windows, "
        "cut into stage-length windows (the same tokens per step, more rows); after the last stage, data.seq_len",
    )
    transforms: list[str] = Field(
        [],
        description="data transforms (megaseq plugins lists them) applied in order to every training micro-batch "
        "after the schedule's cut, never to held-out windows, each configured in [data_transform.NAME]",
    )

    @model_validator(mode="after")
    def _distinct_ids(self) -> DataConfig:
        if self.token_ids is not None and (len(set(self.token_ids)) != 5 or min(self.token_ids) < 0):
            raise ValueError(f"token_ids must be 5 distinct ids >= 0, got {self.token_ids}")
        return self

    @model_validator(mode="after")
    def _transforms_once(self) -> DataConfig:
        for i, name in enumerate(self.transforms):
            if name in self.transforms[:i]:
                raise ValueError(f"transforms[{i}] {name!r} is already transforms[{self.transforms.index(name)}]: each "
                                 "transform is applied once, configured in its one [data_transform.NAME]")
        return self

    @model_validator(mode="after")
    def _schedule(self) -> DataConfig:
        for i, stage in enumerate(self.schedule):
            if stage.seq_len >= self.seq_len or self.seq_len % stage.seq_len:
                raise ValueError(f"schedule[{i}].seq_len {stage.seq_len} must divide data.seq_len {self.seq_len} and be "
                                 "shorter (a stage cuts each window into shorter ones)")
        for key in ("until_step", "until_tokens"):
            ends = [(i, getattr(s, key)) for i, s in enumerate(self.schedule) if getattr(s, key) is not None]
            for (_, a), (i, b) in itertools.pairwise(ends):
                if b <= a:
                    raise ValueError(f"schedule[{i}].{key} {b} must be later than the stage before it ({a})")
        return self

    def lengths(self) -> list[int]:
        """Every window length training uses: the stages' and ``seq_len``."""
        return [*(s.seq_len for s in self.schedule), self.seq_len]

    def length_at(self, step: int, tokens: int) -> int:
        """The window length of the step after ``step`` completed steps that saw ``tokens`` tokens."""
        for stage in self.schedule:
            if (stage.until_step is not None and step < stage.until_step) or (
                stage.until_tokens is not None and tokens < stage.until_tokens
            ):
                return stage.seq_len
        return self.seq_len


class ModelConfig(Section):
    d_model: int = Field(128, ge=1)
    n_layers: int = Field(4, ge=1)
    layer_pattern: list[str] = Field(["sdpa"], min_length=1, description="attention names, repeated over layers")
    ffn: str = "swiglu"
    moe: str | None = Field(None, description="MoE strategy for layers after the first dense_layers")
    dense_layers: int = Field(0, ge=0, description="with moe: the first N layers use the dense ffn")
    norm: Literal["rmsnorm", "layernorm"] = "rmsnorm"
    norm_eps: float = Field(1e-6, gt=0)
    vocab_size: int = Field(
        5, ge=2, description="tokens the model predicts; default: the size of the data's alphabet (5 for DNA: A C G T N)"
    )
    tie_embeddings: bool = True
    residual_dtype: Literal["fp32", "bf16"] = Field(
        "fp32",
        description="the residual stream between blocks (and so the block inputs that recomputation keeps and "
        "offloading moves) under train.bf16; bf16 halves those bytes, as megatron does by default",
    )

    @model_validator(mode="after")
    def _dense_layers(self) -> ModelConfig:
        if self.moe is None and self.dense_layers:
            raise ValueError("dense_layers is only meaningful with moe set")
        if self.dense_layers > self.n_layers:
            raise ValueError(f"dense_layers ({self.dense_layers}) exceeds n_layers ({self.n_layers})")
        return self

    def attention_of(self, layer: int) -> str:
        return self.layer_pattern[layer % len(self.layer_pattern)]

    def ffn_of(self, layer: int) -> tuple[str, str]:
        """``(kind, name)`` of the feed-forward block of ``layer``."""
        if self.moe is not None and layer >= self.dense_layers:
            return "moe", self.moe
        return "ffn", self.ffn


class TrainConfig(Section):
    steps: int = Field(200, ge=1)
    batch_size: int = Field(
        8, ge=1, description="windows per micro-batch, over all data-parallel ranks (each reads its share)"
    )
    grad_accum: int = Field(1, ge=1)
    lr: float = Field(3e-3, gt=0)
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="cosine floor as a fraction of lr")
    warmup_steps: int = Field(20, ge=0)
    weight_decay: float = Field(0.1, ge=0)
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = Field(
        1.0, ge=0, description="max global grad norm, applied before every optimizer update; 0 disables clipping"
    )
    bf16: bool = Field(False, description="bf16 autocast for the forward (weights and optimizer stay fp32)")
    optimizer_state: Literal["device", "host"] = Field(
        "device",
        description="where AdamW's moments (and fp32 master weights of parameters that are not fp32) live and the "
        "update runs: beside the parameters, or in host memory on the CPU (megaseq.train.optimizer.HostAdamW); on a "
        "CPU run the same memory either way",
    )
    optimizer_shard: bool = Field(
        False,
        description="ZeRO-1: each of the dp x cp ranks keeps and updates the optimizer state of its share of the "
        "parameters (torch ZeroRedundancyOptimizer); checkpointed per rank, resumable under any layout; not with "
        "parallel.ep > 1",
    )
    loss_chunk: int = Field(4096, ge=1, description="tokens per chunk of the LM-head + loss computation")
    log_every: int = Field(10, ge=1)
    eval_every: int = Field(0, ge=0, description="steps between held-out evals during training; 0 = only at the end")
    checkpoint_every: int = Field(0, ge=0, description="steps between checkpoints; 0 = only at the end")
    keep_checkpoints: int = Field(2, ge=0, description="newest checkpoints kept, older ones deleted; 0 = keep all")
    memory_policy: list[str] | Literal["auto"] = Field(
        [],
        description="memory policies applied in order, each configured in [memory_policy.NAME]; 'auto': the set "
        "`megaseq plan` proposes for this recipe and machine",
    )
    on_nonfinite: Literal["stop", "skip"] = Field(
        "stop",
        description="when the loss, an auxiliary loss or the gradient norm is not finite: stop before the update, "
        "or skip the update (weights and optimizer state untouched) and go on",
    )
    init_from: str | None = Field(
        None,
        description="start step 0 from the weights of this run directory (its newest good checkpoint, e.g. one "
        "megaseq import wrote) or checkpoint; the model must have the same shapes",
    )
    trainable: list[str] | None = Field(
        None, description="glob patterns of parameter names to train, the rest frozen (e.g. an indexer's warm-up: ['*.indexer.*']); None = all"
    )


class EvalConfig(Section):
    windows: int = Field(64, ge=1, description="held-out windows scored")
    batch_size: int = Field(8, ge=1)
    baselines: list[str] = Field(
        [], description="baselines scored beside the model (megaseq plugins lists them), each configured in [baseline.NAME]"
    )
    first_bucket: int = Field(1024, ge=1, description="end of the first context-position bucket")
    analyses: list[str] = Field(
        [], description="analyses of every scorer's per-target losses, reported with the baselines (megaseq plugins "
        "lists them), each configured in [eval_analysis.NAME]"
    )


class ParallelConfig(Section):
    """The process layout (``megaseq.distributed.layout``): workers = dp x cp x tp; ep x etp divides the workers."""

    dp: int = Field(1, ge=1, description="data-parallel replicas, each reading its share of train.batch_size")
    cp: int = Field(1, ge=1, description="context-parallel ranks sharing each window (zig-zag shards)")
    ep: int = Field(1, ge=1, description="expert-parallel ranks sharing each MoE layer's experts")
    tp: int = Field(1, ge=1, description="tensor-parallel ranks splitting heads, hidden widths and the vocabulary "
                    "(with sequence parallelism between those regions)")
    etp: int = Field(1, ge=1, description="expert-tensor-parallel ranks splitting each routed expert's hidden width")


class Recipe(Section):
    """A validated recipe. ``components[kind][name]`` holds each used component's validated config."""

    run: RunConfig = RunConfig()
    data: DataConfig = DataConfig()
    model: ModelConfig = ModelConfig()
    train: TrainConfig = TrainConfig()
    eval: EvalConfig = EvalConfig()
    parallel: ParallelConfig = ParallelConfig()
    components: dict[str, dict[str, Any]] = Field(default_factory=dict)
    source: str = "<recipe>"
    _alphabet: Alphabet = PrivateAttr(DNA)

    def component(self, kind: str, name: str) -> ComponentConfig:
        return self.components[kind][name]

    @property
    def alphabet(self) -> Alphabet:
        """The alphabet of ``data.train`` and ``data.heldout`` (``megaseq.alphabets``), set by validation."""
        return self._alphabet

    def corpus(self, which: str, plugins: Plugins | None = None) -> Any:
        """``data.train`` or ``data.heldout`` (``which``: "train" / "heldout") as a ``megaseq.data.Corpus``: the
        name with its ``[data_source.NAME]`` config and the part read, or the FASTA path."""
        from megaseq.data.sources import Corpus

        spec = getattr(self.data, which)
        return Corpus(spec, self.components.get("data_source", {}).get(spec), which, plugins)

    @property
    def out_dir(self) -> Path:
        return self.run.out_path

    def to_dict(self) -> dict[str, Any]:
        """The recipe as TOML-shaped data (what ``load_recipe`` accepts); stored in every checkpoint."""
        raw = self.model_dump(mode="json", exclude={"components", "source"})
        sections = {kind: {} for kind in COMPONENT_SECTIONS}
        for section, kind in COMPONENT_SECTIONS.items():
            for name, cfg in self.components.get(kind, {}).items():
                sections[section][name] = cfg.model_dump(mode="json")
        raw.update({k: v for k, v in sections.items() if v})
        return raw


def _format_loc(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _validation_message(source: str, prefix: str, exc: ValidationError) -> str:
    err = exc.errors()[0]
    key = ".".join(p for p in (prefix, _format_loc(tuple(err["loc"]))) if p)
    msg = err["msg"]
    if err["type"] == "extra_forbidden":
        msg = "unknown key"
    more = f" (and {len(exc.errors()) - 1} more)" if len(exc.errors()) > 1 else ""
    got = f" (got {err['input']!r})" if err["type"] not in ("extra_forbidden", "missing") else ""
    return f"{source}: {key}: {msg}{got}{more}"


def _allowed_keys(model: type[BaseModel]) -> str:
    return ", ".join(model.model_fields)


def parse_override(item: str) -> tuple[list[str], Any]:
    """``"train.lr=1e-3"`` -> ``(["train", "lr"], 0.001)``; the value is read as TOML, else as a string."""
    key, sep, value = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set {item!r}: expected KEY.PATH=VALUE, e.g. --set train.lr=1e-3")
    try:
        parsed = tomllib.loads(f"v = {value}")["v"]
    except tomllib.TOMLDecodeError:
        parsed = value
    return key.strip().split("."), parsed


# the keys that select components, and the section each selects from
SELECTION_KEYS = {
    ("model", "layer_pattern"): "attention", ("model", "ffn"): "ffn", ("model", "moe"): "moe",
    ("train", "memory_policy"): "memory_policy", ("eval", "baselines"): "baseline", ("eval", "analyses"): "eval_analysis",
    ("data", "train"): "data_source", ("data", "heldout"): "data_source",
    ("data", "transforms"): "data_transform",
}


def _selected(raw: dict[str, Any], table: str, key: str, section: str) -> set[str]:
    """The component names ``raw``'s ``table.key`` selects (its schema default when it is not given)."""
    node = raw.get(table)
    if isinstance(node, dict) and key in node:
        value = node[key]
    else:
        value = getattr(Recipe.model_fields[table].default, key)
    if value == "auto":  # train.memory_policy: the planner may start from any configured policy
        tables = raw.get(section)
        return set(tables) if isinstance(tables, dict) else set()
    if isinstance(value, str):
        return {value}
    return {v for v in value if isinstance(v, str)} if isinstance(value, list) else set()


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """``raw`` with each ``--set KEY.PATH=VALUE`` applied. A ``--set`` that takes a component out of its
    selection (``SELECTION_KEYS``: ``eval.baselines = []`` drops every baseline) also removes the recipe's
    ``[SECTION.NAME]`` table of it, unless a ``--set`` configures that table: deselecting is how a recipe's
    component is turned off from the command line."""
    out = copy.deepcopy(raw)
    touched: set[tuple[str, ...]] = set()
    for item in overrides:
        path, value = parse_override(item)
        touched.add(tuple(path[:2]))
        node = out
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--set {item!r}: {part!r} is not a table")
        node[path[-1]] = value
    for section in set(SELECTION_KEYS.values()):
        tables = out.get(section)
        if not isinstance(tables, dict) or not overrides:
            continue
        # a section stays while any of its selection keys still selects it (data.train or data.heldout)
        keys = [table_key for table_key, selected in SELECTION_KEYS.items() if selected == section]
        before = set().union(*(_selected(raw, table, key, section) for table, key in keys))
        after = set().union(*(_selected(out, table, key, section) for table, key in keys))
        for name in before - after:
            if name in tables and (section, name) not in touched and (section,) not in touched:
                del tables[name]
    return out


def is_recipe_key(table: str, key: str) -> bool:
    """Whether ``table.key`` is a key of core's recipe schema (``table`` one of :data:`CORE_TABLES`)."""
    section = Recipe.model_fields.get(table)
    return section is not None and table in CORE_TABLES and key in section.annotation.model_fields


def replaced_keys(plugins: Plugins) -> dict[tuple[str, str], list[tuple[Provided, str]]]:
    """``(table, key) -> [(component, its config field)]``: the keys of core's tables that installed
    components replace (``megaseq.records.Component.replaces``)."""
    found: dict[tuple[str, str], list[tuple[Provided, str]]] = {}
    for kind in COMPONENT_SECTIONS.values():
        for provided in plugins.registry[kind].values():
            for key, config_field in getattr(provided.spec, "replaces", {}).items():  # a data source replaces none
                table, _, name = key.partition(".")
                found.setdefault((table, name), []).append((provided, config_field))
    return found


def _held(raw: dict[str, Any], plugins: Plugins, source: str) -> list[tuple[str, str, Provided, str]]:
    """``(table, key, component, field)`` of each replaced key ``raw`` holds (two replacers: one line)."""
    held = []
    for (table, key), replacers in replaced_keys(plugins).items():
        if not (isinstance(raw.get(table), dict) and key in raw[table]):
            continue
        if len(replacers) > 1:
            named = " and ".join(sorted(f"{p.spec.kind} {p.spec.name!r} ({p.plugin.label.strip()})" for p, _ in replacers))
            raise ConfigError(f"{source}: {table}.{key}: replaced by both {named}; uninstall all but one or set MEGASEQ_PLUGINS")
        held.append((table, key, *replacers[0]))
    return held


def _selection_of(kind: str) -> tuple[str, str]:
    return next(path for path, section in SELECTION_KEYS.items() if section == kind)


def stored_recipe(raw: dict[str, Any], plugins: Plugins, source: str = "<recipe>") -> dict[str, Any]:
    """A recipe as a checkpoint's ``meta.json`` may hold it, in the current keys: a key of core's tables that an
    installed component replaces (``Component.replaces``, ``{"TABLE.KEY": FIELD}``) becomes that component's
    selection (its name joins a list selection, or becomes a single one) with ``FIELD`` set to the key's
    value in its section, so that checkpoints written before the component took the key over still evaluate,
    resume and compare. ``raw`` is left as it was."""
    held = _held(raw, plugins, source)
    if not held:
        return raw
    raw = copy.deepcopy(raw)
    for table, key, provided, config_field in held:
        value = raw[table].pop(key)
        kind, name = provided.spec.kind, provided.spec.name
        if kind not in SELECTION_KEYS.values():
            raise ConfigError(f"{source}: {table}.{key}: replaced by {kind} {name!r} ({provided.plugin.label.strip()}), "
                              f"which a recipe cannot select")
        sel_table, sel_key = _selection_of(kind)
        node = raw.setdefault(sel_table, {})
        chosen = node.get(sel_key, getattr(Recipe.model_fields[sel_table].default, sel_key))
        if isinstance(chosen, list):
            node[sel_key] = chosen if name in chosen else [*chosen, name]
        elif chosen != "auto":  # auto: the planner starts from every configured policy, this one included
            if sel_key in node and chosen not in (None, name):
                raise ConfigError(f"{source}: {table}.{key} selects {kind} {name!r}, but {sel_table}.{sel_key} = {chosen!r}")
            node[sel_key] = name
        section = raw.setdefault(COMPONENT_SECTIONS[kind], {}).setdefault(name, {})
        if config_field in section and section[config_field] != value:
            raise ConfigError(f"{source}: {table}.{key} = {value!r} disagrees with {kind}.{name}.{config_field} = "
                              f"{section[config_field]!r}")
        section[config_field] = value
    return raw


def refuse_replaced_keys(raw: dict[str, Any], plugins: Plugins, source: str) -> None:
    """A recipe file (and its ``--set``) holds only current keys: a replaced one is one line saying what to
    write instead."""
    for table, key, provided, config_field in _held(raw, plugins, source):
        kind, name = provided.spec.kind, provided.spec.name
        value = raw[table][key]
        if kind in SELECTION_KEYS.values():
            sel_table, sel_key = _selection_of(kind)
            is_list = isinstance(getattr(Recipe.model_fields[sel_table].default, sel_key), list)
            select = f'add "{name}" to {sel_table}.{sel_key}' if is_list else f'set {sel_table}.{sel_key} = "{name}"'
            instead = f"{select} and {config_field} = {json.dumps(value)} in [{COMPONENT_SECTIONS[kind]}.{name}]"
        else:
            instead = f"set {config_field} = {json.dumps(value)} in [{COMPONENT_SECTIONS[kind]}.{name}]"
        raise ConfigError(f"{source}: {table}.{key}: not a recipe key; {kind} {name!r} ({provided.plugin.label.strip()}) "
                          f"replaces it: {instead}")


def validate_recipe(raw: dict[str, Any], plugins: Plugins, source: str = "<recipe>") -> Recipe:
    """Validate TOML-shaped data against core's schema and each used component's schema. Keys that installed
    components replace are read in the current keys (:func:`stored_recipe`): a checkpoint's recipe may hold
    them; :func:`load_recipe` refuses them in a recipe file."""
    raw = dict(stored_recipe(raw, plugins, source))
    component_raw = {section: raw.pop(section, {}) for section in COMPONENT_SECTIONS}
    try:
        recipe = Recipe(**raw, source=source)
    except ValidationError as exc:
        err = exc.errors()[0]
        top = err["loc"][0] if err["loc"] else ""
        if err["type"] == "extra_forbidden" and len(err["loc"]) == 1:
            allowed = ", ".join([*CORE_TABLES, *COMPONENT_SECTIONS])
            raise ConfigError(f"{source}: [{top}]: unknown section; allowed: {allowed}") from None
        msg = _validation_message(source, "", exc)
        section = Recipe.model_fields.get(str(top))
        if err["type"] == "extra_forbidden" and section is not None and isinstance(section.annotation, type):
            msg += f"; allowed: {_allowed_keys(section.annotation)}"
        raise ConfigError(msg) from None
    except TypeError as exc:  # e.g. a section that is not a table
        raise ConfigError(f"{source}: {exc}") from None
    if recipe.model.residual_dtype == "bf16" and not recipe.train.bf16:
        raise ConfigError(f"{source}: model.residual_dtype: 'bf16' needs train.bf16 = true (the forward in bf16 "
                          "autocast); allowed without it: 'fp32'")

    model = recipe.model
    ids = recipe.data.token_ids
    if ids is not None and max(ids) >= model.vocab_size:
        raise ConfigError(f"{source}: data.token_ids: id {max(ids)} is beyond model.vocab_size {model.vocab_size}")
    used: dict[str, set[str]] = {kind: set() for kind in COMPONENT_SECTIONS.values()}
    where: dict[tuple[str, str], str] = {}
    for i, name in enumerate(model.layer_pattern):
        used["attention"].add(name)
        where.setdefault(("attention", name), f"model.layer_pattern[{i}]")
    for layer in range(model.n_layers):
        kind, name = model.ffn_of(layer)
        used[kind].add(name)
        where.setdefault((kind, name), "model.moe" if kind == "moe" else "model.ffn")
    if recipe.train.memory_policy == "auto":
        # the planner may pick any installed policy: a section for one of them is a base it starts from
        for name in component_raw["memory_policy"] if isinstance(component_raw["memory_policy"], dict) else ():
            used["memory_policy"].add(name)
            where.setdefault(("memory_policy", name), f"[memory_policy.{name}] with train.memory_policy = 'auto'")
    else:
        for i, name in enumerate(recipe.train.memory_policy):
            used["memory_policy"].add(name)
            where.setdefault(("memory_policy", name), f"train.memory_policy[{i}]")
    for i, name in enumerate(recipe.eval.baselines):
        used["baseline"].add(name)
        where.setdefault(("baseline", name), f"eval.baselines[{i}]")
    for i, name in enumerate(recipe.eval.analyses):
        used["eval_analysis"].add(name)
        where.setdefault(("eval_analysis", name), f"eval.analyses[{i}]")
    sources = plugins.registry["data_source"]
    configured = component_raw["data_source"] if isinstance(component_raw["data_source"], dict) else {}
    for which in ("train", "heldout"):  # a name that is no data source is a FASTA path, read when training starts
        name = getattr(recipe.data, which)
        if name in sources or name in configured:  # a configured name must be a source: it was not meant as a path
            used["data_source"].add(name)
            where.setdefault(("data_source", name), f"data.{which}")
    for i, name in enumerate(recipe.data.transforms):
        used["data_transform"].add(name)
        where.setdefault(("data_transform", name), f"data.transforms[{i}]")

    for section, kind in COMPONENT_SECTIONS.items():
        if not isinstance(component_raw[section], dict):
            raise ConfigError(f"{source}: [{section}] must be a table of [{section}.NAME] tables")
        # an unknown name first: a misspelt name also leaves the section of the intended one unused
        for name in sorted(used[kind]):
            plugins.get(kind, name, where=f"{source}: {where[(kind, name)]}")
    components: dict[str, dict[str, Any]] = {kind: {} for kind in COMPONENT_SECTIONS.values()}
    for section, kind in COMPONENT_SECTIONS.items():
        tables = component_raw[section]
        for name in sorted(set(tables) - used[kind]):
            users = {"attention": "model.layer_pattern", "ffn": "model.ffn", "moe": "model.moe",
                     "memory_policy": "train.memory_policy", "baseline": "eval.baselines",
                     "eval_analysis": "eval.analyses", "data_source": "data.train or data.heldout",
                     "data_transform": "data.transforms"}[kind]
            raise ConfigError(f"{source}: [{section}.{name}] is configured but not used by {users}")
        for name in sorted(used[kind]):
            provided = plugins.get(kind, name, where=f"{source}: {where[(kind, name)]}")
            table = tables.get(name, {})
            if not isinstance(table, dict):
                raise ConfigError(f"{source}: [{section}.{name}] must be a table")
            try:
                components[kind][name] = provided.spec.config(**table)
            except ValidationError as exc:
                msg = _validation_message(source, f"{section}.{name}", exc)
                if exc.errors()[0]["type"] == "extra_forbidden":
                    msg += f"; allowed: {_allowed_keys(provided.spec.config)}"
                raise ConfigError(msg) from None
    alphabet = _check_data(recipe, plugins)
    model = _model_for_alphabet(raw, recipe, alphabet, plugins)
    validated = recipe.model_copy(update={"components": components, "model": model})
    validated._alphabet = alphabet
    return validated


def _check_data(recipe: Recipe, plugins: Plugins) -> Alphabet:
    """The alphabet of the recipe's data: ``data.train``'s and ``data.heldout``'s must agree, and a data source
    without parts cannot be both (its held-out windows would be trained on)."""
    source, data = recipe.source, recipe.data
    sources = plugins.registry["data_source"]
    alphabets = {}
    for which in ("train", "heldout"):
        name = getattr(data, which)
        alphabets[which] = sources[name].spec.alphabet if name in sources else DNA
    if alphabets["train"] != alphabets["heldout"]:
        raise ConfigError(
            f"{source}: data.heldout: {data.heldout!r} is {alphabets['heldout'].name} but data.train {data.train!r} is "
            f"{alphabets['train'].name}; held-out data must be in the training data's alphabet"
        )
    if data.train == data.heldout and data.train in sources and not sources[data.train].spec.parts:
        raise ConfigError(
            f"{source}: data.heldout: {data.heldout!r} is also data.train, and its data source declares no separate "
            "held-out part: the held-out windows would be trained on; name another corpus"
        )
    return alphabets["train"]


def _model_for_alphabet(raw: dict[str, Any], recipe: Recipe, alphabet: Alphabet, plugins: Plugins) -> ModelConfig:
    """``model`` with ``vocab_size`` from the alphabet when the recipe does not give it, checked against the data's
    ids; and every baseline and eval analysis used checked to handle the alphabet."""
    source, model = recipe.source, recipe.model
    given = isinstance(raw.get("model"), dict) and "vocab_size" in raw["model"]
    ids = recipe.data.token_ids
    if ids is not None and alphabet != DNA:
        raise ConfigError(f"{source}: data.token_ids: gives the ids of A, C, G, T, N (an imported DNA model), but the "
                          f"data is {alphabet.name}; remove it")
    if not given:
        model = model.model_copy(update={"vocab_size": alphabet.size if ids is None else model.vocab_size})
    elif ids is None and model.vocab_size < alphabet.size:
        raise ConfigError(f"{source}: model.vocab_size: {model.vocab_size} is below the {alphabet.size} tokens of the "
                          f"data's alphabet {alphabet.name} ({' '.join(alphabet.symbols)}); allowed: {alphabet.size} or more")
    for key, kind in (("baselines", "baseline"), ("analyses", "eval_analysis")):
        for i, name in enumerate(getattr(recipe.eval, key)):
            spec = plugins.get(kind, name).spec
            if alphabet.name not in spec.alphabets:
                able = sorted(n for n, p in plugins.registry[kind].items() if alphabet.name in p.spec.alphabets)
                raise ConfigError(
                    f"{source}: eval.{key}[{i}]: {kind} {name!r} handles {', '.join(sorted(spec.alphabets))}, not "
                    f"{alphabet.name} (the alphabet of data.train {recipe.data.train!r}); allowed: "
                    f"{', '.join(able) or f'no installed {kind} handles {alphabet.name}'}"
                )
    return model


def read_recipe_file(path: str | Path) -> dict[str, Any]:
    """A recipe file's TOML tables; a missing file or invalid TOML is a one-line :class:`ConfigError` (every
    loader of a recipe kind, core's and plugins', reads its file through this)."""
    try:
        return tomllib.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: recipe not found") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None


def load_recipe(path: str | Path, plugins: Plugins, overrides: list[str] | None = None) -> Recipe:
    path = Path(path)
    raw = apply_overrides(read_recipe_file(path), overrides or [])
    refuse_replaced_keys(raw, plugins, str(path))
    return validate_recipe(raw, plugins, source=str(path))
