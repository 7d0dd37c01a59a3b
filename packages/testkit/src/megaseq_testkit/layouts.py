"""Train one recipe under several process layouts and compare: the check that parallelism changes nothing.

:func:`train_under_layouts` runs inside ``run_gloo`` workers (it must be importable, hence here): for each
layout in turn it creates the process groups with megatron-core, trains ``steps`` optimizer steps, and
returns per step the logged metrics and the tokens, and at the end the whole model's weights (expert and
tensor-parallel blocks gathered) and this rank's parameter bytes; :func:`resume_under_layout` continues a saved run under a layout. :func:`train_single` is the same in this process with no group. :func:`run_differences`
measures how far two such results are apart (loss, tokens, gradient norm, every logged metric and the updated
weights) and :func:`assert_same_run` holds them to a tolerance.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from megaseq.config import validate_recipe
from megaseq.distributed.groups import destroy_process_groups, init_process_groups
from megaseq.distributed.layout import Layout
from megaseq.train.trainer import Trainer
from megaseq_testkit import installed_plugins

# metrics that measure the machine, not the training
UNCOMPARED = frozenset({"tokens_per_s", "peak_mem_gib"})


def _recipe(raw: dict[str, Any], layout: Layout, out_dir: Path, **train: Any):
    raw = {**raw, "parallel": vars(layout), "run": {**raw["run"], "out_dir": str(out_dir)}}
    raw["train"] = {**raw.get("train", {}), **train}
    return validate_recipe(raw, installed_plugins())


def _train(trainer: Trainer, steps: int) -> dict[str, Any]:
    history = [trainer.train_step() for _ in range(steps)]
    p = trainer.parallel
    splits = trainer.rank.splits
    whole = p.gather_tensor_parallel(p.gather_experts(trainer.model.state_dict(), splits.ep, splits.etp),
                                     splits.tp, trainer.rank.tp_lengths)
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


def run_differences(
    actual: dict[str, Any], expected: dict[str, Any], layout_metrics: frozenset[str] = frozenset()
) -> dict[str, float]:
    """How far ``actual`` is from ``expected``, per compared quantity: ``step N <metric>`` for every logged
    metric (loss and gradient norm included) and ``weight <name>`` for every updated weight, each
    ``max |actual - expected| / max(1, max |expected|)`` (:func:`megaseq_testkit.assert_close`'s measure;
    ``inf`` where ``actual`` is not finite), and ``tokens``: 0 when the token counts are equal, else ``inf``
    (a count is exact). ``layout_metrics``: metrics that describe the layout itself (e.g.
    the load per expert-parallel rank), present in both runs but not compared. Runs that log other metrics,
    other steps or other weights raise ``AssertionError`` (nothing to compare them by)."""

    def difference(got: Any, want: Any, what: str) -> float:
        a, b = torch.as_tensor(got, dtype=torch.float64), torch.as_tensor(want, dtype=torch.float64)
        assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} != {tuple(b.shape)}"
        if not bool(torch.isfinite(a).all()):
            return math.inf
        if not a.numel():
            return 0.0
        return ((a - b).abs().max() / b.abs().max().clamp_min(1.0)).item()

    differences = {"tokens": 0.0 if actual["tokens"] == expected["tokens"] else math.inf}
    assert len(actual["metrics"]) == len(expected["metrics"]), \
        f"{len(actual['metrics'])} steps logged, expected {len(expected['metrics'])}"
    for step, (got, want) in enumerate(zip(actual["metrics"], expected["metrics"], strict=True), start=1):
        names = set(want) - UNCOMPARED
        assert set(got) - UNCOMPARED == names, f"step {step}: metrics {sorted(set(got) ^ set(want))} differ"
        for name in sorted(names - layout_metrics):
            differences[f"step {step} {name}"] = difference(got[name], want[name], f"step {step} {name}")
    assert actual["weights"].keys() == expected["weights"].keys(), \
        f"parameter names differ: {sorted(actual['weights'].keys() ^ expected['weights'].keys())}"
    for name, value in expected["weights"].items():
        differences[f"weight {name}"] = difference(actual["weights"][name], value, f"weight {name}")
    return differences


def assert_same_run(
    actual: dict[str, Any], expected: dict[str, Any], rtol: float, what: str, layout_metrics: frozenset[str] = frozenset()
) -> None:
    """Every quantity of :func:`run_differences` within ``rtol``; the message names the worst ones."""
    assert actual["tokens"] == expected["tokens"], f"{what}: {actual['tokens']} tokens, expected {expected['tokens']}"
    try:
        differences = run_differences(actual, expected, layout_metrics)
    except AssertionError as exc:
        raise AssertionError(f"{what}: {exc}") from None
    bad = sorted(((d, name) for name, d in differences.items() if not d <= rtol), reverse=True)
    assert not bad, f"{what}: " + ", ".join(f"{name} {d:.3e}" for d, name in bad[:5]) + \
        f" > {rtol:.1e} relative" + (f" (and {len(bad) - 5} more)" if len(bad) > 5 else "")


__all__ = ["UNCOMPARED", "assert_same_run", "resume_under_layout", "run_differences", "single_trainer", "train_single", "train_under_layouts"]
