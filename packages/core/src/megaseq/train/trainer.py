"""The training loop: read top to bottom.

One optimizer step = ``grad_accum`` micro-batches of ``batch_size`` genome windows (the global batch: under
data parallelism each rank reads its share). Plugins see the loop only through lifecycle hooks (step
start/end, checkpoint save/load) and the forward context. Parallelism is set up before the loop
(``megaseq.distributed``): the loop asks its ``Parallel`` for this rank's part of a batch, the forward
context, the gradient sums and the norm; in one process those are identities. Every rank runs the whole
loop (hooks included); rank 0 alone logs, reports the evaluation and publishes checkpoints (every rank takes
part in an evaluation whose layout spreads the model or the sequence, see ``Trainer.eval``).

The optimizer step itself (gradient reduction, norm, the non-finite check agreed over ranks, clipping, the
update, the lifecycle hooks, the learning-rate schedule) is ``megaseq.train.step.OptimizerStep``, which a
plugin's training loop (an RL loop) shares: a non-finite step stops the run or is skipped (``train.on_nonfinite``)
before the update, so non-finite weights are never written.

Everything checkable is checked before the first step (data, held-out data, device, the run directory, the
checkpoint resumed from). Everything logged for a step is logged before that step's checkpoint is saved,
so a resumed run cuts its logs back to the checkpoint's step and logs each step once
(``megaseq.train.rundir``). Checkpoint files, their verification and pruning live in
``megaseq.train.checkpoint``; stopping on SIGINT/SIGTERM in ``megaseq.train.interrupt``.
"""

from __future__ import annotations

import contextlib
import math
import random
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from megaseq import threads
from megaseq.capabilities import check_components
from megaseq.config import Recipe
from megaseq.contracts import ForwardContext
from megaseq.data.transforms import apply_transforms, build_transforms
from megaseq.data.windows import Batch, WindowSampler, training_windows
from megaseq.devices import pick_device
from megaseq.distributed.experts import build_rank_model
from megaseq.distributed.groups import Parallel
from megaseq.distributed.layout import check_run_layout
from megaseq.distributed.sharded import Placement, local_optimizer_state, read_local_weights, shards_meta, write_shard
from megaseq.errors import TrainingDiverged
from megaseq.eval.evaluate import batch_to, evaluate_heldout
from megaseq.memory import heap
from megaseq.memory.plan import plan_run
from megaseq.memory.plan_report import describe_memory_policy
from megaseq.model import LanguageModel, chunked_token_losses, describe
from megaseq.parallel import tp_chunk
from megaseq.plugins import Plugins
from megaseq.train import checkpoint, rundir
from megaseq.train.interrupt import Interrupted, StopRequests
from megaseq.train.metrics import MetricsLogger, peak_memory_gib
from megaseq.train.optimizer import local_optimizer
from megaseq.train.progress import Progress
from megaseq.train.step import apply_memory_policies, build_optimizer_step
from megaseq.train.totals import StepTotals


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


def lm_loss(
    model: LanguageModel, batch: Batch, ctx: ForwardContext, chunk: int, total_weight: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Weighted next-token loss (nats) and the per-token losses. The weighted sum is divided by
    ``total_weight`` (default: this batch's weight, i.e. the mean); a rank holding part of a larger batch
    passes that batch's weight and gets its share of the mean."""
    hidden = model(batch.inputs, ctx)
    token_losses = chunked_token_losses(hidden, model.head_weight, batch.targets, chunk, ctx.tp, model.dims.vocab_size)
    weight = batch.weights.sum() if total_weight is None else total_weight
    weights = batch.weights if ctx.tp is None else tp_chunk(batch.weights, ctx.tp)  # the losses of this rank's chunk
    return (token_losses * weights).sum() / weight, token_losses


MEMORY_NOTE = {
    "cpu": "the progress bar's peak RSS is the whole process (libraries, data, the heap's freed pages unless trimmed), "
    "what the plan predicts",
    "cuda": "the progress bar's peak mem is torch's allocator peak on the device; the plan also counts the CUDA "
    "runtime's own memory",
}


def progress_line(
    metrics: dict[str, float], device: torch.device, planned_gib: float | None = None, tokens_per_s: float | None = None,
    unit: str = "base",
) -> str:
    """The progress line's note on a step: its loss in bits per token of the data's alphabet (``unit``: a base
    of DNA, a residue of protein; the unit of every result), labelled, the throughput over the recent steps
    (``tokens_per_s``; the step's own when not given), and the measured peak beside the plan's."""
    peak = "peak mem" if device.type == "cuda" else "peak RSS"
    plan = f" (plan {planned_gib:.2f} GiB)" if planned_gib is not None else ""
    rate = metrics["tokens_per_s"] if tokens_per_s is None else tokens_per_s
    return f"loss {metrics['bits_per_base']:.4f} bits/{unit}, {rate:.0f} tok/s, {peak} {metrics['peak_mem_gib']:.2f} GiB{plan}"


class Trainer:
    def __init__(
        self,
        recipe: Recipe,
        plugins: Plugins,
        *,
        parallel: Parallel | None = None,
        progress: bool = True,
        tensorboard: bool = True,
        lock_run: bool = True,
    ) -> None:
        """Assemble a run in stages, each in the module that owns it and taking what the earlier ones made: the
        layout, the components it asks for, the memory plan (first of what the run allocates: it decides whether
        torch asks for huge pages, ``megaseq.memory.heap``), the data, the model on this rank, the optimizer.
        ``lock_run=False``: the caller (``megaseq train``, or the launcher of a Ray run) holds the run
        directory's lock, taken before anything is built."""
        self.parallel = parallel or Parallel()
        check_run_layout(recipe, self.parallel.layout)
        check_components(recipe, plugins, self.parallel.layout)
        self.device = pick_device(recipe.run.device)
        self.memory = plan_run(recipe, plugins, self.device)
        if self.device.type == "cpu" and self.memory.maps_large_allocations:
            heap.ask_for_huge_pages()  # before the run's first tensor (megaseq/memory/heap.py)
        seed_everything(recipe.run.seed)
        self.train_windows = training_windows(recipe, plugins)
        self.transforms = build_transforms(recipe, plugins)  # data.transforms, for training batches only
        self.rank = build_rank_model(recipe, plugins, self.device, self.parallel)
        self.recipe = recipe = self.memory.recipe  # with the planner's policies under memory_policy = "auto"
        self.model = self.rank.model
        policies = apply_memory_policies(self.model, plugins, [(name, recipe.component("memory_policy", name))
                                                              for name in recipe.train.memory_policy])
        self.heap = heap.apply_run_setting(recipe.run.trim_heap, self.device, recipe.data.seq_len // self.parallel.layout.cp,
                                           self.model.blocks)
        self.optimizer_step = build_optimizer_step(self.model, recipe.train, plugins, recipe.source, self.parallel,
                                                   policies, self.rank.expert_params, self.rank.tp_params)
        self.optimizer = self.optimizer_step.optimizer

        self.plugins = plugins
        self.progress = progress and self.parallel.is_main
        self.out_dir = recipe.out_dir
        self.sampler = WindowSampler(len(self.train_windows), recipe.train.batch_size, recipe.run.seed)
        self.step = 0
        self.tokens = 0
        self.skipped_steps = 0
        self.checkpoint_meta: dict[str, Any] = {}  # more for every checkpoint's meta.json (e.g. the launch)
        self.tensorboard = tensorboard
        self.lock_run = lock_run
        # this process's share of the machine's cores, re-decided at step boundaries (``megaseq.threads``)
        self.core_share = threads.core_share() if self.device.type == "cpu" else None
        self.stop_file: Path | None = None  # a file whose appearance asks for a stop (``megaseq.train.interrupt``)
        self.notes: list[str] = []  # what resuming changed or found, for the run header

    # -- checkpoints --------------------------------------------------------------------------------
    @property
    def checkpoint_root(self) -> Path:
        return self.out_dir / "checkpoints"

    def placement(self) -> Placement:
        """Where this rank's tensors sit in the whole model and which blocks it writes (``Parallel.placement``)."""
        return self.rank.placement(self.parallel)

    def save(self) -> Path:
        """Write a checkpoint; every rank calls this (each writes its files, rank 0 publishes them)."""
        p = self.parallel
        if not all(bool(torch.isfinite(param).all()) for param in self.model.parameters()):
            raise TrainingDiverged(f"step {self.step}: the weights are not finite; no checkpoint written")
        if p.is_main:
            checkpoint.staging_dir(self.checkpoint_root, self.step)
        p.barrier()
        staged = checkpoint.staging_dir(self.checkpoint_root, self.step)
        run_state = {
            "sampler": self.sampler.state_dict(),
            "rng": checkpoint.rng_state(),
            "tokens": self.tokens,
            "skipped_steps": self.skipped_steps,
            "plugins": self.plugins.hooks.checkpoint_save(self.model),
        }
        local = local_optimizer(self.optimizer)
        placement = self.placement()
        written, shards = write_shard(
            staged,
            self.model,
            local,
            checkpoint.optimizer_param_names(local, self.model),
            run_state if p.is_main else None,
            placement,
            p.rank,
            shard=(p.rank, p.layout.world_size) if self.recipe.train.optimizer_shard else None,
        )
        # every rank hashes its own files and says where its blocks sit
        described = p.gather_on_main((checkpoint.file_entries(staged, written), shards))
        path = self.checkpoint_root / checkpoint.step_name(self.step)
        if p.is_main:
            meta = {
                "tokens": self.tokens,
                "recipe": self.recipe.to_dict(),
                "plugins": self.plugins.active(),
                "layout": vars(p.layout),
                **shards_meta([d for _, d in described], placement),
                **self.checkpoint_meta,
            }
            path = checkpoint.commit(self.checkpoint_root, self.step, meta, {k: v for d, _ in described for k, v in d.items()})
            checkpoint.prune(self.checkpoint_root, self.recipe.train.keep_checkpoints)
        p.barrier()
        return path

    def resume(self) -> bool:
        """Continue from the newest verified checkpoint (False: there is none, the run starts at step 0).

        The checks and the weights are ``checkpoint.load_for_resume``'s; recipe changes (a new ``train.lr``,
        ``train.steps``, ...) take effect and are listed in the run header.
        """
        resumed = checkpoint.resume_on_ranks(
            self.checkpoint_root, self.model, self.recipe.to_dict(), self.parallel, self.notes,
            lambda path, meta: read_local_weights(path, meta, self.placement()), plugins=self.plugins,
        )
        if resumed is None:
            return False
        state = resumed.state
        if not state:  # weights only (megaseq import writes no run state): step 0 with these weights
            self.notes.append(f"weights from {resumed.path}, which holds no run state: starting at step 0")
            return True
        names = checkpoint.optimizer_param_names(self.optimizer, self.model)
        saved, saved_names = local_optimizer_state(resumed.path, resumed.meta, state, self.placement())
        local = local_optimizer(self.optimizer)  # a shard of the state takes its tensors by name
        checkpoint.load_optimizer(local, saved, saved_names, checkpoint.optimizer_param_names(local, self.model))
        trained, saved_trained = {n for g in names for n in g}, {n for g in saved_names for n in g}
        carried = len(trained & saved_trained) if trained != saved_trained else None
        self.optimizer_step.set_hyperparameters()
        sampler = state["sampler"]
        window_order_kept = (sampler["n_windows"], sampler["seed"]) == (self.sampler.n_windows, self.sampler.seed)
        if window_order_kept:
            self.sampler.load_state_dict(sampler)
        checkpoint.set_rng_state(state["rng"])
        self.tokens = state["tokens"]
        self.skipped_steps = state.get("skipped_steps", 0)
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

    def initialise(self, path: Path) -> None:
        """Load the weights of ``path`` (run directory or checkpoint; train.init_from) before step 0."""
        found = checkpoint.resolve(path)
        meta = checkpoint.read_meta(found)
        checkpoint.load_weights(found, self.model, read_local_weights(found, meta, self.placement()))
        self.notes.append(f"weights from {found}")

    # -- the loop -----------------------------------------------------------------------------------
    def _micro_batch(self, totals: StepTotals, index: int, last: bool) -> None:
        """Forward and backward of this rank's part of global micro-batch ``index`` of the step (``last``: the
        step's last, whose backward sums the gradients over the ranks); what it saw goes to ``totals``. The data
        transforms see the whole micro-batch (every rank the same rows) in the data's ids, after the schedule's
        cut."""
        t, p = self.recipe.train, self.parallel
        length = self.recipe.data.length_at(self.step, self.tokens)  # the window-length schedule's stage
        whole = self.train_windows.batch(self.sampler.next_indices()).cut(length)
        whole = apply_transforms(self.transforms, whole, self.recipe.run.seed, self.step + 1, index)
        whole = whole.to_vocab(self.recipe.data.token_ids)
        batch = batch_to(p.local_batch(whole), self.device)
        ctx = p.forward_context(length)

        def forward() -> tuple[torch.Tensor, torch.Tensor]:
            with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=t.bf16):
                loss, _ = lm_loss(self.model, batch, ctx, t.loss_chunk, whole.weights.sum().to(self.device))
            return (loss + sum(ctx.losses.values()) / p.layout.dp) / t.grad_accum, loss.detach()

        loss = self.optimizer_step.backward(forward, last)
        totals.add(loss, batch.inputs.numel() // p.layout.tp, ctx)  # tensor-parallel ranks share them

    def train_step(self) -> dict[str, float]:
        t, p = self.recipe.train, self.parallel
        if self.core_share is not None:
            self.core_share.update()
        info = self.optimizer_step.start(self.step + 1, self.tokens)
        started = time.perf_counter()
        totals = StepTotals()
        with self.optimizer_step.forwards():
            for index in range(t.grad_accum):
                self._micro_batch(totals, index, last=index == t.grad_accum - 1)
        loss, tokens, aux, metrics = totals.reduce(p.sum, p.layout.dp, t.grad_accum)
        update = self.optimizer_step.update(info.step, loss, aux)
        self.skipped_steps += not update.applied  # a skipped step consumes its windows all the same
        self.step += 1
        self.tokens += tokens
        elapsed = time.perf_counter() - started
        metrics.update(
            {
                "loss": loss,
                "bits_per_base": loss / np.log(2),
                "lr": info.lr,
                "grad_norm": update.grad_norm,
                "tokens_per_s": tokens / elapsed,
                **({"seq_len": self.recipe.data.length_at(self.step - 1, self.tokens - tokens)}
                   if self.recipe.data.schedule else {}),
                "peak_mem_gib": update.peak_mem_gib,
                **({"skipped_steps": self.skipped_steps} if t.on_nonfinite == "skip" else {}),
                **{f"aux/{k}": v for k, v in aux.items()},
            }
        )
        self.optimizer_step.end(info, self.tokens, metrics)
        return metrics

    def describe_parameters(self) -> str:
        """The model line of the run header: under ep or tp a rank holds part of the parameters, so the line
        gives the whole model's count and each rank's, labelled."""
        layout = self.parallel.layout
        local = sum(p.numel() for p in self.model.parameters())
        splits = self.rank.splits
        cuts = ((splits.ep, layout.ep), (splits.etp, layout.etp), (splits.tp, layout.tp))
        whole = sum(p.numel() * math.prod(n for dims, n in cuts if name in dims) for name, p in self.model.named_parameters())
        if whole == local:
            return describe(self.model)
        split = ", ".join(f"{what} over {dim}={n}" for what, dim, n in (
            ("experts", "ep", layout.ep), ("expert widths", "etp", layout.etp), ("tensors", "tp", layout.tp)) if n > 1)
        layers = describe(self.model).partition("; ")[2]
        return f"{whole / 1e6:.2f}M parameters in all, {local / 1e6:.2f}M on each rank ({split}); {layers}"

    def header(self) -> str:
        plugins = ", ".join(dict.fromkeys(f"{p['dist']} {p['version']}" for p in self.plugins.active()))
        return "\n".join([
            f"megaseq run {self.recipe.run.name!r} from {self.recipe.source} on {self.device}"
            + (f" x {self.parallel.layout.world_size} workers ({self.parallel.layout})" if self.parallel.distributed else ""),
            f"  plugins: {plugins}",
            f"  model: {self.describe_parameters()}",
            f"  data: {len(self.train_windows)} training windows of {self.recipe.data.seq_len} bases"
            + "".join(f", cut into {s.seq_len} until " + (f"step {s.until_step}" if s.until_step else f"{s.until_tokens} tokens")
                      for s in self.recipe.data.schedule) + f"; out: {self.out_dir}",
            *([f"  data transforms, in order: {'; '.join(b.describe() for b in self.transforms)}"] if self.transforms else []),
            f"  memory: {describe_memory_policy(self.recipe, self.memory.chosen_by)}; heap: {self.heap}"
            + (f", {heap.huge_pages()}" if self.device.type == "cpu" else "") + f"; plan: {self.memory.note}",
            f"  {MEMORY_NOTE[self.device.type]}",
            *(f"  {note}" for note in self.notes),
        ])

    def run(self, mode: rundir.StartMode = "new", evaluate: bool = True) -> TrainResult:
        """Train to ``train.steps`` in the run directory, started as ``mode``: "new", "resume" or "overwrite";
        then, with ``evaluate``, score the held-out set (``[eval]``). Rank 0 holds the run directory's lock
        throughout (``rundir.RunLock``)."""
        holds_lock = self.parallel.is_main and self.lock_run
        with rundir.RunLock(self.out_dir, "training") if holds_lock else contextlib.nullcontext():
            return self._run(mode, evaluate)

    def _run(self, mode: rundir.StartMode, evaluate: bool) -> TrainResult:
        t, p = self.recipe.train, self.parallel
        if p.is_main:
            rundir.prepare(self.out_dir, mode)
        p.barrier()
        if mode == "resume":
            if not self.resume():
                self.notes.append(f"no checkpoint in {self.checkpoint_root} yet: starting at step 0")
            if p.is_main:
                if note := rundir.truncate_metrics(self.out_dir, self.step):
                    self.notes.append(note)
        if t.init_from is not None and self.step == 0:
            self.initialise(Path(t.init_from))
        if p.is_main:
            print(self.header(), file=sys.stderr)
            logger = MetricsLogger(self.out_dir, self.tensorboard, purge_step=self.step + 1 if mode == "resume" else None)
        else:
            logger = _NoLogger()
        losses: list[float] = []
        result_eval = saved_at = None
        bar = Progress("train", t.steps, initial=self.step, every=t.log_every, enabled=self.progress)
        with contextlib.closing(logger), StopRequests(self.stop_file) as stop:
            while self.step < t.steps and not p.any(stop.requested is not None):
                tokens_before = self.tokens
                metrics = self.train_step()
                losses.append(metrics["loss"])
                bar.record(tokens=self.tokens - tokens_before)  # then the line: this step's, with this step's rate
                bar.show(progress_line(metrics, self.device, self.memory.peak_gib, bar.tokens_per_s, self.recipe.alphabet.unit))
                if self.step % t.log_every == 0 or self.step == t.steps:
                    logger.log(self.step, metrics)
                if self.step == t.steps:
                    if evaluate:
                        result_eval = self.eval(baseline=True, write=True)
                        logger.log(self.step, result_eval["flat"] if result_eval else {})
                elif t.eval_every and self.step % t.eval_every == 0:
                    evaluated = self.eval(baseline=False)
                    logger.log(self.step, evaluated["flat"] if evaluated else {})
                if (t.checkpoint_every and self.step % t.checkpoint_every == 0) or self.step == t.steps:
                    self.save()
                    saved_at = self.step
            bar.close()
            if self.step < t.steps:  # a signal asked to stop (on some rank: all stop at the same step)
                saved = self.save() if saved_at != self.step else self.checkpoint_root / checkpoint.step_name(self.step)
                signum = stop.requested or signal.SIGTERM
                raise Interrupted(signum, f"stopped after step {self.step}; saved {saved}; continue with --resume")
        if evaluate and result_eval is None and self.step == t.steps and not losses:  # resumed at train.steps already
            if p.is_main:
                print(f"megaseq: the run was already at step {self.step} of {t.steps}; evaluating it", file=sys.stderr)
            result_eval = self.eval(baseline=True, write=True)
        if p.is_main and losses:
            print(f"megaseq: {self.peak_memory()}", file=sys.stderr)
        return TrainResult(self.out_dir, self.step, losses, result_eval)

    def peak_memory(self) -> str:
        """The process's peak up to this call (CPU: resident memory, what an out-of-memory killer sees; CUDA:
        allocated device memory) beside the plan's prediction."""
        measured, planned = peak_memory_gib(self.device), self.memory.peak_gib
        if planned is None:
            return f"peak memory {measured:.2f}G (plan: {self.memory.note})"
        return f"peak memory {measured:.2f}G, plan {planned:.2f}G ({planned / measured - 1:+.1%})"

    def eval(self, baseline: bool, write: bool = False) -> dict[str, Any] | None:
        """Held-out evaluation (``None`` on ranks other than 0). A layout that spreads the model or the sequence
        over ranks (cp, ep, tp, etp) evaluates each window as it trains, every rank with its part: its zig-zag
        shard of the window, its blocks, its experts (``Parallel.window_losses``); a window one device cannot
        hold in training is never run whole on one. Otherwise (data parallelism alone) rank 0 evaluates its
        whole replica."""
        layout, p = self.parallel.layout, self.parallel
        spread = layout.cp > 1 or layout.ep > 1 or layout.tp > 1 or layout.etp > 1
        result = None
        if spread or p.is_main:
            out_dir = rundir.eval_dir(self.out_dir, self.step) if write and p.is_main else None
            result = evaluate_heldout(self.model, self.recipe, self.device, self.plugins, out_dir, baseline=baseline,
                                      progress=self.progress, parallel=p if spread else None)
        p.barrier()
        return result


class _NoLogger:
    """What ranks other than 0 log to: nothing (rank 0 logs the reduced metrics once)."""

    def log(self, step: int, metrics: dict[str, float]) -> None:
        pass

    def close(self) -> None:
        pass
