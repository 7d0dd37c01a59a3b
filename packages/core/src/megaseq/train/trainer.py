"""The training loop: read top to bottom.

One optimizer step = ``grad_accum`` micro-batches of ``batch_size`` genome windows. Plugins see the loop
only through lifecycle hooks (step start/end, checkpoint save/load) and the forward context.
"""

from __future__ import annotations

import contextlib
import fnmatch
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from megaseq.config import Recipe
from megaseq.contracts import ForwardContext
from megaseq.data.sources import tokenized
from megaseq.data.windows import Batch, GenomeWindows, WindowSampler
from megaseq.errors import UserError
from megaseq.eval.evaluate import batch_to, evaluate_heldout
from megaseq.model import LanguageModel, build_model, chunked_token_losses, describe
from megaseq.plugins import Plugins
from megaseq.train.checkpoint import (
    latest_checkpoint,
    load_state,
    load_weights,
    read_meta,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from megaseq.train.metrics import MetricsLogger, peak_memory_gib
from megaseq.train.schedule import lr_factor
from megaseq.train.state import StepInfo


@dataclass
class TrainResult:
    out_dir: Path
    step: int
    losses: list[float]
    eval: dict[str, Any] | None


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise UserError("run.device = 'cuda' but no CUDA device is available; use 'cpu' or 'auto'")
    return torch.device(name)


def freeze_except(model: torch.nn.Module, patterns: list[str], source: str) -> None:
    """Train only parameters whose names match one of ``patterns`` (fnmatch globs); freeze the rest."""
    names = [name for name, _ in model.named_parameters()]
    for pattern in patterns:
        if not fnmatch.filter(names, pattern):
            raise UserError(f"{source}: train.trainable: {pattern!r} matches no parameter; e.g. {names[:3]}")
    for name, p in model.named_parameters():
        if not any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns):
            p.requires_grad_(False)


def make_optimizer(model: torch.nn.Module, recipe: Recipe) -> torch.optim.AdamW:
    t = recipe.train
    # weight decay on matrices only: norms, biases and gates keep their scale
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": t.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=t.lr, betas=t.betas)


def lm_loss(model: LanguageModel, batch: Batch, ctx: ForwardContext, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean weighted next-token loss (nats) and the per-token losses."""
    hidden = model(batch.inputs, ctx)
    token_losses = chunked_token_losses(hidden, model.head_weight, batch.targets, chunk)
    return (token_losses * batch.weights).sum() / batch.weights.sum(), token_losses


class Trainer:
    def __init__(self, recipe: Recipe, plugins: Plugins, *, progress: bool = True, tensorboard: bool = True) -> None:
        self.recipe = recipe
        self.plugins = plugins
        self.progress = progress
        self.out_dir = recipe.out_dir
        self.device = pick_device(recipe.run.device)
        seed_everything(recipe.run.seed)
        d = recipe.data
        self.train_windows = GenomeWindows(
            tokenized(d.train), d.seq_len, max_n_fraction=d.max_n_fraction, softmask_weight=d.softmask_weight
        )
        if len(self.train_windows) == 0:
            raise UserError(f"{recipe.source}: data.train {d.train!r} has no window of seq_len {d.seq_len} to train on")
        self.model = build_model(recipe, plugins).to(self.device)
        self.policies = [
            plugins.get("memory_policy", name).load()(recipe.component("memory_policy", name))
            for name in recipe.train.memory_policies
        ]
        for policy in self.policies:
            policy.apply(self.model)
        if recipe.train.trainable is not None:
            freeze_except(self.model, recipe.train.trainable, recipe.source)
        self.optimizer = make_optimizer(self.model, recipe)
        t = recipe.train
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_factor(s, t.warmup_steps, t.steps, t.min_lr_ratio)
        )
        self.sampler = WindowSampler(len(self.train_windows), t.batch_size, recipe.run.seed)
        self.step = 0
        self.tokens = 0
        self.logger = MetricsLogger(self.out_dir, tensorboard=tensorboard)

    # -- checkpoints --------------------------------------------------------------------------------
    @property
    def checkpoint_root(self) -> Path:
        return self.out_dir / "checkpoints"

    def save(self) -> Path:
        state = {
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "sampler": self.sampler.state_dict(),
            "rng": rng_state(),
            "tokens": self.tokens,
            "plugins": self.plugins.hooks.checkpoint_save(self.model),
        }
        meta = {"tokens": self.tokens, "recipe": self.recipe.to_dict(), "plugins": self.plugins.active()}
        return save_checkpoint(self.checkpoint_root, self.step, self.model, state, meta)

    def resume(self) -> bool:
        path = latest_checkpoint(self.checkpoint_root)
        if path is None:
            return False
        load_weights(path, self.model)
        state = load_state(path)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.sampler.load_state_dict(state["sampler"])
        set_rng_state(state["rng"])
        self.tokens = state["tokens"]
        self.step = read_meta(path)["step"]
        self.plugins.hooks.checkpoint_load(self.model, state["plugins"])
        return True

    # -- the loop -----------------------------------------------------------------------------------
    def _micro_batch(self, ctx: ForwardContext) -> tuple[torch.Tensor, int]:
        batch = batch_to(self.train_windows.batch(self.sampler.next_indices()), self.device)
        t = self.recipe.train
        autocast = torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=t.bf16)
        with contextlib.ExitStack() as stack:
            for policy in self.policies:
                stack.enter_context(policy.forward_context())
            with autocast:
                loss, _ = lm_loss(self.model, batch, ctx, t.loss_chunk)
            total = loss + sum(ctx.losses.values())
            (total / t.grad_accum).backward()
        return loss.detach(), batch.inputs.numel()

    def train_step(self) -> dict[str, float]:
        t = self.recipe.train
        info = StepInfo(step=self.step + 1, total_steps=t.steps, tokens=self.tokens, lr=self.scheduler.get_last_lr()[0])
        self.plugins.hooks.step_start(info, self.model)
        started = time.perf_counter()
        losses, aux, metrics = [], {}, {}
        for _ in range(t.grad_accum):
            ctx = ForwardContext()
            loss, n_tokens = self._micro_batch(ctx)
            losses.append(loss)
            self.tokens += n_tokens
            for name, value in ctx.losses.items():
                aux[name] = aux.get(name, 0.0) + float(value.detach()) / t.grad_accum
            for name, value in ctx.metrics.items():
                metrics[name] = metrics.get(name, 0.0) + value / t.grad_accum
        params = [p for p in self.model.parameters() if p.grad is not None]
        grad_norm = torch.nn.utils.clip_grad_norm_(params, t.grad_clip if t.grad_clip > 0 else float("inf"))
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        elapsed = time.perf_counter() - started
        loss = float(torch.stack(losses).mean())
        metrics.update(
            {
                "loss": loss,
                "bits_per_base": loss / np.log(2),
                "lr": info.lr,
                "grad_norm": float(grad_norm),
                "tokens_per_s": t.grad_accum * t.batch_size * self.recipe.data.seq_len / elapsed,
                "peak_mem_gib": peak_memory_gib(self.device),
                **{f"aux/{k}": v for k, v in aux.items()},
            }
        )
        if not np.isfinite(loss):
            raise RuntimeError(f"step {self.step}: loss is {loss}; stopping before the weights are overwritten")
        self.plugins.hooks.step_end(StepInfo(self.step, t.steps, self.tokens, info.lr), self.model, metrics)
        return metrics

    def header(self) -> str:
        plugins = ", ".join(f"{p['dist']} {p['version']}" for p in self.plugins.active())
        return (
            f"megaseq run {self.recipe.run.name!r} from {self.recipe.source} on {self.device}\n"
            f"  plugins: {plugins}\n  model: {describe(self.model)}\n"
            f"  data: {len(self.train_windows)} training windows of {self.recipe.data.seq_len} bases; out: {self.out_dir}"
        )

    def run(self, resume: bool = False) -> TrainResult:
        t = self.recipe.train
        if resume and self.resume():
            print(f"resumed from step {self.step}", file=sys.stderr)
        print(self.header(), file=sys.stderr)
        losses: list[float] = []
        bar = tqdm(total=t.steps, initial=self.step, disable=not self.progress, desc="train", file=sys.stderr)
        while self.step < t.steps:
            metrics = self.train_step()
            losses.append(metrics["loss"])
            bar.update(1)
            bar.set_postfix(
                loss=f"{metrics['loss']:.4f}", tok_s=f"{metrics['tokens_per_s']:.0f}", mem=f"{metrics['peak_mem_gib']:.2f}G"
            )
            if self.step % t.log_every == 0 or self.step == t.steps:
                self.logger.log(self.step, metrics)
            if t.eval_every and self.step % t.eval_every == 0 and self.step < t.steps:
                self.logger.log(self.step, self.eval(baseline=False)["flat"])
            if (t.checkpoint_every and self.step % t.checkpoint_every == 0) or self.step == t.steps:
                self.save()
        bar.close()
        result_eval = self.eval(baseline=True, write=True)
        self.logger.log(self.step, result_eval["flat"])
        self.logger.close()
        return TrainResult(self.out_dir, self.step, losses, result_eval)

    def eval(self, baseline: bool, write: bool = False) -> dict[str, Any]:
        return evaluate_heldout(
            self.model, self.recipe, self.device, out_dir=self.out_dir / "eval" if write else None, baseline=baseline
        )
