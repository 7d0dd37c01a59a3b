"""The set-up the two commands run: a deliberate torch build (CPU unless TORCH=cuda) and an isolated test
environment that shares the full venv's third-party packages by hard links but none of its megaseq ones."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def make_dry_run(*args: str) -> subprocess.CompletedProcess:
    # -B: print every recipe whether or not its stamp is up to date; -n: run nothing. Without the calling make's
    # variables (under make test-fast its PYTEST_ARGS would reach this make through MAKEFLAGS).
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "PYTEST_ARGS")}
    return subprocess.run(["make", "-n", "-B", "-C", str(REPO), *args], capture_output=True, text=True, timeout=60,
                          env=env)


@pytest.mark.parametrize("build", ["cpu", "cuda"])
def test_make_installs_the_chosen_torch_build_before_the_packages(build):
    proc = make_dry_run("setup", *([f"TORCH={build}"] if build == "cuda" else []))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    # the main venv's torch (setup also builds .venv-vllm, which takes its torch by the same rule)
    (torch_line,) = [i for i, line in enumerate(lines) if line.startswith(".venv/bin/python tools/install_torch.py")]
    assert lines[torch_line].endswith(f"tools/install_torch.py {build} 2.13.0")
    (packages_line,) = [i for i, line in enumerate(lines) if "-e \"packages/core[distributed," in line]
    assert torch_line < packages_line, "torch must be installed before the packages that require it"
    assert not [line for line in lines if "pip install" in line and "torch==" in line], "an undeliberate torch install"


def test_make_rejects_an_unknown_torch_build():
    proc = make_dry_run("setup", "TORCH=gpu")
    assert proc.returncode != 0 and "TORCH=gpu: use TORCH=cpu (the default) or TORCH=cuda" in proc.stderr


def fake_wheel(directory: Path, version: str) -> None:
    """A minimal valid wheel named torch, enough for pip to resolve it (nothing is installed)."""
    directory.mkdir(parents=True, exist_ok=True)
    info = f"torch-{version}.dist-info"
    with zipfile.ZipFile(directory / f"torch-{version}-py3-none-any.whl", "w") as whl:
        whl.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n")
        whl.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        whl.writestr(f"{info}/RECORD", "")


def pip_arguments(build: str, find_links: Path) -> str:
    # pip as on a stock machine (no configuration file) plus one find-links directory
    env = {**os.environ, "PIP_CONFIG_FILE": os.devnull, "PIP_FIND_LINKS": str(find_links)}
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "install_torch.py"), build, "2.13.0", "--print"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def test_torch_pip_arguments(tmp_path):
    # stock machine: the CPU build comes from PyTorch's CPU index, pinned to +cpu so PyPI's CUDA build never matches
    assert pip_arguments("cpu", tmp_path / "empty") == "torch==2.13.0+cpu --extra-index-url https://download.pytorch.org/whl/cpu"
    # a machine whose pip already offers the CPU wheel locally (this project's CI): no index, no download
    fake_wheel(tmp_path / "wheels", "2.13.0+cpu")
    assert pip_arguments("cpu", tmp_path / "wheels") == "torch==2.13.0+cpu"
    assert pip_arguments("cuda", tmp_path / "wheels") == "torch==2.13.0"


def fake_distribution(site: Path, name: str, files: dict[str, str], requires: tuple[str, ...] = ()) -> None:
    info = site / f"{name}-1.0.dist-info"
    info.mkdir(parents=True)
    requires_dist = "".join(f"Requires-Dist: {r}\n" for r in requires)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n{requires_dist}")
    for relative, text in files.items():
        (site / relative).parent.mkdir(parents=True, exist_ok=True)
        (site / relative).write_text(text)
    record = [*files, f"{info.name}/METADATA", f"{info.name}/RECORD"]
    (info / "RECORD").write_text("".join(f"{r},,\n" for r in record))


def test_link_venv_links_what_the_package_declares_and_nothing_else(tmp_path):
    """The closure of the package's dependencies and extras, through the distributions' own requirements (an
    extra's only when asked), and through the workspace packages it names; nothing undeclared; console
    scripts left behind; what the source lacks reported."""
    sys.path.insert(0, str(REPO / "tools"))
    try:
        from link_venv import closure, link
    finally:
        sys.path.pop(0)
    source, target = tmp_path / "src" / "site-packages", tmp_path / "dst" / "site-packages"
    (tmp_path / "src" / "bin").mkdir(parents=True)
    fake_distribution(source, "heavy", {"heavy/__init__.py": "x = 1\n", "../bin/heavy-cli": "#!/src/python\n"}, ("dep",))
    (tmp_path / "src" / "bin" / "heavy-cli").write_text("#!/src/python\n")
    fake_distribution(source, "dep", {"dep.py": ""})
    fake_distribution(source, "withextra", {"withextra.py": ""}, ('speedy; extra == "fast"', 'slowpoke; extra == "other"'))
    for name in ("speedy", "slowpoke", "unrelated"):
        fake_distribution(source, name, {f"{name}.py": ""})
    package = tmp_path / "plugin"
    package.mkdir()
    (package / "pyproject.toml").write_text(
        '[project]\nname = "plugin"\ndependencies = ["heavy", "megaseq-testkit"]\n'
        '[project.optional-dependencies]\nx = ["withextra[fast]"]\n'
    )
    dists, missing = closure(package, source)
    assert sorted(dists) == ["dep", "heavy", "speedy", "withextra"]
    assert {"pip", "pytest-timeout", "pytest>=9.2", "torch>=2.13", "pluggy>=1.7"} <= set(missing)  # testkit's, core's
    target.mkdir(parents=True)
    assert link(dists, source, target) == 0
    assert (target / "heavy" / "__init__.py").stat().st_ino == (source / "heavy" / "__init__.py").stat().st_ino
    assert (target / "heavy-1.0.dist-info" / "RECORD").is_file()
    assert not (target / "unrelated.py").exists() and not (target / "slowpoke.py").exists()
    assert not (tmp_path / "dst" / "bin").exists()


@pytest.mark.slow  # builds an environment
def test_the_isolated_environment_has_torch_and_no_megaseq_package(tmp_path):
    """The real thing, from this venv, for megaseq-moe-chunked: what it declares importable (torch, and pytest
    through the test kit), what it does not absent (Ray), no megaseq package or entry point."""
    venv = Path(sys.prefix)
    iso = tmp_path / "iso"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(iso)], check=True, timeout=120)
    subprocess.run([sys.executable, str(REPO / "tools" / "link_venv.py"), str(venv), str(iso),
                    str(REPO / "packages" / "moe-chunked")], check=True, capture_output=True, timeout=300)
    probe = ("import importlib.util as u, importlib.metadata as m; "
             "print(u.find_spec('torch') is not None, u.find_spec('pytest') is not None, u.find_spec('ray') is None, "
             "[n for n in ('megaseq', 'megaseq_kda', 'megaseq_dsa', 'megaseq_moe') if u.find_spec(n)], "
             "sorted(e.name for e in m.entry_points(group='megaseq')))")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([str(iso / "bin" / "python"), "-c", probe], capture_output=True, text=True, check=True,
                         env=env, cwd=tmp_path, timeout=120).stdout.strip()
    assert out == "True True True [] []"
    torch_init = next(iso.glob("lib/python*/site-packages/torch/__init__.py"))
    assert torch_init.stat().st_ino == next(venv.glob("lib/python*/site-packages/torch/__init__.py")).stat().st_ino


def test_readme_says_what_the_set_up_needs_and_how_to_use_the_venv():
    text = " ".join((REPO / "README.md").read_text().split())
    assert "source .venv/bin/activate" in text and ".venv/bin/megaseq" in text
    assert "apt-get download" in text and "dpkg-deb" in text
    assert "~/.cache/megaseq" in text and "MEGASEQ_CACHE" in text and "175 MB" in text
    assert "TORCH=cuda" in text and ".venv-isolated" in text
    assert "nothing else" not in text


def test_the_fast_lane_runs_make_tests_sets_without_the_slow_tests():
    def pytest_lines(target: str) -> list[str]:
        return [" ".join(line.split()) for line in make_dry_run(target).stdout.splitlines() if " -m pytest " in line]

    full, fast = pytest_lines("test"), pytest_lines("test-fast")
    assert full and not any("not slow" in line for line in full)  # make test: everything
    assert sorted(fast) == sorted(line.replace(" -m pytest ", ' -m pytest -m "not slow" ') for line in full)
