"""``megaseq data``: fetch and list the named datasets (the installed data sources)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from megaseq.commands import missing_command, run_parsed


def parser() -> argparse.ArgumentParser:
    d = argparse.ArgumentParser(prog="megaseq data", description="Obtain and inspect the named datasets (data sources of the installed plugins).")
    dsub = d.add_subparsers(title="commands", metavar="COMMAND")
    d.set_defaults(func=missing_command("megaseq data", dsub))
    f = dsub.add_parser("fetch", help="download and tokenise a dataset", description="Fetch a dataset into the cache.")
    f.add_argument("name", help="dataset name (see 'megaseq data list')")
    f.add_argument("--cache-dir", help="default: $MEGASEQ_CACHE or ~/.cache/megaseq")
    f.set_defaults(func=cmd_data_fetch)
    ls = dsub.add_parser("list", help="known datasets", description="List the known datasets.")
    ls.set_defaults(func=cmd_data_list)
    return d



def main(argv: list[str]) -> int:
    return run_parsed(parser(), argv)


def cmd_data_fetch(args: argparse.Namespace) -> int:
    from megaseq.data.sources import fetch, token_metadata
    from megaseq.plugins import get_plugins

    plugins = get_plugins()
    cache_dir = Path(args.cache_dir) if args.cache_dir else None
    path = fetch(args.name, cache_dir, plugins)
    meta = token_metadata(args.name, cache_dir, plugins)
    print(f"{args.name}: {path}")
    print(json.dumps({k: v for k, v in meta.items() if k != "records"}, indent=2))
    return 0


def cmd_data_list(args: argparse.Namespace) -> int:
    from megaseq.data.sources import data_sources

    for name, provided in sorted(data_sources().items()):
        print(f"{name}: {provided.spec.summary} [{provided.plugin.label}]")
    return 0
