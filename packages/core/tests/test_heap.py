"""``run.trim_heap`` as ``megaseq.memory.heap.apply_run_setting`` applies it: where it trims, and what the
run header says where it does not."""

from __future__ import annotations

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
