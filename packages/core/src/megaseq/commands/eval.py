"""``megaseq eval``: the held-out loss by context position of a checkpoint, its baselines and analyses."""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

from megaseq.commands import run_parsed

EVAL_HELP = """Held-out loss by context position of a checkpoint, beside the baselines its recipe names
(eval.baselines; --set 'eval.baselines=["NAME"]' adds one), and the analyses it names (eval.analyses;
--set 'eval.analyses=["NAME"]'). megaseq plugins lists the installed baselines and analyses.

Writes heldout.json, heldout_by_position.png and the analyses' plots to --out, by default RUN/eval/step_N for a checkpoint in
RUN/checkpoints (never into the checkpoint directory itself)."""



def parser() -> argparse.ArgumentParser:
    e = argparse.ArgumentParser(prog="megaseq eval", description=EVAL_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    e.add_argument("checkpoint", help="a checkpoint directory, or a run directory (its newest good checkpoint)")
    e.add_argument("--set", action="append", default=[], metavar="KEY.PATH=VALUE", help="e.g. eval.windows=128")
    e.add_argument("--out", metavar="DIR", help="where to write heldout.json and the plot (default: RUN/eval/step_N)")
    e.add_argument("--no-baseline", action="store_true", help="skip the recipe's baselines and analyses (eval.baselines, eval.analyses)")
    e.add_argument("--no-progress", action="store_true", help="no progress bars")
    e.set_defaults(func=cmd_eval)
    return e



def main(argv: list[str]) -> int:
    return run_parsed(parser(), argv)


def cmd_eval(args: argparse.Namespace) -> int:
    import torch

    from megaseq.config import apply_overrides, validate_recipe
    from megaseq.devices import pick_device
    from megaseq.distributed.sharded import read_full_weights
    from megaseq.eval.evaluate import evaluate_heldout
    from megaseq.model import build_model
    from megaseq.plugins import get_plugins
    from megaseq.train import checkpoint, rundir

    path = checkpoint.resolve(Path(args.checkpoint))
    meta = checkpoint.read_meta(path)
    out = Path(args.out) if args.out else default_eval_dir(path)
    # writing into the checkpoint's run directory: under its lock, so never beside a trainer writing it
    run_dir = path.parent.parent if path.parent.name == "checkpoints" else None
    into_run = run_dir is not None and out.absolute().is_relative_to(run_dir.absolute())
    with rundir.RunLock(run_dir, "evaluation") if into_run else contextlib.nullcontext():
        rundir.check_writable(out, "eval --out" if args.out else "evaluation output")
        plugins = get_plugins()
        recipe = validate_recipe(apply_overrides(meta["recipe"], args.set), plugins, source=f"{path}/meta.json")
        device = pick_device(recipe.run.device)
        model = build_model(recipe, plugins).to(device)
        checkpoint.load_weights(path, model, read_full_weights(path, meta))  # checkpoints of any layout hold every expert
        print(f"evaluating {path} (step {meta['step']}) on {recipe.data.heldout}; writing {out}", file=sys.stderr)
        with torch.no_grad():
            result = evaluate_heldout(model, recipe, device, plugins, out_dir=out, baseline=not args.no_baseline, progress=not args.no_progress)
    print(f"step {meta['step']}: held-out {recipe.data.heldout}, {result['windows']} windows of {recipe.data.seq_len} {recipe.alphabet.unit}s")
    print(result["table"])
    extra = ", heldout_by_position.png and the analyses' files" if result["analyses"] else " and heldout_by_position.png"
    print(f"wrote {out}/heldout.json{extra}")
    return 0


def default_eval_dir(checkpoint_dir: Path) -> Path:
    """``RUN/eval/step_N`` for a checkpoint inside ``RUN/checkpoints``, else ``<checkpoint>-eval`` beside it:
    never inside the checkpoint, whose files its manifest describes."""
    if checkpoint_dir.parent.name == "checkpoints":
        return checkpoint_dir.parent.parent / "eval" / checkpoint_dir.name
    return checkpoint_dir.with_name(checkpoint_dir.name + "-eval")
