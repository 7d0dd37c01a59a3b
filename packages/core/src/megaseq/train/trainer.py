"""The training loop: read top to bottom.

One optimizer step = ``grad_accum`` micro-batches of ``batch_size`` genome windows. Plugins see the loop
only through lifecycle hooks (step start/end, checkpoint save/load) and the forward context.

Everything checkable is checked before the first step (data, held-out data, device, the run directory, the
checkpoint resumed from). Everything logged for a step is logged before that step's checkpoint is saved,
so a resumed run cuts its logs back to the checkpoint's step and logs each step once
(``megaseq.train.rundir``). Checkpoint files, their verification and pruning live in
``megaseq.train.checkpoint``; stopping on SIGINT/SIGTERM in ``megaseq.train.interrupt``.
"""

from __future__ import annotations

import contextlib
import fnmatch
import math
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
from megaseq.data.errors import DataError
from megaseq.data.sources import tokenized
from megaseq.data.windows import Batch, GenomeWindows, WindowSampler
from megaseq.errors import TrainingDiverged, UserError
from megaseq.eval.evaluate import batch_to, evaluate_heldout
from megaseq.model import LanguageModel, build_model, chunked_token_losses, describe
from megaseq.plugins import Plugins
from megaseq.train import checkpoint, rundir
from megaseq.train.interrupt import Interrupted, StopRequests
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


def set_hyperparameters(optimizer: torch.optim.AdamW, recipe: Recipe) -> None:
    """The recipe's optimizer hyperparameters (a resumed optimizer state carries the checkpoint's)."""
    decay, no_decay = optimizer.param_groups
    for group, weight_decay in ((decay, recipe.train.weight_decay), (no_decay, 0.0)):
        group["weight_decay"] = weight_decay
        group["betas"] = recipe.train.betas


def data_windows(recipe: Recipe, which: str) -> GenomeWindows:
    """The windows of ``data.train`` or ``data.heldout``; unreadable or unusable data is a one-line error."""
    d = recipe.data
    spec = getattr(d, which)
    try:
        tokens = tokenized(spec)
    except DataError as exc:
        raise DataError(f"{recipe.source}: data.{which}: {exc}") from None
    windows = GenomeWindows(tokens, d.seq_len, max_n_fraction=d.max_n_fraction, softmask_weight=d.softmask_weight)
    if len(windows) == 0:
        raise DataError(
            f"{recipe.source}: data.{which} {spec!r} has no window of data.seq_len {d.seq_len} bases with at most "
            f"data.max_n_fraction {d.max_n_fraction} N"
        )
    return windows


def check_finite(step: int, loss: float, grad_norm: float) -> None:
    """The non-finite rule: a step whose loss or gradient norm is not finite stops the run (one line, exit 2)."""
    if not (math.isfinite(loss) and math.isfinite(grad_norm)):
        raise TrainingDiverged(
            f"step {step}: loss {loss}, gradient norm {grad_norm}: training diverged, stopped before saving "
            f"(the checkpoints on disk are intact); lower train.lr or raise train.warmup_steps and --resume"
        )


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
        self.train_windows = data_windows(recipe, "train")
        data_windows(recipe, "heldout")  # a bad data.heldout fails now, not after training
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
        self.sampler = WindowSampler(len(self.train_windows), recipe.train.batch_size, recipe.run.seed)
        self.step = 0
        self.tokens = 0
        self.tensorboard = tensorboard
        self.notes: list[str] = []  # what resuming changed or found, for the run header

    # -- checkpoints --------------------------------------------------------------------------------
    @property
    def checkpoint_root(self) -> Path:
        return self.out_dir / "checkpoints"

    def save(self) -> Path:
        state = {
            "optimizer": self.optimizer.state_dict(),
            "optimizer_param_names": checkpoint.optimizer_param_names(self.optimizer, self.model),
            "sampler": self.sampler.state_dict(),
            "rng": checkpoint.rng_state(),
            "tokens": self.tokens,
            "plugins": self.plugins.hooks.checkpoint_save(self.model),
        }
        meta = {"tokens": self.tokens, "recipe": self.recipe.to_dict(), "plugins": self.plugins.active()}
        path = checkpoint.save_checkpoint(self.checkpoint_root, self.step, self.model, state, meta)
        checkpoint.prune(self.checkpoint_root, self.recipe.train.keep_checkpoints)
        return path

    def resume(self) -> bool:
        """Continue from the newest verified checkpoint (False: there is none, the run starts at step 0).

        The checks and the weights are ``checkpoint.load_for_resume``'s; recipe changes (a new ``train.lr``,
        ``train.steps``, ...) take effect and are listed in the run header.
        """
        self.notes += [f"removed {name}, left by an interrupted save" for name in checkpoint.remove_leftovers(self.checkpoint_root)]
        resumed = checkpoint.load_for_resume(self.checkpoint_root, self.model, self.recipe.to_dict())
        if resumed is None:
            return False
        if resumed.warning:
            print(f"megaseq: warning: {resumed.warning}", file=sys.stderr)
        state = resumed.state
        names = checkpoint.optimizer_param_names(self.optimizer, self.model)
        carried = checkpoint.load_optimizer(self.optimizer, state["optimizer"], state["optimizer_param_names"], names)
        set_hyperparameters(self.optimizer, self.recipe)
        sampler = state["sampler"]
        window_order_kept = (sampler["n_windows"], sampler["seed"]) == (self.sampler.n_windows, self.sampler.seed)
        if window_order_kept:
            self.sampler.load_state_dict(sampler)
        checkpoint.set_rng_state(state["rng"])
        self.tokens = state["tokens"]
        self.step = resumed.meta["step"]
        self.plugins.hooks.checkpoint_load(self.model, state["plugins"])

        changes = "; ".join(resumed.recipe_changes)
        self.notes.append(f"resumed from {resumed.path}" + (f" with recipe changes: {changes}" if changes else ""))
        if carried is not None:
            self.notes.append(f"optimizer moments carried over for {carried} of {sum(map(len, names))} trained tensors")
        if not window_order_kept:
            self.notes.append(f"window order restarts: the checkpoint's sampler had {sampler['n_windows']} windows, "
                              f"seed {sampler['seed']}")
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
        lr = t.lr * lr_factor(self.step, t.warmup_steps, t.steps, t.min_lr_ratio)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        info = StepInfo(step=self.step + 1, total_steps=t.steps, tokens=self.tokens, lr=lr)
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
        check_finite(self.step, loss, metrics["grad_norm"])
        self.plugins.hooks.step_end(StepInfo(self.step, t.steps, self.tokens, info.lr), self.model, metrics)
        return metrics

    def header(self) -> str:
        plugins = ", ".join(f"{p['dist']} {p['version']}" for p in self.plugins.active())
        return "\n".join([
            f"megaseq run {self.recipe.run.name!r} from {self.recipe.source} on {self.device}",
            f"  plugins: {plugins}",
            f"  model: {describe(self.model)}",
            f"  data: {len(self.train_windows)} training windows of {self.recipe.data.seq_len} bases; out: {self.out_dir}",
            *(f"  {note}" for note in self.notes),
        ])

    def run(self, mode: rundir.StartMode = "new") -> TrainResult:
        """Train to ``train.steps`` in the run directory, started as ``mode``: "new", "resume" or "overwrite"."""
        t = self.recipe.train
        rundir.prepare(self.out_dir, mode)
        if mode == "resume":
            if not self.resume():
                self.notes.append(f"no checkpoint in {self.checkpoint_root} yet: starting at step 0")
            rundir.truncate_metrics(self.out_dir, self.step)
        print(self.header(), file=sys.stderr)
        logger = MetricsLogger(self.out_dir, self.tensorboard, purge_step=self.step + 1 if mode == "resume" else None)
        losses: list[float] = []
        result_eval = saved_at = None
        bar = tqdm(total=t.steps, initial=self.step, disable=not self.progress, desc="train", file=sys.stderr)
        with contextlib.closing(logger), StopRequests() as stop:
            while self.step < t.steps and stop.requested is None:
                metrics = self.train_step()
                losses.append(metrics["loss"])
                bar.update(1)
                bar.set_postfix(
                    loss=f"{metrics['loss']:.4f}", tok_s=f"{metrics['tokens_per_s']:.0f}", mem=f"{metrics['peak_mem_gib']:.2f}G"
                )
                if self.step % t.log_every == 0 or self.step == t.steps:
                    logger.log(self.step, metrics)
                if self.step == t.steps:
                    result_eval = self.eval(baseline=True, write=True)
                    logger.log(self.step, result_eval["flat"])
                elif t.eval_every and self.step % t.eval_every == 0 and stop.requested is None:
                    logger.log(self.step, self.eval(baseline=False)["flat"])
                if (t.checkpoint_every and self.step % t.checkpoint_every == 0) or self.step == t.steps:
                    self.save()
                    saved_at = self.step
            bar.close()
            if self.step < t.steps:  # a signal asked to stop
                assert stop.requested is not None
                saved = self.save() if saved_at != self.step else self.checkpoint_root / checkpoint.step_name(self.step)
                raise Interrupted(stop.requested, f"stopped after step {self.step}; saved {saved}; continue with --resume")
        if result_eval is None:  # the checkpoint resumed from was already at train.steps
            print(f"megaseq: the run was already at step {self.step} of {t.steps}; evaluating it", file=sys.stderr)
            result_eval = self.eval(baseline=True, write=True)
        return TrainResult(self.out_dir, self.step, losses, result_eval)

    def eval(self, baseline: bool, write: bool = False) -> dict[str, Any]:
        out_dir = self.out_dir / "eval" if write else None
        return evaluate_heldout(self.model, self.recipe, self.device, out_dir, baseline=baseline, progress=self.progress)
