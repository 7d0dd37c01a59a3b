"""megaseq's processes start with one intra-op thread, set before torch loads, and keep what the user set;
trainers share the machine's cores through the registry of live trainers (``megaseq.threads.CoreShare``)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from megaseq import threads

# A command, then the threads its process (and any child) ends up with once torch loads.
PROBE = (
    "import os; from megaseq import cli; code = cli.main(['data', 'list']); import torch; "
    "print(code, os.environ.get('OMP_NUM_THREADS'), torch.get_num_threads())"
)


def run_probe(**env: str) -> list[str]:
    environ = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"} | env
    done = subprocess.run([sys.executable, "-c", PROBE], env=environ, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip().splitlines()[-1].split()


def test_cli_defaults_to_one_thread_before_torch_loads():
    assert run_probe() == ["0", "1", "1"]


def test_cli_keeps_the_users_thread_count():
    assert run_probe(OMP_NUM_THREADS="2") == ["0", "2", "2"]


@pytest.mark.parametrize(("environ", "changed"), [
    ({}, {"OMP_NUM_THREADS": "1", threads.AUTO: "1", "GOMP_SPINCOUNT": str(threads.SPIN_COUNT)}),
    ({"OMP_NUM_THREADS": "3"}, {}),
    ({"OMP_WAIT_POLICY": "passive"}, {"OMP_NUM_THREADS": "1", threads.AUTO: "1"}),  # the user's waiting kept
    ({"GOMP_SPINCOUNT": "5"}, {"OMP_NUM_THREADS": "1", threads.AUTO: "1"}),
])
def test_apply_defaults_sets_only_what_is_unset(environ: dict, changed: dict):
    before = dict(environ)
    assert threads.apply_defaults(environ) == changed
    assert environ == before | changed


def test_shared_only_when_megaseq_chose_the_thread_count(monkeypatch):
    assert threads.shared({}) and threads.shared({"OMP_NUM_THREADS": "1", threads.AUTO: "1"})
    assert not threads.shared({"OMP_NUM_THREADS": "1"})
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv(threads.AUTO, "1")
    before = torch.get_num_threads()
    try:
        threads.fix(2)  # a caller that shares the cores out itself
        assert not threads.shared() and os.environ["OMP_NUM_THREADS"] == "2" and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


# A process that registers as a live trainer in the registry argv[1], says so, and lives until killed.
HOLDER = (
    "import sys, time; from pathlib import Path; from megaseq.threads import CoreShare; "
    "share = CoreShare(Path(sys.argv[1])); print('registered', flush=True); time.sleep(600)"
)


@pytest.fixture
def registry(tmp_path, monkeypatch):
    monkeypatch.setattr(threads, "cores", lambda: 4)
    return tmp_path / "trainers"


def test_a_lone_trainer_takes_every_core_and_two_share_them(registry):
    share = threads.CoreShare(registry)
    before = torch.get_num_threads()
    try:
        assert share.live() == 1 and share.decide() == 4
        other = subprocess.Popen([sys.executable, "-c", HOLDER, str(registry)], stdout=subprocess.PIPE, text=True)
        try:
            assert other.stdout.readline().strip() == "registered"
            assert share.live() == 2 and share.decide() == 2
            assert share.update(now=0.0) == 2 and torch.get_num_threads() == 2
            assert share.update(now=threads.RECOUNT_S / 2) is None  # not recounted before RECOUNT_S
        finally:
            other.kill()
            other.wait()
        # the killed trainer's entry is still there, but nobody holds it: not counted, removed
        assert len(list(registry.iterdir())) == 2
        assert share.update(now=threads.RECOUNT_S) == 4 and torch.get_num_threads() == 4
        assert [p.name for p in registry.iterdir()] == [share.name]
    finally:
        share.close()
        torch.set_num_threads(before)


def test_the_trainer_takes_its_share_at_a_step(registry, tmp_path, monkeypatch):
    from megaseq.config import validate_recipe
    from megaseq.train.trainer import Trainer
    from megaseq_testkit import fresh_plugins

    monkeypatch.setenv("MEGASEQ_CACHE", str(tmp_path))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv(threads.AUTO, "1")
    before = torch.get_num_threads()
    plugins = fresh_plugins()
    raw = {"run": {"out_dir": str(tmp_path / "run"), "device": "cpu"},
           "data": {"train": "excerpt-chr20", "heldout": "excerpt-chrX", "seq_len": 32},
           "model": {"d_model": 8, "n_layers": 1}, "attention": {"sdpa": {"n_heads": 1}},
           "train": {"steps": 1, "batch_size": 1, "warmup_steps": 0}}
    trainer = Trainer(validate_recipe(raw, plugins), plugins, progress=False, tensorboard=False)
    try:
        trainer.train_step()
        assert torch.get_num_threads() == 4 and (registry / trainer.core_share.name).exists()
    finally:
        trainer.core_share.close()
        torch.set_num_threads(before)
    monkeypatch.setenv(threads.AUTO, "0")  # the user's own OMP_NUM_THREADS: no sharing
    assert Trainer(validate_recipe(raw, plugins), plugins, progress=False, tensorboard=False).core_share is None


class FakeCounters:
    """``machine_busy`` as a machine whose other processes keep ``others`` cores busy, this one ``own``."""

    def __init__(self, others: float, own: float) -> None:
        self.others, self.own, self.t = others, own, 0.0

    def __call__(self) -> tuple[float, float]:
        return (self.others + self.own) * self.t, self.own * self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


@pytest.mark.parametrize(("others", "expected"), [(0.0, 4), (0.4, 4), (1.0, 3), (2.0, 2), (3.6, 1), (6.0, 1)])
def test_busy_cores_of_other_work_are_left_to_it(registry, others, expected):
    counters = FakeCounters(others, own=4.0)  # this trainer spinning on every core does not count against itself
    share = threads.CoreShare(registry, busy=counters)
    try:
        assert share.decide(now=0.0) == 4  # no interval measured yet: the registry's share
        counters.advance(2.0)
        assert share.decide(now=2.0) == expected
    finally:
        share.close()


def test_another_trainer_is_not_counted_twice(registry):
    """Beside a second megaseq trainer using its two cores, this one takes its share (2 of 4), not less."""
    counters = FakeCounters(2.0, own=2.0)
    share = threads.CoreShare(registry, busy=counters)
    other = subprocess.Popen([sys.executable, "-c", HOLDER, str(registry)], stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout.readline().strip() == "registered"
        share.decide(now=0.0)
        counters.advance(1.5)
        assert share.decide(now=1.5) == 2
    finally:
        other.kill()
        other.wait()
        share.close()


def test_the_machine_counters_describe_this_machine():
    busy = threads.machine_busy()
    if busy is None:  # a container on a larger host: no adjustment, and the decision falls back to the registry
        return
    machine, own = busy
    assert machine > 0 and 0 <= own


@pytest.mark.parametrize(("environ", "ranks", "expected"), [
    ({"OMP_NUM_THREADS": "1", threads.AUTO: "1"}, 8, 2),  # megaseq's count: 16 cores shared by 8 ranks
    ({"OMP_NUM_THREADS": "1", threads.AUTO: "1"}, 1, 16),
    ({"OMP_NUM_THREADS": "1", threads.AUTO: "1"}, 32, 1),  # more ranks than cores: one each
    ({}, 4, 4),
    ({"OMP_NUM_THREADS": "3"}, 8, 3),  # the user's count stays
])
def test_host_update_threads_share_the_machines_cores_among_its_ranks(monkeypatch, environ, ranks, expected):
    monkeypatch.setattr(threads, "cores", lambda: 16)
    assert threads.host_update_threads(ranks, environ) == expected
