"""`megaseq rl` takes the flags `megaseq train` takes for the same things."""

from __future__ import annotations

import re

import pytest

from megaseq.cli import main as megaseq_main
from megaseq_rl.cli import rl_main

SHARED = {"--set", "--resume", "--overwrite", "--out", "--no-progress"}


def flags(run, capsys) -> set[str]:
    with pytest.raises(SystemExit):
        run()
    return set(re.findall(r"(--[a-z-]+)", capsys.readouterr().out))


def test_rl_and_train_share_their_run_flags(capsys):
    train = flags(lambda: megaseq_main(["train", "--help"]), capsys)
    rl = flags(lambda: rl_main(["--help"]), capsys)
    assert SHARED <= train and SHARED <= rl, (sorted(SHARED - train), sorted(SHARED - rl))
