"""The window-length schedule (``data.schedule``): its recipe rules, the cut of a batch into shorter windows,
the trainer's stages by step and by tokens seen, resuming inside a stage, the layouts that refuse a stage's
length, and the plan stage by stage."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megaseq.commands.plan import main as plan_main
from megaseq.config import ConfigError, validate_recipe
from megaseq.data.windows import Batch
from megaseq.distributed.layout import Layout, LayoutError, check_layout
from megaseq.train.trainer import Trainer
from megaseq_testkit import fresh_plugins

TINY = {
    "run": {"name": "schedule"},
    "data": {"seq_len": 64},
    "model": {"d_model": 16, "n_layers": 2, "layer_pattern": ["sdpa"]},
    "attention": {"sdpa": {"n_heads": 2}},
    "train": {"steps": 4, "batch_size": 2, "log_every": 1, "checkpoint_every": 2},
}


def recipe(tmp_path: Path, schedule: list[dict], **train):
    raw = {**TINY, "data": {**TINY["data"], "schedule": schedule}, "run": {**TINY["run"], "out_dir": str(tmp_path)},
           "train": {**TINY["train"], **train}}
    return validate_recipe(raw, fresh_plugins(), source="r.toml")


@pytest.mark.parametrize(("schedule", "message"), [
    ([{"seq_len": 48, "until_step": 2}], "schedule[0].seq_len 48 must divide data.seq_len 64"),
    ([{"seq_len": 64, "until_step": 2}], "must divide data.seq_len 64 and be shorter"),
    ([{"seq_len": 16}], "give exactly one"),
    ([{"seq_len": 16, "until_step": 3, "until_tokens": 9}], "give exactly one"),
    ([{"seq_len": 16, "until_step": 3}, {"seq_len": 32, "until_step": 3}], "schedule[1].until_step 3 must be later"),
])
def test_a_wrong_schedule_is_one_line(tmp_path, schedule, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")) as caught:
        recipe(tmp_path, schedule)
    assert "\n" not in str(caught.value)


def test_stages_by_step_and_by_tokens(tmp_path):
    data = recipe(tmp_path, [{"seq_len": 16, "until_step": 2}, {"seq_len": 32, "until_tokens": 512}]).data
    # step k (after k completed steps), 128 tokens a step
    assert [data.length_at(k, 128 * k) for k in range(6)] == [16, 16, 32, 32, 64, 64]
    assert data.lengths() == [16, 32, 64]


def test_a_cut_batch_is_the_same_targets_in_shorter_windows():
    tokens = torch.randint(0, 4, (2, 13))
    whole = Batch(tokens[:, :-1], tokens[:, 1:], torch.rand(2, 12))
    cut = whole.cut(4)
    assert cut.inputs.shape == (6, 4)
    for piece in range(3):  # piece k of row r: inputs tokens[r, 4k : 4k + 4], targets one further
        assert torch.equal(cut.inputs[piece], tokens[0, 4 * piece : 4 * piece + 4])
        assert torch.equal(cut.targets[3 + piece], tokens[1, 4 * piece + 1 : 4 * piece + 5])
    assert torch.equal(cut.weights.reshape(2, 12), whole.weights)
    assert whole.cut(12) is whole


def test_the_trainer_runs_and_logs_each_stage(tmp_path):
    trainer = Trainer(recipe(tmp_path, [{"seq_len": 16, "until_step": 1}, {"seq_len": 32, "until_tokens": 384}]),
                      fresh_plugins(), progress=False, tensorboard=False)
    seen = []
    original = trainer.model.forward

    def spy(inputs, ctx, *args, **kwargs):
        seen.append(tuple(inputs.shape))
        return original(inputs, ctx, *args, **kwargs)

    trainer.model.forward = spy
    metrics = [trainer.train_step() for _ in range(4)]
    assert [m["seq_len"] for m in metrics] == [16, 32, 32, 64]
    assert seen == [(8, 16), (4, 32), (4, 32), (2, 64)]  # the same 128 tokens a step
    assert trainer.tokens == 4 * 128


def test_resuming_inside_a_stage_continues_it_exactly(tmp_path):
    schedule = [{"seq_len": 16, "until_step": 3}]
    straight = Trainer(recipe(tmp_path / "a", schedule), fresh_plugins(), progress=False, tensorboard=False).run()
    first = Trainer(recipe(tmp_path / "b", schedule, steps=2), fresh_plugins(), progress=False, tensorboard=False)
    first.run(evaluate=False)
    resumed = Trainer(recipe(tmp_path / "b", schedule), fresh_plugins(), progress=False, tensorboard=False)
    result = resumed.run("resume")
    assert result.losses == straight.losses[2:]  # steps 3 (the stage's last) and 4, bit for bit
    rows = [json.loads(line) for line in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert [r["seq_len"] for r in rows if "seq_len" in r] == [16, 16, 16, 64]


@pytest.mark.parametrize(("layout", "schedule", "message"), [
    (Layout(cp=2), [{"seq_len": 8, "until_step": 1}], None),
    (Layout(cp=4), [{"seq_len": 4, "until_step": 1}], "data.schedule[0].seq_len 4 is not a multiple of 2 x cp = 8"),
    (Layout(tp=2), [{"seq_len": 2, "until_step": 1}], None),
    (Layout(tp=4), [{"seq_len": 2, "until_step": 1}], "data.schedule[0].seq_len 2 / cp 1 is not a multiple of tp 4"),
])
def test_layouts_refuse_a_stage_they_cannot_shard(tmp_path, layout, schedule, message):
    r = recipe(tmp_path, schedule)
    if message is None:
        check_layout(r, layout)
        return
    with pytest.raises(LayoutError) as caught:
        check_layout(r, layout)
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_plan_shows_each_stage(tmp_path, capsys, monkeypatch):
    path = tmp_path / "r.toml"
    path.write_text(
        '[run]\nname = "s"\n[data]\nseq_len = 1024\nschedule = [{seq_len = 128, until_step = 10}]\n'
        '[model]\nd_model = 32\nn_layers = 2\nlayer_pattern = ["sdpa"]\n[attention.sdpa]\nn_heads = 2\n'
        '[train]\nbatch_size = 2\n'
    )
    monkeypatch.setenv("MEGASEQ_DISABLE_PLUGIN_AUTOLOAD", "1")
    assert plan_main([str(path), "--json"]) == 0
    found = json.loads(capsys.readouterr().out)
    (short, whole) = found["stages"]
    assert short["window"] == "data.schedule[0].seq_len = 128" and whole["window"] == "data.seq_len = 1024"
    assert 0 < short["device_peak_bytes"] <= whole["device_peak_bytes"]  # sdpa's scores grow with the window
    assert plan_main([str(path)]) == 0
    out = capsys.readouterr().out
    assert "window-length schedule (data.schedule)" in out and "data.schedule[0].seq_len = 128: peak" in out
