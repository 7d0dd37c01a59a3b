"""Runs you can trust, through the command line: a run directory is never overwritten or mixed silently,
damaged or mismatched checkpoints give one line (and a fallback where one exists), each step is logged
once after a resume, bad held-out data fails before the first step, a diverged run stops in one line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from megaseq.cli import main

REPO = Path(__file__).resolve().parents[3]
RECIPE = str(REPO / "recipes" / "tiny.toml")
QUICK = ["--no-progress", "--set", "train.log_every=1", "--set", "eval.windows=2",
         "--set", "data.seq_len=64", "--set", "model.d_model=16"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(autouse=True)
def cache_dir(cache, monkeypatch):
    monkeypatch.setenv("MEGASEQ_CACHE", str(cache))


def train(run: Path, *args: str, steps: int = 4, every: int = 2) -> int:
    return main(["train", RECIPE, *QUICK, "--set", f"run.out_dir={run}", "--set", f"train.steps={steps}",
                 "--set", f"train.checkpoint_every={every}", *args])


def error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("megaseq: error")]


def logged_steps(run: Path, key: str = "loss") -> list[int]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [row["step"] for row in rows if key in row]


def tensorboard_steps(run: Path, tag: str = "loss") -> list[int]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run / "tensorboard"))  # applies TensorBoard's purge rule, as the UI does
    events.Reload()
    return [e.step for e in events.Scalars(tag)]


@pytest.fixture(scope="module")
def finished(tmp_path_factory, cache):
    """A run of 4 steps with checkpoints at 2 and 4 (copied by each test that damages it)."""
    run = tmp_path_factory.mktemp("finished") / "run"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MEGASEQ_CACHE", str(cache))
        assert train(run) == 0
    return run


@pytest.fixture
def run(finished, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(finished, copy)
    return copy


def test_a_run_directory_is_not_reused_without_a_flag(run, capsys):
    before = (run / "metrics.jsonl").read_text()
    capsys.readouterr()
    assert train(run) == 2
    (line,) = error_lines(capsys.readouterr().err)
    assert "already holds a run" in line and "--resume" in line and "--overwrite" in line
    assert (run / "metrics.jsonl").read_text() == before
    assert train(run, "--overwrite", steps=3) == 0
    assert logged_steps(run) == [1, 2, 3]
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == ["step_0000002", "step_0000003"]


def test_resume_logs_each_step_once(tmp_path, capsys):
    """Steps logged after the last checkpoint (a kill) are cut from metrics.jsonl and TensorBoard on resume."""
    run = tmp_path / "run"
    assert train(run, steps=5, every=2) == 0  # checkpoints 2, 4 and the final 5
    shutil.rmtree(run / "checkpoints" / "step_0000005")  # as if killed after logging step 5, before its save
    (run / "checkpoints" / "latest").write_text("step_0000004\n")
    assert train(run, "--resume", steps=6) == 0
    assert logged_steps(run) == [1, 2, 3, 4, 5, 6]
    assert logged_steps(run, "eval/model/bits_per_base") == [6]  # the first run's final eval at 5 is cut too
    assert tensorboard_steps(run) == [1, 2, 3, 4, 5, 6]
    assert "resumed from" in capsys.readouterr().err


def test_unreadable_metrics_lines_are_kept_aside_and_reported_on_resume(run, capsys):
    lines = (run / "metrics.jsonl").read_text().splitlines()
    garbage = ["not json at all", '{"loss": 1.0}', '{"step": 3, "loss": 1.']  # no step; a row cut short
    (run / "metrics.jsonl").write_text("\n".join([lines[0], *garbage[:2], *lines[1:], garbage[2]]) + "\n")
    capsys.readouterr()
    assert train(run, "--resume", steps=5) == 0
    err = capsys.readouterr().err
    assert f"moved 3 unreadable line(s) of metrics.jsonl to {run / 'metrics.unreadable.txt'}" in err, err
    assert (run / "metrics.unreadable.txt").read_text().splitlines() == garbage
    assert logged_steps(run) == [1, 2, 3, 4, 5]


def test_checkpoints_without_a_manifest_are_upgraded_then_resume(run, capsys):
    for step in ("step_0000002", "step_0000004"):  # as written before manifests existed
        (run / "checkpoints" / step / "manifest.json").unlink()
    capsys.readouterr()
    assert train(run, "--resume", steps=5) == 2
    (line,) = error_lines(capsys.readouterr().err)
    assert "no manifest.json" in line and f"megaseq checkpoint upgrade {run / 'checkpoints'}" in line, line
    assert main(["checkpoint", "upgrade", str(run)]) == 0
    assert capsys.readouterr().out.count("wrote ") == 2
    assert train(run, "--resume", steps=5) == 0 and "resumed from" in capsys.readouterr().err
    assert main(["checkpoint", "upgrade", str(run)]) == 0 and "already has a manifest" in capsys.readouterr().out


def test_a_cut_short_file_gets_no_manifest(run, capsys):
    step = run / "checkpoints" / "step_0000004"
    (step / "manifest.json").unlink()
    weights = step / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    capsys.readouterr()
    assert main(["checkpoint", "upgrade", str(step)]) == 2
    (line,) = error_lines(capsys.readouterr().err)
    assert "model.safetensors cannot be read" in line and not (step / "manifest.json").exists(), line


def test_latest_naming_a_missing_checkpoint_falls_back(run, capsys):
    shutil.rmtree(run / "checkpoints" / "step_0000004")
    capsys.readouterr()
    assert train(run, "--resume", steps=6) == 0
    err = capsys.readouterr().err
    assert "latest names step_0000004, which does not exist; resuming from step_0000002" in err
    assert logged_steps(run) == [1, 2, 3, 4, 5, 6]


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (lambda c: truncate(c / "model.safetensors"), "model.safetensors has"),
        (lambda c: truncate(c / "state.pt"), "state.pt has"),
        (lambda c: (c / "meta.json").write_text(""), "meta.json has 0 bytes"),
        (lambda c: (c / "model.safetensors").unlink(), "model.safetensors is missing"),
    ],
    ids=["truncated-weights", "truncated-state", "empty-meta", "missing-weights"],
)
def test_a_damaged_latest_checkpoint_is_one_line_and_resume_falls_back(run, capsys, damage, reason):
    damage(run / "checkpoints" / "step_0000004")
    capsys.readouterr()
    assert train(run, "--resume", steps=6) == 0
    err = capsys.readouterr().err
    (warning,) = [line for line in err.splitlines() if line.startswith("megaseq: warning")]
    assert f"step_0000004 is damaged ({reason}" in warning and "resuming from step_0000002" in warning
    assert "Traceback" not in err
    assert (run / "checkpoints" / "step_0000004.damaged").is_dir()  # kept for inspection, out of the way
    assert logged_steps(run) == [1, 2, 3, 4, 5, 6]


def test_empty_latest_pointer(run, capsys):
    (run / "checkpoints" / "latest").write_text("")
    capsys.readouterr()
    assert train(run, "--resume", steps=6) == 0
    assert "latest is empty; resuming from step_0000004" in capsys.readouterr().err


def test_no_usable_checkpoint_is_one_line(run, capsys):
    for step in (2, 4):
        (run / "checkpoints" / f"step_{step:07d}" / "state.pt").unlink()
    capsys.readouterr()
    assert train(run, "--resume", steps=6) == 2
    (line,) = error_lines(capsys.readouterr().err)
    assert "no usable checkpoint" in line and "step_0000004 is damaged" in line and "--overwrite" in line


def test_a_recipe_of_another_shape_is_one_line_naming_the_keys(run, capsys):
    capsys.readouterr()
    assert train(run, "--resume", "--set", "model.d_model=24", steps=6) == 2
    err = capsys.readouterr().err
    (line,) = error_lines(err)
    assert "model.d_model 16 -> 24" in line and "embed.weight [5, 16] -> [5, 24]" in line
    assert "Traceback" not in err


def test_changed_hyperparameters_are_reported_and_used(run, capsys):
    capsys.readouterr()
    assert train(run, "--resume", "--set", "train.lr=0.001", steps=6) == 0
    err = capsys.readouterr().err
    (header,) = [line for line in err.splitlines() if "resumed from" in line]
    assert "train.lr 0.003 -> 0.001" in header and "train.steps 4 -> 6" in header
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    lr5 = next(r["lr"] for r in rows if r["step"] == 5 and "lr" in r)
    from megaseq.train.schedule import lr_factor

    assert lr5 == pytest.approx(0.001 * lr_factor(4, 2, 6, 0.1))  # tiny.toml: warmup 2, default min_lr_ratio


def test_leftovers_of_an_interrupted_save_are_removed(run, capsys):
    leftover = run / "checkpoints" / ".tmp-step_0000005"
    leftover.mkdir()
    (leftover / "model.safetensors").write_bytes(b"partial")
    capsys.readouterr()
    assert train(run, "--resume", steps=5) == 0
    assert not leftover.exists()
    assert f"removed {leftover.name}, left by an interrupted save" in capsys.readouterr().err


def test_old_checkpoints_are_pruned(tmp_path):
    run = tmp_path / "run"
    assert train(run, "--set", "train.keep_checkpoints=2", steps=4, every=1) == 0
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["latest", "step_0000003", "step_0000004"]
    assert train(run, "--overwrite", steps=4, every=1) == 0  # default: the newest 2 as well
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == ["step_0000003", "step_0000004"]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("", "not a FASTA file"),
        (">gap\n" + "N" * 400 + "\n", "has no window of data.seq_len 64"),
        (">sp|P69905|HBA_HUMAN\nMVLSPADKTNVKAAWGKVGAHAGEYGAEALERMFLSFPTTKTYFPHFDLSHGSAQVKGHGKKVADALTNAVAHV\n", "invalid nucleotide"),
    ],
    ids=["empty", "all-N", "protein"],
)
def test_bad_heldout_data_fails_before_training(tmp_path, capsys, content, message):
    fasta = tmp_path / "heldout.fa"
    fasta.write_text(content)
    run = tmp_path / "run"
    assert train(run, "--set", f"data.heldout={fasta}") == 2
    assert not (run / "metrics.jsonl").exists() and not (run / "checkpoints").exists(), "it trained first"
    (line,) = error_lines(capsys.readouterr().err)
    assert "data.heldout" in line and message in line


def test_non_finite_weights_stop_in_one_line(run, capsys):
    from megaseq.config import load_recipe
    from megaseq.errors import UserError
    from megaseq.plugins import get_plugins
    from megaseq.train.trainer import Trainer

    plugins = get_plugins()
    recipe = load_recipe(RECIPE, plugins, [*QUICK[2::2], f"run.out_dir={run}"])
    trainer = Trainer(recipe, plugins, progress=False, tensorboard=False)
    with torch.no_grad():
        trainer.model.embed.weight[0, 0] = float("nan")
    with pytest.raises(UserError, match=r"^step 1: loss nan, gradient norm nan: training diverged"):
        trainer.train_step()
    # the same weights in a checkpoint (the trainer never writes one: this writes it directly): resuming
    # from it is one line, exit 2, before any step
    from megaseq.train import checkpoint

    checkpoint.save_checkpoint(trainer.checkpoint_root, 5, trainer.model, {}, {"recipe": recipe.to_dict()})
    capsys.readouterr()
    assert train(run, "--resume", steps=6) == 2
    err = capsys.readouterr().err
    (line,) = error_lines(err)
    assert "step_0000005: non-finite weights (embed.weight" in line and "Traceback" not in err
