"""``megaseq plugins``: the installed plugins, their components and status."""

from __future__ import annotations

import argparse

from megaseq.commands import run_parsed


def parser() -> argparse.ArgumentParser:
    pl = argparse.ArgumentParser(prog="megaseq plugins", description="The components a recipe can name, the installed plugins providing them, their status.",
    )
    pl.add_argument("--json", action="store_true", help="machine-readable output")
    pl.add_argument(
        "--check", action="store_true",
        help="import every component's target (and memory target), run nothing else; exit status 2 on failure",
    )
    pl.set_defaults(func=cmd_plugins)
    return pl



def main(argv: list[str]) -> int:
    return run_parsed(parser(), argv)


def cmd_plugins(args: argparse.Namespace) -> int:
    from megaseq import plugin_report
    from megaseq.plugins import get_plugins

    return plugin_report.run(get_plugins(), as_json=args.json, check=args.check)
