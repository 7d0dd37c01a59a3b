"""Ray Train launch and fault tolerance, on a real local Ray cluster (this test alone pays Ray's start-up).

``megaseq train --workers 2`` trains the hybrid recipe with dp=2. Once the step-2 checkpoint is complete,
the test SIGKILLs one of the run's own Ray worker processes. Ray restarts the worker group, the
new workers resume from that checkpoint, and the run ends with the weights, token count and data position
of an uninterrupted run (one process: the equivalence tests show dp=2 equals it): no window lost or read
twice.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("ray.train", reason="needs the distributed extra: pip install 'megaseq-core[distributed]'")
pytest.importorskip("megatron.core", reason="needs the distributed extra: pip install 'megaseq-core[distributed]'")

import psutil
import torch

from megaseq.distributed.sharded import read_full_weights
from megaseq.train.checkpoint import read_meta
from megaseq_testkit import assert_close
from megaseq_testkit.layouts import single_trainer, train_single

# Killed once the step-2 checkpoint is complete: two steps before, one after. The one-process weights are the
# oracle for as many steps as the layout-equivalence tests compare dp=2 with one process (three): AdamW's first
# steps amplify the different rounding of the two layouts' gradient reductions where a gradient is near zero
# (tests/conftest.py), so a fourth step measures that, not the restart.
STEPS = 3
REPO = Path(__file__).resolve().parents[1]


def _ray_workers(pid: int) -> list[psutil.Process]:
    found = []
    for child in psutil.Process(pid).children(recursive=True):
        try:
            if "RayTrainWorker" in " ".join(child.cmdline()):
                found.append(child)
        except psutil.Error:
            continue
    return found


@pytest.mark.slow
def test_killed_worker_restarts_and_resumes_to_the_uninterrupted_weights(tmp_path, monkeypatch, layouts_recipe, recipe_toml):
    monkeypatch.setenv("MEGASEQ_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "run"
    hybrid = layouts_recipe  # compared with one process, as the layout-equivalence tests are (tests/conftest.py)
    raw = {**hybrid, "run": {**hybrid["run"], "out_dir": str(out)}, "train": {**hybrid["train"], "steps": STEPS, "checkpoint_every": 2}}
    recipe = tmp_path / "hybrid.toml"
    recipe.write_text(recipe_toml(raw))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "megaseq.cli", "train", str(recipe), "--workers", "2", "--no-progress"]
    with (tmp_path / "log").open("w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            killed = None
            deadline = time.monotonic() + 400
            while killed is None and proc.poll() is None and time.monotonic() < deadline:
                if (out / "checkpoints" / "step_0000002").is_dir():
                    workers = _ray_workers(proc.pid)
                    if workers:
                        killed = workers[-1].pid
                        os.kill(killed, signal.SIGKILL)
                time.sleep(0.05)
            assert proc.wait(timeout=400) == 0, (tmp_path / "log").read_text()[-3000:]
        finally:
            if proc.poll() is None:
                proc.kill()
    text = (tmp_path / "log").read_text()
    assert killed is not None, "the run ended before a worker could be killed:\n" + text[-2000:]
    assert "  resumed from " in text, text[-3000:]  # the restarted rank 0's run header

    final = out / "checkpoints" / f"step_{STEPS:07d}"
    meta = read_meta(final)
    reference = single_trainer(raw, tmp_path / "single")
    expected = train_single(reference, STEPS)
    assert meta["tokens"] == expected["tokens"]
    state = torch.load(final / "state.pt", weights_only=False)
    assert state["sampler"] == reference.sampler.state_dict()
    weights = read_full_weights(final, meta)
    for name, value in expected["weights"].items():
        assert_close(weights[name], value, 1e-5, f"{name} after the restart")
    assert Path(out / "eval" / f"step_{STEPS:07d}" / "heldout.json").exists()


def _tiny_ray_run(tmp_path: Path, *extra: str) -> tuple[subprocess.Popen, Path, Path]:
    """The README's `--workers 2` command on the tiny recipe, long enough to be stopped, started in a directory of
    its own where the run directory (runs/{name}, the default) and the cache are relative paths."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    cmd = [sys.executable, "-m", "megaseq.cli", "train", str(REPO / "recipes" / "tiny.toml"), "--workers", "2",
           "--no-progress", "--set", "train.steps=400", "--set", "train.checkpoint_every=2",
           "--set", "eval.windows=2", "--set", "data.seq_len=64", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MEGASEQ_CACHE": "cache"}
    log = tmp_path / "log"
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, cwd=elsewhere, stdout=f, stderr=subprocess.STDOUT, env=env)
    return proc, elsewhere / "runs" / "tiny", log


def _wait_for_workers(proc: subprocess.Popen, out: Path, log: Path) -> list[psutil.Process]:
    """Once the step-2 checkpoint is complete: the run's process tree (Ray's cluster and workers included)."""
    deadline = time.monotonic() + 400
    while proc.poll() is None and time.monotonic() < deadline:
        if (out / "checkpoints" / "step_0000002").is_dir() and _ray_workers(proc.pid):
            return psutil.Process(proc.pid).children(recursive=True)
        time.sleep(0.05)
    proc.kill()
    pytest.fail("the run ended or stalled before its workers checkpointed:\n" + log.read_text()[-3000:])


@pytest.mark.slow
def test_sigterm_saves_stops_the_workers_and_the_cluster_and_leaves_no_process(tmp_path):
    """Also the relative paths: Ray's workers run in a directory of their own, so the launcher hands them absolute
    ones, and the checkpoints land in the default run directory under the command's working directory."""
    proc, out, log = _tiny_ray_run(tmp_path)
    try:
        tree = _wait_for_workers(proc, out, log)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=300) == 143, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    (line,) = [line for line in text.splitlines() if line.startswith("megaseq: interrupted")]
    stopped = int(line.split("stopped after step ")[1].split(";")[0])
    assert stopped < 400 and f"step_{stopped:07d}" in line and "--resume" in line, line
    assert (out / "checkpoints" / f"step_{stopped:07d}" / "meta.json").exists()
    assert (out.parents[1] / "cache" / "tokens").is_dir(), "the workers did not use the relative MEGASEQ_CACHE"
    # Ray's own chatter is filtered (its documented settings), and so are megatron-core's import lines, DDP's
    # note on its flag and terminal colours; rank 0's run header shows once
    for noise in ("Failed to query Ray Train Controller actor state", "Requesting resources",
                  "Started training worker group", "Setting up process group", "core_worker", "PreemptionWatcher",
                  "Megatron-FSDP", "find_unused_parameters", "\x1b["):
        assert noise not in text, text[-3000:]
    assert text.count("megaseq run 'tiny'") == 1, text[-3000:]
    # the local cluster's processes end with the command (a detached actor would otherwise live up to 30 s more)
    _, alive = psutil.wait_procs(tree, timeout=1)
    assert not alive, f"left running: {[(p.pid, p.name()) for p in alive]}"
    # megaseq prints no traceback. Ray's placement-group cleaner (a thread in one of its actors) dies with one when
    # another local Ray cluster runs on the machine (its state API cannot tell the two apart): that one is Ray's.
    assert text.count("Traceback") <= text.count("Found multiple active Ray instances"), text[-3000:]


@pytest.mark.slow
def test_a_failed_group_names_the_worker_that_died_first(tmp_path):
    proc, out, log = _tiny_ray_run(tmp_path, "--max-failures", "0")
    try:
        _wait_for_workers(proc, out, log)
        killed = _ray_workers(proc.pid)[-1].pid
        os.kill(killed, signal.SIGKILL)
        assert proc.wait(timeout=300) == 1, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    (line,) = [line for line in log.read_text().splitlines() if line.startswith("megaseq: error")]
    assert f"(PID {killed} on " in line and "died without an error" in line, line


def test_first_failure_reads_the_workers_records(tmp_path):
    """The rule behind the error of a failed group, on hand-written records: a rank that died without a word
    failed before the ranks whose errors are the broken connection; else the earliest error."""
    from megaseq.distributed.launch import first_failure

    def record(rank: int, **fields) -> None:
        (tmp_path / f"rank{rank}.json").write_text(json.dumps({"pid": 100 + rank, "host": "h", **fields}))

    record(0, failed_at=2.0, error="RuntimeError: Connection closed by peer")  # the survivor
    record(1)  # killed: started, never recorded an error
    assert first_failure(tmp_path, 2) == "worker rank 1 (PID 101 on h) died without an error (killed, or the process crashed)"
    record(1, failed_at=1.0, error="ValueError: bad window")
    assert first_failure(tmp_path, 2) == "worker rank 1 (PID 101 on h) failed first: ValueError: bad window"
    record(0, failed_at=0.5, error="UserError: no such file")
    assert first_failure(tmp_path, 2).startswith("worker rank 0 (PID 100 on h) failed first: UserError")
    assert first_failure(tmp_path / "none", 2) is None
    # Ray stopped the survivor before it recorded its error: both ranks are silent, and Ray's report of the
    # failed ranks (the killed one) tells them apart; without it, nothing does.
    record(0)
    record(1)
    assert first_failure(tmp_path, 2, reported={1: "health check failed"}).startswith("worker rank 1 (PID 101 on h) died")
    assert first_failure(tmp_path, 2, reported={}) is None
    assert first_failure(tmp_path, 2) is None
    record(0, failed_at=2.0, error="RuntimeError: Connection closed by peer")
    assert first_failure(tmp_path, 2, reported={0: "RuntimeError"}).startswith("worker rank 1 (PID 101 on h) died")


def test_worker_paths_are_absolute_and_data_source_names_stay_names(tmp_path, monkeypatch):
    from megaseq.config import validate_recipe
    from megaseq.distributed.launch import with_absolute_paths
    from megaseq.plugins import get_plugins

    monkeypatch.chdir(tmp_path)
    (tmp_path / "genome.fa").write_text(">chr\nACGT\n")
    raw = {"run": {"name": "x"}, "data": {"train": "genome.fa", "heldout": "excerpt-chrX"}}
    recipe = with_absolute_paths(validate_recipe(raw, get_plugins()))
    assert recipe.run.out_dir == str(tmp_path / "runs" / "x")
    assert (recipe.data.train, recipe.data.heldout) == (str(tmp_path / "genome.fa"), "excerpt-chrX")
