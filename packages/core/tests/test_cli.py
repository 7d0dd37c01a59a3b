"""The command line: help everywhere, one-line errors with exit status 2, plugin listing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from megaseq.cli import main

REPO = Path(__file__).resolve().parents[3]


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megaseq.cli", *args], capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("args", [[], ["train"], ["eval"], ["plugins"], ["data"], ["data", "fetch"], ["data", "list"]])
def test_help_everywhere(args, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([*args, "--help"])
    assert exit_.value.code == 0
    assert "usage: megaseq" in capsys.readouterr().out


def test_user_errors_are_one_line_exit_2(tmp_path):
    recipe = tmp_path / "r.toml"
    recipe.write_text("[train]\nsteps = 'many'\n")
    for args, expected in [
        (["train", str(recipe)], f"megaseq: error: {recipe}: train.steps: Input should be a valid integer"),
        (["train", str(tmp_path / "none.toml")], "recipe not found"),
        (["train", str(recipe), "--set", "oops"], "expected KEY.PATH=VALUE"),
        (["eval", str(tmp_path)], "not a megaseq checkpoint"),
        (["data", "fetch", "grch99-chr1"], "grch37-chr20"),
    ]:
        proc = run(*args)
        assert proc.returncode == 2, (args, proc.stderr)
        errors = [line for line in proc.stderr.splitlines() if line.startswith("megaseq: error")]
        assert len(errors) == 1 and expected in errors[0], proc.stderr
        assert "Traceback" not in proc.stderr


def test_plugins_listing():
    proc = run("plugins", "--json")
    assert proc.returncode == 0, proc.stderr
    infos = {i["dist"]: i for i in json.loads(proc.stdout)}
    core = infos["megaseq-core"]
    assert core["status"] == "active" and core["components"] == {"attention": ["sdpa"], "ffn": ["swiglu"]}
    text = run("plugins").stdout
    assert "megaseq-core" in text and "attention: sdpa" in text


def test_train_then_eval_checkpoint(tmp_path, monkeypatch):
    env_cache = {"MEGASEQ_CACHE": str(tmp_path / "cache")}
    args = ["train", str(REPO / "recipes" / "tiny.toml"), "--no-progress", "--set", f"run.out_dir={tmp_path / 'run'}",
            "--set", "train.steps=2"]
    proc = subprocess.run([sys.executable, "-m", "megaseq.cli", *args], capture_output=True, text=True, timeout=300,
                          env={**__import__("os").environ, **env_cache})
    assert proc.returncode == 0, proc.stderr
    assert "bits/base by context position" in proc.stdout and "markov-3" in proc.stdout
    proc = subprocess.run([sys.executable, "-m", "megaseq.cli", "eval", str(tmp_path / "run"), "--set", "eval.windows=2"],
                          capture_output=True, text=True, timeout=300, env={**__import__("os").environ, **env_cache})
    assert proc.returncode == 0, proc.stderr
    assert "step 2:" in proc.stdout and (tmp_path / "run" / "checkpoints" / "step_0000002" / "eval" / "heldout.json").exists()
