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
   (R3) when ``update.routing_replay``. Their distance to the engine's own log-probabilities is logged as
   ``rollout/logprob_gap`` (the trainer/engine mismatch during the run).
5. **Policy update.** ``update.updates_per_step`` optimizer steps, each over every completion in
   micro-batches of ``update.micro_batch`` rows, each micro-batch weighted by ``algorithm.batch_weight`` so
   that the split does not change the step. The components' auxiliary losses (``ctx.losses``: DSA indexer,
   MoE balance) are added as in pre-training. Each optimizer step is core's
   (``megaseq.train.step.OptimizerStep``, the one ``megaseq train`` uses): gradients summed over the
   data-parallel ranks, the non-finite rule ``train.on_nonfinite`` applied before the update and agreed over
   ranks, ``train.grad_clip``, AdamW with weight decay on matrices only, core's learning-rate schedule, the
   memory policies of ``train.memory_policy`` around the forwards and backwards, and the plugins'
   lifecycle hooks once per RL step (e.g. MoE bias balancing).
6. **Weight sync**: ``engine.update_weights(model.state_dict())``.

Data parallelism (``parallel.dp``; one process per rank, started by torchrun): rank 0 holds the engine,
draws the rollouts (steps 1-3) and sends them to every rank; each rank computes the old log-probabilities
and the update of its contiguous share of the completions, each micro-batch weighted by the whole batch's
weight, so the gradients summed over ranks are the one process's. Every rank holds the whole policy.

Held-out evaluation (every ``eval.every`` steps, before the first and after the last; rank 0): the LM loss
on held-out windows (core's evaluation, the policy recipe's windows) and the mean reward on a fixed set of
held-out prompts. Checkpoints are core's (``megaseq.train.checkpoint``: atomic, verified, pruned to
``train.keep_checkpoints``; ``megaseq eval`` and ``megaseq logprob-gap`` read them) and hold everything a
resumed run needs to continue as if never stopped: optimizer, RNG states, the prompt sampler, the history
and the plugins' state. The run directory follows core's rules (``megaseq.train.rundir``: new, resume,
overwrite); SIGINT/SIGTERM stop at the next step boundary with a checkpoint (``megaseq.train.interrupt``).
"""

from __future__ import annotations

import contextlib
import json
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor
from tqdm import tqdm

from megaseq.contracts import ForwardContext
from megaseq.devices import pick_device
from megaseq.distributed.groups import Parallel
from megaseq.errors import TrainingDiverged, UserError
from megaseq.eval.evaluate import heldout_windows, score_model
from megaseq.inference import Generation, SamplingParams
from megaseq.plugins import Plugins
from megaseq.train import checkpoint, rundir
from megaseq.train.interrupt import Interrupted, StopRequests
from megaseq.train.metrics import MetricsLogger
from megaseq.train.state import StepInfo
from megaseq.train.step import apply_memory_policies, build_optimizer_step
from megaseq.train.trainer import seed_everything
from megaseq_rl.policy import completion_terms, load_policy
from megaseq_rl.recipe import RLRecipe
from megaseq_rl.rollout import build_engine, cat_generations, select_rows
from megaseq_rl.task import build_task, task_corpus


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
    def __init__(self, recipe: RLRecipe, plugins: Plugins, *, parallel: Parallel | None = None, progress: bool = True) -> None:
        self.recipe, self.plugins = recipe, plugins
        self.parallel = p = parallel or Parallel()
        if p.layout.world_size != recipe.parallel.dp or p.layout.dp != recipe.parallel.dp:
            raise ValueError(f"the process groups are laid out as {p.layout}, the RL recipe as dp={recipe.parallel.dp}")
        self.progress = progress and p.is_main
        s, t = recipe.sampling, recipe.train
        if t.optimizer_shard:
            raise UserError(f"{recipe.source}: train.optimizer_shard: the RL loop keeps one whole optimizer state, "
                            "which rank 0 checkpoints; remove it (train.optimizer_state = 'host' is supported)")
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
        self.on_main(self.build_engine)  # rank 0 alone draws rollouts and evaluates
        task = recipe.task
        options = {"gc_target": task.gc_target, "avoid": task.avoid}
        train, heldout = (task_corpus(self.policy_recipe, which, getattr(task, which), plugins) for which in ("train", "heldout"))
        self.task = build_task(task.name, train, task.prompt_len, s.max_new_tokens, **options)
        heldout_task = build_task(task.name, heldout, task.prompt_len, s.max_new_tokens, **options)
        self.heldout_prompts = heldout_task.sample(recipe.eval.reward_prompts, np.random.default_rng([recipe.run.seed, 1]))
        policy_eval = self.policy_recipe.eval.model_copy(update={"windows": recipe.eval.windows})
        self.eval_recipe = self.policy_recipe.model_copy(update={"eval": policy_eval})
        self.heldout = heldout_windows(self.eval_recipe, plugins)
        self.rng = np.random.default_rng([recipe.run.seed, 0])
        policies = apply_memory_policies(self.model, plugins, recipe.memory_policies)
        self.optimizer_step = build_optimizer_step(self.model, t, plugins, recipe.source, p, policies)
        self.optimizer = self.optimizer_step.optimizer
        self.step = 0
        self.tokens = 0  # completion tokens trained on
        self.skipped_updates = 0
        self.history: list[dict[str, float]] = []
        self.notes: list[str] = []  # what resuming changed or found, for the run header
        self.sync_weights()

    def on_main(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` on rank 0, its result on every rank; a mistake it finds stops every rank, in one line."""
        result: Any = None
        if self.parallel.is_main:
            try:
                result = fn()
            except UserError as exc:
                result = exc
            if self.parallel.distributed:  # the tensors travel pickled: on the CPU
                result = _to_cpu(result)
        result = self.parallel.broadcast_from_main(result)
        if isinstance(result, UserError):
            raise result
        return result

    def build_engine(self) -> None:
        r, s = self.recipe, self.recipe.sampling
        self.engine = build_engine(r.engine.name, r.engine_config, self.policy_recipe, self.plugins, s.rollout_workers)
        longest = r.task.prompt_len + s.max_new_tokens
        if longest > self.engine.max_model_len:
            raise UserError(
                f"{r.source}: task.prompt_len {r.task.prompt_len} + sampling.max_new_tokens {s.max_new_tokens} "
                f"exceeds the engine's max_model_len {self.engine.max_model_len}"
            )

    def sync_weights(self) -> None:
        """6: the engine samples from the policy's current weights."""
        if self.parallel.is_main:
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
        return ForwardContext(routing=gen.replay(rows) if self.recipe.update.routing_replay and gen.routing else None)

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

    def micro_batches(self, size: int, rank: int | None = None) -> list[slice]:
        """Micro-batches of ``update.micro_batch`` rows over data-parallel rank ``rank``'s contiguous share of
        ``size`` rows (default: this rank's)."""
        dp = self.parallel.layout.dp
        rank = self.parallel.dp_rank if rank is None else rank
        start, stop = rank * size // dp, (rank + 1) * size // dp
        step = self.recipe.update.micro_batch
        return [slice(a, min(a + step, stop)) for a in range(start, stop, step)]

    def update(self, batch: Rollouts, info: StepInfo) -> dict[str, float]:
        u, p = self.recipe.update, self.parallel
        b = batch.tokens.shape[0]
        slices = self.micro_batches(b)
        mask = batch.mask.to(self.device)
        with torch.no_grad():
            old = {rows.start: self.terms(batch, rows)[0] for rows in slices}
        engine_lp = batch.generation.logprobs.to(self.device)
        gap = {"gap": 0.0, "tokens": 0.0}
        for rows in slices:
            gap["gap"] += float((old[rows.start] - engine_lp[rows]).abs()[mask[rows]].sum())
            gap["tokens"] += float(mask[rows].sum())
        gap = p.sum_values(gap)
        metrics = {"rollout/logprob_gap": gap["gap"] / gap["tokens"] if gap["tokens"] else 0.0}
        adv = batch.advantages.to(self.device, torch.float32)[:, None].expand_as(engine_lp)
        every_rank = [rows for r in range(p.layout.dp) for rows in self.micro_batches(b, r)]
        total = sum(self.algorithm.batch_weight(mask[rows]) for rows in every_rank)
        sums: dict[str, float] = {}
        for _ in range(u.updates_per_step):
            shares: dict[str, float] = {}
            with self.optimizer_step.forwards():
                for i, rows in enumerate(slices):
                    weight = self.algorithm.batch_weight(mask[rows]) / total if total else 0.0

                    def forward(rows: slice = rows, weight: float = weight) -> tuple[torch.Tensor, Any]:
                        logprobs, entropy, ctx = self.terms(batch, rows)
                        loss, m = self.algorithm.loss(logprobs, old[rows.start], adv[rows], mask[rows], entropy)
                        aux = sum(ctx.losses.values()) * ((rows.stop - rows.start) / b) if ctx.losses else 0.0
                        return loss * weight + aux, (loss, m, ctx)

                    loss, m, ctx = self.optimizer_step.backward(forward, last=i == len(slices) - 1)
                    terms = {**m, "loss": float(loss.detach()), **{f"aux/{k}": float(v.detach()) for k, v in ctx.losses.items()}}
                    for key, value in terms.items():
                        shares[key] = shares.get(key, 0.0) + value * weight
            shares = p.sum_values(shares)  # the whole batch's weighted means
            aux = {k.removeprefix("aux/"): v for k, v in shares.items() if k.startswith("aux/")}
            result = self.optimizer_step.update(info.step, shares.get("loss", 0.0), aux)
            self.skipped_updates += not result.applied
            for key, value in shares.items():
                sums[key] = sums.get(key, 0.0) + value / u.updates_per_step
        self.tokens += int(batch.mask.sum())
        metrics.update({f"policy/{k}": v for k, v in sums.items()})
        metrics["policy/grad_norm"] = result.grad_norm
        metrics["policy/lr"] = info.lr
        if self.recipe.train.on_nonfinite == "skip":
            metrics["policy/skipped_updates"] = float(self.skipped_updates)
        return metrics

    # -- the loop -------------------------------------------------------------------------------------
    def train_step(self) -> dict[str, float]:
        started = time.perf_counter()
        batch, metrics = self.on_main(self.collect)
        info = self.optimizer_step.start(self.step + 1, self.tokens)
        if batch is None:
            if self.parallel.is_main:
                print(f"step {self.step + 1}: every group was dropped by {self.recipe.algorithm.name}'s filter; no update",
                      file=sys.stderr)
        else:
            metrics.update(self.update(batch, info))
            self.sync_weights()
        self.step += 1
        self.optimizer_step.end(info, self.tokens, metrics)
        metrics["time_s"] = time.perf_counter() - started
        return metrics

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Held-out LM loss and reward, on rank 0 (the others wait and get ``{}``)."""
        result: dict[str, float] = {}
        if self.parallel.is_main:
            windows, indices = self.heldout
            summary = score_model(self.model, self.eval_recipe, windows, indices, self.device)
            prompts, answers = self.heldout_prompts
            gen = self.engine.generate(prompts, self.sampling(seed=12345))
            reward = self.task.reward(answers, gen.tokens.cpu(), gen.mask.cpu())
            result = {"eval/heldout_bits_per_base": summary["bits_per_base"], "eval/heldout_reward": float(reward.mean())}
        self.parallel.barrier()
        return result

    # -- checkpoints ----------------------------------------------------------------------------------
    @property
    def checkpoint_root(self) -> Path:
        return self.recipe.out_dir / "checkpoints"

    def save(self) -> Path:
        """Write a checkpoint of this step (rank 0; every rank holds the same weights and optimizer state)."""
        path = self.checkpoint_root / checkpoint.step_name(self.step)
        if not all(bool(torch.isfinite(param).all()) for param in self.model.parameters()):
            raise TrainingDiverged(f"step {self.step}: the weights are not finite; no checkpoint written")
        if self.parallel.is_main:
            meta = {"recipe": self.policy_recipe.to_dict(), "rl_recipe": self.recipe.raw, "plugins": self.plugins.active(),
                    "tokens": self.tokens, "started_from": str(self.checkpoint)}
            state = {
                "optimizer": self.optimizer.state_dict(),
                "optimizer_names": checkpoint.optimizer_param_names(self.optimizer, self.model),
                "rng": checkpoint.rng_state(),
                "prompt_rng": self.rng.bit_generator.state,
                "tokens": self.tokens,
                "skipped_updates": self.skipped_updates,
                "history": self.history,
                "plugins": self.plugins.hooks.checkpoint_save(self.model),
            }
            path = checkpoint.save_checkpoint(self.checkpoint_root, self.step, self.model, state, meta)
            checkpoint.prune(self.checkpoint_root, self.recipe.train.keep_checkpoints)
        self.parallel.barrier()
        return path

    def resume(self) -> bool:
        """Continue from the newest verified checkpoint of the run directory (False: there is none). Changes of
        the RL recipe since that checkpoint take effect and are listed in the run header."""
        resumed = checkpoint.resume_on_ranks(self.checkpoint_root, self.model, self.policy_recipe.to_dict(), self.parallel,
                                             self.notes, plugins=self.plugins)
        if resumed is None:
            return False
        state = resumed.state
        names = checkpoint.optimizer_param_names(self.optimizer, self.model)
        carried = checkpoint.load_optimizer(self.optimizer, state["optimizer"], state["optimizer_names"], names)
        self.optimizer_step.set_hyperparameters()
        checkpoint.set_rng_state(state["rng"])
        self.rng.bit_generator.state = state["prompt_rng"]
        self.tokens, self.skipped_updates, self.history = state["tokens"], state["skipped_updates"], state["history"]
        self.step = resumed.meta["step"]
        self.plugins.hooks.checkpoint_load(self.model, state["plugins"])
        self.sync_weights()
        changes = "; ".join(checkpoint.recipe_changes(resumed.meta["rl_recipe"], self.recipe.raw))
        self.notes.append(f"resumed from {resumed.path}" + (f" with RL recipe changes: {changes}" if changes else ""))
        if carried is not None:
            self.notes.append(f"optimizer moments carried over for {carried} of {sum(map(len, names))} trained tensors")
        return True

    def header(self) -> str:
        r = self.recipe
        return "\n".join([
            f"megaseq rl {r.run.name!r} from {r.source}: policy {self.checkpoint}, algorithm {r.algorithm.name}, "
            f"engine {r.engine.name}, {r.sampling.prompts_per_step} prompts x {r.sampling.group_size} completions "
            f"of {r.sampling.max_new_tokens} tokens per step; out: {r.out_dir}"
            + (f"; {self.parallel.layout.dp} data-parallel ranks" if self.parallel.distributed else ""),
            *(f"  {note}" for note in self.notes),
        ])

    def run(self, mode: rundir.StartMode = "new") -> RLResult:
        """Run to ``train.steps`` RL steps in ``run.out_dir``, started as ``mode``: "new", "resume" or
        "overwrite" (core's run-directory rules, ``megaseq.train.rundir``); rank 0 holds the run directory's
        lock throughout."""
        with rundir.RunLock(self.recipe.out_dir, "rl") if self.parallel.is_main else contextlib.nullcontext():
            return self._run(mode)

    def _run(self, mode: rundir.StartMode) -> RLResult:
        r, p = self.recipe, self.parallel
        out = r.out_dir
        if p.is_main:
            rundir.prepare(out, mode)
        p.barrier()
        if mode == "resume":
            if not self.resume():
                self.notes.append(f"no checkpoint in {self.checkpoint_root} yet: starting at step 0")
            if p.is_main:
                if note := rundir.truncate_metrics(out, self.step):
                    self.notes.append(note)
        if p.is_main:
            print(self.header(), file=sys.stderr)
        logger = MetricsLogger(out, tensorboard=False) if p.is_main else None
        if not self.history:
            first = {"step": 0.0, **self.evaluate()}
            if logger:
                logger.log(0, first)
            self.history.append(first)
        saved_at = None
        bar = tqdm(total=r.train.steps, initial=self.step, disable=not self.progress, desc="rl", file=sys.stderr)
        with contextlib.closing(logger) if logger else contextlib.nullcontext(), StopRequests() as stop:
            while self.step < r.train.steps and not p.any(stop.requested is not None):
                metrics = self.train_step()
                if (r.eval.every and self.step % r.eval.every == 0) or self.step == r.train.steps:
                    metrics.update(self.evaluate())
                if logger and (self.step % r.train.log_every == 0 or "eval/heldout_reward" in metrics):
                    logger.log(self.step, metrics)
                self.history.append({"step": float(self.step), **metrics})
                if (r.train.checkpoint_every and self.step % r.train.checkpoint_every == 0) or self.step == r.train.steps:
                    self.save()
                    saved_at = self.step
                bar.update(1)
                bar.set_postfix(reward=f"{metrics['reward/mean']:.3f}")
            bar.close()
            if self.step < r.train.steps:  # a signal asked to stop (on some rank: all stop at the same step)
                saved = self.save() if saved_at != self.step else self.checkpoint_root / checkpoint.step_name(self.step)
                raise Interrupted(stop.requested or signal.SIGTERM, f"stopped after step {self.step}; saved {saved}; continue with --resume")
        if p.is_main:
            (out / "rl_history.json").write_text(json.dumps(self.history, indent=1))
            plot_history(self.history, out / "rl_curve.png", f"{r.run.name}: {r.algorithm.name}, {r.task.name}")
        return RLResult(out, self.history)


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, Tensor):
        return obj.cpu()
    if isinstance(obj, tuple | list):
        return type(obj)(_to_cpu(o) for o in obj)
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, Rollouts | Generation):
        return type(obj)(**{f: _to_cpu(getattr(obj, f)) for f in obj.__dataclass_fields__})
    return obj


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
