"""The context-extension experiment's plan: budgets, lengths, the curriculum, the held-out set, and the stages
it implies.

A plan is validated like a recipe (unknown keys and bad values are one-line errors) and comes from a scale
preset (``cpu``: sized for about 70 minutes of an idle 2-core CPU; ``cpu-quick``: the same stages and held-out
set with a fraction of the training, a smoke run; ``gpu``: the same experiment with a larger budget, longer
context and a larger held-out set) plus ``--set KEY.PATH=VALUE`` overrides, read like ``megaseq train --set``:
``plan.KEY=VALUE`` sets a plan key (``plan.pretrain_tokens=1e6``), ``STAGE.SECTION.KEY=VALUE`` (``STAGE`` one of
:data:`STAGES`) overrides that stage's recipe (``long.train.memory_policy=auto``), and any other
``SECTION.KEY=VALUE`` overrides every stage's recipe (``train.lr=1e-3``).

Stages (each a training run in its own directory):

- ``pretrain``: the recipe from scratch at ``short_len`` for ``pretrain_tokens``, ``pretrain_batch`` windows per
  step, with the curriculum: a window-length schedule (core's ``data.schedule``: each step's windows cut into
  ``curriculum`` lengths until their steps, then whole) and planted repeats (megaseq-genome's ``planted-repeats``
  transform) in ``planted_share`` of the windows until ``planted_hold_step``, annealed to none by
  ``planted_until_step``, so that the pretrain ends on the genome's own repeats;
- ``control`` (when there is a curriculum): the same recipe, steps and tokens without it, so that what the
  pretrain gains or loses is the curriculum's;
- ``long``: from pretrain's weights, ``long_len`` for ``extension_tokens``, one window per step;
- ``short``: from pretrain's weights, ``short_len`` for the same ``extension_tokens`` in the same number of
  steps of the same size (``long_len // short_len`` windows per step) and the same learning-rate schedule,
  so that any gain of ``long`` over ``short`` comes from context, not from more or different training;
- ``sdpa`` (``plan.sdpa``): softmax attention and dense SwiGLU of the same total parameter count as the recipe
  (:func:`sdpa_twin`), with the pretrain's data (curriculum included), at ``short_len`` for
  ``pretrain_tokens + extension_tokens`` (each hybrid model's budget), with the pretraining schedule.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from megaseq.config import Recipe, apply_overrides, parse_override, validate_recipe
from megaseq.errors import ConfigError
from megaseq.plugins import Plugins
from megaseq_genome.config import MIN_PLANTED_SEGMENT

STAGES = ("pretrain", "control", "long", "short", "sdpa")
PLANTED = "planted-repeats"
Scale = Literal["cpu", "cpu-quick", "gpu"]


class ContextExtensionPlan(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    short_len: int = Field(4096, ge=2, description="pretraining and short-continuation window (a power of two)")
    long_len: int = Field(65536, ge=2, description="long-continuation window; also the held-out window")
    pretrain_tokens: int = Field(ge=1, description="tokens of the pretraining stage")
    pretrain_batch: int = Field(4, ge=1, description="windows of short_len per pretraining step")
    curriculum: list[tuple[int, int]] = Field(
        [], description="the pretrain's window-length schedule: [length, last step] stages, lengths increasing below "
        "short_len (each dividing it); short_len windows after the last; empty: none",
    )
    planted_share: float = Field(0.0, ge=0, le=1, description="share of the pretrain's windows given a planted repeat")
    planted_segment: int = Field(256, ge=MIN_PLANTED_SEGMENT, description="longest planted segment (at most half the window)")
    planted_hold_step: int = Field(1, ge=1, description="the pretrain's last step at the full planted share")
    planted_until_step: int | None = Field(
        None, ge=2, description="the pretrain's step by which the planted share has fallen linearly to 0 (needed with a "
        "share; unused without)",
    )
    extension_tokens: int = Field(ge=1, description="tokens of each continuation (long and short)")
    extension_lr: float = Field(gt=0, description="peak learning rate of both continuations")
    extension_warmup: int = Field(0, ge=0, description="warm-up steps of both continuations")
    sdpa: bool = Field(False, description="train and evaluate the parameter-matched sdpa model")
    sdpa_heads: int = Field(4, ge=1, description="heads of the sdpa model")
    heldout: str = Field("grch37-chrX", description="held-out dataset (megaseq data list) or FASTA path")
    heldout_region: tuple[int, int] = Field(
        (10_000_000, 58_000_000),
        description="[start, end) token offsets; chrX 10-58 Mb avoids the pseudo-autosomal start and the centromere",
    )
    eval_windows: int = Field(ge=1, description="held-out windows of long_len scored")
    first_bucket: int = Field(128, ge=1, description="end of the first context-position bucket")
    markov_orders: list[int] = Field([8, 11], description="k-mer Markov baselines fitted on the training data")
    bootstrap_samples: int = Field(2000, ge=100)
    confidence: float = Field(0.95, gt=0, lt=1)
    jobs: int = Field(2, ge=1, description="stages (and evaluations) run at once; threads and memory are shared out")
    memory_gib: float | None = Field(None, gt=0, description="memory the jobs share (default: this machine's RAM or GPU)")
    recipe_overrides: list[str] = Field([], description="recipe overrides for every stage")
    stage_overrides: dict[str, list[str]] = Field({}, description="recipe overrides per stage")

    @model_validator(mode="after")
    def _lengths(self) -> ContextExtensionPlan:
        if self.short_len & (self.short_len - 1):
            raise ValueError(f"short_len must be a power of two (a position-bucket edge), got {self.short_len}")
        if self.long_len % self.short_len or self.long_len <= self.short_len:
            raise ValueError(f"long_len ({self.long_len}) must be a multiple of short_len ({self.short_len}) above it")
        if self.short_len < self.first_bucket:
            raise ValueError(f"short_len ({self.short_len}) must be >= first_bucket ({self.first_bucket})")
        if (self.long_len // self.short_len) % self.pretrain_batch and self.pretrain_batch % (self.long_len // self.short_len):
            raise ValueError(
                f"pretrain_batch ({self.pretrain_batch}) and long_len // short_len ({self.long_len // self.short_len})"
                " must divide one another"
            )
        if self.heldout_region[1] <= self.heldout_region[0]:
            raise ValueError(f"heldout_region must be [start, end) with end > start, got {list(self.heldout_region)}")
        for i, (length, until) in enumerate(self.curriculum):
            if length >= self.short_len or self.short_len % length or length < 2:
                raise ValueError(f"curriculum[{i}]: window length {length} must divide short_len ({self.short_len}) and be shorter")
            if i and (length <= self.curriculum[i - 1][0] or until <= self.curriculum[i - 1][1]):
                raise ValueError(f"curriculum[{i}]: [{length}, {until}] must be longer and end later than the stage before it")
            if until < 1:
                raise ValueError(f"curriculum[{i}]: the last step {until} must be >= 1")
        if self.planted_share > 0:
            if self.planted_until_step is None:
                raise ValueError("planted_share needs planted_until_step: the planted repeats are annealed to none "
                                 "before the pretrain ends, so that it ends on the genome's own repeats")
            if self.planted_hold_step >= self.planted_until_step:
                raise ValueError(f"planted_hold_step ({self.planted_hold_step}) must be before planted_until_step "
                                 f"({self.planted_until_step})")
        unknown = sorted(set(self.stage_overrides) - set(STAGES))
        if unknown:
            raise ValueError(f"stage_overrides: unknown stage {unknown[0]!r}; stages: {', '.join(STAGES)}")
        return self

    @property
    def has_curriculum(self) -> bool:
        """Whether the pretrain differs from the recipe's own data order (then a control is trained beside it)."""
        return bool(self.curriculum) or self.planted_share > 0


# what --set plan.KEY may set (the overrides are set through STAGE.* and SECTION.* keys)
PLAN_KEYS = [k for k in ContextExtensionPlan.model_fields if k not in ("recipe_overrides", "stage_overrides")]

# The curriculum (docs/results.md, "Diagnosis", has the measurements behind it): on chr20 with a repeat planted
# in every window, the hybrid formed a copying circuit in 128-base windows within about 1,000 steps of 4,096
# tokens (on uniform bases its loss left chance by step 500 and neared the copier's by 1,000), and a circuit
# formed there carried over as the windows doubled (copying again 250 steps after each lengthening); one left
# before it was complete fell back. So the pretrain steps 4,096 tokens (one short_len window: the most steps the
# budget buys, and at this size a step of one window costs fewer CPU seconds per token than one of four),
# spends 600 of its 1,024 steps in 128-base windows (fewer than the probe's 1,000, what the budget leaves; on
# uniform bases the loss had left chance by step 500-750), 100 in 256-base windows, then doubles the length
# every 60 steps to short_len. It holds the planted share through the 256-base stage and anneals it to none by
# the 2,048-base stage's end, so that its last 144 steps (0.6M tokens) and the continuations see only the
# genome's own repeats. Reverse-complement is not used: the pretrain draws 4M of chr20's 63M bases, no window
# twice, so an augmentation that makes more distinct windows adds nothing, and it would be one more difference
# between the pretrain and its control.
# The continuations go on at the pretraining's final learning rate (the recipe's 1e-3 x min_lr_ratio 0.1)
# without warm-up: re-warming to 1e-3 made both continuations worse than the pretrain they started from
# (docs/results.md), which hides any gain from context.
#
# Budget (`cpu`: about 68 minutes of an idle 2-core CPU, two one-thread jobs at a time), from a few steps of each
# stage timed on the 2-core machine (CPU seconds, under load) and the stages' wall times on the idle machine
# (docs/results.md), which run 1.05-1.1x those CPU seconds: a pretrain or control step of one 4,096-base window
# takes 1.9-2.2 s at every window length of the curriculum (1,024 steps: ~37 min, the two side by side); a
# short continuation step (16 windows, one at a time) ~35 s and a long one (one 65,536-base window) ~55 s, its
# idle wall time (16 steps: ~9 and ~15 min); scoring a model on the 24 held-out windows ~8 min, a Markov baseline seconds. The
# control finishes first and is scored beside the pretrain's last steps; then long beside short; then the
# other three scorings: ~37 + 15 + 16 min.
# `cpu-quick` is the same shape with a quarter of the pretraining and 4 continuation steps, on the same held-out
# set (about 31 minutes idle, most of it the four scorings): a smoke run of every stage and the report.
PRESETS: dict[str, dict[str, Any]] = {
    "cpu": {
        "pretrain_tokens": 4_194_304,
        "pretrain_batch": 1,
        "curriculum": [[128, 600], [256, 700], [512, 760], [1024, 820], [2048, 880]],
        "planted_share": 1.0,
        "planted_hold_step": 700,
        "planted_until_step": 880,
        "extension_tokens": 1_048_576,
        "extension_lr": 1e-4,
        "eval_windows": 24,
    },
    "cpu-quick": {
        "pretrain_tokens": 1_048_576,
        "pretrain_batch": 1,
        "curriculum": [[128, 150], [256, 175], [512, 190], [1024, 205], [2048, 220]],
        "planted_share": 1.0,
        "planted_hold_step": 175,
        "planted_until_step": 220,
        "extension_tokens": 262_144,
        "extension_lr": 1e-4,
        "eval_windows": 24,
    },
    # 4,096 steps of 16 windows: the curriculum's stages in steps as on the CPU, the rest on the genome's own data
    "gpu": {
        "long_len": 262_144,
        "pretrain_tokens": 268_435_456,
        "pretrain_batch": 16,
        "curriculum": [[128, 1000], [256, 1250], [512, 1500], [1024, 1750], [2048, 2000]],
        "planted_share": 1.0,
        "planted_hold_step": 1250,
        "planted_until_step": 2000,
        "extension_tokens": 33_554_432,
        "extension_lr": 1e-4,
        "eval_windows": 64,
        "jobs": 1,
        "sdpa": True,
    },
}


def load_plan(scale: str, sets: list[str]) -> ContextExtensionPlan:
    """The preset ``scale`` with ``--set`` overrides (see the module docstring); errors are one line."""
    if scale not in PRESETS:
        raise ConfigError(f"--scale {scale!r}: choose one of {', '.join(PRESETS)}")
    raw = copy.deepcopy(PRESETS[scale])
    raw.setdefault("recipe_overrides", [])
    raw.setdefault("stage_overrides", {})
    for item in sets:
        path, value = parse_override(item)
        value_text = item.partition("=")[2]
        if len(path) < 2:
            raise ConfigError(
                f"--set {item!r}: expected plan.KEY=VALUE (a plan key), STAGE.SECTION.KEY=VALUE (one stage's recipe, "
                f"STAGE one of {', '.join(STAGES)}) or SECTION.KEY=VALUE (every stage's recipe)"
            )
        head, rest = path[0], ".".join(path[1:])
        if head == "plan":
            if len(path) != 2 or path[1] not in PLAN_KEYS:
                raise ConfigError(f"--set {item!r}: {rest}: unknown plan key; allowed: {', '.join(PLAN_KEYS)}")
            raw[path[1]] = value
        elif head in STAGES:
            raw["stage_overrides"].setdefault(head, []).append(f"{rest}={value_text}")
        else:
            raw["recipe_overrides"].append(f"{'.'.join(path)}={value_text}")
    try:
        return ContextExtensionPlan(**raw)
    except ValidationError as exc:
        err = exc.errors()[0]
        key = ".".join(str(p) for p in err["loc"])
        msg = "unknown key" if err["type"] == "extra_forbidden" else err["msg"]
        if err["type"] == "extra_forbidden":
            msg += f"; allowed: {', '.join(PLAN_KEYS)}"
        raise ConfigError(f"experiment plan ({scale}): plan.{key}: {msg}") from None


@dataclass(frozen=True)
class Stage:
    """One training run of the experiment: its validated recipe and where its weights start from."""

    name: str
    recipe: Recipe
    init_from: str | None
    tokens: int
    eval_context: int | None  # longest context the model is scored with; None: the whole held-out window

    @property
    def steps(self) -> int:
        return self.recipe.train.steps


def _steps(tokens: int, step_tokens: int, stage: str) -> int:
    if tokens < step_tokens:
        raise ConfigError(f"{stage}: a budget of {tokens} tokens is less than one step of {step_tokens} tokens")
    return tokens // step_tokens


def stages(
    plan: ContextExtensionPlan, raw_recipe: dict[str, Any], plugins: Plugins, source: str, out_dir: Path
) -> list[Stage]:
    """The stages of the plan (module docstring), each recipe validated before anything trains; stage S
    writes its run directory (metrics, checkpoints) to ``out_dir / S``."""
    base = apply_overrides(raw_recipe, plan.recipe_overrides)

    def build(name: str, raw: dict[str, Any], sets: list[str]) -> Recipe:
        own = [f"run.name='{name}'", f"run.out_dir='{out_dir / name}'"]
        raw = apply_overrides(raw, [*sets, *own, *plan.stage_overrides.get(name, [])])
        return validate_recipe(raw, plugins, source=f"{source} [{name}]")

    batch = plan.pretrain_batch
    pretrain_steps = _steps(plan.pretrain_tokens, plan.short_len * batch, "pretrain_tokens")
    per_long_step = plan.long_len // plan.short_len
    short_batch = min(batch, per_long_step)
    extension_steps = _steps(plan.extension_tokens, plan.long_len, "extension_tokens")
    extension = [
        f"train.steps={extension_steps}",
        f"train.lr={plan.extension_lr}",
        f"train.warmup_steps={plan.extension_warmup}",
    ]
    pretraining = [
        f"data.seq_len={plan.short_len}", f"train.batch_size={batch}", "train.grad_accum=1", f"train.steps={pretrain_steps}",
    ]
    pretrain = build("pretrain", with_curriculum(base, plan, pretrain_steps, source), pretraining)
    pretrain_tokens = pretrain_steps * plan.short_len * batch
    result = [Stage("pretrain", pretrain, None, pretrain_tokens, None)]
    if plan.has_curriculum:  # the same steps of the same windows, in the recipe's own data order
        result.append(Stage("control", build("control", base, pretraining), None, pretrain_tokens, None))
    result += [
        Stage("long", build("long", base, [
            f"data.seq_len={plan.long_len}", "train.batch_size=1", "train.grad_accum=1", *extension,
        ]), "pretrain", extension_steps * plan.long_len, None),
        Stage("short", build("short", base, [
            f"data.seq_len={plan.short_len}", f"train.batch_size={short_batch}",
            f"train.grad_accum={per_long_step // short_batch}", *extension,
        ]), "pretrain", extension_steps * plan.long_len, None),
    ]
    if plan.sdpa:
        tokens = pretrain_tokens + extension_steps * plan.long_len
        twin = sdpa_twin(pretrain, plan.sdpa_heads, plugins)
        steps = _steps(tokens, plan.short_len * batch, "sdpa budget")
        result.append(Stage("sdpa", build("sdpa", twin, [f"train.steps={steps}"]), None, steps * plan.short_len * batch, plan.short_len))
    return result


def with_curriculum(raw: dict[str, Any], plan: ContextExtensionPlan, steps: int, source: str) -> dict[str, Any]:
    """The recipe (TOML data) with the plan's curriculum for a pretraining of ``steps`` steps: ``data.schedule``
    from ``plan.curriculum`` and ``planted-repeats`` appended to ``data.transforms``. The plan owns both, so a
    recipe that sets either itself is refused: its control would not be the pretrain without the curriculum."""
    data = raw.get("data", {})
    if data.get("schedule") or PLANTED in data.get("transforms", []):
        raise ConfigError(
            f"{source}: data.schedule / data.transforms {PLANTED!r}: the context-extension experiment sets the pretrain's "
            "curriculum itself (plan.curriculum, plan.planted_*); remove them from the recipe"
        )
    if plan.curriculum and plan.curriculum[-1][1] >= steps:
        raise ConfigError(
            f"plan.curriculum: its last stage ends at step {plan.curriculum[-1][1]}, leaving none of the pretrain's "
            f"{steps} steps in windows of short_len ({plan.short_len}); end it earlier or raise pretrain_tokens"
        )
    if plan.planted_share > 0 and plan.planted_until_step is not None and plan.planted_until_step > steps:
        raise ConfigError(
            f"plan.planted_until_step: {plan.planted_until_step} is after the pretrain's last step ({steps}): the planted "
            "repeats must be gone before the pretrain ends; anneal them earlier or raise pretrain_tokens"
        )
    raw = copy.deepcopy(raw)
    data = raw.setdefault("data", {})
    if plan.curriculum:
        data["schedule"] = [{"seq_len": length, "until_step": until} for length, until in plan.curriculum]
    if plan.planted_share > 0:
        data["transforms"] = [*data.get("transforms", []), PLANTED]
        raw.setdefault("data_transform", {})[PLANTED] = {
            "share": plan.planted_share, "segment": plan.planted_segment,
            "anneal_from_step": plan.planted_hold_step, "anneal_until_step": plan.planted_until_step,
        }
    return raw


def parameter_count(recipe: Recipe, plugins: Plugins) -> int:
    from megaseq.model import build_model

    return sum(p.numel() for p in build_model(recipe, plugins).parameters())


def sdpa_twin(recipe: Recipe, heads: int, plugins: Plugins) -> dict[str, Any]:
    """The recipe (as TOML data) with every layer softmax attention + dense SwiGLU, the SwiGLU width chosen
    so that the total parameter count is as close as possible to ``recipe``'s."""
    target = parameter_count(recipe, plugins)
    raw = recipe.to_dict()
    raw["model"] = {**raw["model"], "layer_pattern": ["sdpa"], "moe": None, "dense_layers": 0, "ffn": "swiglu"}
    raw["model"] = {k: v for k, v in raw["model"].items() if v is not None}
    raw["attention"] = {"sdpa": {"n_heads": heads}}
    raw.pop("moe", None)
    raw["train"] = {**raw["train"], "memory_policy": []}
    raw.pop("memory_policy", None)

    def count(hidden: int) -> int:
        trial = copy.deepcopy(raw)
        trial["ffn"] = {"swiglu": {"hidden": hidden}}
        return parameter_count(validate_recipe(trial, plugins, source="sdpa twin"), plugins)

    # the count is affine in the SwiGLU width: two probes give it exactly
    low, high = count(8), count(16)
    hidden = max(1, round(8 + (target - low) * 8 / (high - low)))
    raw["ffn"] = {"swiglu": {"hidden": hidden}}
    return raw
