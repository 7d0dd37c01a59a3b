"""megaseq's processes default to one intra-op thread, set before torch loads, and keep what the user set."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

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


@pytest.mark.parametrize(("environ", "changed"), [({}, {"OMP_NUM_THREADS": "1"}), ({"OMP_NUM_THREADS": "3"}, {})])
def test_apply_defaults_sets_only_what_is_unset(environ: dict, changed: dict):
    before = dict(environ)
    assert threads.apply_defaults(environ) == changed
    assert environ == before | changed
