"""``megaseq context-extension RECIPE``: the command megaseq-genome adds to ``megaseq``."""

from __future__ import annotations

import argparse
from pathlib import Path

DESCRIPTION = (
    "Does training at long context teach the model to use it? Pretrain RECIPE at a short context with a curriculum "
    "(windows lengthening from 128 bases, planted repeats annealed to none) beside a control without it, continue it "
    "at a long and (same budget) a short context, and score all with Markov baselines on one fixed held-out set by "
    "context position and by the distance to each target's earlier k-mer, checking the experiment's targets "
    "(docs/context-extension.md)."
)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megaseq context-extension", description=DESCRIPTION)
    p.add_argument("recipe", help="the model recipe, e.g. recipes/genome-cpu.toml")
    p.add_argument("--scale", default="cpu",
                   help="budget preset: cpu (sized for about 70 minutes on 2 idle CPU cores), cpu-quick (the same stages, "
                   "a quarter of the training: a smoke run) or gpu")
    p.add_argument("--set", action="append", default=[], metavar="KEY.PATH=VALUE",
                   help="plan.KEY (e.g. plan.pretrain_tokens=1e6), STAGE.SECTION.KEY (one stage's recipe, e.g. "
                   "long.train.memory_policy=auto) or SECTION.KEY (every stage's recipe, e.g. train.lr=1e-3)")
    p.add_argument("--out", default="runs/context-extension", help="output directory (default runs/context-extension)")
    start = p.add_mutually_exclusive_group()
    start.add_argument("--resume", action="store_true", help="continue the experiment in --out: skip what is done and still matches the plan")
    start.add_argument("--overwrite", action="store_true", help="delete the experiment in --out and start over")
    p.add_argument("--dry-run", action="store_true", help="check the plan, print the stages and exit")
    return p


def main(argv: list[str]) -> int:
    from megaseq_genome.experiment.context_extension import run_context_extension

    args = parser().parse_args(argv)
    out = Path(args.out)
    mode = "resume" if args.resume else "overwrite" if args.overwrite else "new"
    report = run_context_extension(args.recipe, args.scale, args.set, out, mode, dry_run=args.dry_run)
    if report:
        print((out / "report.md").read_text())
        print(f"wrote {out}/report.json, report.md, bits_by_bucket.png")
    return 0
