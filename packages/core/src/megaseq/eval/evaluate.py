"""Held-out evaluation: loss by context position for the model and the recipe's baselines.

The model and every baseline ``eval.baselines`` names (``megaseq.contracts.Baseline``, e.g. a k-mer model
fitted on the training data) are scored on the same held-out windows (evenly spaced over the held-out data) with
the same weights, so every number has a reference beside it. The analyses ``eval.analyses`` names
(``megaseq.contracts.EvalAnalysis``, e.g. loss by the distance to an earlier copy) are fed every scorer's per-target
losses and report beside them.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from megaseq.config import Recipe
from megaseq.contracts import MODEL_SCORER, Baseline, EvalAnalysis, EvalInfo, ForwardContext
from megaseq.data.sources import tokenized
from megaseq.data.windows import Batch, GenomeWindows
from megaseq.errors import UserError
from megaseq.eval.positions import PositionLoss, format_table, plot_positions
from megaseq.model import LanguageModel, chunked_token_losses
from megaseq.plugins import Plugins
from megaseq.train.progress import Progress


def batch_to(batch: Batch, device: torch.device) -> Batch:
    return Batch(batch.inputs.to(device), batch.targets.to(device), batch.weights.to(device))


def heldout_windows(recipe: Recipe, plugins: Plugins | None = None) -> tuple[GenomeWindows, list[int]]:
    d = recipe.data
    windows = GenomeWindows(tokenized(recipe.corpus("heldout", plugins), plugins=plugins), d.seq_len,
                            max_n_fraction=d.max_n_fraction, softmask_weight=d.softmask_weight, alphabet=recipe.alphabet)
    if len(windows) == 0:
        raise UserError(f"{recipe.source}: data.heldout {d.heldout!r} has no window of seq_len {d.seq_len}")
    n = min(recipe.eval.windows, len(windows))
    return windows, np.linspace(0, len(windows) - 1, n).round().astype(int).tolist()


def _batches(indices: list[int], batch_size: int, progress: bool, desc: str) -> Iterator[int]:
    """The first index of each batch, with a progress line (off a terminal, about every tenth batch)."""
    starts = range(0, len(indices), batch_size)
    bar = Progress(desc, len(starts), unit="batches", every=max(1, len(starts) // 10), leave=False, enabled=progress)
    try:
        for start in starts:
            yield start
            bar.advance()
    finally:
        bar.close()


def _feed(analyses: list[EvalAnalysis], scorer: str, first: int, batch: Batch, losses: torch.Tensor) -> None:
    """Hand each window of ``batch`` (windows ``first, first + 1, ...``; megaseq's token ids) and the scorer's
    losses on it to every analysis."""
    if not analyses:
        return
    ids = torch.cat([batch.inputs, batch.targets[:, -1:]], dim=1).numpy()
    losses_np = losses.detach().to("cpu", torch.float64).numpy()
    weights = batch.weights.to(torch.float64).numpy()
    for row in range(ids.shape[0]):
        for analysis in analyses:
            analysis.add(scorer, first + row, ids[row], losses_np[row], weights[row])


@torch.no_grad()
def score_model(
    model: LanguageModel, recipe: Recipe, windows: GenomeWindows, indices: list[int], device: torch.device,
    progress: bool = False, analyses: list[EvalAnalysis] | None = None, parallel: Any = None,
) -> dict:
    """``parallel`` (``megaseq.distributed.groups.Parallel``): every rank of a layout scores the same windows with
    its part of the model (``Parallel.window_losses``); each ends with the whole result."""
    was_training = model.training
    model.eval()
    acc = PositionLoss(recipe.data.seq_len, recipe.eval.first_bucket)
    bs = recipe.eval.batch_size
    for start in _batches(indices, bs, progress, "eval model"):
        raw = windows.batch(indices[start : start + bs])
        batch = batch_to(raw.to_vocab(recipe.data.token_ids), device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=recipe.train.bf16):
            if parallel is not None and parallel.distributed:
                losses = parallel.window_losses(model, batch.inputs, batch.targets, recipe.train.loss_chunk)
            else:
                hidden = model(batch.inputs, ForwardContext())
                losses = chunked_token_losses(hidden, model.head_weight, batch.targets, recipe.train.loss_chunk)
        acc.add(losses.float(), batch.weights)
        _feed(analyses or [], MODEL_SCORER, start, raw, losses.float())
    model.train(was_training)
    return acc.summary()


def build_baselines(recipe: Recipe, plugins: Plugins) -> list[Baseline]:
    """The baselines ``eval.baselines`` names, each built from its ``[baseline.NAME]`` config and fitted on
    ``data.train``, given as a ``megaseq.data.Corpus`` (see ``megaseq.contracts.Baseline``)."""
    built = []
    train = recipe.corpus("train", plugins)
    for name in recipe.eval.baselines:
        provided = plugins.get("baseline", name, where=f"{recipe.source}: eval.baselines")
        built.append(provided.load()(recipe.component("baseline", name), train))
    return built


def build_analyses(recipe: Recipe, plugins: Plugins, baselines: list[Baseline], windows: int) -> dict[str, EvalAnalysis]:
    """The analyses ``eval.analyses`` names, each built from its ``[eval_analysis.NAME]`` config for the model
    and ``baselines`` on ``windows`` held-out windows (see ``megaseq.contracts.EvalAnalysis``)."""
    info = EvalInfo(recipe.source, recipe.data.seq_len, windows, tuple(b.label for b in baselines), recipe.alphabet)
    built = {}
    for name in recipe.eval.analyses:
        provided = plugins.get("eval_analysis", name, where=f"{recipe.source}: eval.analyses")
        built[name] = provided.load()(recipe.component("eval_analysis", name), info)
    return built


def check_analyses(recipe: Recipe, plugins: Plugins) -> None:
    """Build the recipe's baselines and analyses as its evaluation will (fitted baselines and tokenised data
    are cached, so the evaluation pays for neither again): a recipe an analysis cannot serve fails in one line
    before training, not after it."""
    if recipe.eval.analyses:
        _, indices = heldout_windows(recipe, plugins)
        build_analyses(recipe, plugins, build_baselines(recipe, plugins), len(indices))


def score_baseline(
    baseline: Baseline, recipe: Recipe, windows: GenomeWindows, indices: list[int], progress: bool = False,
    analyses: list[EvalAnalysis] | None = None,
) -> dict:
    acc = PositionLoss(recipe.data.seq_len, recipe.eval.first_bucket)
    for start in _batches(indices, recipe.eval.batch_size, progress, f"eval {baseline.label}"):
        batch = windows.batch(indices[start : start + recipe.eval.batch_size])
        losses = baseline.token_losses(batch.inputs, batch.targets).double()
        acc.add(losses, batch.weights)
        _feed(analyses or [], baseline.label, start, batch, losses)
    return acc.summary()


def flatten(results: dict[str, dict]) -> dict[str, float]:
    """Scalar metrics for the logs: ``eval/<name>/bits_per_base`` overall and per bucket."""
    flat = {}
    for name, summary in results.items():
        flat[f"eval/{name}/bits_per_base"] = summary["bits_per_base"]
        for b in summary["buckets"]:
            if b["bits_per_base"] is not None:
                flat[f"eval/{name}/bits_per_base@{b['start']}-{b['end']}"] = b["bits_per_base"]
    return flat


def analysis_tables(reports: dict[str, dict[str, Any]]) -> str:
    """The analyses' text tables (``heldout.json``'s ``"analyses"``: ``{name: {"result", "table"}}``), each
    after a blank line."""
    return "".join(f"\n{report['table']}" for report in reports.values())


def evaluate_heldout(
    model: LanguageModel,
    recipe: Recipe,
    device: torch.device,
    plugins: Plugins,
    out_dir: Path | None = None,
    baseline: bool = True,
    progress: bool = False,
    parallel: Any = None,
) -> dict[str, Any] | None:
    """Score the model (and, with ``baseline``, the recipe's baselines and analyses) on held-out windows; write
    JSON + PNG (and the analyses' files) to ``out_dir``. ``progress``: a progress bar per scorer on stderr.
    ``parallel``: the model is one rank's part of a layout (:func:`score_model`); every rank scores it, rank 0
    alone the rest, and the others return ``None``."""
    windows, indices = heldout_windows(recipe, plugins)
    if parallel is not None and not parallel.is_main:
        score_model(model, recipe, windows, indices, device, parallel=parallel)
        return None
    baselines = build_baselines(recipe, plugins) if baseline else []
    # built before any scoring, so that a recipe an analysis cannot serve fails in one line at once
    analyses = build_analyses(recipe, plugins, baselines, len(indices)) if baseline else {}
    fed = list(analyses.values())
    results = {MODEL_SCORER: score_model(model, recipe, windows, indices, device, progress, fed, parallel)}
    for built in baselines:
        results[built.label] = score_baseline(built, recipe, windows, indices, progress, fed)
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
    reports = {name: dict(zip(("result", "table"), analysis.finish(out_dir), strict=True)) for name, analysis in analyses.items()}
    table = format_table(results) + analysis_tables(reports)
    if out_dir is not None:
        payload = {"heldout": recipe.data.heldout, "alphabet": recipe.alphabet.name, "unit": recipe.alphabet.unit,
                   "seq_len": recipe.data.seq_len, "windows": len(indices), "results": results}
        (out_dir / "heldout.json").write_text(json.dumps(payload | ({"analyses": reports} if reports else {}), indent=2))
        plot_positions(results, out_dir / "heldout_by_position.png", f"{recipe.run.name}: held-out {recipe.data.heldout}",
                       recipe.alphabet.unit)
    analysed = {name: report["result"] for name, report in reports.items()}
    return {"results": results, "analyses": analysed, "table": table, "flat": flatten(results), "windows": len(indices)}
