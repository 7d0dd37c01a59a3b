"""Held-out evaluation: loss by context position for the model and a k-mer Markov baseline.

Both are scored on the same held-out windows (evenly spaced over the held-out chromosome) with the same
weights, so every number has a reference beside it. The baseline is fitted on the training chromosome
and cached next to the token cache.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from megaseq.config import Recipe
from megaseq.contracts import ForwardContext
from megaseq.data.sources import default_cache_dir, resolve_fasta, tokenized
from megaseq.data.windows import Batch, GenomeWindows
from megaseq.errors import UserError
from megaseq.eval.markov import MarkovBaseline
from megaseq.eval.positions import PositionLoss, format_table, plot_positions
from megaseq.model import LanguageModel, chunked_token_losses


def batch_to(batch: Batch, device: torch.device) -> Batch:
    return Batch(batch.inputs.to(device), batch.targets.to(device), batch.weights.to(device))


def heldout_windows(recipe: Recipe) -> tuple[GenomeWindows, list[int]]:
    d = recipe.data
    windows = GenomeWindows(tokenized(d.heldout), d.seq_len, max_n_fraction=d.max_n_fraction, softmask_weight=d.softmask_weight)
    if len(windows) == 0:
        raise UserError(f"{recipe.source}: data.heldout {d.heldout!r} has no window of seq_len {d.seq_len}")
    n = min(recipe.eval.windows, len(windows))
    return windows, np.linspace(0, len(windows) - 1, n).round().astype(int).tolist()


def _batches(indices: list[int], batch_size: int, progress: bool, desc: str) -> tqdm:
    starts = range(0, len(indices), batch_size)
    return tqdm(starts, desc=desc, unit="batch", disable=not progress, leave=False, file=sys.stderr)


@torch.no_grad()
def score_model(
    model: LanguageModel, recipe: Recipe, windows: GenomeWindows, indices: list[int], device: torch.device, progress: bool = False
) -> dict:
    was_training = model.training
    model.eval()
    acc = PositionLoss(recipe.data.seq_len, recipe.eval.first_bucket)
    bs = recipe.eval.batch_size
    for start in _batches(indices, bs, progress, "eval model"):
        batch = batch_to(windows.batch(indices[start : start + bs]).to_vocab(recipe.data.token_ids), device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=recipe.train.bf16):
            hidden = model(batch.inputs, ForwardContext())
            losses = chunked_token_losses(hidden, model.head_weight, batch.targets, recipe.train.loss_chunk)
        acc.add(losses.float(), batch.weights)
    model.train(was_training)
    return acc.summary()


def markov_baseline(recipe: Recipe) -> MarkovBaseline:
    return fitted_markov(recipe.data.train, recipe.eval.markov_order)


def fitted_markov(train: str, order: int) -> MarkovBaseline:
    """The order-``order`` Markov baseline fitted on dataset ``train``, from the cache or fitted once."""
    source = resolve_fasta(train)
    stat = source.stat()
    key = hashlib.sha256(f"{source.resolve()}:{stat.st_size}:{stat.st_mtime_ns}:{order}".encode()).hexdigest()[:16]
    path = default_cache_dir() / "markov" / f"order{order}-{key}.npz"
    if path.exists():
        return MarkovBaseline.load(path)
    print(f"fitting the order-{order} Markov baseline on {train} ...", file=sys.stderr)
    model = MarkovBaseline(order).fit(tokenized(train))
    path.parent.mkdir(parents=True, exist_ok=True)
    model.save(path)
    return model


def score_markov(
    baseline: MarkovBaseline, recipe: Recipe, windows: GenomeWindows, indices: list[int], progress: bool = False
) -> dict:
    acc = PositionLoss(recipe.data.seq_len, recipe.eval.first_bucket)
    for start in _batches(indices, recipe.eval.batch_size, progress, f"eval markov-{baseline.order}"):
        batch = windows.batch(indices[start : start + recipe.eval.batch_size])
        acc.add(baseline.token_losses(batch.inputs, batch.targets), batch.weights)
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


def evaluate_heldout(
    model: LanguageModel,
    recipe: Recipe,
    device: torch.device,
    out_dir: Path | None = None,
    baseline: bool = True,
    progress: bool = False,
) -> dict[str, Any]:
    """Score the model (and the Markov baseline) on held-out windows; write JSON + PNG to ``out_dir``.

    ``progress``: a progress bar per scorer on stderr."""
    windows, indices = heldout_windows(recipe)
    results = {"model": score_model(model, recipe, windows, indices, device, progress)}
    if baseline:
        markov = markov_baseline(recipe)
        results[f"markov-{recipe.eval.markov_order}"] = score_markov(markov, recipe, windows, indices, progress)
    table = format_table(results)
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        payload = {"heldout": recipe.data.heldout, "seq_len": recipe.data.seq_len, "windows": len(indices), "results": results}
        (out_dir / "heldout.json").write_text(json.dumps(payload, indent=2))
        plot_positions(results, out_dir / "heldout_by_position.png", f"{recipe.run.name}: held-out {recipe.data.heldout}")
    return {"results": results, "table": table, "flat": flatten(results), "windows": len(indices)}
