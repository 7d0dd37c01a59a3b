"""``run.trim_heap`` as ``megaseq.memory.heap.apply_run_setting`` applies it: where it trims, and what the
run header says where it does not; huge pages for torch's large CPU tensors, asked for by every megaseq
command before its first tensor, and what the header says of them."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from megaseq.memory import heap


@pytest.fixture(autouse=True)
def heap_as_it_was():
    """Trimming here turns this process's huge pages off (process-wide): back as they were after each test."""
    state = dict(heap._state)
    yield
    heap._state.update(state)
    if heap.available():
        heap._follow_heap()


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


@pytest.mark.parametrize(("environ", "changed"), [({}, {heap.HUGE_PAGES: "1"}), ({heap.HUGE_PAGES: "0"}, {})])
def test_huge_page_default_keeps_the_users_setting(environ: dict, changed: dict):
    before = dict(environ)
    assert heap.apply_defaults(environ) == changed
    assert environ == before | changed


# A megaseq command, then what the header would say of its process's large tensors.
PAGES_PROBE = (
    "from megaseq import cli; from megaseq.memory import heap; code = cli.main(['data', 'list']); "
    "print(code, '|', heap.huge_pages())"
)


def pages_probe(**env: str) -> tuple[str, str]:
    environ = {k: v for k, v in os.environ.items() if k != heap.HUGE_PAGES} | env
    done = subprocess.run([sys.executable, "-c", PAGES_PROBE], env=environ, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    code, said = done.stdout.strip().splitlines()[-1].split(" | ")
    return code, said


@pytest.mark.skipif(heap.kernel_huge_pages() != "madvise", reason="the kernel gives huge pages only where asked in madvise mode")
def test_commands_ask_for_huge_pages_and_the_header_tells():
    # torch asks only when the command set the variable before the process's first tensor (a probe run
    # after that first tensor, or with the variable set to 0, finds none)
    assert pages_probe() == ("0", "huge pages from 2 MiB (kernel: madvise)")
    code, said = pages_probe(**{heap.HUGE_PAGES: "0"})
    assert code == "0" and said == "no huge pages (torch's allocator reads THP_MEM_ALLOC_ENABLE at the process's first tensor; now 0)"


@pytest.mark.skipif(heap.kernel_huge_pages() == "madvise", reason="there, what torch asked for decides (above)")
def test_header_says_what_the_kernel_does():
    said = heap.huge_pages()
    if heap.kernel_huge_pages() == "always":
        assert said == "huge pages from 2 MiB (kernel: always)"
    else:
        assert said.startswith("no huge pages (the kernel's transparent huge pages are")


# Trims as a run's heap setting does, then maps large allocations as an offloading policy does; says what the
# header would after each.
TRIM_THEN_MAP = (
    "import torch; from megaseq import cli; from megaseq.memory import heap; cli.main(['data', 'list']); "
    "said = [heap.huge_pages()]; "
    "said.append(heap.apply_run_setting(True, torch.device('cpu'), 1, torch.nn.ModuleList([torch.nn.Linear(2, 2)]))); "
    "said.append(heap.huge_pages()); heap.map_large_allocations(2**20); said.append(heap.huge_pages()); print(' | '.join(said))"
)


@pytest.mark.skipif(not heap.available() or heap.kernel_huge_pages() != "madvise",
                    reason="glibc and a kernel that gives huge pages where asked")
def test_huge_pages_off_while_the_trimmed_heap_holds_large_allocations():
    environ = {k: v for k, v in os.environ.items() if k != heap.HUGE_PAGES}
    done = subprocess.run([sys.executable, "-c", TRIM_THEN_MAP], env=environ, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    on = "huge pages from 2 MiB (kernel: madvise)"
    assert done.stdout.strip().splitlines()[-1].split(" | ") == [
        on, "trimmed at block boundaries", "no huge pages (off while the trimmed heap holds the large allocations)", on
    ]
