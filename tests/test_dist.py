"""The packages install without the repository: built wheels of core and a plugin, in a fresh virtual
environment, list the plugin as active with its component (entry points and metadata come from the wheels).

Kept cheap (seconds): the wheels are built with hatchling (the packages' build backend) and installed by pip
without dependencies into a venv without pip of its own; the few distributions ``megaseq plugins`` imports
(listing plugins imports neither torch nor any component) are lent from this environment on PYTHONPATH.
The declared dependencies are checked from the installed metadata instead of being installed.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[1]
# what `megaseq plugins` imports: core's registry (pluggy, packaging), the config schemas (pydantic and its own)
LISTING_NEEDS = ["pluggy", "packaging", "pydantic", "pydantic_core", "typing_extensions", "annotated_types", "typing_inspection"]


def version_of(package: str) -> str:
    about = next((REPO / package / "src").glob("*/__about__.py")).read_text()
    return about.split("=")[1].strip().strip('"')


def lend(modules: list[str], into: Path) -> Path:
    """A directory of links to this environment's copies of ``modules`` (packages or single files)."""
    into.mkdir()
    for name in modules:
        spec = importlib.util.find_spec(name)
        assert spec is not None and spec.origin, name
        source = Path(spec.origin).parent if spec.submodule_search_locations else Path(spec.origin)
        (into / source.name).symlink_to(source)
    return into


@pytest.mark.slow
def test_wheels_install_into_a_fresh_venv_and_list_the_plugin(tmp_path):
    pytest.importorskip("hatchling")
    wheels = tmp_path / "wheels"
    for package in ("packages/core", "packages/attn-kda"):
        build = [sys.executable, "-m", "hatchling", "build", "-t", "wheel", "-d", str(wheels)]
        subprocess.run(build, cwd=REPO / package, check=True, capture_output=True, text=True)
    core_version, kda_version = version_of("packages/core"), version_of("packages/attn-kda")
    core_wheel = wheels / f"megaseq_core-{core_version}-py3-none-any.whl"
    kda_wheel = wheels / f"megaseq_attn_kda-{kda_version}-py3-none-any.whl"
    assert core_wheel.exists() and kda_wheel.exists(), sorted(p.name for p in wheels.iterdir())

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    install = [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps"]
    subprocess.run([*install, "--disable-pip-version-check", str(core_wheel), str(kda_wheel)], check=True)
    env = {"PATH": str(venv / "bin"), "HOME": str(tmp_path), "PYTHONPATH": str(lend(LISTING_NEEDS, tmp_path / "lent"))}

    listing = subprocess.run(
        [str(venv / "bin" / "megaseq"), "plugins", "--json"], capture_output=True, text=True, check=True, env=env
    )
    plugins = {p["dist"]: p for p in json.loads(listing.stdout)}
    assert set(plugins) == {"megaseq-core", "megaseq-attn-kda"}, plugins
    kda = plugins["megaseq-attn-kda"]
    assert (kda["status"], kda["version"], kda["components"]) == (
        "active", kda_version, {"attention": ["kda"], "hf_layout": ["kda", "kimi_linear"]})
    assert plugins["megaseq-core"]["version"] == core_version

    # the declared requirements, as installed: the ranged core dependency and everything the pyproject says
    code = "import importlib.metadata as md, json; print(json.dumps(md.requires('megaseq-attn-kda')))"
    requires = json.loads(subprocess.run([str(python), "-c", code], capture_output=True, text=True, check=True, env=env).stdout)
    declared = tomllib.loads((REPO / "packages/attn-kda/pyproject.toml").read_text())["project"]["dependencies"]
    installed = {str(Requirement(r)) for r in requires if "extra" not in r}
    assert installed == {str(Requirement(r)) for r in declared}
    core = next(Requirement(r) for r in requires if r.startswith("megaseq-core"))
    assert core.specifier.contains(core_version) and not core.specifier.contains("0.2.0")
