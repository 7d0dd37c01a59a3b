"""The ``megaseq`` command line. User mistakes: one line on stderr, exit status 2, no traceback."""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path

from megaseq.__about__ import __version__
from megaseq.errors import UserError


def _one_line_warnings() -> None:
    def show(message, category, filename, lineno, file=None, line=None):
        print(f"megaseq: warning: {message}", file=sys.stderr)

    warnings.showwarning = show


def cmd_train(args: argparse.Namespace) -> int:
    from megaseq.config import load_recipe
    from megaseq.plugins import get_plugins
    from megaseq.train.trainer import Trainer

    plugins = get_plugins()
    recipe = load_recipe(args.recipe, plugins, args.set)
    result = Trainer(recipe, plugins, progress=not args.no_progress).run(resume=args.resume)
    assert result.eval is not None
    print(f"\nheld-out {recipe.data.heldout}, {result.eval['windows']} windows of {recipe.data.seq_len} bases "
          f"(bits/base by context position):")
    print(result.eval["table"])
    print(f"\nwrote {result.out_dir}/eval/heldout.json, heldout_by_position.png; checkpoints in {result.out_dir}/checkpoints")
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    import torch

    from megaseq.config import apply_overrides, validate_recipe
    from megaseq.eval.evaluate import evaluate_heldout
    from megaseq.model import build_model
    from megaseq.plugins import get_plugins
    from megaseq.train.checkpoint import latest_checkpoint, load_weights, read_meta
    from megaseq.train.trainer import pick_device

    path = Path(args.checkpoint)
    if (path / "checkpoints").is_dir():  # a run directory: take its newest checkpoint
        path = latest_checkpoint(path / "checkpoints") or path
    meta = read_meta(path)
    plugins = get_plugins()
    recipe = validate_recipe(apply_overrides(meta["recipe"], args.set), plugins, source=f"{path}/meta.json")
    device = pick_device(recipe.run.device)
    model = build_model(recipe, plugins).to(device)
    load_weights(path, model)
    with torch.no_grad():
        result = evaluate_heldout(model, recipe, device, out_dir=path / "eval", baseline=not args.no_baseline)
    print(f"step {meta['step']}: held-out {recipe.data.heldout}, {result['windows']} windows of {recipe.data.seq_len} bases")
    print(result["table"])
    print(f"wrote {path}/eval/heldout.json and heldout_by_position.png")
    return 0


def cmd_plugins(args: argparse.Namespace) -> int:
    from megaseq.plugins import get_plugins

    plugins = get_plugins()
    infos = list(plugins)
    if args.json:
        print(json.dumps([vars(i) for i in infos], indent=2))
        return 0
    for info in infos:
        print(f"{info.dist} {info.version} [{info.name}]: {info.status}" + (f" ({info.reason})" if info.reason else ""))
        for kind, names in sorted(info.components.items()):
            print(f"    {kind}: {', '.join(sorted(names))}")
    return 0


def cmd_data_fetch(args: argparse.Namespace) -> int:
    from megaseq.data.sources import fetch, token_metadata

    path = fetch(args.name, Path(args.cache_dir) if args.cache_dir else None)
    meta = token_metadata(args.name, Path(args.cache_dir) if args.cache_dir else None)
    print(f"{args.name}: {path}")
    print(json.dumps({k: v for k, v in meta.items() if k != "records"}, indent=2))
    return 0


def cmd_data_list(args: argparse.Namespace) -> int:
    from megaseq.data.sources import DATASETS

    for name, info in DATASETS.items():
        print(f"{name}: {info.description}")
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megaseq", description="Plugin-based training for million-token sequences.")
    p.add_argument("--version", action="version", version=f"megaseq-core {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="train a recipe", description="Train the model a TOML recipe describes.")
    t.add_argument("recipe", help="path to a TOML recipe, e.g. recipes/genome-cpu.toml")
    t.add_argument("--set", action="append", default=[], metavar="KEY.PATH=VALUE", help="override a recipe value")
    t.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in the run directory")
    t.add_argument("--no-progress", action="store_true", help="no progress bar")
    t.set_defaults(func=cmd_train)

    e = sub.add_parser("eval", help="evaluate a checkpoint", description="Held-out loss by context position.")
    e.add_argument("checkpoint", help="a checkpoint directory, or a run directory (its newest checkpoint)")
    e.add_argument("--set", action="append", default=[], metavar="KEY.PATH=VALUE", help="e.g. eval.windows=128")
    e.add_argument("--no-baseline", action="store_true", help="skip the Markov baseline")
    e.set_defaults(func=cmd_eval)

    pl = sub.add_parser("plugins", help="list plugins", description="Installed plugins, their status and components.")
    pl.add_argument("--json", action="store_true", help="machine-readable output")
    pl.set_defaults(func=cmd_plugins)

    d = sub.add_parser("data", help="genome datasets", description="Obtain and inspect genome datasets.")
    dsub = d.add_subparsers(dest="data_command", required=True)
    f = dsub.add_parser("fetch", help="download and tokenise a dataset", description="Fetch a dataset into the cache.")
    f.add_argument("name", help="dataset name (see 'megaseq data list')")
    f.add_argument("--cache-dir", help="default: $MEGASEQ_CACHE or ~/.cache/megaseq")
    f.set_defaults(func=cmd_data_fetch)
    ls = dsub.add_parser("list", help="known datasets", description="List the known datasets.")
    ls.set_defaults(func=cmd_data_list)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    _one_line_warnings()
    try:
        return args.func(args)
    except UserError as exc:
        print(f"megaseq: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("megaseq: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
