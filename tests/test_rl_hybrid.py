"""The inference-engine suite and the RL loop on the kda/dsa/moe hybrid assembled from three plugins: decoding
with every component's cache, MoE routing reported and replayed (R3)."""

from __future__ import annotations

import pytest
import torch

from megaseq.config import validate_recipe
from megaseq.plugins import get_plugins
from megaseq.train.trainer import Trainer
from megaseq_rl.loop import RLRun
from megaseq_rl.recipe import validate_rl_recipe
from megaseq_testkit.engine import EngineConformance

HYBRID = {
    "model": {"d_model": 32, "n_layers": 4, "layer_pattern": ["kda", "kda", "kda", "dsa"], "moe": "chunked", "dense_layers": 1, "vocab_size": 7},
    "attention": {
        "kda": {"n_heads": 2, "head_dim": 16},
        "dsa": {"n_heads": 2, "head_dim": 8, "q_lora_rank": 16, "kv_lora_rank": 16, "index_heads": 2, "index_dim": 8, "topk": 8, "index_pool": 2},
    },
    "moe": {"chunked": {"n_experts": 4, "top_k": 2, "expert_hidden": 32, "chunk_tokens": 16}},
}


class TestCachedEngineOnHybrid(EngineConformance):
    name = "cached"
    config = {"device": "cpu", "max_model_len": 64}
    recipe = HYBRID
    prompt_len = 13  # DSA top-k 8 < prompt: decoding must select like the full forward


@pytest.fixture
def hybrid_checkpoint(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGASEQ_CACHE", str(tmp_path / "cache"))
    raw = {
        **HYBRID,
        "model": {**HYBRID["model"], "vocab_size": 5},
        "run": {"name": "h", "out_dir": str(tmp_path / "policy"), "device": "cpu"},
        "data": {"train": "excerpt-chr20", "heldout": "excerpt-chrX", "seq_len": 64},
        "train": {"steps": 1, "batch_size": 2, "warmup_steps": 1},
        "eval": {"windows": 2, "batch_size": 2},
    }
    plugins = get_plugins()
    trainer = Trainer(validate_recipe(raw, plugins), plugins, progress=False, tensorboard=False)
    trainer.train_step()
    return trainer.save()


def test_rl_step_on_hybrid_replays_routing(tmp_path, hybrid_checkpoint):
    plugins = get_plugins()
    raw = {
        "run": {"out_dir": str(tmp_path / "rl"), "device": "cpu"},
        "policy": {"checkpoint": str(hybrid_checkpoint)},
        "task": {"prompt_len": 20},
        "sampling": {"prompts_per_step": 2, "group_size": 2, "max_new_tokens": 5},
        "algorithm": {"name": "dapo", "dapo": {"dynamic_sampling": False}},
        "train": {"steps": 1},
        "update": {"micro_batch": 3},
        "eval": {"windows": 1, "reward_prompts": 2},
    }
    run = RLRun(validate_rl_recipe(raw, plugins), plugins, progress=False)
    batch, _ = run.collect()
    assert batch is not None and set(batch.generation.routing) == {"layer1", "layer2", "layer3"}
    metrics = run.train_step()  # the next batch; the MoE plugin's step_end hook adds its metrics
    assert metrics["rollout/logprob_gap"] < 1e-4, metrics
    assert "aux/dsa_indexer" in {k.removeprefix("policy/") for k in metrics} and "moe/routing_entropy" in metrics


def test_gap_reports_both_routing_modes(hybrid_checkpoint):
    from megaseq_rl.gap import measure_gap

    (fp32,) = measure_gap(str(hybrid_checkpoint), [40], get_plugins(), new_tokens=6, device="cpu")
    assert fp32["routing_replay"] and fp32["mean_abs"] <= 1e-4 and fp32["routing_mismatch"] == 0.0
    (bf16,) = measure_gap(str(hybrid_checkpoint), [40], get_plugins(), new_tokens=6, device="cpu", dtype="bf16")
    assert 0 <= bf16["routing_mismatch"] <= 1 and bf16["with_replay_mean_abs"] == bf16["mean_abs"]
    assert 0 < bf16["mean_abs"] < 0.05 and bf16["without_replay_mean_abs"] > 0


def test_rl_step_with_memory_policies_equals_without(tmp_path, hybrid_checkpoint):
    """train.memory_policy in an RL recipe: the policies act on the policy model (recompute re-runs blocks in
    backward, offload moves saved tensors out) and the step is the one without them."""
    from megaseq_testkit import assert_close

    plugins = get_plugins()
    updated = {}
    for policies in ([], ["recompute", "offload"]):
        raw = {
            "run": {"out_dir": str(tmp_path / "-".join(policies)), "device": "cpu"},
            "policy": {"checkpoint": str(hybrid_checkpoint)},
            "task": {"prompt_len": 20},
            "sampling": {"prompts_per_step": 2, "group_size": 2, "max_new_tokens": 5},
            "algorithm": {"name": "grpo"},
            "train": {"steps": 1, "lr": 1e-2, "memory_policy": policies},
            "update": {"micro_batch": 3},
            "eval": {"windows": 1, "reward_prompts": 2},
        }
        if policies:
            raw["memory_policy"] = {"offload": {"min_bytes": 1}}
        run = RLRun(validate_rl_recipe(raw, plugins), plugins, progress=False)
        if policies:
            assert [type(p).__name__ for p in run.optimizer_step.policies] == ["RecomputePolicy", "OffloadPolicy"]
        metrics = run.train_step()
        if policies:
            assert run.optimizer_step.policies[1].last_moved > 0, "offload moved no saved tensor"
        updated[tuple(policies)] = metrics, {k: v.detach().clone() for k, v in run.model.state_dict().items()}
    (plain_metrics, plain), (metrics, weights) = updated[()], updated[("recompute", "offload")]
    assert_close(torch.tensor(metrics["policy/loss"]), torch.tensor(plain_metrics["policy/loss"]), 1e-5, "policy loss")
    for name, value in plain.items():
        assert_close(weights[name], value, 1e-5, name)
