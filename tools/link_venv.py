"""Give a fresh venv the third-party packages one workspace package needs, by hard links from another venv.

``make test`` runs each megaseq package's tests in an environment holding only megaseq-core, the test kit and
that package, with only the third-party packages they declare: a plugin that silently needs another plugin,
or a library it never declared, fails there. Hard links give the environment those packages (torch and triton
alone are about 1.7 GB) without a second copy on disk and without a second download.

What is linked: the closure, through the installed distributions' own metadata in SOURCE, of what PACKAGE's
pyproject.toml declares (its dependencies and every extra: its tests may use any of its features) and of what
the workspace packages it names declare (their dependencies, and the extras it asks of them, e.g.
``megaseq-core[distributed]``); for each, every file inside site-packages that its RECORD lists. A declared
package that SOURCE does not have (say, an extra meant for another environment) is reported and left out.
pip and pytest-timeout are linked too (``TOOLS``). The workspace packages themselves are not linked: the
Makefile installs them editable into TARGET. Console scripts in ``bin/`` are not linked: their first line
names SOURCE's interpreter, and the Makefile runs everything as ``TARGET/bin/python -m ...``.

Why hard links are sound here: pip never writes into an installed file (it removes files and writes new
ones) and Python writes bytecode to a temporary file and renames it, so neither environment can change a
file the other sees. If the two venvs are on different file systems, files are copied instead, and this
says so.

Usage: ``python tools/link_venv.py SOURCE_VENV TARGET_VENV PACKAGE_DIR`` (TARGET made with ``python -m venv
--without-pip``; PACKAGE_DIR e.g. ``packages/attn-dsa``).
"""

from __future__ import annotations

import os
import shutil
import sys
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

WORKSPACE = Path(__file__).resolve().parents[1] / "packages"
# Linked whatever the package declares: what the Makefile installs the workspace packages and checks them with,
# and the plugin behind the repository's pytest setting `timeout` (pyproject.toml), which pytest would ignore.
TOOLS = ("pip", "pytest-timeout")


def site_packages(venv: Path) -> Path:
    (found,) = venv.glob("lib/python*/site-packages")
    return found


def workspace_projects() -> dict[str, dict]:
    """Every workspace package's ``[project]`` table, by canonical name."""
    projects = {}
    for pyproject in sorted(WORKSPACE.glob("*/pyproject.toml")):
        project = tomllib.loads(pyproject.read_text())["project"]
        projects[canonicalize_name(project["name"])] = project
    return projects


def declared(project: dict, extras: set[str] | None) -> list[Requirement]:
    """A project's dependencies and those of ``extras`` (None: every extra)."""
    optional = project.get("optional-dependencies", {})
    chosen = optional if extras is None else {name: optional[name] for name in extras if name in optional}
    return [Requirement(text) for text in [*project.get("dependencies", []), *(r for rs in chosen.values() for r in rs)]]


def closure(package: Path, source: Path) -> tuple[dict[str, metadata.Distribution], list[str]]:
    """The third-party distributions of ``source`` that ``package`` needs (module docstring), by canonical name,
    and the declared names ``source`` does not have."""
    projects = workspace_projects()
    installed = {canonicalize_name(d.metadata["Name"]): d for d in metadata.distributions(path=[str(source)])}
    own = tomllib.loads((package / "pyproject.toml").read_text())["project"]
    pending = [*declared(own, None), *(Requirement(tool) for tool in TOOLS)]
    seen_workspace: set[tuple[str, frozenset[str]]] = {(canonicalize_name(own["name"]), frozenset())}
    found: dict[str, metadata.Distribution] = {}
    missing: list[str] = []
    extras_done: dict[str, set[str]] = {}
    while pending:
        requirement = pending.pop()
        name = canonicalize_name(requirement.name)
        if name in projects:  # a workspace package: what it declares, with the extras asked of it
            key = (name, frozenset(requirement.extras))
            if key not in seen_workspace:
                seen_workspace.add(key)
                pending += declared(projects[name], set(requirement.extras))
            continue
        if name not in installed:
            missing.append(str(requirement))
            continue
        new_extras = set(requirement.extras) - extras_done.get(name, set())
        if name in found and not new_extras:
            continue
        found[name] = installed[name]
        extras_done.setdefault(name, set()).update(requirement.extras)
        for text in installed[name].requires or []:
            child = Requirement(text)
            asked = [{"extra": extra} for extra in extras_done[name]] or [{"extra": ""}]
            if child.marker is None or any(child.marker.evaluate(env) for env in asked):
                pending.append(child)
    return found, sorted(set(missing))


def link(dists: dict[str, metadata.Distribution], source: Path, target: Path) -> int:
    """Link every file of ``dists`` from site-packages ``source`` into ``target``; returns the files copied
    because linking failed."""
    copied = 0
    for dist in dists.values():
        for file in dist.files or []:
            relative = Path(file)
            if relative.parts[0] == ".." or not (source / relative).is_file():
                continue  # outside site-packages (console scripts), or listed but never written (bytecode)
            destination = target / relative
            destination.parent.mkdir(parents=True, exist_ok=True)
            if destination.exists():
                continue  # two distributions list one file (namespace packages' __init__)
            try:
                os.link(source / relative, destination)
            except OSError:
                shutil.copy2(source / relative, destination)
                copied += 1
    return copied


def main() -> int:
    if len(sys.argv) != 4:
        print(__doc__[__doc__.index("Usage"):].strip(), file=sys.stderr)
        return 2
    source, target = (site_packages(Path(arg)) for arg in sys.argv[1:3])
    package = Path(sys.argv[3])
    dists, missing = closure(package, source)
    copied = link(dists, source, target)
    print(f"link_venv: {len(dists)} distributions linked from {source} for {package.name}")
    if missing:
        print(f"link_venv: declared by {package.name} or what it names but not in {source}: {', '.join(missing)}")
    if copied:
        print(f"link_venv: {copied} files copied, not linked: {source} and {target} are on different file systems")
    return 0


if __name__ == "__main__":
    sys.exit(main())
