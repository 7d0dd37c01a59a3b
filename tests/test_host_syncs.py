"""Host synchronisations of a whole training step have a budget independent of the layers and micro-batches.

A step of a small MoE recipe (kda and the chunked MoE, the balance loss on) in one process is counted with
``megaseq_testkit.count_host_syncs``: every read of a tensor back to the host (on CUDA each waits for the
device) and every ``torch.cuda.synchronize``. The step reads what it reports once: the losses, tokens,
auxiliary losses and metrics of all micro-batches together (``StepTotals.reduce``), the gradient norm with
the verdict on it (``OptimizerStep.update``), the MoE layers' load (``moe_load_metrics``) and the MoE
plugin's bias update with its metrics (``megaseq_moe.layer.end_step``). Twice the layers and three
micro-batches read nothing more.
"""

from __future__ import annotations

import collections
from typing import Any

import pytest

from megaseq_testkit import count_host_syncs
from megaseq_testkit.layouts import single_trainer

pytestmark = pytest.mark.usefixtures("module_cache")  # tests/conftest.py

BUDGET = 4  # per step: the step's totals, the update's verdict, the MoE load metrics, the MoE bias update


def _recipe(hybrid: dict[str, Any], n_layers: int, grad_accum: int) -> dict[str, Any]:
    return {
        **hybrid,
        "model": {**hybrid["model"], "n_layers": n_layers, "layer_pattern": ["kda"]},
        "attention": {"kda": hybrid["attention"]["kda"]},
        "moe": {"chunked": {**hybrid["moe"]["chunked"], "aux_loss_coef": 0.01}},
        "train": {**hybrid["train"], "grad_accum": grad_accum},
    }


def _step_syncs(raw: dict[str, Any], out_dir) -> list[str]:
    trainer = single_trainer(raw, out_dir)
    trainer.train_step()  # the first step builds the optimizer's state
    with count_host_syncs() as sites:
        trainer.train_step()
    return sites


def test_host_syncs_per_step_are_within_budget_whatever_the_layers_and_micro_batches(tmp_path, hybrid):
    counts = {}
    for n_layers, grad_accum in ((3, 1), (6, 3)):
        sites = _step_syncs(_recipe(hybrid, n_layers, grad_accum), tmp_path / f"{n_layers}x{grad_accum}")
        where = ", ".join(f"{site} x{n}" for site, n in collections.Counter(sites).most_common(6))
        assert len(sites) <= BUDGET, f"{n_layers} layers, {grad_accum} micro-batches: {len(sites)} host syncs ({where})"
        counts[n_layers, grad_accum] = len(sites)
    assert len(set(counts.values())) == 1, counts
