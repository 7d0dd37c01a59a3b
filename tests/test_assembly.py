"""The GLM-5.3-Flash layer structure assembled from three independently installed plugins.

kda (3) : dsa (1) attention, dense first layer then chunked MoE, trained on the shipped DNA excerpts:
the plugins meet only through core, their losses and metrics reach the trainer's logs, resume is
bit-for-bit, and MoE routing recorded in one forward replays in another.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megaseq.config import load_recipe, validate_recipe
from megaseq.contracts import ForwardContext, RoutingReplay
from megaseq.model import build_model
from megaseq.plugins import get_plugins
from megaseq.train.trainer import Trainer
from megaseq_testkit import assert_close

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGASEQ_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def plugins():
    return get_plugins()


def hybrid(tmp_path, plugins, **train):
    raw = {
        "run": {"name": "hybrid", "out_dir": str(tmp_path / "run"), "device": "cpu"},
        "data": {"train": "excerpt-chr20", "heldout": "excerpt-chrX", "seq_len": 96},
        "model": {"d_model": 32, "n_layers": 4, "layer_pattern": ["kda", "kda", "kda", "dsa"], "moe": "chunked", "dense_layers": 1},
        "attention": {
            "kda": {"n_heads": 2, "head_dim": 16},
            "dsa": {"n_heads": 2, "head_dim": 8, "q_lora_rank": 16, "kv_lora_rank": 16, "index_heads": 2, "index_dim": 8, "topk": 16, "index_pool": 4},
        },
        "moe": {"chunked": {"n_experts": 4, "top_k": 2, "expert_hidden": 32, "chunk_tokens": 100}},
        "train": {"steps": 4, "batch_size": 2, "warmup_steps": 1, "log_every": 1, **train},
        "eval": {"windows": 2, "batch_size": 2},
    }
    return validate_recipe(raw, plugins)


def test_shipped_hybrid_recipes_validate(plugins):
    for name in ("genome-cpu.toml", "glm5-flash-1m.toml", "genome-sdpa-cpu.toml"):
        load_recipe(REPO / "recipes" / name, plugins)


def test_hybrid_trains_logs_plugin_metrics_and_resumes(tmp_path, plugins):
    straight = Trainer(hybrid(tmp_path / "a", plugins), plugins, progress=False, tensorboard=False)
    losses = [straight.train_step() for _ in range(4)]
    assert all(torch.isfinite(torch.tensor(m["loss"])) for m in losses)
    first = losses[0]
    assert "aux/dsa_indexer" in first, sorted(first)
    # each quantity once: the indexer's KL is the aux loss (coef 1), not also a metric of its own
    assert not [k for k in first if k != "aux/dsa_indexer" and first[k] == first["aux/dsa_indexer"]], first
    assert any(k.startswith("moe/") for k in first), sorted(first)

    a = Trainer(hybrid(tmp_path / "b", plugins), plugins, progress=False, tensorboard=False)
    resumed = [a.train_step()["loss"] for _ in range(2)]
    a.save()
    b = Trainer(hybrid(tmp_path / "b", plugins), plugins, progress=False, tensorboard=False)
    assert b.resume()
    resumed += [b.train_step()["loss"] for _ in range(2)]
    assert resumed == [m["loss"] for m in losses]
    for name, value in straight.model.state_dict().items():
        assert torch.equal(value, b.model.state_dict()[name]), name


def test_hybrid_end_to_end_run_writes_eval(tmp_path, plugins):
    result = Trainer(hybrid(tmp_path, plugins, steps=2), plugins, progress=False, tensorboard=False).run()
    heldout = json.loads((tmp_path / "run" / "eval" / "step_0000002" / "heldout.json").read_text())
    assert heldout["results"]["model"]["bits_per_base"] > 0 and result.eval is not None


def test_routing_replay_through_the_whole_model(tmp_path, plugins):
    torch.manual_seed(0)
    model = build_model(hybrid(tmp_path, plugins), plugins)
    tokens = torch.randint(0, 4, (2, 40))
    record = RoutingReplay("record")
    with torch.no_grad():
        logits = model.logits(model(tokens, ForwardContext(routing=record)))
        assert len(record.indices) == 3  # layers 1..3 are MoE
        # perturb the balancing biases: the routers alone now choose other experts; replay must not
        biases = [buf for name, buf in model.named_buffers() if name.endswith("expert_bias")]
        assert len(biases) == 3
        for buf in biases:
            buf.add_(torch.randn_like(buf) * 10)
        rerouted = model.logits(model(tokens, ForwardContext()))
        replayed = model.logits(model(tokens, ForwardContext(routing=record.replay())))
    assert not torch.allclose(rerouted, logits), "perturbing the biases did not change routing: the test proves nothing"
    assert_close(replayed, logits, 1e-6, "replayed logits")
