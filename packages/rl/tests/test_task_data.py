"""The RL loop and ``megaseq logprob-gap`` read their prompts as the policy's trainer read its data: a data source
of an outside plugin, known only to the plugin manager given to them, gets the policy recipe's
``[data_source.NAME]`` config and the part it is read as."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest

from megaseq.config import validate_recipe
from megaseq.data.tokenizer import TOKEN_ID_MASK, decode
from megaseq.hookspecs import hookimpl
from megaseq.records import ComponentConfig, DataSourceSpec, FetchRequest
from megaseq.train.trainer import Trainer
from megaseq_rl.gap import measure_gap
from megaseq_rl.loop import RLRun
from megaseq_rl.recipe import validate_rl_recipe
from megaseq_testkit import fresh_plugins, registered

MOTIF = "ACGGTCAT"


class MotifConfig(ComponentConfig):
    motif: str  # required: a source read without the recipe's section is refused, not silently defaulted
    copies: int = 60


def fetch_motif(request: FetchRequest) -> Path:
    """The training part: ``motif`` repeated ``copies`` times; the held-out part: the motif reversed, likewise."""
    motif = request.config.motif if request.part == "train" else request.config.motif[::-1]
    key = hashlib.sha256(f"{motif}:{request.config.copies}".encode()).hexdigest()[:12]
    out = request.cache_dir / request.name / f"{key}.fa"
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(f">motif\n{motif * request.config.copies}\n")
    return out


class MotifPlugin:
    @hookimpl
    def megaseq_data_source(self):
        return [DataSourceSpec(name="motif", target=f"{__name__}:fetch_motif", config=MotifConfig, parts=True,
                               summary="a motif repeated")]


@pytest.fixture(scope="module")
def motif_policy(tmp_path_factory, cache_dir):
    """A 1-step checkpoint trained on the motif source, and the plugins that know the source."""
    plugins = fresh_plugins(autoload=True)
    out = tmp_path_factory.mktemp("motif-policy")
    raw = {
        "run": {"name": "motif-policy", "device": "cpu", "out_dir": str(out)},
        "data": {"train": "motif", "heldout": "motif", "seq_len": 32},
        "data_source": {"motif": {"motif": MOTIF}},
        "model": {"d_model": 16, "n_layers": 1, "layer_pattern": ["sdpa"]},
        "attention": {"sdpa": {"n_heads": 2}},
        "train": {"steps": 1, "batch_size": 2, "warmup_steps": 1, "log_every": 1},
        "eval": {"windows": 2, "batch_size": 2},
    }
    with registered(MotifPlugin(), plugins, "motif-plugin"):
        trainer = Trainer(validate_recipe(raw, plugins), plugins, progress=False, tensorboard=False)
        trainer.train_step()
        yield trainer.save(), plugins


def letters(tokens) -> str:
    return decode(np.asarray(tokens) & TOKEN_ID_MASK)


def test_the_rl_task_reads_the_policy_data_source_with_its_config(tmp_path, motif_policy):
    checkpoint, plugins = motif_policy
    raw = {
        "run": {"name": "t", "out_dir": str(tmp_path / "rl"), "device": "cpu"},
        "policy": {"checkpoint": str(checkpoint)},
        "task": {"prompt_len": 16},
        "sampling": {"prompts_per_step": 2, "group_size": 2, "max_new_tokens": 4},
        "eval": {"windows": 2, "reward_prompts": 2},
    }
    run = RLRun(validate_rl_recipe(raw, plugins), plugins, progress=False)
    assert letters(run.task.tokens) == MOTIF * 60  # the recipe's motif, the training part
    prompts, answers = run.heldout_prompts
    held = MOTIF[::-1] * 60
    for prompt, answer in zip(prompts, answers, strict=True):
        assert letters(np.concatenate([prompt.numpy(), answer.numpy()])) in held  # the held-out part


def test_the_logprob_gap_reads_the_policy_data_source_with_its_config(motif_policy):
    checkpoint, plugins = motif_policy
    (row,) = measure_gap(str(checkpoint), [16], plugins, new_tokens=2, device="cpu")
    assert row["length"] == 16 and row["mean_abs"] <= 1e-4
