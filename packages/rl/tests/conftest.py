from __future__ import annotations

import pytest

from megaseq.config import validate_recipe
from megaseq.plugins import get_plugins
from megaseq.train.trainer import Trainer

TINY_POLICY = {
    "run": {"name": "tiny-policy", "device": "cpu"},
    "data": {"train": "excerpt-chr20", "heldout": "excerpt-chrX", "seq_len": 128},
    "model": {"d_model": 32, "n_layers": 2, "layer_pattern": ["sdpa"]},
    "attention": {"sdpa": {"n_heads": 2}},
    "train": {"steps": 2, "batch_size": 4, "warmup_steps": 1, "log_every": 1},
    "eval": {"windows": 2, "batch_size": 2},
}


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("cache")
    mp = pytest.MonkeyPatch()
    mp.setenv("MEGASEQ_CACHE", str(path))
    yield path
    mp.undo()


@pytest.fixture(scope="session")
def policy_checkpoint(tmp_path_factory, cache_dir):
    """A 2-step genome checkpoint of a tiny sdpa model (core's built-ins only), trained on the shipped excerpts."""
    out = tmp_path_factory.mktemp("policy")
    raw = {**TINY_POLICY, "run": {**TINY_POLICY["run"], "out_dir": str(out)}}
    plugins = get_plugins()
    trainer = Trainer(validate_recipe(raw, plugins), plugins, progress=False, tensorboard=False)
    trainer.train_step()
    return trainer.save()
