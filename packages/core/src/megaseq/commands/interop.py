"""``megaseq import`` and ``megaseq export``: Hugging Face model directories to and from megaseq checkpoints."""

from __future__ import annotations

import argparse
from pathlib import Path

from megaseq.commands import run_parsed


def import_parser() -> argparse.ArgumentParser:
    im = argparse.ArgumentParser(prog="megaseq import", description="Convert a Hugging Face model directory (config.json, safetensors, tokenizer.json) "
                        "into OUT/recipe.toml and a checkpoint in OUT/checkpoints. Its layout is the installed one "
                        "(kind hf_layout in `megaseq plugins`) that reads config.json's model_type. Anything it "
                        "cannot map exactly is one line, exit status 2, nothing written.")
    im.add_argument("model", help="the model directory")
    im.add_argument("--out", required=True, metavar="DIR", help="a new directory for the recipe and the checkpoint")
    im.set_defaults(func=cmd_import)
    return im



def export_parser() -> argparse.ArgumentParser:
    ex = argparse.ArgumentParser(prog="megaseq export", description="Write a checkpoint (or a run directory's newest good one) as a Hugging Face model "
                        "directory: config.json and safetensors weights (sharded with an index above --max-shard-gib).")
    ex.add_argument("checkpoint", help="a checkpoint directory, or a run directory (its newest good checkpoint)")
    ex.add_argument("--out", required=True, metavar="DIR", help="a new directory for the model")
    ex.add_argument("--format", choices=["hf"], default="hf", help="hf: Hugging Face (the only format)")
    ex.add_argument("--layout", metavar="NAME",
                    help="an installed Hugging Face layout (kind hf_layout in `megaseq plugins`); default: the "
                    "one an installed layout declares the default")
    ex.add_argument("--max-shard-gib", type=float, default=5.0, metavar="GiB", help="largest safetensors shard (default 5)")
    ex.set_defaults(func=cmd_export)
    return ex



def import_main(argv: list[str]) -> int:
    return run_parsed(import_parser(), argv)


def export_main(argv: list[str]) -> int:
    return run_parsed(export_parser(), argv)


def cmd_import(args: argparse.Namespace) -> int:
    from megaseq.interop.convert import import_model
    from megaseq.plugins import get_plugins

    path = import_model(Path(args.model), Path(args.out), get_plugins())
    print(f"wrote {args.out}/recipe.toml and the checkpoint {path}")
    print(f"fine-tune: megaseq train {args.out}/recipe.toml --init-from {args.out}; evaluate: megaseq eval {args.out}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from megaseq.interop.convert import export_checkpoint
    from megaseq.plugins import get_plugins

    files = export_checkpoint(Path(args.checkpoint), Path(args.out), args.layout, get_plugins(), int(args.max_shard_gib * 2**30))
    print(f"wrote {args.out}: {', '.join(files)}")
    return 0
