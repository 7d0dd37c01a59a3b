"""The trainer on the shipped DNA excerpts: outputs, bit-for-bit resume, lifecycle hooks, memory policies."""

from __future__ import annotations

import contextlib
import json

import pytest
import torch
from safetensors.torch import load_file

from megaseq.config import validate_recipe
from megaseq.hookspecs import hookimpl
from megaseq.records import ComponentConfig, MemoryPolicySpec
from megaseq.train.trainer import Trainer
from megaseq_testkit import fresh_plugins, registered


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGASEQ_CACHE", str(tmp_path / "cache"))


def tiny(tmp_path, plugins, **train):
    raw = {
        "run": {"name": "t", "out_dir": str(tmp_path / "run"), "device": "cpu"},
        "data": {"train": "excerpt-chr20", "heldout": "excerpt-chrX", "seq_len": 64},
        "model": {"d_model": 16, "n_layers": 2},
        "attention": {"sdpa": {"n_heads": 2}},
        "train": {"steps": 6, "batch_size": 3, "warmup_steps": 2, "log_every": 1, "loss_chunk": 50, **train},
        "eval": {"windows": 4, "batch_size": 2},
    }
    return validate_recipe(raw, plugins)


def test_run_writes_metrics_checkpoint_and_eval(tmp_path):
    plugins = fresh_plugins()
    result = Trainer(tiny(tmp_path, plugins, checkpoint_every=3), plugins, progress=False).run()
    out = tmp_path / "run"
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines if "loss" in m] == [1, 2, 3, 4, 5, 6]
    assert all(torch.isfinite(torch.tensor(m["loss"])) for m in lines if "loss" in m)
    assert (out / "tensorboard").is_dir()
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_0000006"
    assert sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.startswith("step")) == ["step_0000003", "step_0000006"]
    assert not list((out / "checkpoints").glob(".tmp-*")), "a temporary checkpoint directory was left behind"
    meta = json.loads((out / "checkpoints" / "step_0000006" / "meta.json").read_text())
    assert meta["plugins"][0]["dist"] == "megaseq-core" and meta["recipe"]["train"]["steps"] == 6
    heldout = json.loads((out / "eval" / "step_0000006" / "heldout.json").read_text())
    assert set(heldout["results"]) == {"model"}  # no eval.baselines (test_baseline_conformance scores one)
    assert (out / "eval" / "step_0000006" / "heldout_by_position.png").stat().st_size > 1000
    assert result.eval is not None and "model" in result.eval["table"]


def test_resume_continues_bit_for_bit(tmp_path):
    plugins = fresh_plugins()
    straight = Trainer(tiny(tmp_path / "a", plugins), plugins, progress=False, tensorboard=False)
    straight_losses = [straight.train_step()["loss"] for _ in range(6)]

    first = Trainer(tiny(tmp_path / "b", plugins), plugins, progress=False, tensorboard=False)
    resumed_losses = [first.train_step()["loss"] for _ in range(3)]
    first.save()
    torch.manual_seed(1234)  # disturb global RNG: resume must restore it
    second = Trainer(tiny(tmp_path / "b", plugins), plugins, progress=False, tensorboard=False)
    assert second.resume() and second.step == 3
    resumed_losses += [second.train_step()["loss"] for _ in range(3)]
    assert resumed_losses == straight_losses
    for name, value in straight.model.state_dict().items():
        assert torch.equal(value, second.model.state_dict()[name]), name


def test_same_seed_same_run_and_weights_match_checkpoint(tmp_path):
    plugins = fresh_plugins()
    a = Trainer(tiny(tmp_path / "a", plugins, steps=3), plugins, progress=False, tensorboard=False).run()
    b = Trainer(tiny(tmp_path / "b", plugins, steps=3), plugins, progress=False, tensorboard=False).run()
    assert a.losses == b.losses
    saved = load_file(str(tmp_path / "a" / "run" / "checkpoints" / "step_0000003" / "model.safetensors"))
    assert "embed.weight" in saved


class Recorder:
    """A plugin using every lifecycle hook and providing a memory policy."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.restored: dict | None = None

    @hookimpl
    def megaseq_step_start(self, step, model):
        self.calls.append(f"start{step.step}")

    @hookimpl
    def megaseq_step_end(self, step, model, metrics):
        assert "loss" in metrics
        metrics["recorder/steps"] = step.step
        self.calls.append(f"end{step.step}")

    @hookimpl
    def megaseq_checkpoint_save(self, model):
        return {"recorder": {"calls": len(self.calls)}}

    @hookimpl
    def megaseq_checkpoint_load(self, model, state):
        self.restored = state["recorder"]

    @hookimpl
    def megaseq_memory_policy(self):
        return [MemoryPolicySpec(name="count-forwards", target=f"{__name__}:CountingPolicy", config=CountConfig)]


class CountConfig(ComponentConfig):
    label: str = "x"


class CountingPolicy:
    instances: list[CountingPolicy] = []

    def __init__(self, config: CountConfig) -> None:
        self.applied = False
        self.entered = 0
        CountingPolicy.instances.append(self)

    def apply(self, model):
        self.applied = True

    @contextlib.contextmanager
    def step(self):
        self.entered += 1
        yield


def test_lifecycle_hooks_and_memory_policy(tmp_path):
    plugins = fresh_plugins()
    recorder = Recorder()
    with registered(recorder, plugins, name="recorder"):
        recipe = tiny(tmp_path, plugins, steps=2, grad_accum=2, memory_policy=["count-forwards"])
        trainer = Trainer(recipe, plugins, progress=False, tensorboard=False)
        trainer.run()
        assert recorder.calls == ["start1", "end1", "start2", "end2"]
        policy = CountingPolicy.instances[-1]
        assert policy.applied and policy.entered == 2  # once per step, around both micro-batches
        again = Trainer(recipe, plugins, progress=False, tensorboard=False)
        assert again.resume()
        assert recorder.restored == {"calls": 4}
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m.get("recorder/steps") for m in lines if "loss" in m] == [1, 2]


def test_bf16_autocast_trains(tmp_path):
    plugins = fresh_plugins()
    result = Trainer(tiny(tmp_path, plugins, steps=2, bf16=True), plugins, progress=False, tensorboard=False).run()
    assert all(torch.isfinite(torch.tensor(result.losses)))


def test_trainable_patterns_freeze_the_rest(tmp_path):
    plugins = fresh_plugins()
    trainer = Trainer(tiny(tmp_path, plugins, steps=1, trainable=["blocks.*.attention.*"]), plugins, progress=False, tensorboard=False)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train_step()
    for name, p in trainer.model.named_parameters():
        changed = not torch.equal(before[name], p.detach())
        assert changed == (name.startswith("blocks.") and ".attention." in name), name
    from megaseq.errors import UserError

    with pytest.raises(UserError, match=r"train.trainable: '\*.nothing' matches no parameter"):
        Trainer(tiny(tmp_path, plugins, trainable=["*.nothing"]), plugins, progress=False, tensorboard=False)


def test_header_and_end_show_the_plan_beside_the_measured_peak(tmp_path, capsys):
    """The run header gives the planner's prediction for the run's own policies and the run ends with the
    measured peak beside it; a policy the planner cannot model is said so, not hidden."""
    from megaseq.memory.machine import GiB
    from megaseq.memory.plan import planned_peak

    plugins = fresh_plugins()
    recipe = tiny(tmp_path, plugins, steps=1)
    predicted = planned_peak(recipe, plugins, torch.device("cpu")).device_peak / GiB
    trainer = Trainer(recipe, plugins, progress=False, tensorboard=False)
    assert f"plan: {predicted:.2f}G per device" in trainer.header()
    trainer.run()
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("megaseq: peak memory ") and f"plan {predicted:.2f}G (" in last, last
    with registered(Recorder(), plugins, name="recorder"):  # its policy reports no memory effect
        recipe = tiny(tmp_path / "other", plugins, memory_policy=["count-forwards"])
        header = Trainer(recipe, plugins, progress=False, tensorboard=False).header()
    assert "plan: not planned: memory_policy 'count-forwards'" in header and "reports no memory effect" in header


@pytest.mark.parametrize(("trim_heap", "from_tokens", "per_step"), [(True, 32768, 12), ("auto", 64, 12), ("auto", 65, 0), (False, 1, 0)])
def test_heap_trimmed_at_every_block_boundary(tmp_path, monkeypatch, trim_heap, from_tokens, per_step):
    """On CPU the heap's freed pages go back after every block's forward and before every block's backward
    (2 layers x forward and backward x 3 micro-batches of 64 tokens); with ``"auto"`` only from
    ``TRIM_FROM_TOKENS`` tokens per device; never with ``false``; the header says which. Trimming changes no
    number: the loss equals the untrimmed run's."""
    from megaseq.memory import heap

    calls = []
    monkeypatch.setattr(heap, "TRIM_FROM_TOKENS", from_tokens)
    monkeypatch.setattr(heap, "available", lambda: True)
    monkeypatch.setattr(heap, "return_freed_memory", lambda: calls.append(1))
    plugins = fresh_plugins()
    recipe = tiny(tmp_path, plugins, grad_accum=3, batch_size=3)
    recipe = recipe.model_copy(update={"run": recipe.run.model_copy(update={"trim_heap": trim_heap})})
    trainer = Trainer(recipe, plugins, progress=False, tensorboard=False)
    assert ("heap: trimmed at block boundaries" in trainer.header()) == (per_step > 0)
    loss = trainer.train_step()["loss"]
    assert len(calls) == per_step
    with torch.no_grad():  # evaluation and decoding do not trim
        trainer.model(torch.zeros(1, 8, dtype=torch.long))
    assert len(calls) == per_step
    torch.manual_seed(0)
    untrimmed = tiny(tmp_path / "plain", plugins, grad_accum=3, batch_size=3)
    untrimmed = untrimmed.model_copy(update={"run": untrimmed.run.model_copy(update={"trim_heap": False})})
    assert Trainer(untrimmed, plugins, progress=False, tensorboard=False).train_step()["loss"] == loss
