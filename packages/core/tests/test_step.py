"""The optimizer step every loop shares (``megaseq.train.step``), on a tiny module against hand-made oracles:
weight decay on matrices only, the scheduled learning rate, hooks once per loop step around several updates,
clipping to ``train.grad_clip`` (the norm reported before clipping), and the non-finite rule before the update."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from megaseq.config import TrainConfig
from megaseq.errors import TrainingDiverged
from megaseq.hookspecs import hookimpl
from megaseq.plugins import Plugins
from megaseq.train.optimizer import make_optimizer
from megaseq.train.schedule import lr_factor
from megaseq.train.step import OptimizerStep


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, int, float]] = []

    @hookimpl
    def megaseq_step_start(self, step, model) -> None:
        self.calls.append(("start", step.step, step.lr))

    @hookimpl
    def megaseq_step_end(self, step, model, metrics) -> None:
        self.calls.append(("end", step.step, step.lr))


def setup(**train) -> tuple[nn.Module, OptimizerStep, Recorder]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4))
    config = TrainConfig(**{"steps": 10, "warmup_steps": 2, "lr": 0.1, **train})
    plugins, recorder = Plugins(), Recorder()
    plugins.register(recorder, name="recorder")
    return model, OptimizerStep(make_optimizer(model, config), config, model, plugins), recorder


def backward(model: nn.Module, scale: float = 1.0) -> float:
    loss = model(torch.ones(2, 3)).pow(2).sum() * scale
    loss.backward()
    return float(loss.detach())


def test_weight_decay_on_matrices_only():
    _, step, _ = setup(weight_decay=0.3)
    decay, no_decay = step.optimizer.param_groups
    assert [p.shape for p in decay["params"]] == [torch.Size([4, 3])] and decay["weight_decay"] == 0.3
    assert len(no_decay["params"]) == 3 and no_decay["weight_decay"] == 0.0


def test_schedule_and_hooks_once_per_loop_step_around_several_updates():
    model, step, recorder = setup()
    for number in (1, 2, 3):
        info = step.start(number, tokens=0)
        assert info.lr == pytest.approx(0.1 * lr_factor(number - 1, 2, 10, 0.1), rel=1e-12)
        assert all(group["lr"] == info.lr for group in step.optimizer.param_groups)
        for _ in range(2):  # e.g. two PPO epochs on one batch
            with step.forwards():
                loss = backward(model)
            assert step.update(number, loss).applied
            assert all(p.grad is None for p in model.parameters())
        step.end(info, 0, {})
    assert [c[:2] for c in recorder.calls] == [("start", 1), ("end", 1), ("start", 2), ("end", 2), ("start", 3), ("end", 3)]


def test_clip_to_grad_clip_reports_the_norm_before():
    model, step, _ = setup(grad_clip=0.5)
    reference = [p.detach().clone().requires_grad_(True) for p in model.parameters()]
    step.start(1, 0)
    loss = backward(model, scale=10.0)
    grads = [p.grad.clone() for p in model.parameters()]
    norm = math.sqrt(sum(float(g.pow(2).sum()) for g in grads))
    update = step.update(1, loss)
    assert update.grad_norm == pytest.approx(norm, rel=1e-6) and norm > 0.5
    # the oracle: AdamW on the gradients scaled to norm 0.5 (same groups, same hyperparameters)
    for ref, g in zip(reference, grads, strict=True):
        ref.grad = g * (0.5 / (norm + 1e-6))
    groups = [{"params": [r for r in reference if r.dim() >= 2], "weight_decay": 0.1},
              {"params": [r for r in reference if r.dim() < 2], "weight_decay": 0.0}]
    oracle = torch.optim.AdamW(groups, lr=step.optimizer.param_groups[0]["lr"], betas=(0.9, 0.95))
    oracle.step()
    for p, ref in zip(model.parameters(), reference, strict=True):
        torch.testing.assert_close(p.detach(), ref.detach(), rtol=1e-6, atol=0)


@pytest.mark.parametrize("bad", ["loss", "grad", "aux"])
def test_nonfinite_stops_or_skips_before_the_update(bad):
    for mode in ("stop", "skip"):
        model, step, _ = setup(on_nonfinite=mode)
        before = [p.detach().clone() for p in model.parameters()]
        step.start(1, 0)
        loss = backward(model, scale=float("inf") if bad == "grad" else 1.0)
        loss = float("nan") if bad == "loss" else loss
        aux = {"balance": float("inf")} if bad == "aux" else {}
        if mode == "stop":
            with pytest.raises(TrainingDiverged, match="step 1: .*training diverged.*stopped before the update"):
                step.update(1, loss, aux)
        else:
            assert not step.update(1, loss, aux).applied
            assert not step.optimizer.state and all(p.grad is None for p in model.parameters())
        for p, b in zip(model.parameters(), before, strict=True):
            assert torch.equal(p.detach(), b)


def test_moe_load_reaches_the_step_metrics() -> None:
    """``end`` adds ``moe/load/KEY``: each key of every MoE layer's ``load_stats()`` averaged over the layers,
    before ``step_end`` (which sees it); a model without MoE layers adds nothing."""
    from pathlib import Path

    from megaseq.contracts import LOAD_STAT_KEYS, ForwardContext
    from megaseq.records import ModelDims
    from megaseq_testkit import load_factory

    build = load_factory(f"{Path(__file__).parents[2] / 'testkit' / 'tests' / 'moe_variants.py'}:LoopMoE")  # the kit's reference MoE
    torch.manual_seed(0)
    model = nn.Sequential(*(build({}, ModelDims(d_model=8, n_layers=2, vocab_size=8), i) for i in range(2)))
    h = torch.randn(1, 12, 8)
    for layer in model:
        h = layer(h, ForwardContext())
    seen = {}

    class Seer:
        @hookimpl
        def megaseq_step_end(self, step, model, metrics) -> None:
            seen.update(metrics)

    plugins = Plugins()
    plugins.register(Seer(), name="seer")
    config = TrainConfig(steps=1, warmup_steps=0)
    step = OptimizerStep(make_optimizer(model, config), config, model, plugins)
    info = step.start(1, 0)
    metrics: dict[str, float] = {}
    step.end(info, 12, metrics)
    for key in LOAD_STAT_KEYS:
        expected = sum(layer.load_stats()[key] for layer in model) / 2
        assert metrics[f"moe/load/{key}"] == pytest.approx(expected), key
    assert seen == metrics
    _, dense_step = setup()[:2]
    plain: dict[str, float] = {}
    dense_step.end(dense_step.start(1, 0), 0, plain)
    assert plain == {}
