"""RL recipes: the TOML file ``megaseq rl`` runs.

Sections: ``[run]``, ``[policy]`` (the checkpoint to start from: its own recipe gives the model),
``[task]``, ``[sampling]``, ``[algorithm]`` (``name`` plus an optional ``[algorithm.NAME]`` table validated by
that algorithm's schema), ``[engine]`` (likewise), ``[train]``, ``[update]``, ``[parallel]``, ``[eval]`` and one
``[memory_policy.NAME]`` per policy in ``train.memory_policy``. Every mistake is one line naming the file, the
key and what is allowed (``megaseq.errors.ConfigError``).

``[run]``, ``[train]`` and ``[parallel]`` are core's sections (``megaseq.config``), read as ``megaseq train``
reads them; RL's own keys live in RL's sections. Where RL wants another default, :data:`RL_DEFAULTS` gives it
(a constant learning rate, no weight decay: fine-tuning, not pre-training). Core keys that have no meaning
here (:data:`NOT_IN_RL`) are one-line errors, not silently ignored.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from megaseq.config import ParallelConfig, RunConfig, Section, TrainConfig, apply_overrides, read_recipe_file
from megaseq.errors import ConfigError
from megaseq.plugins import Plugins
from megaseq.records import ComponentConfig

RL_DEFAULTS: dict[str, dict[str, Any]] = {
    "run": {"name": "rl"},
    "train": {
        "steps": 20, "lr": 1e-4, "warmup_steps": 0, "min_lr_ratio": 1.0, "weight_decay": 0.0, "betas": (0.9, 0.999),
        "log_every": 1,
    },
}
NOT_IN_RL = {
    "train.batch_size": "a step's batch is sampling.prompts_per_step x sampling.group_size completions",
    "train.grad_accum": "update.micro_batch splits the batch without changing the step",
    "train.eval_every": "eval.every sets the evaluations of an RL run",
}


class PolicySection(Section):
    checkpoint: str = Field(description="a checkpoint directory, or a run directory (its newest checkpoint)")


class TaskSection(Section):
    name: Literal["continuation", "gc-content"] = Field(
        "continuation", description="continuation: continue a genome prefix; gc-content: a design reward"
    )
    train: str | None = Field(None, description="dataset or FASTA the prompts come from; default: the policy's data.train")
    heldout: str | None = Field(None, description="dataset or FASTA of held-out prompts; default: the policy's data.heldout")
    prompt_len: int = Field(256, ge=1)
    gc_target: float = Field(0.6, ge=0, le=1, description="gc-content: the GC fraction rewarded most")
    avoid: str = Field("TATA", pattern="^[ACGTacgt]*$", description="gc-content: a motif that zeroes the reward")


class SamplingSection(Section):
    prompts_per_step: int = Field(8, ge=1)
    group_size: int = Field(4, ge=1, description="completions per prompt")
    max_new_tokens: int = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0, description="0 = greedy")
    top_p: float = Field(1.0, gt=0, le=1)
    max_resample_rounds: int = Field(4, ge=1, description="rollout rounds per step when the algorithm drops groups")
    rollout_workers: int = Field(1, ge=1, description="> 1: that many engines as Ray actors (needs megaseq-rl[ray])")


class NamedSection(BaseModel):
    """``name`` plus one table per configured component; the tables are validated against the plugins."""

    model_config = ConfigDict(extra="allow", frozen=True)
    name: str


class UpdateSection(Section):
    """How each batch of rollouts updates the policy (RL's own keys; the optimizer's are core's ``[train]``)."""

    micro_batch: int = Field(16, ge=1, description="completions per forward/backward")
    updates_per_step: int = Field(
        1,
        ge=1,
        description="optimizer steps on each batch of rollouts (PPO epochs); the algorithm's ratio clip "
        "(eps_low, eps_high, dual_clip) binds only from the second, as the first runs at the old policy",
    )
    routing_replay: bool = Field(True, description="replay the engine's MoE routing in the training forward (R3)")


class EvalSection(Section):
    every: int = Field(5, ge=0, description="steps between evaluations (also before the first step); 0 = start and end only")
    windows: int = Field(8, ge=1, description="held-out windows of the policy's seq_len scored for the LM loss")
    reward_prompts: int = Field(16, ge=1, description="held-out prompts whose mean reward is tracked")


class RLRecipe(Section):
    run: RunConfig
    policy: PolicySection
    task: TaskSection = TaskSection()
    sampling: SamplingSection = SamplingSection()
    algorithm: NamedSection = NamedSection(name="grpo")
    engine: NamedSection = NamedSection(name="cached")
    train: TrainConfig
    update: UpdateSection = UpdateSection()
    parallel: ParallelConfig = ParallelConfig()
    eval: EvalSection = EvalSection()
    source: str = "<rl recipe>"
    raw: dict[str, Any] = Field(default_factory=dict)
    algorithm_config: Any = None
    engine_config: Any = None
    memory_policies: list[tuple[str, Any]] = Field(default_factory=list)

    @model_validator(mode="before")
    @classmethod
    def _rl_defaults(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = dict(data)
        for section, defaults in RL_DEFAULTS.items():
            table = data.get(section, {})
            if isinstance(table, dict):
                data[section] = {**defaults, **table}
        return data

    @property
    def out_dir(self) -> Path:
        return self.run.out_path


def _message(source: str, exc: ValidationError) -> str:
    err = exc.errors()[0]
    key = ".".join(str(p) for p in err["loc"])
    if err["type"] == "extra_forbidden":
        return f"{source}: {key}: unknown key"
    if err["type"] == "missing":
        return f"{source}: {key}: required"
    return f"{source}: {key}: {err['msg']} (got {err['input']!r})"


def _component(
    source: str, section: str, kind: str, table: NamedSection, plugins: Plugins
) -> ComponentConfig:
    extra = dict(table.model_extra or {})
    for other in sorted(set(extra) - {table.name}):
        raise ConfigError(f"{source}: [{section}.{other}] is configured but {section}.name is {table.name!r}")
    provided = plugins.get(kind, table.name, where=f"{source}: {section}.name")
    options = extra.get(table.name, {})
    if not isinstance(options, dict):
        raise ConfigError(f"{source}: [{section}.{table.name}] must be a table")
    try:
        return provided.spec.config(**options)
    except ValidationError as exc:
        msg = _message(f"{source}: [{section}.{table.name}]", exc)
        if exc.errors()[0]["type"] == "extra_forbidden":
            msg += f"; allowed: {', '.join(provided.spec.config.model_fields)}"
        raise ConfigError(msg) from None


def _memory_policies(source: str, names: list[str], tables: Any, plugins: Plugins) -> list[tuple[str, ComponentConfig]]:
    """``(name, validated config)`` of each policy in ``train.memory_policy``, from its ``[memory_policy.NAME]``."""
    if not isinstance(tables, dict):
        raise ConfigError(f"{source}: [memory_policy] must be a table of [memory_policy.NAME] tables")
    for name in sorted(set(tables) - set(names)):
        raise ConfigError(f"{source}: [memory_policy.{name}] is configured but not used by train.memory_policy")
    configs = []
    for i, name in enumerate(names):
        provided = plugins.get("memory_policy", name, where=f"{source}: train.memory_policy[{i}]")
        table = tables.get(name, {})
        if not isinstance(table, dict):
            raise ConfigError(f"{source}: [memory_policy.{name}] must be a table")
        try:
            configs.append((name, provided.spec.config(**table)))
        except ValidationError as exc:
            msg = _message(f"{source}: [memory_policy.{name}]", exc)
            if exc.errors()[0]["type"] == "extra_forbidden":
                msg += f"; allowed: {', '.join(provided.spec.config.model_fields)}"
            raise ConfigError(msg) from None
    return configs


def _check_rl_use(source: str, raw: dict[str, Any], recipe: RLRecipe) -> None:
    """Core keys that mean nothing to an RL run, and layouts it cannot run, as one-line errors."""
    for key, why in NOT_IN_RL.items():
        section, name = key.split(".")
        if isinstance(raw.get(section), dict) and name in raw[section]:
            raise ConfigError(f"{source}: {key}: not used by megaseq rl ({why})")
    if recipe.train.memory_policy == "auto":
        raise ConfigError(
            f"{source}: train.memory_policy = 'auto': the planner plans pre-training windows; name the policies "
            f"for an RL run (e.g. ['recompute'])"
        )
    p = recipe.parallel
    if p.cp > 1 or p.ep > 1:
        raise ConfigError(
            f"{source}: parallel cp = {p.cp}, ep = {p.ep}: megaseq rl runs data parallelism only (parallel.dp); "
            f"set cp = 1 and ep = 1"
        )


def validate_rl_recipe(raw: dict[str, Any], plugins: Plugins, source: str = "<rl recipe>") -> RLRecipe:
    fields = dict(raw)
    policy_tables = fields.pop("memory_policy", {})
    try:
        recipe = RLRecipe(**fields, source=source, raw=raw)
    except ValidationError as exc:
        err = exc.errors()[0]
        if err["type"] == "extra_forbidden" and len(err["loc"]) == 1:
            allowed = "run, policy, task, sampling, algorithm, engine, train, update, parallel, eval, memory_policy"
            raise ConfigError(f"{source}: [{err['loc'][0]}]: unknown section; allowed: {allowed}") from None
        msg = _message(source, exc)
        section = RLRecipe.model_fields.get(str(err["loc"][0])) if err["loc"] else None
        if err["type"] == "extra_forbidden" and section is not None and isinstance(section.annotation, type):
            msg += f"; allowed: {', '.join(section.annotation.model_fields)}"
        raise ConfigError(msg) from None
    except TypeError as exc:
        raise ConfigError(f"{source}: {exc}") from None
    _check_rl_use(source, raw, recipe)
    return recipe.model_copy(
        update={
            "algorithm_config": _component(source, "algorithm", "rl_algorithm", recipe.algorithm, plugins),
            "engine_config": _component(source, "engine", "inference_engine", recipe.engine, plugins),
            "memory_policies": _memory_policies(source, list(recipe.train.memory_policy), policy_tables, plugins),
        }
    )


def load_rl_recipe(path: str | Path, plugins: Plugins, overrides: list[str] | None = None) -> RLRecipe:
    return validate_rl_recipe(apply_overrides(read_recipe_file(path), overrides or []), plugins, source=str(path))
