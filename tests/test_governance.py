"""Repository rules that keep the plugin architecture honest.

- Core never imports a plugin; a plugin never imports another plugin (they meet only through core).
- Every package has the layout docs/architecture.md describes: hatchling, src/ layout, static version,
  README, CHANGELOG, tests, and (plugins) a ranged megaseq-core dependency and a `megaseq` entry point.
- Every package declares the distributions it imports (dependencies or extras).
- Core's catalog of the project's components (``megaseq.catalog``) matches what the packages register.
- Nothing in the repository cites documents that are not in it.
"""

from __future__ import annotations

import ast
import importlib
import subprocess
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[1]
PACKAGES = sorted(p.parent for p in (REPO / "packages").glob("*/pyproject.toml"))
EXAMPLES = sorted(p.parent for p in (REPO / "examples").glob("*/pyproject.toml"))


def import_name(package: Path) -> str:
    (src,) = [p for p in (package / "src").iterdir() if p.is_dir() and not p.name.endswith(".egg-info")]
    return src.name


def imported_roots(package: Path) -> set[str]:
    roots = set()
    for path in (package / "src").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                roots |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                roots.add(node.module.split(".")[0])
    return roots


ALL_IMPORT_NAMES = {import_name(p) for p in PACKAGES + EXAMPLES}


@pytest.mark.parametrize("package", PACKAGES + EXAMPLES, ids=lambda p: p.name)
def test_no_cross_plugin_imports(package):
    own = import_name(package)
    allowed = {own} if own == "megaseq" else {own, "megaseq"}
    forbidden = (imported_roots(package) & ALL_IMPORT_NAMES) - allowed
    assert not forbidden, f"{package.name} imports {sorted(forbidden)}"


@pytest.mark.parametrize("package", PACKAGES + EXAMPLES, ids=lambda p: p.name)
def test_package_layout(package):
    meta = tomllib.loads((package / "pyproject.toml").read_text())
    assert meta["build-system"]["build-backend"] == "hatchling.build"
    name = import_name(package)
    assert (package / "src" / name / "__about__.py").read_text().startswith("__version__ = ")
    assert meta["tool"]["hatch"]["version"]["path"] == f"src/{name}/__about__.py"
    assert (package / "README.md").stat().st_size > 200, "README too short to be useful"
    assert list((package / "tests").glob("test_*.py")), "no tests"
    if package.parent.name == "packages":
        assert (package / "CHANGELOG.md").exists()
    if name != "megaseq":
        reqs = [Requirement(r) for r in meta["project"]["dependencies"]]
        core = [r for r in reqs if r.name == "megaseq-core"]
        assert core and core[0].specifier and "<" in str(core[0].specifier), "needs a ranged megaseq-core dependency"
        assert meta["project"]["entry-points"]["megaseq"], "no megaseq entry point"


def registered_components(package: Path) -> dict[tuple[str, str], str]:
    """(kind, name) -> distribution, for every component the package's registration hooks return."""
    from megaseq.records import SPEC_TYPES

    meta = tomllib.loads((package / "pyproject.toml").read_text())["project"]
    dist = meta["name"]
    modules = ["megaseq.builtins"] if dist == "megaseq-core" else list(meta["entry-points"]["megaseq"].values())
    found = {}
    for module_name in modules:
        module = importlib.import_module(module_name)
        for kind in SPEC_TYPES:
            hook = getattr(module, f"megaseq_{kind}", None)
            for spec in hook() if hook else []:
                found[(kind, spec.name)] = dist
    return found


def test_catalog_names_every_shipped_component():
    from megaseq.catalog import PROVIDERS

    shipped = {}
    for package in PACKAGES + EXAMPLES:
        shipped |= registered_components(package)
    assert shipped == PROVIDERS, "megaseq.catalog.PROVIDERS must list exactly the components the packages register"


def test_no_citation_of_documents_outside_the_repository():
    outside = ["DESIGN" + ".md", "REFERENCE" + ".md"]  # the team's notes, not shipped: cite docs/ instead
    files = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    for name in files:
        path = REPO / name
        if path.suffix in {".py", ".md", ".toml", ".txt", ".cfg", ""} and path.is_file():
            text = path.read_text(errors="ignore")
            cited = [doc for doc in outside if doc in text]
            assert not cited, f"{name} cites {cited}, which are not in the repository"


# import name -> distribution name, where they differ
DISTRIBUTION_OF = {"fla": "fla-core", "flash_attn": "flash-attn", "megaseq": "megaseq-core", "megatron": "megatron-core"}


@pytest.mark.parametrize("package", PACKAGES + EXAMPLES, ids=lambda p: p.name)
def test_every_imported_distribution_is_declared(package):
    import sys

    project = tomllib.loads((package / "pyproject.toml").read_text())["project"]
    extras = project.get("optional-dependencies", {}).values()
    requirements = [*project.get("dependencies", []), *(r for extra in extras for r in extra)]
    declared = {Requirement(r).name.lower() for r in requirements} | {project["name"]}
    imported = imported_roots(package) - set(sys.stdlib_module_names) - {import_name(package)}
    missing = sorted(DISTRIBUTION_OF.get(root, root) for root in imported if DISTRIBUTION_OF.get(root, root) not in declared)
    assert not missing, f"{package.name} imports {missing} without declaring them in pyproject.toml"
