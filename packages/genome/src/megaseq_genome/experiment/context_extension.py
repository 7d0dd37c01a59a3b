"""``megaseq context-extension RECIPE``: does training at long context teach a model to use it?

Pretrain the recipe at a short context with a curriculum (windows that lengthen in steps, planted repeats
annealed to none) and, beside it, a control on the same steps and tokens without the curriculum; continue the
pretrain at a long context and, from the same checkpoint, at the short context for the same tokens and steps;
optionally train a parameter-matched softmax-attention model on the same budget; score all of them and k-mer
Markov baselines on one fixed held-out set by context position and by the distance back to each target's
earlier k-mer (``megaseq_genome.heldout_set``, ``megaseq_genome.retrieval``), with bootstrap intervals over
windows; write a report with the experiment's targets checked (``megaseq_genome.experiment.report``). The plan
and its stages are in ``megaseq_genome.experiment.plan``.

Every stage and every evaluation runs in its own process (so its wall time and peak memory are its own),
``plan.jobs`` at a time, the machine's cores shared out between them as intra-op threads. Each stage is a
training run with its own run directory ``OUT/STAGE`` (``megaseq.train.rundir``: metrics, verified
checkpoints); a finished stage writes ``OUT/STAGE/stage.json``. A model is scored from its run's newest
verified checkpoint into that run's ``eval/step_N/`` (where ``megaseq eval`` writes), as ``heldout_set.npz``
(per-window, per-bucket loss sums) and ``heldout_set.json`` (time and memory); a Markov baseline into
``OUT/baselines/markov-K.npz``. ``OUT`` follows the run-directory rule as a whole: a new experiment refuses
a directory that holds one; ``--resume`` skips what is done and resumes an unfinished stage from its newest
verified checkpoint; ``--overwrite`` deletes it first. What ``--resume`` reuses is checked piece by piece
(:func:`check_reuse`), not as a whole plan: a stage's checkpoints must come from the recipe the plan gives it
now, its parent stage must be finished, and an evaluation must have been scored on the same held-out set.
So a plan may change where nothing made under the old one is kept: change the continuations' learning rate,
delete ``OUT/long`` and ``OUT/short``, and ``--resume`` retrains those two from the pretrain it keeps (or
copy the finished stages into a new ``--out``).

Before anything trains: the plan and every stage's recipe are validated, the memory planner
(``megaseq.memory``) must find that every stage fits in this machine's memory shared by ``plan.jobs``
concurrent jobs, and the held-out set must have a window (one line each, exit status 2).
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import os
import re
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from megaseq.config import load_recipe
from megaseq.errors import UserError
from megaseq.plugins import get_plugins
from megaseq.train import rundir
from megaseq_genome.experiment.plan import STAGES, ContextExtensionPlan, Stage, load_plan, parameter_count, stages
from megaseq_genome.experiment.report import write_report
from megaseq_genome.retrieval import KS


def peak_rss_gib() -> float:
    """This process's peak resident set (VmHWM), GiB."""
    match = re.search(r"VmHWM:\s+(\d+) kB", Path("/proc/self/status").read_text())
    return int(match.group(1)) / 2**20 if match else float("nan")


# --- what runs in a child process ------------------------------------------------------------------------


def _child_setup(threads: int) -> Any:
    from megaseq import threads as thread_counts

    thread_counts.fix(threads)  # the experiment shares the cores out itself
    return get_plugins()


def train_stage(raw: dict, source: str, init_from: str | None, threads: int, result: str) -> None:
    from megaseq.config import validate_recipe
    from megaseq.train import checkpoint
    from megaseq.train.trainer import Trainer

    plugins = _child_setup(threads)
    recipe = validate_recipe(raw, plugins, source)
    trainer = Trainer(recipe, plugins, progress=False, tensorboard=False)
    if init_from is not None and checkpoint.newest_verified(trainer.checkpoint_root).path is None:
        load_newest(Path(init_from), trainer.model)  # a continuation starts from its parent's weights
    mode = "resume" if rundir.run_outputs(trainer.out_dir) else "new"
    started, cpu_started = time.perf_counter(), time.process_time()
    trainer.run(mode, evaluate=False)
    record = {
        "steps": trainer.step,
        "tokens": trainer.tokens,
        "wall_s": time.perf_counter() - started,
        "cpu_s": time.process_time() - cpu_started,
        "peak_rss_gib": peak_rss_gib(),
        "threads": threads,
        "parameters": sum(p.numel() for p in trainer.model.parameters()),
    }
    Path(result).write_text(json.dumps(record, indent=2))


def load_newest(run_dir: Path, model: Any) -> Path:
    """Load the newest verified checkpoint of ``run_dir`` into ``model``; returns its path."""
    from megaseq.distributed.sharded import read_full_weights
    from megaseq.train import checkpoint

    found = checkpoint.newest_verified(run_dir / "checkpoints")
    if found.path is None:
        raise checkpoint.CheckpointError(f"{run_dir}: no usable checkpoint" + (f" ({found.report()})" if found.report() else ""))
    checkpoint.load_weights(found.path, model, read_full_weights(found.path, checkpoint.read_meta(found.path)))
    return found.path


def model_eval_path(out: Path, stage: Stage) -> Path:
    """Where the evaluation of ``stage``'s final checkpoint goes: ``OUT/STAGE/eval/step_N/heldout_set.npz``."""
    from megaseq.train.checkpoint import step_name

    return out / stage.name / "eval" / step_name(stage.steps) / "heldout_set.npz"


def markov_eval_path(out: Path, order: int) -> Path:
    return out / "baselines" / f"markov-{order}.npz"


def evaluate(spec: dict, threads: int, result: str) -> None:
    """Score one model or Markov baseline on the held-out set; write per-window bucket sums to ``result``."""
    import torch

    from megaseq.config import validate_recipe
    from megaseq.contracts import ForwardContext
    from megaseq.data.sources import tokenized
    from megaseq.devices import pick_device
    from megaseq.model import build_model, chunked_token_losses
    from megaseq_genome.heldout_set import HeldoutSet, score_windows
    from megaseq_genome.markov import fitted_markov
    from megaseq_genome.retrieval import RetrievalLoss

    plugins = _child_setup(threads)
    heldout = HeldoutSet(**spec["heldout"])
    tokens = tokenized(heldout.dataset)
    retrieval = RetrievalLoss(len(heldout.starts), tuple(spec["retrieval_ks"]))
    started, cpu_started = time.perf_counter(), time.process_time()
    if spec["kind"] == "markov":
        baseline = fitted_markov(spec["train"], spec["order"])
        fit_s = time.perf_counter() - started
        acc = score_windows(heldout, tokens, spec["first_bucket"], baseline.token_losses, retrieval)
        extra = {"fit_s": fit_s}
    else:
        recipe = validate_recipe(spec["recipe"], plugins, spec["source"])
        device = pick_device(recipe.run.device)
        model = build_model(recipe, plugins).eval()
        scored = load_newest(Path(spec["run_dir"]), model)
        if scored.name != Path(result).parent.name:
            raise RuntimeError(f"{spec['run_dir']}: the newest verified checkpoint is {scored.name}, not the final one")
        model.to(device)
        context = spec["eval_context"]

        @torch.no_grad()
        def losses(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            inputs, targets = inputs.to(device), targets.to(device)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=recipe.train.bf16):
                if context is None:
                    hidden = model(inputs, ForwardContext())
                    return chunked_token_losses(hidden, model.head_weight, targets, recipe.train.loss_chunk).float()
                return sliding_losses(model, inputs, targets, context, recipe.train.loss_chunk)

        acc = score_windows(heldout, tokens, spec["first_bucket"], losses, retrieval)
        extra = {"eval_context": context, "checkpoint": str(scored)}
    meta = {
        "wall_s": time.perf_counter() - started,
        "cpu_s": time.process_time() - cpu_started,
        "peak_rss_gib": peak_rss_gib(),
        "threads": threads,
        "scored_on": evaluation_record(spec),
        **extra,
    }
    Path(result).parent.mkdir(parents=True, exist_ok=True)
    Path(result).with_suffix(".json").write_text(json.dumps(meta, indent=2))
    # the .npz, written last and renamed into place, is what marks this evaluation done
    np.savez(result + ".tmp.npz", sums=acc.sums, edges=np.asarray(acc.edges), **retrieval.arrays())
    os.replace(result + ".tmp.npz", result)


def sliding_losses(model: Any, inputs: Any, targets: Any, context: int, loss_chunk: int) -> Any:
    """Token losses of a model that may only see ``context`` tokens: targets are scored in blocks of
    ``context // 2``, each block fed with the tokens before it up to ``context`` in all, so a target at
    position p sees min(p + 1, context // 2) to ``context`` tokens of its window."""
    import torch

    from megaseq.contracts import ForwardContext
    from megaseq.model import chunked_token_losses

    step, length, parts = max(1, context // 2), inputs.shape[1], []
    for block in range(0, length, step):
        end = min(block + step, length)
        first = max(0, end - context)
        hidden = model(inputs[:, first:end], ForwardContext())
        losses = chunked_token_losses(hidden, model.head_weight, targets[:, first:end], loss_chunk).float()
        parts.append(losses[:, block - first :])
    return torch.cat(parts, dim=1)


# --- the parent: schedule the children, report ------------------------------------------------------------


@dataclass
class Job:
    name: str
    target: Any
    args: tuple
    result: Path
    after: tuple[str, ...] = ()
    process: Any = None
    started: float = 0.0


def _progress_line(running: list[Job], out: Path) -> str:
    parts = []
    for job in running:
        metrics = out / job.name / "metrics.jsonl"
        last = None
        if metrics.exists():
            lines = metrics.read_text().splitlines()
            last = json.loads(lines[-1]) if lines else None
        elapsed = time.perf_counter() - job.started
        if last is not None and "loss" in last:
            parts.append(f"{job.name} step {last['step']} {last['bits_per_base']:.3f} bits ({elapsed:.0f} s)")
        else:
            parts.append(f"{job.name} ({elapsed:.0f} s)")
    return "  |  ".join(parts)


def run_jobs(jobs: list[Job], parallel: int, out: Path, log_every: float = 60.0) -> None:
    """Run jobs in child processes, ``parallel`` at a time, each after the jobs named in its ``after``."""
    context = multiprocessing.get_context("spawn")
    pending = [j for j in jobs if not j.result.exists()]
    done = {j.name for j in jobs if j.result.exists()}
    running: list[Job] = []
    last_log = time.perf_counter()

    def stop(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    # Python's default SIGTERM exits without running `finally`, and daemonic children are only reaped at a
    # normal exit: a terminated experiment would leave its stages training as orphans.
    previous = signal.signal(signal.SIGTERM, stop)
    try:
        while pending or running:
            for job in [j for j in pending if all(a in done for a in j.after)][: parallel - len(running)]:
                pending.remove(job)
                print(f"[experiment] start {job.name}", file=sys.stderr, flush=True)
                # daemonic: a child never outlives this process
                job.process = context.Process(target=job.target, args=(*job.args, str(job.result)), name=job.name, daemon=True)
                job.started = time.perf_counter()
                job.process.start()
                running.append(job)
            time.sleep(0.2)
            for job in list(running):
                if job.process.exitcode is None:
                    continue
                running.remove(job)
                if job.process.exitcode != 0 or not job.result.exists():
                    raise UserError(f"experiment: {job.name} failed (exit {job.process.exitcode}); see the messages above")
                done.add(job.name)
                print(f"[experiment] done {job.name} in {time.perf_counter() - job.started:.0f} s", file=sys.stderr, flush=True)
            if running and time.perf_counter() - last_log > log_every:
                last_log = time.perf_counter()
                print(f"[experiment] {_progress_line(running, out)}", file=sys.stderr, flush=True)
    finally:
        signal.signal(signal.SIGTERM, previous)
        for job in running:
            job.process.terminate()
            job.process.join()


def plan_jobs(plan: ContextExtensionPlan, all_stages: list[Stage], heldout: dict, train_data: str, out: Path, threads: int) -> list[Job]:
    jobs = []
    for stage in all_stages:
        init = str(out / stage.init_from) if stage.init_from else None
        args = (stage.recipe.to_dict(), stage.recipe.source, init, threads)
        jobs.append(Job(stage.name, train_stage, args, out / stage.name / "stage.json", (stage.init_from,) if init else ()))
    for stage in all_stages:
        spec = {"name": stage.name, "kind": "model", "recipe": stage.recipe.to_dict(), "source": stage.recipe.source,
                "run_dir": str(out / stage.name), "eval_context": stage.eval_context}
        jobs.append(Job(f"eval-{stage.name}", evaluate, (spec | common(plan, heldout), threads), model_eval_path(out, stage), (stage.name,)))
    for order in plan.markov_orders:
        spec = {"name": f"markov-{order}", "kind": "markov", "train": train_data, "order": order}
        jobs.append(Job(f"eval-markov-{order}", evaluate, (spec | common(plan, heldout), threads), markov_eval_path(out, order)))
    return jobs


def common(plan: ContextExtensionPlan, heldout: dict) -> dict:
    return {"heldout": heldout, "first_bucket": plan.first_bucket, "retrieval_ks": list(KS)}


def describe_plan(all_stages: list[Stage], plan: ContextExtensionPlan) -> str:
    lines = [f"{'stage':8} {'seq_len':>8} {'steps':>6} {'windows/step':>12} {'tokens':>11}  starts from"]
    for s in all_stages:
        t = s.recipe.train
        lines.append(f"{s.name:8} {s.recipe.data.seq_len:8} {t.steps:6} {t.batch_size * t.grad_accum:12} "
                     f"{s.tokens:11,}  {s.init_from or 'scratch'}")
    for s in all_stages:
        data = s.recipe.data
        if data.schedule:
            cuts = ", ".join(f"{st.seq_len} until " + (f"step {st.until_step}" if st.until_step is not None else
                                                       f"{st.until_tokens:,} tokens") for st in data.schedule)
            lines.append(f"{s.name}: windows of {cuts}, then {data.seq_len}")
        if "planted-repeats" in data.transforms:
            planted = s.recipe.component("data_transform", "planted-repeats")
            lines.append(f"{s.name}: planted repeats (up to {planted.segment} bases) in {planted.share:.0%} of the windows "
                         f"until step {planted.anneal_from_step}, none from step {planted.anneal_until_step}")
    lines.append(f"held-out: {plan.eval_windows} windows of {plan.long_len} from {plan.heldout} "
                 f"{list(plan.heldout_region)}; Markov orders {plan.markov_orders}; {plan.jobs} job(s) at once")
    return "\n".join(lines)


def check_memory(all_stages: list[Stage], plan: ContextExtensionPlan, plugins: Any) -> None:
    """Every stage must fit, by the memory planner, in this machine's memory (``plan.memory_gib``, default
    all of it) shared by ``plan.jobs`` jobs at once; a stage that does not is a one-line error before training."""
    from megaseq.devices import device_type
    from megaseq.distributed.layout import Layout
    from megaseq.memory.machine import Machine
    from megaseq.memory.plan import plan as memory_plan

    for stage in all_stages:
        recipe = stage.recipe
        kind = device_type(recipe.run.device)
        machine = Machine.detect(kind, plan.memory_gib)
        if kind == "cpu":  # the jobs running at once share the machine's memory (a GPU job has the device)
            machine = dataclasses.replace(machine, device_bytes=machine.device_bytes // plan.jobs)
        policies = recipe.train.memory_policy
        result = memory_plan(recipe, plugins, layout=Layout(), machine=machine,
                             policies=policies if policies == "auto" or policies else "none")
        if result.chosen is None:
            policy = "any memory policy set" if policies == "auto" else f"train.memory_policy = {policies}"
            shorter = ", a smaller long_len" if stage.name == "long" else ""
            raise UserError(
                f"experiment: stage {stage.name} (seq_len {recipe.data.seq_len}) does not fit with {policy}: "
                f"{result.summary()} ({plan.jobs} job(s) at once; `megaseq plan` shows the estimate); set "
                f"{stage.name}.train.memory_policy=auto{shorter} or jobs=1"
            )


def evaluation_record(spec: dict) -> dict:
    """What an evaluation's scores depend on besides the model: the held-out windows, the buckets and, for a
    Markov baseline, its training data and order. Saved beside the scores; ``--resume`` compares it."""
    keys = ("heldout", "first_bucket", "retrieval_ks", "eval_context", "train", "order")
    return json.loads(json.dumps({k: spec[k] for k in keys if k in spec}))  # tuples -> lists, as read back


def check_reuse(out: Path, all_stages: list[Stage], jobs: list[Job], plugins: Any) -> list[str]:
    """Refuse (one line) to resume on top of anything made under a different plan: a stage whose checkpoints
    come from another recipe (``train.lr 0.001 -> 0.0001``), a stage with checkpoints whose parent is not
    finished (its weights came from a parent that is gone), an evaluation scored on another held-out set.
    Returns notes for what cannot be checked (evaluations saved before their record was)."""
    from megaseq.config import stored_recipe
    from megaseq.train import checkpoint

    for stage in all_stages:
        found = checkpoint.newest_verified(out / stage.name / "checkpoints")
        if found.path is None:
            continue
        saved = stored_recipe(checkpoint.read_meta(found.path)["recipe"], plugins, str(found.path / "meta.json"))
        changes = checkpoint.recipe_changes(saved, stage.recipe.to_dict())
        if changes:
            raise UserError(
                f"{out / stage.name}: trained with a different recipe ({changes[0]}"
                + (f" and {len(changes) - 1} more" if len(changes) > 1 else "")
                + f"); delete {out / stage.name} to train it again with this plan, or use another --out"
            )
        if stage.init_from and not (out / stage.init_from / "stage.json").exists():
            raise UserError(
                f"{out / stage.name}: continues stage {stage.init_from}, which is not finished in {out}; "
                f"delete {out / stage.name} to train it again from the new {stage.init_from}"
            )
    notes = []
    for job in jobs:
        record_path = job.result.with_suffix(".json")
        if job.target is not evaluate or not job.result.exists() or not record_path.exists():
            continue
        saved, current = json.loads(record_path.read_text()).get("scored_on"), evaluation_record(job.args[0])
        if saved is None:
            notes.append(f"{job.result}: reused without a check (saved before megaseq recorded its held-out set)")
        elif saved != current:
            changed = next(k for k in sorted(set(saved) | set(current)) if saved.get(k) != current.get(k))
            raise UserError(
                f"{job.result}: scored with a different {changed} than this plan's; delete it (and its .json) "
                "to score again, or use another --out"
            )
    return notes


EXPERIMENT_OUTPUTS = (
    "plan.json", "report.json", "report.md", "bits_by_bucket.png", "retrieval_by_distance.png", "baselines", *STAGES
)


def prepare_out(out: Path, plan: ContextExtensionPlan, mode: str) -> None:
    """The run-directory rule (``megaseq.train.rundir``) for the experiment's directory as a whole (what a
    resumed experiment reuses is checked by :func:`check_reuse`)."""
    rundir.prepare(out, mode, EXPERIMENT_OUTPUTS, holds="a context-extension experiment", option="--out")
    (out / "plan.json").write_text(json.dumps(plan.model_dump(mode="json"), indent=2))


def run_context_extension(
    recipe_path: str, scale: str, sets: list[str], out: Path, mode: str = "new", dry_run: bool = False
) -> dict:
    """The whole experiment (module docstring), ``mode`` "new", "resume" or "overwrite". Returns the report
    (also written under ``out``); nothing is written for ``dry_run``."""
    from megaseq.data.sources import tokenized
    from megaseq_genome.heldout_set import select_heldout

    plan = load_plan(scale, sets)
    plugins = get_plugins()
    recipe = load_recipe(recipe_path, plugins)
    all_stages = stages(plan, recipe.to_dict(), plugins, str(recipe_path), out)
    check_memory(all_stages, plan, plugins)
    # the held-out set is chosen (and an empty one rejected) before anything trains
    heldout = select_heldout(tokenized(plan.heldout), plan.heldout, plan.heldout_region, plan.long_len, plan.eval_windows)
    print(describe_plan(all_stages, plan), file=sys.stderr)
    if len(heldout.starts) < plan.eval_windows:
        print(f"[experiment] only {len(heldout.starts)} valid held-out windows (asked for {plan.eval_windows})", file=sys.stderr)
    if dry_run:
        return {}
    threads = max(1, (os.cpu_count() or 1) // plan.jobs)
    jobs = plan_jobs(plan, all_stages, dict(vars(heldout)), recipe.data.train, out, threads)
    notes = check_reuse(out, all_stages, jobs, plugins) if mode == "resume" else []
    with rundir.RunLock(out, "context-extension experiment"):  # one experiment per directory; each stage locks its own
        prepare_out(out, plan, mode)
        for note in notes:
            print(f"[experiment] {note}", file=sys.stderr)
        run_jobs(jobs, plan.jobs, out)
        params = {s.name: parameter_count(s.recipe, plugins) for s in all_stages}
        paths = {s.name: model_eval_path(out, s) for s in all_stages} | {
            f"markov-{k}": markov_eval_path(out, k) for k in plan.markov_orders
        }
        return write_report(out, plan, all_stages, heldout, params, paths)
