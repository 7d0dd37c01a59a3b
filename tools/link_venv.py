"""Give a fresh venv the third-party packages of another venv by hard links, without the workspace's own.

``make test`` runs each megaseq package's tests in an environment holding only megaseq-core and that
package, so a plugin that silently needs another plugin fails. That environment needs the same third-party
packages as the full venv (torch and triton alone are about 1.7 GB); hard links give it them without a
second copy on disk and without a second download.

What is linked: every file, inside site-packages, that a distribution's RECORD lists, for every
distribution of SOURCE except editable installs (the workspace's packages, which the Makefile installs
into TARGET one at a time). Console scripts in ``bin/`` are not linked: their first line names SOURCE's
interpreter, and the Makefile runs everything as ``TARGET/bin/python -m ...``.

Why hard links are sound here: pip never writes into an installed file (it removes files and writes new
ones) and Python writes bytecode to a temporary file and renames it, so neither environment can change a
file the other sees. If the two venvs are on different file systems, files are copied instead, and this
says so.

Usage: ``python tools/link_venv.py SOURCE_VENV TARGET_VENV`` (TARGET made with ``python -m venv --without-pip``).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from importlib import metadata
from pathlib import Path


def site_packages(venv: Path) -> Path:
    (found,) = venv.glob("lib/python*/site-packages")
    return found


def is_editable(dist: metadata.Distribution) -> bool:
    direct_url = dist.read_text("direct_url.json")
    return bool(direct_url) and json.loads(direct_url).get("dir_info", {}).get("editable", False)


def link_tree(source: Path, target: Path) -> tuple[list[str], list[str], int]:
    """Link the non-editable distributions of site-packages ``source`` into ``target``.

    Returns (linked distribution names, skipped editable names, files copied because linking failed).
    """
    linked, skipped, copied = [], [], 0
    for dist in sorted(metadata.distributions(path=[str(source)]), key=lambda d: d.metadata["Name"].lower()):
        name = dist.metadata["Name"]
        if is_editable(dist):
            skipped.append(name)
            continue
        for file in dist.files or []:
            relative = Path(file)
            if relative.parts[0] == ".." or not (source / relative).is_file():
                continue  # outside site-packages (console scripts), or listed but never written (bytecode)
            destination = target / relative
            destination.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(source / relative, destination)
            except OSError:
                shutil.copy2(source / relative, destination)
                copied += 1
        linked.append(name)
    return linked, skipped, copied


def main() -> int:
    if len(sys.argv) != 3:
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    source, target = (site_packages(Path(arg)) for arg in sys.argv[1:])
    linked, skipped, copied = link_tree(source, target)
    print(f"link_venv: {len(linked)} distributions linked from {source} (not: {', '.join(skipped) or 'none'})")
    if copied:
        print(f"link_venv: {copied} files copied, not linked: {source} and {target} are on different file systems")
    return 0


if __name__ == "__main__":
    sys.exit(main())
