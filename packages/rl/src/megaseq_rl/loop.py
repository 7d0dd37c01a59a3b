"""The RL loop, read top to bottom: prompts -> rollouts -> rewards -> advantages -> policy update -> weight sync.

One step:

1. **Rollouts.** Draw ``prompts_per_step`` prompts from the task, ``group_size`` completions each, from the
   engine (which holds the policy's current weights). Tokens outside the vocabulary and non-finite rewards
   stop the run with one line, before any update.
2. **Rewards and filtering.** ``algorithm.shape_rewards`` (length shaping), then ``algorithm.filter``: groups it
   drops (DAPO: all rewards equal) are replaced by new prompts, up to ``max_resample_rounds`` rounds;
   completions it drops (DAPO: truncated) contribute no tokens.
3. **Advantages** per group, broadcast to the completion's tokens.
4. **Old log-probabilities** from the training forward (no gradient), with the engine's MoE routing replayed
   (R3) when ``train.routing_replay``. Their distance to the engine's own log-probabilities is logged as
   ``rollout/logprob_gap`` (the trainer/engine mismatch during the run).
5. **Policy update.** ``updates_per_step`` optimizer steps, each over every completion in micro-batches of
   ``micro_batch`` rows, each micro-batch weighted by ``algorithm.batch_weight`` so that the split does not
   change the step. The components' auxiliary losses (``ctx.losses``: DSA indexer, MoE balance) are added
   as in pre-training, and the plugins' lifecycle hooks run (e.g. MoE bias balancing).
6. **Weight sync**: ``engine.update_weights(model.state_dict())``.

Held-out evaluation (every ``eval.every`` steps, before the first and after the last): the LM loss on
held-out windows (core's evaluation, the policy recipe's windows) and the mean reward on a fixed set of
held-out prompts. Checkpoints are core's (atomic; ``megaseq eval`` and ``megaseq logprob-gap`` read them).
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor
from tqdm import tqdm

from megaseq.contracts import ForwardContext
from megaseq.errors import UserError
from megaseq.eval.evaluate import heldout_windows, score_model
from megaseq.inference import Generation, SamplingParams
from megaseq.plugins import Plugins
from megaseq.train import rundir
from megaseq.train.checkpoint import save_checkpoint
from megaseq.train.metrics import MetricsLogger
from megaseq.train.state import StepInfo
from megaseq.train.trainer import pick_device, seed_everything
from megaseq_rl.policy import completion_terms, load_policy
from megaseq_rl.recipe import RLRecipe
from megaseq_rl.rollout import build_engine, cat_generations, select_rows
from megaseq_rl.task import build_task


@dataclass
class Rollouts:
    """A batch of kept completions: ``tokens [B, P + N]`` (prompt + completion), the engine's generation,
    per-completion shaped rewards and advantages ``[B]``, and the token mask ``[B, N]``."""

    tokens: Tensor
    generation: Generation
    rewards: Tensor
    advantages: Tensor
    mask: Tensor


@dataclass
class RLResult:
    out_dir: Path
    history: list[dict[str, float]]


class RLRun:
    def __init__(self, recipe: RLRecipe, plugins: Plugins, *, progress: bool = True) -> None:
        self.recipe, self.plugins, self.progress = recipe, plugins, progress
        s = recipe.sampling
        seed_everything(recipe.run.seed)
        self.checkpoint, self.policy_recipe, self.model = load_policy(recipe.policy.checkpoint, plugins)
        self.device = pick_device(recipe.run.device)
        self.model.to(self.device).train()
        provided = plugins.get("rl_algorithm", recipe.algorithm.name)
        self.algorithm = provided.load()(recipe.algorithm_config)
        if s.group_size < self.algorithm.min_group_size:
            raise UserError(
                f"{recipe.source}: sampling.group_size = {s.group_size}, but algorithm {recipe.algorithm.name!r} needs "
                f"at least {self.algorithm.min_group_size} completions per prompt"
            )
        self.engine = build_engine(recipe.engine.name, recipe.engine_config, self.policy_recipe, plugins, s.rollout_workers)
        longest = recipe.task.prompt_len + s.max_new_tokens
        if longest > self.engine.max_model_len:
            raise UserError(
                f"{recipe.source}: task.prompt_len {recipe.task.prompt_len} + sampling.max_new_tokens {s.max_new_tokens} "
                f"exceeds the engine's max_model_len {self.engine.max_model_len}"
            )
        d = self.policy_recipe.data
        task = recipe.task
        options = {"gc_target": task.gc_target, "avoid": task.avoid}
        self.task = build_task(task.name, task.train or d.train, task.prompt_len, s.max_new_tokens, **options)
        heldout_task = build_task(task.name, task.heldout or d.heldout, task.prompt_len, s.max_new_tokens, **options)
        self.heldout_prompts = heldout_task.sample(recipe.eval.reward_prompts, np.random.default_rng([recipe.run.seed, 1]))
        policy_eval = self.policy_recipe.eval.model_copy(update={"windows": recipe.eval.windows})
        self.eval_recipe = self.policy_recipe.model_copy(update={"eval": policy_eval})
        self.heldout = heldout_windows(self.eval_recipe)
        self.rng = np.random.default_rng([recipe.run.seed, 0])
        t = recipe.train
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=t.lr, betas=t.betas, weight_decay=t.weight_decay)
        self.step = 0
        self.engine.update_weights(self.model.state_dict())

    # -- 1-3: rollouts, rewards, advantages ------------------------------------------------------------
    def sampling(self, seed: int) -> SamplingParams:
        s = self.recipe.sampling
        return SamplingParams(s.max_new_tokens, temperature=s.temperature, top_p=s.top_p, seed=seed)

    def generate(self, prompts: Tensor, seed: int) -> Generation:
        n = self.recipe.sampling.group_size
        gen = self.engine.generate(prompts.repeat_interleave(n, 0), self.sampling(seed))
        vocab = self.policy_recipe.model.vocab_size
        if gen.tokens.numel() and (int(gen.tokens.min()) < 0 or int(gen.tokens.max()) >= vocab):
            raise UserError(
                f"engine {self.recipe.engine.name!r} returned token ids in [{int(gen.tokens.min())}, {int(gen.tokens.max())}], "
                f"outside the model's vocabulary [0, {vocab})"
            )
        return gen

    def rewards(self, answers: Tensor, gen: Generation) -> Tensor:
        n = self.recipe.sampling.group_size
        rewards = self.task.reward(answers.repeat_interleave(n, 0), gen.tokens.cpu(), gen.mask.cpu()).view(-1, n)
        if not torch.isfinite(rewards).all():
            bad = int((~torch.isfinite(rewards)).sum())
            raise UserError(f"task {self.recipe.task.name!r} returned {bad} non-finite rewards (NaN or inf); stopping before the update")
        return rewards

    def collect(self) -> tuple[Rollouts | None, dict[str, float]]:
        s = self.recipe.sampling
        n, wanted = s.group_size, s.prompts_per_step
        kept: list[tuple[Tensor, Generation, Tensor, Tensor]] = []
        raw_rewards = []
        have = 0
        for round_ in range(s.max_resample_rounds):
            prompts, answers = self.task.sample(wanted - have, self.rng)
            gen = self.generate(prompts, seed=self.recipe.run.seed * 1_000_003 + self.step * 1009 + round_)
            rewards = self.rewards(answers, gen)
            raw_rewards.append(rewards)
            lengths = gen.mask.sum(-1).view(-1, n).cpu()
            shaped = self.algorithm.shape_rewards(rewards, lengths, s.max_new_tokens)
            groups, completions = self.algorithm.filter(shaped, gen.truncated.view(-1, n).cpu())
            if groups.any():
                rows = groups.repeat_interleave(n).nonzero().squeeze(-1)
                kept.append((torch.cat([prompts.repeat_interleave(n, 0), gen.tokens.cpu()], 1)[rows], select_rows(gen, rows.to(gen.tokens.device)),
                             shaped[groups], completions[groups]))
                have += int(groups.sum())
            if have == wanted:
                break
        raw = torch.cat(raw_rewards)
        metrics = {"reward/mean": float(raw.mean()), "reward/std": float(raw.std()) if raw.numel() > 1 else 0.0,
                   "rollout/groups_kept": float(have), "rollout/rounds": float(round_ + 1)}
        if not kept:
            return None, metrics
        shaped = torch.cat([k[2] for k in kept])
        advantages = self.algorithm.advantages(shaped)
        gen = cat_generations([k[1] for k in kept])
        mask = gen.mask.cpu() & torch.cat([k[3] for k in kept]).reshape(-1)[:, None]
        metrics["reward/kept_mean"] = float(shaped.mean())
        metrics["advantage/abs_mean"] = float(advantages.abs().mean())
        return Rollouts(torch.cat([k[0] for k in kept]), gen, shaped.reshape(-1), advantages.reshape(-1), mask), metrics

    # -- 4-5: old log-probabilities and the policy update -----------------------------------------------
    def context(self, gen: Generation, rows: slice) -> ForwardContext:
        return ForwardContext(routing=gen.replay(rows) if self.recipe.train.routing_replay and gen.routing else None)

    def terms(self, batch: Rollouts, rows: slice) -> tuple[Tensor, Tensor, ForwardContext]:
        t = self.recipe.train
        ctx = self.context(batch.generation, rows)
        autocast = torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=t.bf16)
        with autocast:
            logprobs, entropy = completion_terms(
                self.model, batch.tokens[rows].to(self.device), self.recipe.task.prompt_len, ctx,
                self.sampling(0).policy_temperature, t.loss_chunk,
            )
        return logprobs, entropy, ctx

    def micro_batches(self, size: int) -> list[slice]:
        step = self.recipe.train.micro_batch
        return [slice(a, min(a + step, size)) for a in range(0, size, step)]

    def update(self, batch: Rollouts) -> dict[str, float]:
        t = self.recipe.train
        b = batch.tokens.shape[0]
        slices = self.micro_batches(b)
        with torch.no_grad():
            old = torch.cat([self.terms(batch, rows)[0] for rows in slices])
        mask = batch.mask.to(self.device)
        engine_lp = batch.generation.logprobs.to(self.device)
        metrics = {"rollout/logprob_gap": float((old - engine_lp).abs()[mask].mean()) if mask.any() else 0.0}
        adv = batch.advantages.to(self.device, torch.float32)[:, None].expand_as(old)
        total = sum(self.algorithm.batch_weight(mask[rows]) for rows in slices)
        sums: dict[str, float] = {}
        info = StepInfo(step=self.step + 1, total_steps=t.steps, tokens=0, lr=t.lr)
        self.plugins.hooks.step_start(info, self.model)
        for _ in range(t.updates_per_step):
            self.optimizer.zero_grad(set_to_none=True)
            for rows in slices:
                weight = self.algorithm.batch_weight(mask[rows]) / total if total else 0.0
                logprobs, entropy, ctx = self.terms(batch, rows)
                loss, m = self.algorithm.loss(logprobs, old[rows], adv[rows], mask[rows], entropy)
                aux = sum(ctx.losses.values()) * ((rows.stop - rows.start) / b) if ctx.losses else 0.0
                (loss * weight + aux).backward()
                for key, value in {**m, "loss": float(loss.detach()), **{f"aux/{k}": float(v.detach()) for k, v in ctx.losses.items()}}.items():
                    sums[key] = sums.get(key, 0.0) + value * weight / t.updates_per_step
            params = [p for p in self.model.parameters() if p.grad is not None]
            norm = torch.nn.utils.clip_grad_norm_(params, t.grad_clip if t.grad_clip > 0 else float("inf"))
            if not torch.isfinite(norm):
                raise RuntimeError(f"step {self.step + 1}: gradient norm is {float(norm)}; stopping before the weights change")
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        metrics.update({f"policy/{k}": v for k, v in sums.items()})
        metrics["policy/grad_norm"] = float(norm)
        self.plugins.hooks.step_end(StepInfo(self.step + 1, t.steps, 0, t.lr), self.model, metrics)
        return metrics

    # -- the loop -------------------------------------------------------------------------------------
    def train_step(self) -> dict[str, float]:
        started = time.perf_counter()
        batch, metrics = self.collect()
        if batch is None:
            print(f"step {self.step + 1}: every group was dropped by {self.recipe.algorithm.name}'s filter; no update",
                  file=sys.stderr)
        else:
            metrics.update(self.update(batch))
            self.engine.update_weights(self.model.state_dict())  # 6: weight sync
        self.step += 1
        metrics["time_s"] = time.perf_counter() - started
        return metrics

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        windows, indices = self.heldout
        summary = score_model(self.model, self.eval_recipe, windows, indices, self.device)
        prompts, answers = self.heldout_prompts
        gen = self.engine.generate(prompts, self.sampling(seed=12345))
        reward = self.task.reward(answers, gen.tokens.cpu(), gen.mask.cpu())
        return {"eval/heldout_bits_per_base": summary["bits_per_base"], "eval/heldout_reward": float(reward.mean())}

    def save(self) -> Path:
        meta = {"recipe": self.policy_recipe.to_dict(), "rl_recipe": self.recipe.raw, "plugins": self.plugins.active(),
                "tokens": 0, "started_from": str(self.checkpoint)}
        state = {"optimizer": self.optimizer.state_dict(), "rl_step": self.step}
        return save_checkpoint(self.recipe.out_dir / "checkpoints", self.step, self.model, state, meta)

    def run(self, overwrite: bool = False) -> RLResult:
        """Run ``train.steps`` RL steps into ``run.out_dir``, which must not hold a run unless ``overwrite``
        (its run output is then deleted first; core's run-directory rules). RL runs do not resume yet."""
        r = self.recipe
        out = r.out_dir
        rundir.prepare(out, "overwrite" if overwrite else "new")
        print(f"megaseq rl {r.run.name!r} from {r.source}: policy {self.checkpoint}, algorithm {r.algorithm.name}, "
              f"engine {r.engine.name}, {r.sampling.prompts_per_step} prompts x {r.sampling.group_size} completions "
              f"of {r.sampling.max_new_tokens} tokens per step; out: {out}", file=sys.stderr)
        logger = MetricsLogger(out, tensorboard=False)
        history: list[dict[str, float]] = []
        first = {"step": 0.0, **self.evaluate()}
        logger.log(0, first)
        history.append(first)
        bar = tqdm(total=r.train.steps, disable=not self.progress, desc="rl", file=sys.stderr)
        while self.step < r.train.steps:
            metrics = self.train_step()
            if (r.eval.every and self.step % r.eval.every == 0) or self.step == r.train.steps:
                metrics.update(self.evaluate())
            if self.step % r.train.log_every == 0 or "eval/heldout_reward" in metrics:
                logger.log(self.step, metrics)
            history.append({"step": float(self.step), **metrics})
            if (r.train.checkpoint_every and self.step % r.train.checkpoint_every == 0) or self.step == r.train.steps:
                self.save()
            bar.update(1)
            bar.set_postfix(reward=f"{metrics['reward/mean']:.3f}")
        bar.close()
        logger.close()
        (out / "rl_history.json").write_text(json.dumps(history, indent=1))
        plot_history(history, out / "rl_curve.png", f"{r.run.name}: {r.algorithm.name}, {r.task.name}")
        return RLResult(out, history)


def plot_history(history: list[dict[str, Any]], path: Path, title: str) -> None:
    """Mean rollout reward per step, held-out reward, and held-out LM loss (bits/base) over steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_r, ax_l) = plt.subplots(1, 2, figsize=(10, 3.8))
    train = [(h["step"], h["reward/mean"]) for h in history if "reward/mean" in h]
    held = [(h["step"], h["eval/heldout_reward"]) for h in history if "eval/heldout_reward" in h]
    loss = [(h["step"], h["eval/heldout_bits_per_base"]) for h in history if "eval/heldout_bits_per_base" in h]
    if train:
        ax_r.plot(*zip(*train, strict=True), label="rollouts (train prompts)", alpha=0.8)
    if held:
        ax_r.plot(*zip(*held, strict=True), "o-", label="held-out prompts")
    ax_r.set(xlabel="RL step", ylabel="mean reward", title="reward")
    ax_r.legend()
    if loss:
        ax_l.plot(*zip(*loss, strict=True), "o-", color="C2")
    ax_l.set(xlabel="RL step", ylabel="bits/base", title="held-out LM loss")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
