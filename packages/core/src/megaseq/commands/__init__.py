"""Core's own commands: this module is a built-in plugin of core whose ``megaseq_command`` records are
dispatched by ``megaseq.cli`` exactly as a plugin's commands are: ``main(argv) -> int``. A plugin of its own,
apart from the built-in components (``megaseq.builtins``), so that a component that cannot load (e.g. without
torch) never takes the commands with it: ``megaseq plugins`` must still say what is wrong.

Each module builds its own ``argparse`` parser (``parser()``, so that ``--help`` texts can be walked) and
imports what it runs only when it runs, so that ``megaseq --help`` stays quick.
"""

from __future__ import annotations

import argparse
import json
import re

from megaseq.errors import UserError
from megaseq.hookspecs import hookimpl
from megaseq.records import CommandSpec


@hookimpl
def megaseq_command() -> list[CommandSpec]:
    def command(name: str, target: str, summary: str) -> CommandSpec:
        return CommandSpec(name=name, target=f"megaseq.commands.{target}", summary=summary)

    return [
        command("train", "train:main", "train a recipe"),
        command("plan", "plan:main", "plan memory (policies, peak per device)"),
        command("eval", "eval:main", "evaluate a checkpoint"),
        command("import", "interop:import_main", "import a Hugging Face model (in an installed layout)"),
        command("export", "interop:export_main", "export a checkpoint in Hugging Face format"),
        command("checkpoint", "checkpoint:main", "checkpoint maintenance"),
        command("plugins", "plugins:main", "list plugins and components"),
        command("data", "data:main", "datasets"),
    ]


def missing_command(prog: str, commands: argparse.Action):
    """What a command that needs a subcommand does without one: a one-line error naming the choices."""

    def run(args: argparse.Namespace) -> int:
        where = prog.removeprefix("megaseq").strip()
        raise UserError(f"{where + ': ' if where else ''}missing command; choose one of: {', '.join(commands.choices)} "
                        f"(see {prog} --help)")

    return run


def add_run_arguments(parser: argparse.ArgumentParser, out_default: str = "runs/{run.name}") -> None:
    """The arguments of a command that trains into a run directory (``megaseq train``, and a plugin's that
    does): ``--set``, ``--resume`` or ``--overwrite``, ``--out``, ``--no-progress``."""
    parser.add_argument("--set", action="append", default=[], metavar="KEY.PATH=VALUE", help="override a recipe value")
    start = parser.add_mutually_exclusive_group()
    start.add_argument("--resume", action="store_true", help="continue from the newest good checkpoint in the run directory")
    start.add_argument("--overwrite", action="store_true", help="delete the run directory's output and start over")
    parser.add_argument("--out", metavar="DIR", help=f"the run directory (as --set run.out_dir=DIR; default {out_default})")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def run_parsed(parser: argparse.ArgumentParser, argv: list[str]) -> int:
    """Parse ``argv`` and call the ``func`` the parser (or its subcommand) set."""
    args = parser.parse_args(argv)
    return args.func(args)


def memory_policy_override(value: str | None) -> list[str]:
    """``--memory-policy auto|none|NAMES`` as a recipe override of ``train.memory_policy``."""
    if value is None:
        return []
    parsed = parse_policy_argument(value)
    return [f"train.memory_policy={json.dumps([] if parsed == 'none' else parsed)}"]


def parse_policy_argument(value: str) -> str | list[str]:
    """``auto``, ``none`` or comma-separated policy names."""
    value = value.strip()
    if value in ("auto", "none"):
        return value
    names = [n.strip() for n in value.split(",") if n.strip()]
    if not names or any(not re.fullmatch(r"[A-Za-z0-9_.-]+", n) for n in names):
        raise UserError(f"--memory-policy {value!r}: expected auto, none or comma-separated policy names")
    return names


__all__ = ["add_run_arguments", "megaseq_command", "memory_policy_override", "missing_command", "parse_policy_argument", "run_parsed"]
