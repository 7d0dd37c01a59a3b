"""``megaseq train``: train a recipe in one process, under Ray Train (``--workers``) or torchrun."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from megaseq.commands import add_run_arguments, memory_policy_override, run_parsed

TRAIN_HELP = """Train the model a TOML recipe describes.

Output goes to the run directory, run.out_dir (default runs/{run.name}; set it with --set
run.out_dir=PATH): metrics.jsonl, tensorboard/, checkpoints/ (train.checkpoint_every, the newest
train.keep_checkpoints kept) and eval/step_N/ (held-out loss by context position of the final
step, JSON and PNG; where megaseq eval writes too).

A run directory holds one run: training into one that already holds output is an error unless you pass
--resume (continue from its newest good checkpoint; the logs are cut back to that step) or --overwrite
(delete its output and start over). Ctrl-C or SIGTERM saves a checkpoint after the current step; a second
one stops at once.

data.train and data.heldout are dataset names (megaseq data list) or paths to FASTA files (plain or
gzip), e.g. --set data.train=/path/genome.fa.gz."""


def parser() -> argparse.ArgumentParser:
    t = argparse.ArgumentParser(prog="megaseq train", description=TRAIN_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    t.add_argument("recipe", help="path to a TOML recipe, e.g. recipes/genome-cpu.toml")
    add_run_arguments(t)
    t.add_argument("--parallel", metavar="dp=N,cp=N,tp=N,ep=N,etp=N", help="process layout (overrides the recipe's "
                   "[parallel]): dp x cp x tp workers; ep x etp of them (dividing the workers) share each MoE layer's "
                   "experts, etp splitting each expert's hidden width")
    t.add_argument("--workers", type=int, metavar="N", help="start N workers with Ray Train (alone: dp=N)")
    t.add_argument("--address", metavar="HOST:PORT", help="run the workers on this existing Ray cluster")
    t.add_argument("--max-failures", type=int, default=2, metavar="K",
                   help="restarts of the worker group from the newest checkpoint after a worker dies (default 2)")
    t.add_argument("--memory-policy", metavar="auto|none|NAMES",
                   help="memory policies (train.memory_policy): auto = what `megaseq plan` proposes, none, or names")
    t.add_argument("--dry-run", action="store_true",
                   help="check the layout against the recipe and print every rank's groups and the memory plan, "
                   "then stop: no worker starts, no device is used")
    t.add_argument("--init-from", metavar="DIR",
                   help="start from these weights (train.init_from): a run directory, e.g. one `megaseq import` wrote, "
                   "or a checkpoint; the recipe's data and schedule apply")
    t.set_defaults(func=cmd_train)
    return t



def main(argv: list[str]) -> int:
    return run_parsed(parser(), argv)


def cmd_train(args: argparse.Namespace) -> int:
    from megaseq.config import ParallelConfig, load_recipe
    from megaseq.distributed.launch import in_torchrun
    from megaseq.distributed.layout import Layout, resolve_layout
    from megaseq.plugins import get_plugins

    plugins = get_plugins()
    init_from = [f"train.init_from={json.dumps(args.init_from)}"] if args.init_from else []
    out = [f"run.out_dir={json.dumps(args.out)}"] if args.out else []  # TOML reads a JSON string as a string
    recipe = load_recipe(args.recipe, plugins, [*args.set, *out, *memory_policy_override(args.memory_policy), *init_from])
    layout = resolve_layout(recipe, Layout.parse(args.parallel, base=Layout.of(recipe)), args.workers)
    parallel = {name: getattr(layout, name) for name in ParallelConfig.model_fields}
    recipe = recipe.model_copy(update={"parallel": ParallelConfig(**parallel)})
    if args.dry_run:
        from megaseq.distributed.launch import dry_run

        print(dry_run(recipe, plugins, layout, args.resume, args.address))
        return 0
    mode = "resume" if args.resume else "overwrite" if args.overwrite else "new"
    from megaseq.distributed.launch import WorkerFailed, preflight, run_torchrun, run_with_ray
    from megaseq.eval.evaluate import check_analyses
    from megaseq.train import rundir

    if in_torchrun():  # rank 0's trainer holds the lock; the launching process checked the analyses
        preflight(recipe, plugins, layout, args.resume, args.address)
        result = run_torchrun(recipe, mode, progress=not args.no_progress)
        if result is not None:
            print_eval(result.out_dir, result.step)
        return 0
    # the lock first: a second trainer of a live run stops at once, before baselines are fitted or a model built;
    # held here for the whole run (and, under Ray, for the workers over their restarts)
    with rundir.RunLock(recipe.out_dir, "training"):
        check_analyses(recipe, plugins)
        if layout.world_size == 1 and args.address is None:
            from megaseq.train.trainer import Trainer

            result = Trainer(recipe, plugins, progress=not args.no_progress, lock_run=False).run(mode)
            out_dir, step = result.out_dir, result.step
        else:
            preflight(recipe, plugins, layout, args.resume, args.address)
            rundir.prepare(recipe.out_dir, mode)  # once, here: restarted workers must not refuse or wipe their own run
            try:
                out_dir, step = run_with_ray(recipe, layout, args.resume, args.address, args.max_failures), recipe.train.steps
            except WorkerFailed as exc:
                print(f"megaseq: error: {exc}", file=sys.stderr)
                return 1
    print_eval(out_dir, step)
    return 0


def print_eval(out_dir: Path, step: int) -> None:
    """The held-out table the run wrote for its final step (rank 0 of a distributed run writes it)."""
    from megaseq.eval.evaluate import analysis_tables
    from megaseq.eval.positions import format_table
    from megaseq.train.rundir import eval_dir

    where = eval_dir(out_dir, step)
    heldout = json.loads((where / "heldout.json").read_text())
    unit = heldout.get("unit", "base")  # a heldout.json that names no unit is of DNA
    print(f"\nheld-out {heldout['heldout']}, {heldout['windows']} windows of {heldout['seq_len']} {unit}s "
          f"(bits/{unit} by context position):")
    print(format_table(heldout["results"]) + analysis_tables(heldout.get("analyses", {})))
    print(f"\nwrote {where}/heldout.json, heldout_by_position.png; checkpoints in {out_dir}/checkpoints")
