"""RL recipes: the TOML file ``megaseq rl`` runs.

Sections: ``[run]``, ``[policy]`` (the checkpoint to start from: its own recipe gives the model),
``[task]``, ``[sampling]``, ``[algorithm]`` (``name`` plus an optional ``[algorithm.NAME]`` table validated by
that algorithm's schema), ``[engine]`` (likewise), ``[train]`` and ``[eval]``. Every mistake is one line
naming the file, the key and what is allowed (``megaseq.errors.ConfigError``).
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from megaseq.config import RunConfig, Section, apply_overrides
from megaseq.errors import ConfigError
from megaseq.plugins import Plugins
from megaseq.records import ComponentConfig


class RunSection(RunConfig):
    name: str = "rl"


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


class TrainSection(Section):
    steps: int = Field(20, ge=1)
    lr: float = Field(1e-4, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    grad_clip: float = Field(1.0, ge=0, description="0 disables clipping")
    micro_batch: int = Field(16, ge=1, description="completions per forward/backward")
    updates_per_step: int = Field(1, ge=1, description="optimizer steps on each batch of rollouts (PPO epochs)")
    routing_replay: bool = Field(True, description="replay the engine's MoE routing in the training forward (R3)")
    bf16: bool = Field(False, description="bf16 autocast for the training forward")
    loss_chunk: int = Field(4096, ge=1)
    log_every: int = Field(1, ge=1)
    checkpoint_every: int = Field(0, ge=0, description="0 = only at the end")


class EvalSection(Section):
    every: int = Field(5, ge=0, description="steps between evaluations (also before the first step); 0 = start and end only")
    windows: int = Field(8, ge=1, description="held-out windows of the policy's seq_len scored for the LM loss")
    reward_prompts: int = Field(16, ge=1, description="held-out prompts whose mean reward is tracked")


class RLRecipe(Section):
    run: RunSection = RunSection()
    policy: PolicySection
    task: TaskSection = TaskSection()
    sampling: SamplingSection = SamplingSection()
    algorithm: NamedSection = NamedSection(name="grpo")
    engine: NamedSection = NamedSection(name="cached")
    train: TrainSection = TrainSection()
    eval: EvalSection = EvalSection()
    source: str = "<rl recipe>"
    raw: dict[str, Any] = Field(default_factory=dict)
    algorithm_config: Any = None
    engine_config: Any = None

    @property
    def out_dir(self) -> Path:
        return Path(self.run.out_dir.replace("{name}", self.run.name))


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


def validate_rl_recipe(raw: dict[str, Any], plugins: Plugins, source: str = "<rl recipe>") -> RLRecipe:
    try:
        recipe = RLRecipe(**raw, source=source, raw=raw)
    except ValidationError as exc:
        err = exc.errors()[0]
        if err["type"] == "extra_forbidden" and len(err["loc"]) == 1:
            allowed = "run, policy, task, sampling, algorithm, engine, train, eval"
            raise ConfigError(f"{source}: [{err['loc'][0]}]: unknown section; allowed: {allowed}") from None
        raise ConfigError(_message(source, exc)) from None
    except TypeError as exc:
        raise ConfigError(f"{source}: {exc}") from None
    return recipe.model_copy(
        update={
            "algorithm_config": _component(source, "algorithm", "rl_algorithm", recipe.algorithm, plugins),
            "engine_config": _component(source, "engine", "inference_engine", recipe.engine, plugins),
        }
    )


def load_rl_recipe(path: str | Path, plugins: Plugins, overrides: list[str] | None = None) -> RLRecipe:
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: recipe not found") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    return validate_rl_recipe(apply_overrides(raw, overrides or []), plugins, source=str(path))
