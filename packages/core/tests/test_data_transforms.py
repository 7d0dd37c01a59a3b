"""Data transforms (``data.transforms``, ``[data_transform.NAME]``): their recipe rules, the generator of each
call, and the trainer applying them to training micro-batches only, in order, after the schedule's cut and in
the data's ids, resumably."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from pydantic import Field

from megaseq.config import apply_overrides, validate_recipe
from megaseq.data.transforms import apply_transforms, build_transforms, transform_generator
from megaseq.data.windows import Batch
from megaseq.errors import ConfigError, UserError
from megaseq.hookspecs import hookimpl
from megaseq.records import ComponentConfig, DataTransformSpec, NoConfig
from megaseq.train.checkpoint import step_name
from megaseq.train.trainer import Trainer
from megaseq_testkit import fresh_plugins


class RotateConfig(ComponentConfig):
    p: float = Field(0.5, ge=0, le=1)
    min_length: int = Field(1, ge=1)


class Rotate:
    """With probability ``p`` a window's bases A C G T become C G T A (N stays): random, keeps the windows."""

    def __init__(self, config: RotateConfig) -> None:
        self.p, self.min_length = config.p, config.min_length

    def __call__(self, batch: Batch, *, step: int, generator: torch.Generator) -> Batch:
        chosen = (torch.rand(batch.inputs.shape[0], generator=generator) < self.p)[:, None]
        inputs, targets = (torch.where(chosen & (t < 4), (t + 1) % 4, t) for t in (batch.inputs, batch.targets))
        return Batch(inputs, targets, batch.weights.clone())


class Halve:
    """Halves every weight: deterministic, so its position after ``rotate`` shows in what each sees."""

    min_length = 1

    def __call__(self, batch: Batch, *, step: int, generator: torch.Generator) -> Batch:
        return Batch(batch.inputs.clone(), batch.targets.clone(), batch.weights / 2)


CALLS: list[dict] = []  # every call of a transform built by this module: what it was given and returned


def recorded(name: str, transform):
    def call(batch: Batch, *, step: int, generator: torch.Generator) -> Batch:
        out = transform(batch, step=step, generator=generator)
        CALLS.append({"name": name, "step": step, "given": batch, "returned": out})
        return out

    call.min_length = transform.min_length
    return call


def build_rotate(config: RotateConfig):
    if config.p == 0:
        raise ConfigError("p: 0 rotates no window; allowed: more than 0, up to 1 (or leave rotate out of data.transforms)")
    return recorded("rotate", Rotate(config))


def build_halve(config: NoConfig):
    return recorded("halve", Halve())


class Plugin:
    @hookimpl
    def megaseq_data_transform(self):
        return [
            DataTransformSpec(name="rotate", target=f"{__name__}:build_rotate", config=RotateConfig,
                              changes_distribution=False, summary="test"),
            DataTransformSpec(name="halve", target=f"{__name__}:build_halve", changes_distribution=True, summary="test"),
        ]


def plugins():
    found = fresh_plugins()
    found.register(Plugin(), name="transforms-test")
    return found


TINY = {
    "run": {"name": "transforms"},
    "data": {"seq_len": 32},
    "model": {"d_model": 16, "n_layers": 1, "layer_pattern": ["sdpa"]},
    "attention": {"sdpa": {"n_heads": 2}},
    "train": {"steps": 4, "batch_size": 2, "log_every": 1, "checkpoint_every": 2},
    "eval": {"windows": 2, "batch_size": 2, "first_bucket": 8},
}


def recipe(tmp_path: Path, transforms: list[str], data: dict | None = None, sections: dict | None = None,
           model: dict | None = None, **train):
    raw = {**TINY, "data": {**TINY["data"], "transforms": transforms, **(data or {})}, "model": {**TINY["model"], **(model or {})},
           "run": {**TINY["run"], "out_dir": str(tmp_path)}, "train": {**TINY["train"], **train}, **(sections or {})}
    return validate_recipe(raw, plugins(), source="r.toml")


# -- the recipe ------------------------------------------------------------------------------------------------
def test_a_recipe_selects_and_configures_transforms(tmp_path):
    r = recipe(tmp_path, ["rotate", "halve"], sections={"data_transform": {"rotate": {"p": 0.25}}})
    assert r.component("data_transform", "rotate").p == 0.25
    stored = r.to_dict()
    assert stored["data"]["transforms"] == ["rotate", "halve"]
    assert stored["data_transform"] == {"rotate": {"p": 0.25, "min_length": 1}, "halve": {}}
    assert validate_recipe(stored, plugins()).to_dict() == stored


@pytest.mark.parametrize(("transforms", "sections", "message"), [
    (["nope"], {}, "r.toml: data.transforms[0]: no data_transform named 'nope'; available: halve, rotate"),
    ([], {"data_transform": {"rotate": {}}}, "r.toml: [data_transform.rotate] is configured but not used by data.transforms"),
    (["rotate"], {"data_transform": {"rotate": {"q": 1}}}, "r.toml: data_transform.rotate.q: unknown key; allowed: p, min_length"),
    (["rotate"], {"data_transform": {"rotate": {"p": 2}}},
     "r.toml: data_transform.rotate.p: Input should be less than or equal to 1 (got 2)"),
    (["rotate", "rotate"], {}, "transforms[1] 'rotate' is already transforms[0]"),
])
def test_transform_mistakes_are_one_line(tmp_path, transforms, sections, message):
    with pytest.raises(UserError) as caught:
        recipe(tmp_path, transforms, sections=sections)
    assert message in str(caught.value) and "\n" not in str(caught.value), str(caught.value)


@pytest.mark.parametrize(("data", "message"), [
    ({}, "r.toml: data.seq_len 32: data transform 'rotate' ([data_transform.rotate]) acts on windows of at least 48 tokens"),
    ({"seq_len": 64, "schedule": [{"seq_len": 16, "until_step": 2}]},
     "r.toml: data.schedule[0].seq_len 16: data transform 'rotate' ([data_transform.rotate]) acts on windows of at least 48"),
])
def test_a_window_shorter_than_a_transform_acts_on_is_refused_before_training(tmp_path, data, message):
    r = recipe(tmp_path, ["rotate"], data=data, sections={"data_transform": {"rotate": {"min_length": 48}}})
    with pytest.raises(ConfigError) as caught:
        build_transforms(r, plugins())
    assert str(caught.value).startswith(message) and "\n" not in str(caught.value)


def test_a_config_the_transform_refuses_is_one_line_naming_its_section(tmp_path):
    r = recipe(tmp_path, ["halve", "rotate"], sections={"data_transform": {"rotate": {"p": 0}}})
    with pytest.raises(ConfigError) as caught:
        build_transforms(r, plugins())
    assert str(caught.value) == ("r.toml: [data_transform.rotate] p: 0 rotates no window; allowed: more than 0, up to 1 "
                                 "(or leave rotate out of data.transforms)")


def test_a_set_that_deselects_a_transform_drops_its_section():
    raw = {"data": {"transforms": ["rotate"]}, "data_transform": {"rotate": {"p": 0.1}}}
    assert "data_transform" not in validate_recipe(apply_overrides(raw, ["data.transforms=[]"]), plugins()).to_dict()
    with pytest.raises(ConfigError, match=r"\[data_transform.rotate\] is configured but not used by data.transforms"):
        validate_recipe(apply_overrides(raw, ["data.transforms=[]", "data_transform.rotate.p=0.2"]), plugins(), "r.toml")


# -- the generator of each call ----------------------------------------------------------------------------------
def test_each_call_has_its_own_stream_and_the_global_generators_stay():
    state = torch.get_rng_state(), np.random.get_state()[1].copy()
    draws = {key: torch.rand(4, generator=transform_generator(*key)) for key in
             [(0, 1, 0, 0), (1, 1, 0, 0), (0, 2, 0, 0), (0, 1, 1, 0), (0, 1, 0, 1), (-1, 1, 0, 0)]}
    assert len({tuple(d.tolist()) for d in draws.values()}) == len(draws)
    assert torch.equal(torch.rand(4, generator=transform_generator(0, 1, 0, 0)), draws[(0, 1, 0, 0)])
    assert torch.equal(torch.get_rng_state(), state[0]) and np.array_equal(np.random.get_state()[1], state[1])


def test_a_transform_that_breaks_the_batch_is_stopped_in_one_line(tmp_path):
    (built,) = build_transforms(recipe(tmp_path, ["halve"]), plugins())
    batch = Batch(torch.zeros(2, 8, dtype=torch.int64), torch.zeros(2, 8, dtype=torch.int64), torch.ones(2, 8))
    short = type(built)(built.name, built.config, lambda b, *, step, generator: Batch(b.inputs[:1], b.targets[:1], b.weights[:1]),
                        built.changes_distribution)
    with pytest.raises(ValueError, match=r"data transform 'halve' returned inputs torch.int64 \(1, 8\), it was given"):
        apply_transforms([short], batch, 0, 1, 0)


# -- the trainer ---------------------------------------------------------------------------------------------------
def test_the_trainer_transforms_training_batches_only_in_order_after_the_cut(tmp_path):
    """Two transforms, rotate then halve, over 3 steps of 2 micro-batches with an evaluation after every step
    (and the final one): each micro-batch's cut windows go through rotate, its result through halve, in the
    data's ids, and the model reads halve's result in its own vocabulary; evaluation calls neither."""
    r = recipe(tmp_path, ["rotate", "halve"], steps=3, grad_accum=2, eval_every=1, checkpoint_every=0,
               data={"token_ids": [9, 8, 7, 6, 5], "schedule": [{"seq_len": 16, "until_step": 2}]},
               model={"vocab_size": 10})
    CALLS.clear()
    trainer = Trainer(r, plugins(), progress=False, tensorboard=False)
    seen = []
    forward = trainer.model.forward

    def spy(inputs, ctx, *args, **kwargs):
        if trainer.model.training:  # not the evaluation's forwards
            seen.append(inputs.clone())
        return forward(inputs, ctx, *args, **kwargs)

    trainer.model.forward = spy
    evaluate, evaluations = trainer.eval, []

    def evaluation(*args, **kwargs):
        evaluations.append(kwargs)
        before = len(CALLS)
        out = evaluate(*args, **kwargs)
        assert len(CALLS) == before, "the evaluation called a data transform"
        return out

    trainer.eval = evaluation
    trainer.run()
    assert len(evaluations) == 3 and len(seen) == 6  # after steps 1 and 2, and the final one; 6 micro-batches
    assert [c["name"] for c in CALLS] == ["rotate", "halve"] * 6
    assert [c["step"] for c in CALLS] == [1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3]
    assert [tuple(c["given"].inputs.shape) for c in CALLS[::2]] == [(4, 16)] * 4 + [(2, 32)] * 2  # the stage's windows
    table = torch.tensor([9, 8, 7, 6, 5])
    for micro in range(6):
        rotate, halve = CALLS[2 * micro], CALLS[2 * micro + 1]
        assert int(rotate["given"].inputs.max()) <= 4  # the data's ids, not the model's
        assert halve["given"] is rotate["returned"]
        assert torch.equal(seen[micro], table[halve["returned"].inputs])  # what the model trained on


def test_a_run_resumed_inside_a_stage_with_transforms_equals_the_straight_run(tmp_path):
    schedule = {"schedule": [{"seq_len": 16, "until_step": 3}]}
    rotate = {"data_transform": {"rotate": {"p": 0.5}}}

    def trainer(out: Path, transforms: list[str], **train) -> Trainer:
        sections = rotate if transforms else {}
        return Trainer(recipe(out, transforms, data=schedule, sections=sections, **train), plugins(), progress=False,
                       tensorboard=False)

    straight = trainer(tmp_path / "a", ["rotate"]).run(evaluate=False)
    trainer(tmp_path / "b", ["rotate"], steps=2).run(evaluate=False)
    resumed = trainer(tmp_path / "b", ["rotate"]).run("resume", evaluate=False)
    assert resumed.losses == straight.losses[2:]  # steps 3 (the stage's last) and 4, bit for bit
    plain = trainer(tmp_path / "c", [], steps=2).run(evaluate=False)
    assert plain.losses != straight.losses[:2]  # the transform did change what was trained on
    meta = json.loads((tmp_path / "b" / "checkpoints" / step_name(4) / "meta.json").read_text())
    assert meta["recipe"]["data"]["transforms"] == ["rotate"] and meta["recipe"]["data_transform"]["rotate"]["p"] == 0.5


def test_the_run_header_lists_the_transforms(tmp_path):
    r = recipe(tmp_path, ["rotate", "halve"], sections={"data_transform": {"rotate": {"p": 0.25}}})
    header = Trainer(r, plugins(), progress=False, tensorboard=False).header()
    assert ("data transforms, in order: rotate(p=0.25, min_length=1) keeps the distribution; halve() changes the "
            "distribution") in header
