"""``megaseq checkpoint``: checkpoint maintenance (``upgrade``)."""

from __future__ import annotations

import argparse
from pathlib import Path

from megaseq.commands import missing_command, run_parsed


def parser() -> argparse.ArgumentParser:
    ck = argparse.ArgumentParser(prog="megaseq checkpoint", description="Maintain checkpoints.")
    cksub = ck.add_subparsers(title="commands", metavar="COMMAND")
    ck.set_defaults(func=missing_command("megaseq checkpoint", cksub))
    up = cksub.add_parser(
        "upgrade", help="write the manifest of checkpoints written before manifests",
        description="Give checkpoints written before megaseq wrote manifests (manifest.json: every file's size and "
        "SHA-256, checked on every load) a manifest, after reading each file whole; then they resume and evaluate.",
    )
    up.add_argument("path", help="a checkpoint, a run directory or its checkpoints/ directory")
    up.set_defaults(func=cmd_checkpoint_upgrade)
    return ck



def main(argv: list[str]) -> int:
    return run_parsed(parser(), argv)


def cmd_checkpoint_upgrade(args: argparse.Namespace) -> int:
    from megaseq.train import checkpoint

    path = Path(args.path)
    upgraded = checkpoint.upgrade(path)
    for target in upgraded:
        print(f"wrote {target / checkpoint.MANIFEST}")
    if not upgraded:
        print(f"{path}: every checkpoint already has a manifest")
    return 0
