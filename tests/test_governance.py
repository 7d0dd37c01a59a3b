"""Repository rules that keep the plugin architecture honest.

- Core never imports a plugin; a plugin never imports another plugin (they meet only through core).
- Every package has the layout DESIGN.md asks for: hatchling, src/ layout, static version, README,
  CHANGELOG, tests, and (plugins) a ranged megaseq-core dependency and a `megaseq` entry point.
"""

from __future__ import annotations

import ast
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
