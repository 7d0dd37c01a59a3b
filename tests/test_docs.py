"""The plugin guide (docs/writing-a-plugin.md) is executed, and documents every hook and every suite knob.

Every fenced block of the guide runs:

- blocks with ``file=PATH`` are written to a scratch directory (the worked plugin ``megaseq-mything``: its
  pyproject, modules, test and recipe), and the ``text`` tree must name exactly files that exist there;
- ``console`` blocks run command by command, in order, in a fresh virtual environment: ``make dist`` builds
  every package of this repository into the scratch ``dist/``, ``pip install`` installs the named wheels
  into the fresh environment (their dependencies are lent from this environment instead of being
  installed: torch alone would take minutes), anything else runs as written (``megaseq plugins --check``,
  the plugin's conformance suite through pytest);
- plain ``python`` blocks run in that environment in order (one that comes before the install, such as the
  snippet of the shared utilities, runs right after it).

The commands see only the installed wheels of megaseq: nothing of this checkout is on their path.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
GUIDE = REPO / "docs" / "writing-a-plugin.md"
FENCE = re.compile(r"^```(\w+)([^\n]*)\n(.*?)^```$", re.MULTILINE | re.DOTALL)


def blocks() -> list[tuple[str, dict[str, str], str]]:
    """(language, attributes such as file=..., body) of every fenced block, in order."""
    found = []
    for language, info, body in FENCE.findall(GUIDE.read_text()):
        attributes = dict(part.split("=", 1) for part in info.split() if "=" in part)
        found.append((language, attributes, body))
    return found


def lend_site_packages(into: Path) -> Path:
    """Links to this environment's installed distributions except megaseq's own (and .pth hooks), so that
    a fresh environment can import torch, pytest, ... while megaseq comes only from the wheels it installs."""
    into.mkdir()
    site = Path(importlib.util.find_spec("torch").origin).parents[1]
    for entry in site.iterdir():
        own = entry.name.lower().lstrip("_").startswith(("megaseq", "editable")) or entry.suffix == ".pth"
        if not own and entry.name != "__pycache__":
            (into / entry.name).symlink_to(entry)
    return into


@pytest.mark.timeout(900)
def test_guide_runs_end_to_end(tmp_path):
    pytest.importorskip("hatchling")
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    all_blocks = blocks()
    languages = {language for language, _, _ in all_blocks}
    assert languages <= {"text", "toml", "markdown", "python", "console"}, languages

    # files first: the worked plugin, written as the guide shows it
    for _, attributes, body in all_blocks:
        if "file" in attributes:
            path = scratch / attributes["file"]
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(body)
    (tree,) = [body for language, _, body in all_blocks if language == "text"]
    root, *entries = tree.splitlines()
    listed = {root.rstrip("/") + "/" + line.split()[0] for line in entries if line.strip()}
    written = {str(p.relative_to(scratch)) for p in (scratch / root.rstrip("/")).rglob("*") if p.is_file()}
    assert listed == written, f"the layout tree lists {sorted(listed)}, the guide's files are {sorted(written)}"

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    env = {
        "PATH": f"{venv / 'bin'}:{os.environ['PATH']}",
        "PYTHONPATH": str(lend_site_packages(tmp_path / "lent")),
        "HOME": str(tmp_path),
        "MEGASEQ_CACHE": str(tmp_path / "cache"),
        "OMP_NUM_THREADS": "1",
    }

    def run(command: list[str] | str, cwd: Path) -> str:
        shell = isinstance(command, str)
        proc = subprocess.run(command, cwd=cwd, env=env, shell=shell, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, f"{command!r} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        return proc.stdout

    outputs, waiting, installed = [], [], False

    def run_python(body: str) -> None:
        outputs.append(run([str(venv / "bin" / "python"), "-c", body], scratch))

    for language, attributes, body in all_blocks:
        if language == "console":
            cwd = scratch
            for line in body.splitlines():
                assert line.startswith("$ "), f"a console block line must be a command: {line!r}"
                for command in line[2:].split(" && "):
                    words = shlex.split(command)
                    if words[0] == "cd":
                        cwd = (cwd / words[1]).resolve()
                    elif words[:2] == ["make", "dist"]:
                        run(["make", "-C", str(REPO), "dist", f"DIST={scratch / 'dist'}"], REPO)
                    elif words[:2] == ["pip", "install"]:
                        install = [sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install"]
                        run([*install, "-q", "--no-deps", "--disable-pip-version-check", *words[2:]], cwd)
                        installed = True
                        while waiting:
                            run_python(waiting.pop(0))
                    else:
                        outputs.append(run(command, cwd))
        elif language == "python" and "file" not in attributes:
            if installed:
                run_python(body)
            else:
                waiting.append(body)
    assert installed and not waiting, "the guide never installs the wheels"

    listing = "\n".join(outputs)
    assert re.search(r"attention +mything +megaseq-mything 0.1.0", listing), listing
    assert "megaseq-mything 0.1.0, mything: active" in listing, listing
    assert "components' targets import" in listing
    assert re.search(r"\d+ passed", listing), listing  # the plugin's conformance suite ran
    metrics = [json.loads(line) for line in (scratch / "runs" / "mything-demo" / "metrics.jsonl").read_text().splitlines()]
    assert any(row.get("mything/layers") == 1.0 for row in metrics), metrics  # the plugin's step_end hook ran


def test_every_hook_is_documented_in_the_guide():
    from megaseq import hookspecs

    guide = GUIDE.read_text()
    hooks = [name for name in dir(hookspecs) if name.startswith("megaseq_")]
    missing = [name for name in hooks if f"`{name}" not in guide]
    assert not missing, f"docs/writing-a-plugin.md does not document {missing}"
    for name in hooks:
        doc = getattr(hookspecs, name).__doc__ or ""
        assert "alled" in doc and "eturn" in doc, f"hookspec {name}: say when it is called and what it returns"


@pytest.mark.parametrize(
    "suite",
    ["megaseq.testing.attention:AttentionConformance", "megaseq.testing.ffn:FeedForwardConformance",
     "megaseq.testing.moe:MoEConformance", "megaseq.testing.rl:RLAlgorithmConformance",
     "megaseq.testing.engine:EngineConformance", "megaseq.testing.memory_policy:MemoryPolicyConformance",
     "megaseq.testing.tiling:SequenceTilingConformance"],
)
def test_every_suite_knob_is_documented_in_the_guide(suite):
    from megaseq.records import load_target

    cls = load_target(suite)
    knobs = {name for klass in cls.__mro__ for name in getattr(klass, "__annotations__", {})}
    assert knobs, suite
    rows = [line for line in GUIDE.read_text().splitlines() if line.startswith("| `")]
    documented = {name for row in rows for name in re.findall(r"`(\w+)`", row.split("|")[1])}
    missing = sorted(knobs - documented)
    assert not missing, f"{suite}: knobs {missing} are not in a knob table of docs/writing-a-plugin.md"
