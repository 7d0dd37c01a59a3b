"""``megaseq data``: fetch and list the named datasets (the installed data sources)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from megaseq.commands import missing_command, run_parsed
from megaseq.records import PARTS


def parser() -> argparse.ArgumentParser:
    d = argparse.ArgumentParser(prog="megaseq data", description="Obtain and inspect the named datasets (data sources of the installed plugins).")
    dsub = d.add_subparsers(title="commands", metavar="COMMAND")
    d.set_defaults(func=missing_command("megaseq data", dsub))
    f = dsub.add_parser("fetch", help="download and tokenise a dataset", description="Fetch a dataset into the cache.")
    f.add_argument("name", help="dataset name (see 'megaseq data list')")
    f.add_argument("--cache-dir", help="default: $MEGASEQ_CACHE or ~/.cache/megaseq")
    f.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a key of the data source's config, as its recipe section [data_source.NAME] would set it")
    f.add_argument("--part", choices=PARTS, default="train", help="for a data source with parts: which one (default: train)")
    f.set_defaults(func=cmd_data_fetch)
    ls = dsub.add_parser("list", help="known datasets", description="List the known datasets.")
    ls.set_defaults(func=cmd_data_list)
    return d



def main(argv: list[str]) -> int:
    return run_parsed(parser(), argv)


def cmd_data_fetch(args: argparse.Namespace) -> int:
    from megaseq.config import parse_override
    from megaseq.data.sources import Corpus, fetch, token_metadata
    from megaseq.errors import UserError
    from megaseq.plugins import get_plugins

    plugins = get_plugins()
    cache_dir = Path(args.cache_dir) if args.cache_dir else None
    config = {}
    for item in args.set:
        keys, value = parse_override(item)
        if len(keys) != 1:
            raise UserError(f"--set {item!r}: a key of data_source.{args.name}'s config, e.g. --set path=VALUE")
        config[keys[0]] = value
    corpus = Corpus(args.name, config, args.part, plugins)
    path = fetch(corpus, cache_dir)
    meta = token_metadata(corpus, cache_dir)
    print(f"{args.name}: {path}")
    print(json.dumps({k: v for k, v in meta.items() if k != "records"}, indent=2))
    return 0


def cmd_data_list(args: argparse.Namespace) -> int:
    from megaseq.data.sources import data_sources

    for name, provided in sorted(data_sources().items()):
        print(f"{name}: {provided.spec.summary} [{provided.plugin.label}]")
    return 0
