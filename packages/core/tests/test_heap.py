"""``run.trim_heap`` as ``megaseq.memory.heap.apply_run_setting`` applies it: where it trims, and what the
run header says where it does not; huge pages for torch's large CPU tensors, asked for before a run's first
tensor where its large allocations will be mapped, and what the header says of them."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from megaseq.memory import heap


def blocks() -> nn.ModuleList:
    return nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])


@pytest.mark.parametrize(
    ("setting", "device", "tokens", "said"),
    [
        (True, "meta", 10**6, "acts on CPU runs; this one is on meta"),
        (False, "cpu", 10**6, "run.trim_heap = false"),
        ("auto", "cpu", heap.TRIM_FROM_TOKENS - 1, f"trims from {heap.TRIM_FROM_TOKENS:,} tokens per device, this run has 32,767"),
    ],
)
def test_no_trimming_where_the_setting_does_not_act(setting, device, tokens, said):
    model = blocks()
    assert said in heap.apply_run_setting(setting, torch.device(device), tokens, model)
    assert not any(block._forward_hooks for block in model)


@pytest.mark.skipif(not heap.available(), reason="the C library is not glibc")
@pytest.mark.parametrize(("setting", "tokens"), [(True, 1), ("auto", heap.TRIM_FROM_TOKENS)])
def test_trimming_hooks_every_block(setting, tokens):
    model = blocks()
    assert heap.apply_run_setting(setting, torch.device("cpu"), tokens, model) == "trimmed at block boundaries"
    assert all(len(block._forward_hooks) == 1 for block in model)
    model[1](model[0](torch.ones(1, 4, requires_grad=True))).sum().backward()  # trims in forward and backward


def fresh(script: str, **env: str) -> str:
    """The last line ``python -c script`` prints, in a process started without ``THP_MEM_ALLOC_ENABLE`` unless
    given."""
    environ = {k: v for k, v in os.environ.items() if k != heap.HUGE_PAGES} | env
    done = subprocess.run([sys.executable, "-c", script], env=environ, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip().splitlines()[-1]


ASK = "import os, torch; from megaseq.memory import heap; {before}asked = heap.ask_for_huge_pages(); " \
      "print(asked, '|', os.environ.get(heap.HUGE_PAGES), '|', heap.huge_pages())"
ON = "huge pages from 2 MiB (kernel: madvise)"


@pytest.mark.skipif(heap.kernel_huge_pages() != "madvise", reason="the kernel gives huge pages only where asked in madvise mode")
def test_huge_pages_asked_for_only_before_the_first_tensor():
    assert fresh(ASK.format(before="")) == f"True | 1 | {ON}"
    # too late: torch read the variable at the first tensor; none is left for child processes
    assert fresh(ASK.format(before="torch.ones(1); ")) == "False | None | no huge pages"
    assert fresh(ASK.format(before=""), **{heap.HUGE_PAGES: "0"}) == "False | 0 | no huge pages"  # the user's


@pytest.mark.skipif(heap.kernel_huge_pages() == "madvise", reason="there, what torch asked for decides (above)")
def test_header_says_what_the_kernel_does():
    said = fresh("from megaseq.memory import heap; print(heap.huge_pages())")
    if heap.kernel_huge_pages() == "always":
        assert said == "huge pages from 2 MiB (kernel: always)"
    else:
        assert said.startswith("no huge pages (the kernel's transparent huge pages are")
