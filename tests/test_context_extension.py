"""A miniature of `megaseq context-extension` (megaseq-genome's command): the pipeline and the report format, not the science.

The hybrid (kda, kda, kda, dsa; chunked MoE) at widths of a few dozen, on the DNA excerpts shipped with
core, the ``cpu-quick`` preset cut down to seconds: a 128-token pretraining with its curriculum (64-token windows,
then 128; planted repeats annealed to none) beside its control, a 128-token short continuation, a 512-token long
continuation and held-out windows, the sdpa twin, order-2 and order-3 Markov baselines. Then: running the command again does nothing, a changed plan resumes
only on top of what it leaves unchanged, and bad input is one line with exit status 2.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

RECIPE = """
[run]
name = "mini"
device = "cpu"
[data]
train = "excerpt-chr20"
heldout = "excerpt-chrX"
[model]
d_model = 32
n_layers = 4
layer_pattern = ["kda", "kda", "kda", "dsa"]
moe = "chunked"
dense_layers = 1
[attention.kda]
n_heads = 2
head_dim = 16
[attention.dsa]
n_heads = 2
head_dim = 8
q_lora_rank = 16
kv_lora_rank = 16
index_heads = 2
index_dim = 8
topk = 16
index_pool = 4
[moe.chunked]
n_experts = 4
top_k = 2
expert_hidden = 32
[train]
warmup_steps = 1
log_every = 1
"""

MINI = [
    "plan.short_len=128", "plan.long_len=512", "plan.pretrain_tokens=1024", "plan.pretrain_batch=2",
    "plan.extension_tokens=1024", "plan.heldout=excerpt-chrX", "plan.heldout_region=[0, 200000]", "plan.eval_windows=4",
    "plan.first_bucket=16", "plan.markov_orders=[2, 3]", "plan.bootstrap_samples=200",
    "plan.curriculum=[[64, 2]]", "plan.planted_hold_step=2", "plan.planted_until_step=3", "plan.sdpa=true",
]


def arguments(tmp_path: Path, sets: tuple[str, ...]) -> list[str]:
    """The command's arguments on the miniature; ``sets`` are plan keys (``--set``) or flags (``--resume``)."""
    recipe = tmp_path / "hybrid.toml"
    recipe.write_text(RECIPE)
    args = ["context-extension", str(recipe), "--scale", "cpu-quick", "--out", str(tmp_path / "out")]
    for item in sets:
        args += [item] if item.startswith("--") else ["--set", item]
    return args


def experiment(tmp_path: Path, *sets: str) -> subprocess.CompletedProcess:
    """Run the command on the miniature as a process, as a user does."""
    env = {**os.environ, "MEGASEQ_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "megaseq.cli", *arguments(tmp_path, sets)], capture_output=True, text=True,
                          env=env, timeout=600)


def refused(tmp_path: Path, capsys: pytest.CaptureFixture[str], *sets: str) -> tuple[int, str]:
    """Run the command in this process, for input it must refuse before any stage starts (a process per case
    would import torch again for a one-line error): its exit status and what it printed to stderr."""
    from megaseq.cli import main

    capsys.readouterr()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MEGASEQ_CACHE", str(tmp_path / "cache"))
        status = main(arguments(tmp_path, sets))
    return status, capsys.readouterr().err


@pytest.mark.slow
def test_miniature_experiment_writes_the_report(tmp_path, capsys):
    proc = experiment(tmp_path, *MINI)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = tmp_path / "out"
    report = json.loads((out / "report.json").read_text())
    names = ["pretrain", "control", "long", "short", "sdpa", "markov-2", "markov-3"]
    assert list(report["models"]) == names
    assert report["columns"] == ["0-16", "16-32", "32-64", "64-128", "128-256", "256-512", "all", "<128", ">=128"]
    assert report["heldout"]["windows"] == 4 and report["heldout"]["window_targets"] == 512
    for name, model in report["models"].items():
        bits = model["bits_per_base"]
        assert len(bits["mean"]) == len(report["columns"])
        assert all(lo <= m <= hi for lo, m, hi in zip(bits["low"], bits["mean"], bits["high"], strict=True)), name
        assert 1.0 < bits["mean"][6] < 3.0, name
        relative = model["relative_to_short"]["mean"]
        assert relative == [0.0] * 9 if name == "short" else len(relative) == 9
        assert model["eval"]["wall_s"] > 0 and model["eval"]["peak_rss_gib"] > 0
    runs = {n: report["models"][n] for n in ("pretrain", "control", "long", "short", "sdpa")}
    assert runs["long"]["tokens_seen"] == runs["short"]["tokens_seen"] == 1024 + 1024 == runs["sdpa"]["tokens_seen"]
    assert runs["control"]["tokens_seen"] == runs["pretrain"]["tokens_seen"] == 1024
    assert runs["control"]["steps"] == runs["pretrain"]["steps"] == 4
    assert runs["long"]["steps"] == runs["short"]["steps"] == 2 and runs["long"]["seq_len"] == 512
    assert abs(runs["sdpa"]["parameters"] - runs["long"]["parameters"]) / runs["long"]["parameters"] < 0.01
    for run in runs.values():
        assert run["train"]["wall_s"] > 0 and run["train"]["peak_rss_gib"] > 0 and run["train"]["steps"] == run["steps"]
    targets = report["targets"]
    assert set(targets) == {"checks", "met", "reference", "k", "verdict"} and targets["reference"] == "markov-3"
    assert set(targets["met"]) == set("abcd") and len(targets["checks"]) == 9
    assert targets["met"]["b"] is None  # a 512-token window has no distance past 4k: not measured
    assert targets["verdict"].split(":")[0] in ("Yes", "Partly", "No")
    pretrain_log = [json.loads(line) for line in (out / "pretrain" / "metrics.jsonl").read_text().splitlines()]
    assert [m["seq_len"] for m in pretrain_log if "seq_len" in m] == [64, 64, 128, 128]  # the curriculum's windows
    assert set(report["markov_flat_within_interval"]) == {"markov-2", "markov-3"}
    table = (out / "report.md").read_text()
    assert "| positions | pretrain | control | long | short | sdpa | markov-2 | markov-3 |" in table
    assert "| run | parameters |" in table and "Targets (k = 20" in table
    assert all(f"- ({t}) **" in table for t in "abcd")
    assert (out / "bits_by_bucket.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    retrieval = report["retrieval"]  # by distance to each target's last earlier k-mer occurrence
    assert retrieval["ks"] == [12, 16, 20, 32] and retrieval["reference"] == "markov-3" and list(retrieval["models"]) == names
    assert all(sum(row) == 4 * 512 for row in retrieval["targets"])  # every target in one bucket, for every k
    assert all(row[2:4] == [0, 0] for row in retrieval["targets"])  # a 512-token window has no distance past 4k
    assert all(f"Retrieval (k = {k})" in table for k in (12, 16, 20, 32))
    assert "| perfect copier, bits |" in table and "| long, captured |" in table and "| control, captured |" in table
    assert (out / "retrieval_by_distance.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "Bits/base on the held-out set" in proc.stdout

    for stage in ("pretrain", "control", "long", "short", "sdpa"):  # each stage is a run directory, scored where `megaseq eval` writes
        steps = runs[stage]["steps"]
        assert (out / stage / "checkpoints" / f"step_{steps:07d}" / "manifest.json").exists()
        assert (out / stage / "eval" / f"step_{steps:07d}" / "heldout_set.npz").exists()
        assert (out / stage / "metrics.jsonl").exists()

    stamps = {p: p.stat().st_mtime_ns for p in out.glob("*/stage.json")}
    again = experiment(tmp_path, *MINI, "--resume")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "[experiment] start" not in again.stderr, "a finished experiment ran something again"
    assert {p: p.stat().st_mtime_ns for p in out.glob("*/stage.json")} == stamps

    status, err = refused(tmp_path, capsys, *MINI)  # neither --resume nor --overwrite: the run-directory rule
    assert status == 2 and "already holds a context-extension experiment" in err
    # --resume checks what it reuses: the held-out set of every evaluation, the recipe of every trained stage
    status, err = refused(tmp_path, capsys, *MINI, "plan.eval_windows=3", "--resume")
    assert status == 2 and "heldout_set.npz: scored with a different heldout than this plan's" in err
    status, err = refused(tmp_path, capsys, *MINI, "plan.extension_lr=0.0003", "--resume")
    assert status == 2 and f"{out / 'long'}: trained with a different recipe (train.lr 0.0001 -> 0.0003)" in err
    assert {p: p.stat().st_mtime_ns for p in out.glob("*/stage.json")} == stamps

    # ... so a changed plan retrains only what it changes: the continuations, from the pretrain it keeps
    first = json.loads((out / "report.json").read_text())["models"]
    for stage in ("long", "short"):
        shutil.rmtree(out / stage)
    rerun = experiment(tmp_path, *MINI, "plan.extension_lr=0.0003", "--resume")
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    started = sorted(line.split()[-1] for line in rerun.stderr.splitlines() if line.startswith("[experiment] start"))
    assert started == ["eval-long", "eval-short", "long", "short"]
    assert {p: p.stat().st_mtime_ns for p in out.glob("*/stage.json") if p.parent.name not in ("long", "short")} == {
        p: t for p, t in stamps.items() if p.parent.name not in ("long", "short")}
    second = json.loads((out / "report.json").read_text())["models"]
    for name in ("pretrain", "control", "sdpa", "markov-2"):  # kept: the same scores (relative_to_short moved with short)
        assert second[name]["bits_per_base"] == first[name]["bits_per_base"], name
    assert second["long"]["bits_per_base"] != first["long"]["bits_per_base"]

    shutil.rmtree(out / "pretrain")  # the continuations' weights came from a pretrain that is gone
    status, err = refused(tmp_path, capsys, *MINI, "plan.extension_lr=0.0003", "--resume")
    assert status == 2 and f"{out / 'long'}: continues stage pretrain, which is not finished" in err


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (["plan.pretrain_tokens=0"], "plan.pretrain_tokens: Input should be greater than or equal to 1"),
        (["plan.extension_tokens=100"], "extension_tokens: a budget of 100 tokens is less than one step of 512 tokens"),
        (["plan.heldout_region=[0, 400]"], "held-out set: excerpt-chrX [0, 400) has no window of 513 tokens without N"),
        (["plan.long_len=1048576", "plan.extension_tokens=1048576", "plan.memory_gib=2"],
         "experiment: stage long (seq_len 1048576) does not fit with train.memory_policy = []"),
    ],
)
def test_bad_input_is_one_line_exit_2(tmp_path, capsys, sets, message):
    status, err = refused(tmp_path, capsys, *MINI, *sets)
    assert status == 2, err[-2000:]
    errors = [line for line in err.splitlines() if line.startswith("megaseq: error")]
    assert len(errors) == 1 and message in errors[0], err
    assert "Traceback" not in err and not (tmp_path / "out").exists()
