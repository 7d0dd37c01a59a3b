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
    assert core["status"] == "active"
    assert core["components"] == {"attention": ["sdpa"], "ffn": ["swiglu"], "inference_engine": ["cached"]}
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
    out = tmp_path / "run" / "eval" / "step_0000002"
    assert "step 2:" in proc.stdout and f"wrote {out}/heldout.json" in proc.stdout
    assert (out / "heldout.json").exists() and (out / "heldout_by_position.png").exists()
    # it says where it writes before the work starts, shows progress, and leaves the checkpoint as it was
    assert f"writing {out}" in proc.stderr and "eval model" in proc.stderr
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints" / "step_0000002").iterdir()) == [
        "manifest.json", "meta.json", "model.safetensors", "state.pt"]


def test_help_says_where_output_goes_and_what_data_may_be(capsys):
    for args in (["train", "--help"], ["eval", "--help"]):
        with pytest.raises(SystemExit):
            main(args)
    text = " ".join(capsys.readouterr().out.split())
    assert "run.out_dir (default runs/{run.name}" in text and "metrics.jsonl, tensorboard/, checkpoints/" in text
    assert "paths to FASTA files" in text and "--resume" in text and "--overwrite" in text
    assert "RUN/eval/step_N" in text and "never into the checkpoint directory" in text


@pytest.mark.parametrize(("args", "choices"), [([], "train, eval, plugins, data"), (["data"], "fetch, list")])
def test_a_missing_subcommand_is_one_line_naming_the_choices(args, choices, capsys):
    assert main(args) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert f"missing command; choose one of: {choices}" in line and "data_command" not in line
