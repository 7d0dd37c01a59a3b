"""The run directory's lock (``megaseq.train.rundir.RunLock``) in one process: two open files of one lock
exclude each other as two processes do (``flock``); test_interrupt.py runs it between real processes."""

from __future__ import annotations

import os
import socket

import pytest

from megaseq.errors import UserError
from megaseq.train.rundir import LOCK_NAME, RunLock, prepare


def test_a_held_lock_refuses_a_second_holder_until_released(tmp_path):
    with RunLock(tmp_path / "run", "training"):
        assert (tmp_path / "run" / LOCK_NAME).read_text() == f"{os.getpid()}@{socket.gethostname()} training\n"
        with pytest.raises(UserError, match=rf"in use by PID {os.getpid()} on .* \(training\)"):
            RunLock(tmp_path / "run", "rl").__enter__()
    with RunLock(tmp_path / "run", "rl"):  # released on exit
        pass


def test_a_stale_lock_file_is_taken_over_with_a_line(tmp_path, capsys):
    (tmp_path / LOCK_NAME).write_text("4194999@elsewhere training\n")  # its holder died holding it
    with RunLock(tmp_path, "evaluation"):
        pass
    assert "holder PID 4194999 on elsewhere (training) is no longer running" in capsys.readouterr().err


def test_the_lock_survives_overwrite_and_is_not_run_output(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    with RunLock(tmp_path):
        prepare(tmp_path, "overwrite")
        assert (tmp_path / LOCK_NAME).exists() and not (tmp_path / "metrics.jsonl").exists()
        prepare(tmp_path, "new")  # the lock file alone is no run


def test_an_unwritable_place_is_one_line(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(UserError, match="run.out_dir .*file/run: cannot write there"):
        RunLock(tmp_path / "file" / "run").__enter__()
