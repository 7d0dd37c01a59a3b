"""The training loop: read top to bottom.

One optimizer step = ``grad_accum`` micro-batches of ``batch_size`` genome windows (the global batch: under
data parallelism each rank reads its share). Plugins see the loop only through lifecycle hooks (step
start/end, checkpoint save/load) and the forward context. Parallelism is set up before the loop
(``megaseq.distributed``): the loop asks its ``Parallel`` for this rank's part of a batch, the forward
context, the gradient sums and the norm; in one process those are identities. Every rank runs the whole
loop (hooks included); rank 0 alone logs, evaluates and publishes checkpoints.

The optimizer step itself (gradient reduction, norm, the non-finite check agreed over ranks, clipping, the
update, the lifecycle hooks, the learning-rate schedule) is ``megaseq.train.step.OptimizerStep``, which the
RL loop of megaseq-rl shares: a non-finite step stops the run or is skipped (``train.on_nonfinite``)
before the update, so non-finite weights are never written.

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
from megaseq.data.errors import DataError
from megaseq.data.sources import tokenized
from megaseq.data.windows import Batch, GenomeWindows, WindowSampler
from megaseq.devices import pick_device
from megaseq.distributed.experts import (
    build_local_model,
    layout_etp_dims,
    layout_expert_dims,
    layout_tp_dims,
    whole_shapes,
)
from megaseq.distributed.groups import Parallel
from megaseq.distributed.layout import Layout, check_layout
from megaseq.distributed.sharded import (
    Placement,
    local_optimizer_state,
    read_local_weights,
    shards_meta,
    write_shard,
)
from megaseq.errors import TrainingDiverged, UserError
from megaseq.eval.evaluate import batch_to, evaluate_heldout
from megaseq.memory import heap
from megaseq.memory.machine import GiB
from megaseq.memory.plan import planned_peak
from megaseq.memory.plan_report import describe_memory_policy
from megaseq.model import LanguageModel, chunked_token_losses, describe
from megaseq.parallel import tp_chunk
from megaseq.plugins import Plugins
from megaseq.train import checkpoint, rundir
from megaseq.train.interrupt import Interrupted, StopRequests
from megaseq.train.metrics import MetricsLogger, peak_memory_gib
from megaseq.train.optimizer import local_optimizer, make_optimizer
from megaseq.train.progress import Progress
from megaseq.train.step import OptimizerStep, apply_memory_policies
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


def freeze_except(model: torch.nn.Module, patterns: list[str], source: str) -> None:
    """Train only parameters whose names match one of ``patterns`` (fnmatch globs); freeze the rest."""
    names = [name for name, _ in model.named_parameters()]
    for pattern in patterns:
        if not fnmatch.filter(names, pattern):
            raise UserError(f"{source}: train.trainable: {pattern!r} matches no parameter; e.g. {names[:3]}")
    for name, p in model.named_parameters():
        if not any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns):
            p.requires_grad_(False)


def data_windows(recipe: Recipe, which: str, plugins: Plugins | None = None) -> GenomeWindows:
    """The windows of ``data.train`` or ``data.heldout``; unreadable or unusable data is a one-line error."""
    d = recipe.data
    spec = getattr(d, which)
    alphabet = recipe.alphabet
    try:
        tokens = tokenized(recipe.corpus(which, plugins), plugins=plugins)
    except DataError as exc:
        raise DataError(f"{recipe.source}: data.{which}: {exc}") from None
    windows = GenomeWindows(tokens, d.seq_len, max_n_fraction=d.max_n_fraction, softmask_weight=d.softmask_weight,
                            alphabet=alphabet)
    if len(windows) == 0:
        raise DataError(
            f"{recipe.source}: data.{which} {spec!r} has no window of data.seq_len {d.seq_len} {alphabet.unit}s with "
            f"at most data.max_n_fraction {d.max_n_fraction} {alphabet.unknown}"
        )
    return windows


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
        """``lock_run=False``: the caller (``megaseq train``, or the launcher of a Ray run) holds the run
        directory's lock, taken before anything is built."""
        self.recipe = recipe
        self.plugins = plugins
        self.parallel = parallel or Parallel()
        if self.parallel.layout != Layout.of(recipe):
            raise ValueError(f"the process groups are laid out as {self.parallel.layout}, the recipe as {Layout.of(recipe)}")
        check_layout(recipe, self.parallel.layout)  # e.g. a batch that does not split evenly would lose windows
        check_components(recipe, plugins, self.parallel.layout)
        self.progress = progress and self.parallel.is_main
        self.out_dir = recipe.out_dir
        self.device = pick_device(recipe.run.device)
        seed_everything(recipe.run.seed)
        self.train_windows = data_windows(recipe, "train", plugins)
        data_windows(recipe, "heldout", plugins)  # a bad data.heldout fails now, not after training
        p = self.parallel
        self.model = build_local_model(
            recipe, plugins, self.device, p.ep_rank, p.layout.ep, p.tp_rank, p.layout.tp, p.etp_rank, p.layout.etp
        )
        self.expert_dims = layout_expert_dims(recipe, plugins, p.layout.ep)
        self.etp_dims = layout_etp_dims(recipe, plugins, p.layout.etp)
        self.tp_dims = layout_tp_dims(recipe, plugins, p.layout.tp)
        self.shapes = whole_shapes(recipe, plugins)  # where this rank's blocks sit (``placement``)
        self.tp_lengths = {name: self.shapes[name][dim] for name, dim in self.tp_dims.items()}  # blocks may be padded
        self.expert_params = {param for name, param in self.model.named_parameters()
                              if name in self.expert_dims or name in self.etp_dims}
        self.tp_params = {param for name, param in self.model.named_parameters() if name in self.tp_dims}
        self.plan = None
        if recipe.train.memory_policy == "auto":  # the planner's choice for this recipe, layout and device
            from megaseq.memory.plan import choose_memory_policy

            self.recipe, self.plan = choose_memory_policy(recipe, plugins, self.device)
            recipe = self.recipe
        planned = self.plan.chosen if self.plan is not None else planned_peak(recipe, plugins, self.device)
        self.planned_gib = planned.device_peak / GiB if not isinstance(planned, str) else None
        self.planned_note = f"{self.planned_gib:.2f}G per device" if self.planned_gib is not None else planned
        configs = [(name, recipe.component("memory_policy", name)) for name in recipe.train.memory_policy]
        policies = apply_memory_policies(self.model, plugins, configs)
        tokens_per_device = recipe.data.seq_len // self.parallel.layout.cp
        self.heap = heap.apply_run_setting(recipe.run.trim_heap, self.device, tokens_per_device, self.model.blocks)
        if recipe.train.trainable is not None:
            freeze_except(self.model, recipe.train.trainable, recipe.source)
        self.optimizer = make_optimizer(self.model, recipe.train, self.parallel)
        self.optimizer_step = OptimizerStep(
            self.optimizer, recipe.train, self.model, plugins, self.parallel, policies, self.expert_params, self.tp_params
        )
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
        return self.parallel.placement(self.shapes, self.expert_dims, self.etp_dims, self.tp_dims)

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
        p = self.parallel
        if p.is_main:
            self.notes += [f"removed {name}, left by an interrupted save" for name in checkpoint.remove_leftovers(self.checkpoint_root)]

        def load() -> checkpoint.Resumed | None:
            return checkpoint.load_for_resume(
                self.checkpoint_root,
                self.model,
                self.recipe.to_dict(),
                lambda path, meta: read_local_weights(path, meta, self.placement()),
            )

        # rank 0 first: it sets damaged checkpoints aside, so that the others find the same newest good one
        resumed = load() if p.is_main else None
        p.barrier()
        if not p.is_main:
            resumed = load()
        if resumed is None:
            return False
        if resumed.warning and p.is_main:
            print(f"megaseq: warning: {resumed.warning}", file=sys.stderr)
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
    def _micro_batch(self, totals: StepTotals) -> None:
        """Forward and backward of this rank's part of one global micro-batch; what it saw goes to ``totals``."""
        t, p = self.recipe.train, self.parallel
        whole = self.train_windows.batch(self.sampler.next_indices()).to_vocab(self.recipe.data.token_ids)
        batch = batch_to(p.local_batch(whole), self.device)
        ctx = p.forward_context(self.recipe.data.seq_len)
        autocast = torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=t.bf16)
        with autocast:
            loss, _ = lm_loss(self.model, batch, ctx, t.loss_chunk, whole.weights.sum().to(self.device))
        total = loss + sum(ctx.losses.values()) / p.layout.dp
        (total / t.grad_accum).backward()
        totals.add(loss.detach(), batch.inputs.numel() // p.layout.tp, ctx)  # tensor-parallel ranks share them

    def train_step(self) -> dict[str, float]:
        t, p = self.recipe.train, self.parallel
        if self.core_share is not None:
            self.core_share.update()
        info = self.optimizer_step.start(self.step + 1, self.tokens)
        started = time.perf_counter()
        totals = StepTotals()
        with self.optimizer_step.forwards():
            for _ in range(t.grad_accum):
                self._micro_batch(totals)
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
        cuts = ((self.expert_dims, layout.ep), (self.etp_dims, layout.etp), (self.tp_dims, layout.tp))
        whole = sum(p.numel() * math.prod(n for dims, n in cuts if name in dims) for name, p in self.model.named_parameters())
        if whole == local:
            return describe(self.model)
        split = ", ".join(f"{what} over {dim}={n}" for what, dim, n in (
            ("experts", "ep", layout.ep), ("expert widths", "etp", layout.etp), ("tensors", "tp", layout.tp)) if n > 1)
        layers = describe(self.model).partition("; ")[2]
        return f"{whole / 1e6:.2f}M parameters in all, {local / 1e6:.2f}M on each rank ({split}); {layers}"

    def header(self) -> str:
        plugins = ", ".join(f"{p['dist']} {p['version']}" for p in self.plugins.active())
        return "\n".join([
            f"megaseq run {self.recipe.run.name!r} from {self.recipe.source} on {self.device}"
            + (f" x {self.parallel.layout.world_size} workers ({self.parallel.layout})" if self.parallel.distributed else ""),
            f"  plugins: {plugins}",
            f"  model: {self.describe_parameters()}",
            f"  data: {len(self.train_windows)} training windows of {self.recipe.data.seq_len} bases; out: {self.out_dir}",
            f"  memory: {describe_memory_policy(self.recipe, self.plan)}; heap: {self.heap}; plan: {self.planned_note}",
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
                bar.show(progress_line(metrics, self.device, self.planned_gib, bar.tokens_per_s, self.recipe.alphabet.unit))
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
        measured = peak_memory_gib(self.device)
        if self.planned_gib is None:
            return f"peak memory {measured:.2f}G (plan: {self.planned_note})"
        return f"peak memory {measured:.2f}G, plan {self.planned_gib:.2f}G ({self.planned_gib / measured - 1:+.1%})"

    def eval(self, baseline: bool, write: bool = False) -> dict[str, Any] | None:
        """Held-out evaluation (``None`` on ranks other than 0). A layout that spreads the model over ranks (ep, tp,
        etp) evaluates it where it is, every rank with its part (``Parallel.window_losses``); otherwise rank 0
        evaluates its whole replica."""
        layout, p = self.parallel.layout, self.parallel
        spread = layout.ep > 1 or layout.tp > 1 or layout.etp > 1
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
