"""One optimizer step, shared by every training loop (core's trainer and a plugin's, such as an RL loop).

A loop drives it as::

    info = step.start(number, tokens)            # lr from the schedule; plugins' step_start
    with step.forwards():                        # the memory policies' per-step resources
        for each micro-batch:
            kept = step.backward(forward, last)  # forward() -> (objective, kept): the loop's own loss
    update = step.update(number, loss, aux)      # see below
    step.end(info, metrics)                      # plugins' step_end

``backward`` runs a micro-batch's forward through the gradient reduction
(``megaseq.distributed.gradients``) and differentiates its objective: gradients accumulate on each rank, and
the backward of the last micro-batch (``last``) also sums them over the ranks of the parallel layout, in
buckets overlapped with it.

``update`` is where every loop must agree, so it lives here once:

1. the gradient reduction finished (a rank that had no micro-batch joins it with an empty one);
2. the whole model's gradient norm (``Parallel.grad_norm``);
3. the verdict on the loss, the auxiliary losses and the gradient norm (the reduced, global values) is taken
   on every rank and agreed over ranks, so that all ranks update or none does;
4. if all are finite: clip to ``train.grad_clip`` (0: no clipping) and ``optimizer.step()``; if not,
   ``train.on_nonfinite``: ``stop`` raises :class:`TrainingDiverged` before the update, ``skip`` leaves
   weights and optimizer state untouched. Non-finite weights are never written;
5. ``zero_grad``.

A loop may call ``update`` several times between ``start`` and ``end`` (the RL loop's
``update.updates_per_step`` optimizer steps on one batch of rollouts); the hooks run once per loop step.

The optimizer is AdamW with weight decay on matrices only (``megaseq.train.optimizer.make_optimizer``): norms,
biases and gates keep their scale; its state on the device or in host memory, whole or sharded (ZeRO-1). The learning rate follows :func:`megaseq.train.schedule.lr_factor`.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import nn

from megaseq.config import TrainConfig
from megaseq.contracts import LOAD_STAT_KEYS, MemoryPolicy, MoE, iter_modules
from megaseq.distributed.gradients import GradientReduction
from megaseq.distributed.groups import Parallel
from megaseq.errors import TrainingDiverged
from megaseq.plugins import Plugins
from megaseq.records import ComponentConfig
from megaseq.train.metrics import peak_memory_gib
from megaseq.train.schedule import lr_factor
from megaseq.train.state import StepInfo

T = TypeVar("T")


def apply_memory_policies(
    model: nn.Module, plugins: Plugins, configs: Sequence[tuple[str, ComponentConfig]]
) -> list[MemoryPolicy]:
    """Build the memory policies ``(name, config)`` and apply them to ``model`` in order (before the optimizer
    exists: ``megaseq.contracts.MemoryPolicy``)."""
    policies = [plugins.get("memory_policy", name).load()(config) for name, config in configs]
    for policy in policies:
        policy.apply(model)
    return policies


def diverged(step: int, loss: float, grad_norm: float, aux: dict[str, float]) -> TrainingDiverged:
    """The one-line stop of the non-finite rule (``train.on_nonfinite = "stop"``)."""
    bad_aux = {k: v for k, v in aux.items() if not math.isfinite(v)}
    return TrainingDiverged(
        f"step {step}: loss {loss}, gradient norm {grad_norm}: training diverged"
        + (f" (auxiliary losses {bad_aux})" if bad_aux else "")
        + ", stopped before the update (the checkpoints on disk are intact); lower train.lr or raise "
        "train.warmup_steps and --resume, or skip such steps with train.on_nonfinite = 'skip'"
    )


def moe_load_metrics(model: nn.Module, parallel: Parallel) -> dict[str, float]:
    """``moe/load/KEY`` for each of ``LOAD_STAT_KEYS``: the MoE layers' ``load_stats()`` (each describes its
    layer's last training forward, the step's last micro-batch), averaged over the layers and over all ranks,
    read from the device once for all layers.
    They describe routing as each rank saw it, so they depend on how the layout splits the batch (unlike the
    loss and the weights, which every layout reproduces).
    Empty for a model without MoE layers or before any training forward."""
    rows = [stats for _, layer in iter_modules(model, MoE) if (stats := layer.load_stats())]
    if not rows:  # the same on every rank: every rank holds the same layers and ran the same forwards
        return {}
    missing = sorted({key for stats in rows for key in LOAD_STAT_KEYS if key not in stats})
    if missing:
        raise ValueError(f"an MoE layer's load_stats() lacks {missing} (megaseq.contracts.MoE)")
    values = [stats[key] for stats in rows for key in LOAD_STAT_KEYS]
    device = next((v.device for v in values if isinstance(v, torch.Tensor)), torch.device("cpu"))
    table = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=device) for v in values])
    totals = parallel.sum(table.view(len(rows), -1).mean(0)) / parallel.layout.world_size
    return {f"moe/load/{key}": value for key, value in zip(LOAD_STAT_KEYS, totals.tolist(), strict=True)}


@dataclass(frozen=True)
class Update:
    """What :meth:`OptimizerStep.update` did: the gradient norm before clipping, whether the weights changed
    (False: a skipped non-finite step), and the busiest rank's peak memory since it started (GiB)."""

    grad_norm: float
    applied: bool
    peak_mem_gib: float


class OptimizerStep:
    """The optimizer step of a loop (module docstring). ``expert_params``: parameters sharded over expert
    parallelism (their gradients are summed over the expert-data-parallel group only); ``tp_params``: those
    split over tensor parallelism (summed over the ranks holding the same block). Build it after the memory
    policies are applied: the gradient reduction hooks the parameters as they are then."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        train: TrainConfig,
        model: nn.Module,
        plugins: Plugins,
        parallel: Parallel | None = None,
        policies: Sequence[MemoryPolicy] = (),
        expert_params: set[nn.Parameter] | frozenset[nn.Parameter] = frozenset(),
        tp_params: set[nn.Parameter] | frozenset[nn.Parameter] = frozenset(),
    ) -> None:
        self.optimizer, self.train, self.model, self.plugins = optimizer, train, model, plugins
        self.parallel = parallel or Parallel()
        self.policies = list(policies)
        self.expert_params = expert_params
        self.tp_params = tp_params
        self.device = next(model.parameters()).device
        self.reduction = GradientReduction(model, self.parallel, expert_params, tp_params)

    def set_hyperparameters(self) -> None:
        """The recipe's weight decay and betas (a resumed optimizer state carries the checkpoint's)."""
        decay, no_decay = self.optimizer.param_groups
        for group, weight_decay in ((decay, self.train.weight_decay), (no_decay, 0.0)):
            group["weight_decay"] = weight_decay
            group["betas"] = self.train.betas

    def start(self, step: int, tokens: int) -> StepInfo:
        """Begin loop step ``step`` (counted from 1): set the scheduled learning rate, run ``step_start``."""
        t = self.train
        lr = t.lr * lr_factor(step - 1, t.warmup_steps, t.steps, t.min_lr_ratio)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        info = StepInfo(step=step, total_steps=t.steps, tokens=tokens, lr=lr)
        self.plugins.hooks.step_start(info, self.model)
        return info

    @contextlib.contextmanager
    def forwards(self) -> Iterator[None]:
        """Around the forwards and backwards of one optimizer update: each memory policy's per-step resources,
        released on exit."""
        with contextlib.ExitStack() as stack:
            for policy in self.policies:
                stack.enter_context(policy.step())
            yield

    def backward(self, forward: Callable[[], tuple[torch.Tensor, T]], last: bool) -> T:
        """Run ``forward()``, this rank's part of one micro-batch, which returns the objective to differentiate
        (its share of the loss) and what the loop keeps; differentiate the objective and return what was kept.
        ``last``: the last micro-batch before :meth:`update`, whose backward also sums the gradients (these and
        the earlier micro-batches') over the ranks, overlapped with it. Each rank runs one ``last`` per update."""
        objective, kept = self.reduction.forward(forward, sync=last)
        objective.backward()
        return kept

    def update(self, step: int, loss: float, aux: dict[str, float] | None = None) -> Update:
        """Reduce, check, clip, step and zero the gradients (module docstring). ``loss`` and ``aux``: the
        values over all ranks (the same on every rank)."""
        aux = aux or {}
        p = self.parallel
        params = [param for param in self.model.parameters() if param.requires_grad]
        self.reduction.finish()
        norm = p.grad_norm(params, self.expert_params, self.tp_params)
        # one read of the device for the whole verdict: whether some rank saw a non-finite value, the busiest
        # rank's peak memory, and the norm (the same on every rank, so its maximum is itself)
        finite_host = all(math.isfinite(v) for v in (loss, *aux.values()))
        nonfinite = (~torch.isfinite(norm)) | (not finite_host)
        verdict = torch.stack([nonfinite.to(torch.float64), torch.tensor(peak_memory_gib(self.device),
                               dtype=torch.float64, device=norm.device), norm.to(torch.float64)])
        flag, peak, grad_norm = p.max(verdict).tolist()
        applied = flag == 0
        if applied:
            if self.train.grad_clip > 0:
                torch.nn.utils.clip_grads_with_norm_(params, self.train.grad_clip, norm)
            self.optimizer.step()
        elif self.train.on_nonfinite == "stop":
            raise diverged(step, loss, grad_norm, aux)
        self.optimizer.zero_grad(set_to_none=True)
        return Update(grad_norm, applied, peak)

    def end(self, info: StepInfo, tokens: int, metrics: dict[str, Any]) -> None:
        """Finish the loop step begun as ``info``; ``tokens``: the total after it. Adds the MoE layers' load
        (:func:`moe_load_metrics`) to ``metrics``, then runs ``step_end``."""
        metrics.update(moe_load_metrics(self.model, self.parallel))
        self.plugins.hooks.step_end(StepInfo(info.step, info.total_steps, tokens, info.lr), self.model, metrics)


def build_optimizer_step(
    model: nn.Module,
    train: TrainConfig,
    plugins: Plugins,
    source: str,
    parallel: Parallel | None = None,
    policies: Sequence[MemoryPolicy] = (),
    expert_params: set[nn.Parameter] | frozenset[nn.Parameter] = frozenset(),
    tp_params: set[nn.Parameter] | frozenset[nn.Parameter] = frozenset(),
) -> OptimizerStep:
    """A loop's optimizer stage, the trainer's and the RL loop's: freeze what ``train.trainable`` leaves out, make
    the optimizer (``train.optimizer_state``, ``train.optimizer_shard``) and its step."""
    from megaseq.train.optimizer import freeze_except, make_optimizer

    if train.trainable is not None:
        freeze_except(model, train.trainable, source)
    optimizer = make_optimizer(model, train, parallel)
    return OptimizerStep(optimizer, train, model, plugins, parallel, policies, expert_params, tp_params)
