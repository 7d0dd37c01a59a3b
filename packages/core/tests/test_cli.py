"""The command line: help everywhere, one-line errors with exit status 2, plugin listing."""

from __future__ import annotations

import importlib.metadata as md
import json
import re
import subprocess
import sys
import tomllib
import types
from pathlib import Path

import pytest

from megaseq.cli import main
from megaseq.config import validate_recipe
from megaseq.errors import PluginError
from megaseq.hookspecs import hookimpl
from megaseq.records import AttentionSpec
from megaseq_testkit import fresh_plugins

REPO = Path(__file__).resolve().parents[3]


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megaseq.cli", *args], capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("args", [[], ["train"], ["eval"], ["plugins"], ["data"], ["data", "fetch"], ["data", "list"]])
def test_help_everywhere(args, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([*args, "--help"])
    assert exit_.value.code == 0
    assert "usage: megaseq" in capsys.readouterr().out


def test_user_errors_are_one_line_exit_2(tmp_path, capsys):
    """In this process: what a process adds (``sys.exit(main())``) test_plugins_listing runs."""
    recipe = tmp_path / "r.toml"
    recipe.write_text("[train]\nsteps = 'many'\n")
    for args, expected in [
        (["train", str(recipe)], f"megaseq: error: {recipe}: train.steps: Input should be a valid integer"),
        (["train", str(tmp_path / "none.toml")], "recipe not found"),
        (["train", str(recipe), "--set", "oops"], "expected KEY.PATH=VALUE"),
        (["eval", str(tmp_path)], "not a megaseq checkpoint"),
        (["data", "fetch", "grch99-chr1"], "unknown dataset 'grch99-chr1'; known datasets: excerpt-chr20, excerpt-chrX"),
        (["data", "fetch", "excerpt-chr20", "--set", "path=x.txt"], "data_source.excerpt-chr20.path: unknown key; "
         "allowed keys: none"),
    ]:
        capsys.readouterr()
        status = main(args)
        err = capsys.readouterr().err
        assert status == 2, (args, err)
        errors = [line for line in err.splitlines() if line.startswith("megaseq: error")]
        assert len(errors) == 1 and expected in errors[0], err
        assert "Traceback" not in err


@pytest.mark.slow  # CLI processes, each importing torch
def test_plugins_listing():
    proc = run("plugins", "--json")
    assert proc.returncode == 0, proc.stderr
    infos = {i["name"]: i for i in json.loads(proc.stdout)}
    core = infos["megaseq.builtins"]  # core's components; its commands are the built-in plugin megaseq.commands
    assert core["status"] == "active"
    assert core["components"] == {"attention": ["sdpa"], "ffn": ["swiglu"], "inference_engine": ["cached"],
                                  "data_source": ["excerpt-chr20", "excerpt-chrX"]}
    text = run("plugins").stdout
    components = text.split("Plugins")[0]  # component names lead, with their kind and provider
    assert re.search(r"attention +sdpa +megaseq-core", components) and re.search(r"ffn +swiglu +megaseq-core", components)
    assert "megaseq-core 0.1.0, megaseq.builtins: active" in text and "megaseq-core 0.1.0, megaseq.commands: active" in text
    assert infos["megaseq.commands"]["components"]["command"][:2] == ["train", "plan"]


class _Dist:
    def __init__(self, name: str) -> None:
        self.name, self.version, self.requires = name, "1.0", ["megaseq-core>=0.1,<0.2"]


class _EntryPoint:
    def __init__(self, name: str, module: types.ModuleType, dist: str) -> None:
        self.name, self.module, self.dist = name, module, _Dist(dist)

    def load(self) -> types.ModuleType:
        return self.module


def _plugin_module(spec: AttentionSpec) -> types.ModuleType:
    module = types.ModuleType(f"fake_{spec.name}")
    module.megaseq_attention = hookimpl(lambda: [spec])
    return module


@pytest.fixture
def troubled_plugins(monkeypatch):
    """Installed plugins with trouble: two distributions providing 'twin', one with a misspelt memory target."""
    twin_a, twin_b = (_plugin_module(AttentionSpec(name="twin", target="megaseq.builtins.sdpa:build")) for _ in "ab")
    typo = _plugin_module(
        AttentionSpec(name="typo", target="megaseq.builtins.sdpa:build", memory="megaseq.builtins.sdpa:memory_estimat")
    )
    eps = [_EntryPoint("twin-a", twin_a, "dist-a"), _EntryPoint("twin-b", twin_b, "dist-b"), _EntryPoint("typo", typo, "dist-typo")]
    monkeypatch.setattr(md, "entry_points", lambda group=None: eps if group == "megaseq" else [])
    monkeypatch.delenv("MEGASEQ_PLUGINS", raising=False)
    monkeypatch.delenv("MEGASEQ_DISABLE_PLUGIN_AUTOLOAD", raising=False)


@pytest.mark.filterwarnings("ignore:.*(provided twice|is broken)")
def test_plugins_runs_despite_conflicts_and_shows_broken_targets(troubled_plugins, capsys):
    assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"attention +twin +dist-a 1.0 \+ dist-b 1.0 +CONFLICT: provided twice, unusable", out)
    assert "dist-a 1.0, twin-a: active\n    conflict: attention 'twin' is also provided by dist-b 1.0" in out
    assert "dist-typo 1.0, typo: broken (attention 'typo': memory 'megaseq.builtins.sdpa:memory_estimat'" in out
    assert "defines no 'memory_estimat')" in out
    assert main(["plugins", "--json"]) == 0
    listed = {i["name"]: i for i in json.loads(capsys.readouterr().out)}
    assert listed["twin-b"]["components"] == {"attention": ["twin"]} and listed["twin-b"]["conflicts"]
    assert listed["typo"]["status"] == "broken"
    # only what needs the conflicting name fails
    plugins = fresh_plugins(autoload=True)
    recipe = tomllib.loads((REPO / "recipes" / "tiny.toml").read_text())
    assert validate_recipe(recipe, plugins).model.layer_pattern == ["sdpa"]
    recipe["model"]["layer_pattern"], recipe["attention"] = ["twin"], {}
    with pytest.raises(PluginError, match="attention 'twin' is provided twice: by dist-a 1.0 \\(twin-a\\) and by dist-b"):
        validate_recipe(recipe, plugins)


@pytest.mark.filterwarnings("ignore:.*(provided twice|is broken)")
def test_plugins_check_imports_targets_and_fails_on_broken(troubled_plugins, capsys):
    assert main(["plugins", "--check"]) == 2
    out = capsys.readouterr().out
    assert "dist-typo 1.0 (typo): broken: attention 'typo': memory" in out and "1 problem(s)" in out


def test_plugins_check_passes_on_installed_plugins():
    proc = run("plugins", "--check")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "components' targets import" in proc.stdout


@pytest.mark.slow  # CLI processes, each importing torch
def test_train_then_eval_checkpoint(tmp_path, monkeypatch):
    env_cache = {"MEGASEQ_CACHE": str(tmp_path / "cache")}
    args = ["train", str(REPO / "recipes" / "tiny.toml"), "--set", f"run.out_dir={tmp_path / 'run'}", "--set", "train.steps=2"]
    proc = subprocess.run([sys.executable, "-m", "megaseq.cli", *args], capture_output=True, text=True, timeout=300,
                          env={**__import__("os").environ, **env_cache})
    assert proc.returncode == 0, proc.stderr
    assert "bits/base by context position" in proc.stdout
    # the progress bar shows the loss in the unit of every result, labelled; the header says what its memory is
    assert re.search(r"loss \d\.\d{4} bits/base, \d+ tok/s, peak RSS \d+\.\d\d GiB \(plan \d+\.\d\d GiB\)", proc.stderr), proc.stderr
    assert "loss=" not in proc.stderr and "the whole process" in proc.stderr and "what the plan predicts" in proc.stderr
    assert re.search(r"megaseq: peak memory \d+\.\d\dG, plan \d+\.\d\dG \([+-]\d+\.\d%\)", proc.stderr), proc.stderr
    assert (tmp_path / "run" / "eval" / "step_0000002" / "heldout.json").exists()  # where megaseq eval writes too
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


def test_eval_into_an_unwritable_place_is_one_line(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", str(REPO / "recipes" / "tiny.toml"), "--no-progress", "--out", str(run),  # run.out_dir
                 "--set", "train.steps=1", "--set", "eval.windows=1", "--set", "data.seq_len=64"]) == 0
    assert (run / "checkpoints" / "step_0000001").is_dir()
    (tmp_path / "file").write_text("")
    capsys.readouterr()
    assert main(["eval", str(run), "--out", str(tmp_path / "file" / "eval"), "--no-progress"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line == f"megaseq: error: eval --out {tmp_path / 'file' / 'eval'}: cannot write there (Not a directory)"


def test_a_misspelt_layer_name_is_reported_before_the_unused_section(tmp_path, capsys):
    assert main(["train", str(REPO / "recipes" / "tiny.toml"), "--set", 'model.layer_pattern=["sdpaa"]',
                 "--set", f"run.out_dir={tmp_path}"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "model.layer_pattern[0]" in line and "'sdpaa'" in line and "configured but not used" not in line, line


def test_a_command_of_an_uninstalled_plugin_says_to_install_it(monkeypatch, capsys):
    monkeypatch.setenv("MEGASEQ_DISABLE_PLUGIN_AUTOLOAD", "1")  # core's commands only, as without megaseq-rl
    assert main(["rl", "recipe.toml"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "unknown command 'rl'" in line and "plugin installed" in line


def test_help_says_where_output_goes_and_what_data_may_be(capsys):
    for args in (["train", "--help"], ["eval", "--help"]):
        with pytest.raises(SystemExit):
            main(args)
    text = " ".join(capsys.readouterr().out.split())
    assert "run.out_dir (default runs/{run.name}" in text and "metrics.jsonl, tensorboard/, checkpoints/" in text
    assert "paths to FASTA files" in text and "--resume" in text and "--overwrite" in text
    assert "RUN/eval/step_N" in text and "never into the checkpoint directory" in text


@pytest.mark.parametrize(("args", "choices"), [([], "train, plan, eval, import, export, checkpoint, plugins, data"),
                                               (["data"], "fetch, list"), (["checkpoint"], "upgrade")])
def test_a_missing_subcommand_is_one_line_naming_the_choices(args, choices, capsys):
    assert main(args) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert f"missing command; choose one of: {choices}" in line and "data_command" not in line  # core's, then plugins'


def test_a_second_trainer_of_a_live_run_is_refused_before_anything_is_built(tmp_path, monkeypatch, capsys):
    import megaseq.eval.evaluate as evaluate
    import megaseq.train.trainer as trainer
    from megaseq.train.rundir import RunLock

    built = []

    def spy(what):
        def record(*args, **kwargs):
            built.append(what)
            raise AssertionError(f"{what} ran before the run directory's lock was checked")
        return record

    monkeypatch.setattr(trainer.Trainer, "__init__", spy("the trainer"))
    monkeypatch.setattr(evaluate, "check_analyses", spy("fitting the baselines"))
    with RunLock(tmp_path / "run", "training"):  # another open file of the lock excludes as another process does
        assert main(["train", str(REPO / "recipes" / "tiny.toml"), "--no-progress", "--out", str(tmp_path / "run")]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert f"{tmp_path / 'run'} is in use by PID" in line and "(training)" in line and not built
