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
  snippet of the shared utilities, runs right after it);
- the "use it" section's runs leave what it says they do: the plugin's step-end metric, the MoE load that core
  logs (``moe/load/KEY``), the memory policy in the run's header, the planner's proposal, the RL algorithm's
  ``policy/...`` metrics, a protein model trained on the plugin's data source, reported per residue.

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


@pytest.mark.slow  # a fresh venv, wheels, and the guide's commands as processes
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
        return proc.stdout + proc.stderr  # megaseq's commands print their headers to stderr

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
    def metrics(run: str) -> list[dict]:
        return [json.loads(line) for line in (scratch / "runs" / run / "metrics.jsonl").read_text().splitlines()]

    demo = metrics("mything-demo")
    assert any(row.get("mything/layers") == 1.0 for row in demo), demo  # the plugin's step_end hook ran
    # the "use it" sections: an MoE run whose load core logs, the same with a memory policy, RL from its checkpoint
    moe = metrics("mything-moe")
    assert all(f"moe/load/{key}" in moe[0] for key in ("tokens_per_expert_max", "routing_entropy")), moe[0]
    assert "memory: recompute(part=block, reuse_kept=True)" in listing and metrics("mything-recompute"), listing  # the run's header
    rl = [row for row in metrics("mything-rl") if "policy/clip_frac_high" in row]  # the first row: step 0's eval
    assert rl and "moe/load/routing_entropy" in rl[0], metrics("mything-rl")
    assert "proposed:" in listing, listing  # megaseq plan ran
    protein = [row for row in metrics("mything-protein") if "loss" in row]
    assert len(protein) == 2 and all(row["loss"] == row["loss"] for row in protein), protein
    (heldout,) = (scratch / "runs" / "mything-protein" / "eval").glob("step_*/heldout.json")
    assert json.loads(heldout.read_text())["alphabet"] == "protein" and "bits/residue" in listing, listing


def test_every_hook_is_documented_in_the_guide():
    from megaseq import hookspecs

    guide = GUIDE.read_text()
    hooks = [name for name in dir(hookspecs) if name.startswith("megaseq_")]
    missing = [name for name in hooks if f"`{name}" not in guide]
    assert not missing, f"docs/writing-a-plugin.md does not document {missing}"
    for name in hooks:
        doc = getattr(hookspecs, name).__doc__ or ""
        assert "alled" in doc and "eturn" in doc, f"hookspec {name}: say when it is called and what it returns"


SUITES = {
    "attention": "megaseq_testkit.attention:AttentionConformance",
    "ffn": "megaseq_testkit.ffn:FeedForwardConformance",
    "moe": "megaseq_testkit.moe:MoEConformance",
    "tiling": "megaseq_testkit.tiling:SequenceTilingConformance",
    "memory policy": "megaseq_testkit.memory_policy:MemoryPolicyConformance",
    "rl": "megaseq_testkit.rl:RLAlgorithmConformance",
    "engine": "megaseq_testkit.engine:EngineConformance",
    "data source": "megaseq_testkit.data_source:DataSourceConformance",
    "baseline": "megaseq_testkit.baseline:BaselineConformance",
    "eval analysis": "megaseq_testkit.eval_analysis:EvalAnalysisConformance",
    "data transform": "megaseq_testkit.data_transform:DataTransformConformance",
}
KNOB_HEADER = "| knob | suites | default | meaning |"


def knob_table(text: str) -> list[str]:
    """The lines of the one knob table in ``text`` (from its header to the first line that is not a row)."""
    lines = text.splitlines()
    assert lines.count(KNOB_HEADER) == 1, f"expected one knob table headed {KNOB_HEADER!r}"
    start = lines.index(KNOB_HEADER)
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    return lines[start:end]


def test_one_knob_table_in_the_guide_and_the_testing_docstring():
    import megaseq_testkit

    assert knob_table(GUIDE.read_text()) == knob_table(megaseq_testkit.__doc__), (
        "the knob tables of docs/writing-a-plugin.md and megaseq_testkit's docstring differ"
    )


def test_the_knob_table_lists_every_suite_knob_and_only_those():
    from megaseq.records import load_target

    listed: dict[str, set[str]] = {}
    for row in knob_table(GUIDE.read_text())[2:]:
        cells = [cell.strip() for cell in row.strip("|").split(" | ")]
        suites = set(SUITES) if cells[1] == "all" else {name.strip() for name in cells[1].split(",")}
        assert suites <= set(SUITES), f"unknown suites in {row!r}"
        for knob in re.findall(r"`(\w+)`", cells[0]):
            listed[knob] = suites
    for suite, target in SUITES.items():
        cls = load_target(target)
        knobs = {name for klass in cls.__mro__ for name in getattr(klass, "__annotations__", {}) if not name.startswith("_")}
        table = {knob for knob, suites in listed.items() if suite in suites}
        assert knobs == table, f"{suite}: knobs {sorted(knobs - table)} not in the table, {sorted(table - knobs)} listed but absent"


def test_the_knob_table_check_catches_a_missing_knob():
    """The check above fails on a suite with a knob the table does not list."""
    from megaseq_testkit.rl import RLAlgorithmConformance

    RLAlgorithmConformance.__annotations__["undocumented_knob"] = "ClassVar[int]"
    try:
        with pytest.raises(AssertionError, match="undocumented_knob"):
            test_the_knob_table_lists_every_suite_knob_and_only_those()
    finally:
        del RLAlgorithmConformance.__annotations__["undocumented_knob"]
