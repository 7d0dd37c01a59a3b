"""Train one recipe under several process layouts and compare: the check that parallelism changes nothing.

:func:`train_under_layouts` runs inside ``run_gloo`` workers (it must be importable, hence here): for each
layout in turn it creates the process groups with megatron-core, trains ``steps`` optimizer steps, and
returns per step the logged metrics and the tokens, and at the end the whole model's weights (expert and
tensor-parallel blocks gathered) and this rank's parameter bytes; :func:`resume_under_layout` continues a saved run under a layout. :func:`train_single` is the same in this process with no group. :func:`assert_same_run`
compares two such results: loss, tokens, gradient norm, every logged metric and the updated weights.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from megaseq.config import validate_recipe
from megaseq.distributed.groups import destroy_process_groups, init_process_groups
from megaseq.distributed.layout import Layout
from megaseq.testing import assert_close, installed_plugins
from megaseq.train.trainer import Trainer

# metrics that measure the machine, not the training
UNCOMPARED = frozenset({"tokens_per_s", "peak_mem_gib"})


def _recipe(raw: dict[str, Any], layout: Layout, out_dir: Path, **train: Any):
    raw = {**raw, "parallel": vars(layout), "run": {**raw["run"], "out_dir": str(out_dir)}}
    raw["train"] = {**raw.get("train", {}), **train}
    return validate_recipe(raw, installed_plugins())


def _train(trainer: Trainer, steps: int) -> dict[str, Any]:
    history = [trainer.train_step() for _ in range(steps)]
    p = trainer.parallel
    whole = p.gather_tensor_parallel(p.gather_experts(trainer.model.state_dict(), trainer.expert_dims, trainer.etp_dims),
                                     trainer.tp_dims, trainer.tp_lengths)
    return {"metrics": history, "tokens": trainer.tokens, "weights": {n: t.detach().clone() for n, t in whole.items()},
            "parameter_bytes": sum(t.numel() * t.element_size() for t in trainer.model.parameters())}


def single_trainer(raw: dict[str, Any], out_dir: Path) -> Trainer:
    """The recipe's trainer in this process, with no process group."""
    return Trainer(_recipe(raw, Layout(), out_dir), installed_plugins(), progress=False, tensorboard=False)


def train_single(trainer: Trainer, steps: int) -> dict[str, Any]:
    """``steps`` more steps of a one-process trainer; metrics of those steps, tokens and weights after them."""
    return _train(trainer, steps)


def train_under_layouts(
    rank: int, world: int, raw: dict[str, Any], layouts: list[Layout], out_dir: str, steps: int, save: bool = False
) -> list[dict[str, Any]]:
    """For each layout: ``steps`` steps from the recipe's initial weights (and, with ``save``, a checkpoint
    in ``out_dir/<layout>``). Results of every rank are returned; rank 0's hold the whole weights."""
    results = []
    for layout in layouts:
        parallel = init_process_groups(layout)
        try:
            recipe = _recipe(raw, layout, Path(out_dir) / str(layout).replace(",", "_"))
            trainer = Trainer(recipe, installed_plugins(), parallel=parallel, progress=False, tensorboard=False)
            result = _train(trainer, steps) | {"parameters": trainer.describe_parameters()}
            if save:
                result["checkpoint"] = str(trainer.save())
            results.append(result)
        finally:
            destroy_process_groups()
    return results


def resume_under_layout(rank: int, world: int, raw: dict[str, Any], layout: Layout, out_dir: str, steps: int) -> dict[str, Any]:
    """Resume the run in ``out_dir`` under ``layout`` (inside ``run_gloo`` workers) and train ``steps`` more steps."""
    parallel = init_process_groups(layout)
    try:
        trainer = Trainer(_recipe(raw, layout, Path(out_dir)), installed_plugins(), parallel=parallel, progress=False, tensorboard=False)
        if not trainer.resume():
            raise RuntimeError(f"no checkpoint to resume in {out_dir}")
        return _train(trainer, steps)
    finally:
        destroy_process_groups()


def assert_same_run(
    actual: dict[str, Any], expected: dict[str, Any], rtol: float, what: str, layout_metrics: frozenset[str] = frozenset()
) -> None:
    """``layout_metrics``: metrics that describe the layout itself (e.g. the load per expert-parallel rank),
    present in both runs but not compared."""
    assert actual["tokens"] == expected["tokens"], f"{what}: {actual['tokens']} tokens, expected {expected['tokens']}"
    for step, (got, want) in enumerate(zip(actual["metrics"], expected["metrics"], strict=True), start=1):
        names = set(want) - UNCOMPARED
        assert set(got) - UNCOMPARED == names, f"{what} step {step}: metrics {sorted(set(got) ^ set(want))} differ"
        names -= layout_metrics
        for name in sorted(names):
            a, b = torch.tensor(got[name], dtype=torch.float64), torch.tensor(want[name], dtype=torch.float64)
            assert_close(a, b, rtol, f"{what} step {step} metric {name}")
    assert actual["weights"].keys() == expected["weights"].keys(), f"{what}: parameter names differ"
    for name, value in expected["weights"].items():
        assert_close(actual["weights"][name], value, rtol, f"{what}: updated {name}")


__all__ = ["UNCOMPARED", "assert_same_run", "resume_under_layout", "single_trainer", "train_single", "train_under_layouts"]
