"""Memory policies on the hybrid assembly (kda, dsa and chunked MoE, a dense first layer): every policy and
their combination give the loss, auxiliary losses (the DSA indexer's and the MoE balance loss), metrics and
gradients of no policy, and ``train.memory_policy = "auto"`` trains with what the planner chooses.

Recomputing whole blocks, attention or feed-forward only, and offloading keep the order of every operation,
so their results are bitwise equal in fp32; a recomputed DSA layer keeps its top-k selection for the re-run,
so every run selects once per micro-batch (per tile in tiles), as without a policy. Tiles change it (the KDA chunk grid restarts at every tile, a
tile's queries are scored in separate blocks), so tiled runs are held to 1e-6 relative: the loss, and the
gradient vector of the whole model, ||g - g_ref|| / ||g_ref||. Tiles of 37 tokens divide neither the
sequence nor a KDA chunk, and the packed documents cross tile boundaries.
"""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch

from megaseq.config import validate_recipe
from megaseq.contracts import ForwardContext
from megaseq.model import build_model, chunked_token_losses
from megaseq.plugins import get_plugins
from megaseq.train.trainer import Trainer
from megaseq_dsa.testing import recorded_selections

T = 150
BOUNDS = torch.tensor([0, 40, 41, 111, 150], dtype=torch.int32)


@pytest.fixture(scope="module")
def plugins():
    return get_plugins()


def recipe(plugins, policies: list[str], configs: dict[str, dict[str, Any]], tmp_path=None, **train: Any):
    raw = {
        "run": {"device": "cpu", **({"out_dir": str(tmp_path / "run")} if tmp_path else {})},
        "data": {"train": "excerpt-chr20", "heldout": "excerpt-chrX", "seq_len": 96},
        "model": {"d_model": 32, "n_layers": 4, "layer_pattern": ["kda", "kda", "kda", "dsa"], "moe": "chunked", "dense_layers": 1},
        "attention": {
            "kda": {"n_heads": 2, "head_dim": 16},
            "dsa": {"n_heads": 2, "head_dim": 8, "q_lora_rank": 16, "kv_lora_rank": 16, "index_heads": 2,
                    "index_dim": 8, "topk": 16, "index_pool": 4},
        },
        "moe": {"chunked": {"n_experts": 4, "top_k": 2, "expert_hidden": 32, "chunk_tokens": 53, "aux_loss_coef": 0.01}},
        "train": {"memory_policy": policies, **train},
        "memory_policy": configs,
        "eval": {"windows": 2, "batch_size": 2},
    }
    return validate_recipe(raw, plugins)


def run(plugins, policies: list[str], configs: dict[str, dict[str, Any]], tmp_path) -> dict[str, Any]:
    r = recipe(plugins, policies, {**configs, **({"offload": {"min_bytes": 4096, "scratch_dir": str(tmp_path)}} if "offload" in policies else {})})
    torch.manual_seed(0)
    model = build_model(r, plugins)
    built = [plugins.get("memory_policy", n).load()(r.component("memory_policy", n)) for n in r.train.memory_policy]
    for policy in built:
        policy.apply(model)
    losses, aux, metrics = [], {}, {}
    with contextlib.ExitStack() as stack:
        selections = stack.enter_context(recorded_selections())
        for policy in built:
            stack.enter_context(policy.step())
        for micro in range(2):
            tokens = torch.randint(0, 5, (1, T + 1), generator=torch.Generator().manual_seed(micro))
            ctx = ForwardContext(cu_seqlens=BOUNDS)
            loss = chunked_token_losses(model(tokens[:, :-1], ctx), model.head_weight, tokens[:, 1:], 64).mean()
            (loss + sum(ctx.losses.values())).backward()
            losses.append(loss.detach())
            for k, v in ctx.losses.items():
                aux[k] = aux.get(k, 0) + v.detach()
            metrics.update({k: metrics.get(k, 0) + v for k, v in ctx.metrics.items()})
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return {"loss": torch.stack(losses), "aux": aux, "metrics": metrics, "grads": grads, "selections": selections}


@pytest.fixture(scope="module")
def reference(plugins, tmp_path_factory):
    return run(plugins, [], {}, tmp_path_factory.mktemp("ref"))


EXACT = {
    "recompute-block": (["recompute"], {"recompute": {"part": "block"}}),
    "recompute-attention": (["recompute"], {"recompute": {"part": "attention"}}),
    "recompute-ffn-some-layers": (["recompute"], {"recompute": {"part": "ffn", "layers": [0, 2]}}),
    "offload": (["offload"], {}),
    "recompute-block+offload": (["recompute", "offload"], {"recompute": {"part": "block"}}),
    "recompute-block-selecting-again": (["recompute"], {"recompute": {"part": "block", "reuse_kept": False}}),
}
TILED = {
    "recompute-tiles": (["recompute"], {"recompute": {"part": "block", "tile_tokens": 37}}),
    "recompute-tiles+offload": (["recompute", "offload"], {"recompute": {"part": "block", "tile_tokens": 37}}),
}


@pytest.mark.parametrize("case", list(EXACT))
def test_order_preserving_policies_are_bitwise(plugins, reference, tmp_path, case):
    got = run(plugins, *EXACT[case], tmp_path)
    assert torch.equal(got["loss"], reference["loss"])
    assert got["aux"].keys() == reference["aux"].keys() == {"dsa_indexer", "moe/aux"}
    for k, v in reference["aux"].items():
        assert torch.equal(got["aux"][k], v), k
    assert got["metrics"] == reference["metrics"]
    assert got["grads"].keys() == reference["grads"].keys()
    for n, g in reference["grads"].items():
        assert torch.equal(got["grads"][n], g), n
    assert reference["selections"] == [(T, T)] * 2  # one DSA layer, two micro-batches
    assert got["selections"] == [(T, T)] * (4 if case == "recompute-block-selecting-again" else 2)
    assert not list(tmp_path.iterdir())


def relative(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.double() - ref.double()).norm() / ref.double().norm()).item()


@pytest.mark.parametrize("case", list(TILED))
def test_tiled_policies_within_1e6_relative(plugins, reference, tmp_path, case):
    got = run(plugins, *TILED[case], tmp_path)
    assert relative(got["loss"], reference["loss"]) <= 1e-6
    for k, v in reference["aux"].items():
        assert relative(got["aux"][k], v) <= 1e-6, k
    for k, v in reference["metrics"].items():
        assert abs(got["metrics"][k] - v) <= 1e-6 * abs(v), k
    flat = lambda grads: torch.cat([grads[n].double().flatten() for n in sorted(reference["grads"])])  # noqa: E731
    assert got["grads"].keys() == reference["grads"].keys()
    assert relative(flat(got["grads"]), flat(reference["grads"])) <= 1e-6
    # each tile's queries select once, among the keys up to the tile's end
    tiles = [(min(start + 37, T) - start, min(start + 37, T)) for start in range(0, T, 37)]
    assert got["selections"] == tiles * 2


def test_auto_trains_with_the_planners_choice(plugins, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MEGASEQ_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("MEGASEQ_SCRATCH", str(tmp_path))
    from megaseq.memory import machine as machine_module
    from megaseq.memory import plan as plan_module

    # this model's largest saved tensor is 12 kB: offloading (a candidate) needs a threshold below it to act
    r = recipe(plugins, "auto", {"offload": {"min_bytes": 4096, "scratch_dir": str(tmp_path)}}, tmp_path, steps=2,
               batch_size=1, log_every=1)
    candidates = plan_module.plan(r, plugins, machine=machine_module.Machine("cpu", 2**50, None)).candidates
    smallest = min(candidates, key=lambda e: e.device_peak)
    # a machine on which only the set with the smallest predicted peak fits
    monkeypatch.setattr(machine_module, "total_ram", lambda: smallest.device_peak)
    trainer = Trainer(r, plugins, progress=False, tensorboard=False)
    assert trainer.memory.chosen_by is not None and trainer.memory.chosen_by.chosen is not None
    assert trainer.memory.chosen_by.chosen.label == smallest.label
    assert trainer.recipe.train.memory_policy == [p.name for p in smallest.policies]
    header = trainer.header()
    assert "memory: " in header and "chosen by the planner" in header
    metrics = trainer.train_step()
    assert torch.isfinite(torch.tensor(metrics["loss"]))


def test_auto_never_proposes_an_offload_that_moves_nothing(plugins, tmp_path, monkeypatch):
    """With offload's default min_bytes (1 MiB) every tensor this model saves (12 kB at most) stays, so a set
    with offloading would stop the run at its first step (the policy refuses a step that moved nothing). Its
    predicted peak is the smallest (mapping large allocations leaves no heap term), yet on a machine of that
    size the planner proposes nothing, and on the smallest machine an acting set fits, `auto` trains with it."""
    monkeypatch.setenv("MEGASEQ_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("MEGASEQ_SCRATCH", str(tmp_path))
    from megaseq.memory import machine as machine_module
    from megaseq.memory import plan as plan_module

    r = recipe(plugins, "auto", {}, tmp_path, steps=1, batch_size=1)
    candidates = plan_module.plan(r, plugins, machine=machine_module.Machine("cpu", 2**50, None)).candidates
    offloading = [e for e in candidates if any(p.name == "offload" for p in e.policies)]
    acting = [e for e in candidates if e not in offloading]
    smallest = min(e.device_peak for e in offloading)
    assert smallest < min(e.device_peak for e in acting)
    assert plan_module.plan(r, plugins, machine=machine_module.Machine("cpu", smallest, None)).chosen is None
    assert all(e.idle and not e.fits and e.offloaded == 0 for e in offloading)

    monkeypatch.setattr(machine_module, "total_ram", lambda: min(e.device_peak for e in acting))
    trainer = Trainer(r, plugins, progress=False, tensorboard=False)
    assert trainer.memory.chosen_by is not None and trainer.memory.chosen_by.chosen is not None
    assert "offload" not in trainer.recipe.train.memory_policy
    assert torch.isfinite(torch.tensor(trainer.train_step()["loss"]))


def test_offload_is_planned_per_saved_tensor(plugins):
    """A layer's tensors leave one by one: with the threshold between a 37-token tile's block input (4.6 kB)
    and the whole sequence's (12 kB), the tiles' inputs stay while the MoE layers' whole inputs leave."""
    from megaseq.distributed.layout import Layout
    from megaseq.memory import machine as machine_module
    from megaseq.memory import plan as plan_module

    def planned(min_bytes: int) -> plan_module.Estimate:
        r = recipe(plugins, ["recompute", "offload"],
                   {"recompute": {"part": "block", "tile_tokens": 37}, "offload": {"min_bytes": min_bytes}}, batch_size=1)
        return plan_module.plan(r, plugins, machine=machine_module.Machine("cpu", 2**50, None),
                                policies=["recompute", "offload"], layout=Layout()).candidates[0]

    everything, some, none = planned(4096), planned(8192), planned(16384)
    assert not everything.idle and not some.idle and none.idle and none.offloaded == 0
    kinds = ("kda+swiglu", "kda+chunked", "dsa+chunked")
    assert all(everything.saved_by_kind[k] == 0 for k in kinds)
    assert all(0 < some.saved_by_kind[k] < none.saved_by_kind[k] for k in kinds[1:])
    assert some.saved_by_kind["kda+swiglu"] == none.saved_by_kind["kda+swiglu"] > 0
    assert 0 < some.offloaded < everything.offloaded


def test_recomputed_dsa_layers_are_planned_with_their_kept_selection(plugins, monkeypatch):
    """Under recomputation of blocks (whole or in tiles) or of the attention, the DSA layer keeps its selected
    indices (int32, ``selected_slots`` per token) until its backward: the plan counts them, by the plan of a DSA
    whose estimate declares nothing kept; recomputing the feed-forward only, or re-runs that select again
    (``reuse_kept = false``), keep nothing more."""
    import dataclasses

    import megaseq_dsa.layer
    from megaseq.distributed.layout import Layout
    from megaseq.memory import machine as machine_module
    from megaseq.memory import plan as plan_module
    from megaseq_dsa.ops import selected_slots

    def kept(config: dict[str, Any]) -> int:
        r = recipe(plugins, ["recompute"], {"recompute": config}, batch_size=1)
        return plan_module.plan(r, plugins, machine=machine_module.Machine("cpu", 2**50, None), policies=["recompute"],
                                layout=Layout()).candidates[0].saved_by_kind["dsa+chunked"]

    configs = ({"part": "block"}, {"part": "block", "tile_tokens": 37}, {"part": "attention"}, {"part": "ffn"},
               {"part": "block", "reuse_kept": False})
    declared = [kept(config) for config in configs]
    estimate = megaseq_dsa.layer.memory_estimate
    monkeypatch.setattr(megaseq_dsa.layer, "memory_estimate",
                        lambda *args: dataclasses.replace(estimate(*args), kept_per_token=0.0))
    undeclared = [kept(config) for config in configs]
    indices = 4 * selected_slots(16, 4) * 96  # the recipe's topk and index_pool, 96 tokens
    assert [a - b for a, b in zip(declared, undeclared, strict=True)] == [indices, indices, indices, 0, 0]
