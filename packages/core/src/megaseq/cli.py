"""The ``megaseq`` command line: a dispatcher. Every command is a ``megaseq_command`` record, core's own
included (registered by core's built-in plugin, ``megaseq.builtins``, from ``megaseq.commands``):
``megaseq NAME ARGS...`` imports the command's target and calls ``main(ARGS)``. User mistakes: one line on
stderr, exit status 2, no traceback."""

from __future__ import annotations

import argparse
import sys
import warnings
from typing import Any

from megaseq import threads
from megaseq.__about__ import __version__
from megaseq.errors import UserError


def _one_line_warnings() -> None:
    def show(message, category, filename, lineno, file=None, line=None):
        print(f"megaseq: warning: {message}", file=sys.stderr)

    warnings.showwarning = show


def commands(name: str | None = None) -> dict[str, Any]:
    """``{name: Provided}`` of every command: core's and the installed plugins'. Asking for ``name`` when two
    plugins provide it is a one-line error naming both (core's own names are always core's: the plugin
    manager keeps core's and warns)."""
    from megaseq.plugins import get_plugins

    plugins = get_plugins()
    if name is not None and ("command", name) in plugins.conflicts:
        plugins.get("command", name)  # raises the conflict's one-line error
    return dict(plugins.registry["command"])


def listed(found: dict[str, Any]) -> list[str]:
    """Command names as help lists them: core's in their order, then the plugins' by name."""
    core = [name for name, provided in found.items() if provided.plugin.dist == "megaseq-core"]
    return core + sorted(set(found) - set(core))


def run_command(provided: Any, argv: list[str]) -> int:
    status = provided.load()(argv)
    return 0 if status is None else int(status)


def parser(found: dict[str, Any]) -> argparse.ArgumentParser:
    """The top-level parser: ``--version``, ``--help`` and the list of commands (each parses its own
    arguments)."""
    p = argparse.ArgumentParser(prog="megaseq", description="Plugin-based training for million-token sequences.")
    p.add_argument("--version", action="version", version=f"megaseq-core {__version__}")
    sub = p.add_subparsers(title="commands", metavar="COMMAND")
    for name in listed(found):
        provided = found[name]
        where = "" if provided.plugin.dist == "megaseq-core" else f" [{provided.plugin.label}]"
        sub.add_parser(name, help=provided.spec.summary + where, add_help=False)
    return p


def main(argv: list[str] | None = None) -> int:
    threads.apply_defaults()  # before anything imports torch: OpenMP reads its variables once, when it loads
    argv = sys.argv[1:] if argv is None else list(argv)
    _one_line_warnings()
    try:
        found = commands(argv[0] if argv else None)
        if argv and argv[0] in found:
            return run_command(found[argv[0]], argv[1:])
        choices = ", ".join(listed(found))
        if argv and not argv[0].startswith("-"):
            raise UserError(f"unknown command {argv[0]!r}; choose one of: {choices} (a plugin's command needs its "
                            "plugin installed: `megaseq plugins` lists what is)")
        parser(found).parse_args(argv)  # --help or --version exit here
        raise UserError(f"missing command; choose one of: {choices} (see megaseq --help)")
    except UserError as exc:
        print(f"megaseq: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:  # Interrupted (a signal during training) says what was saved
        print(f"megaseq: interrupted: {exc}" if str(exc) else "megaseq: interrupted", file=sys.stderr)
        return getattr(exc, "exit_status", 130)


if __name__ == "__main__":
    sys.exit(main())
