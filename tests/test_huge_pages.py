"""A CPU run whose large allocations are mapped (``offload``) gets huge pages for them, and a run that keeps
them in the heap does not (``megaseq.memory.heap``): the trainer plans first and asks before its first tensor.
A trainer that asked too late (after building the model) or never fails the first case; one that asked for
every run fails the second."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from megaseq.memory import heap

REPO = Path(__file__).resolve().parents[1]
ON = "huge pages from 2 MiB (kernel: madvise)"

# The header's heap line of a CPU run of the shipped recipe on its DNA excerpt, built (not trained).
HEADER = """
import sys, tempfile
from megaseq.config import load_recipe
from megaseq.plugins import get_plugins
from megaseq.train.trainer import Trainer
plugins = get_plugins()
with tempfile.TemporaryDirectory() as out:
    recipe = load_recipe(sys.argv[1], plugins, ["data.seq_len=1024", "train.batch_size=1", "data.train='excerpt-chr20'",
                         "data.heldout='excerpt-chrX'", "run.device='cpu'", f"run.out_dir='{out}'", f"train.memory_policy={sys.argv[2]}"])
    trainer = Trainer(recipe, plugins, progress=False, tensorboard=False)
    print(next(line for line in trainer.header().splitlines() if "heap:" in line))
"""


@pytest.mark.skipif(heap.kernel_huge_pages() != "madvise", reason="the kernel gives huge pages only where asked in madvise mode")
@pytest.mark.parametrize(("policies", "pages"), [('["offload"]', ON), ("[]", "no huge pages")])
def test_a_run_gets_huge_pages_where_its_large_allocations_are_mapped(policies: str, pages: str, tmp_path):
    recipe = REPO / "recipes" / "genome-cpu.toml"
    environ = {k: v for k, v in os.environ.items() if k != heap.HUGE_PAGES} | {"MEGASEQ_SCRATCH": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", HEADER, str(recipe), policies], env=environ, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1].endswith(f", {pages}; plan: " + done.stdout.split("; plan: ")[-1].strip())
