"""The policy: a megaseq checkpoint, its recipe and its model; and the training forward's per-token terms."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from megaseq.config import Recipe, validate_recipe
from megaseq.contracts import ForwardContext
from megaseq.model import LanguageModel, build_model
from megaseq.plugins import Plugins
from megaseq.train.checkpoint import CheckpointError, load_weights, newest_verified, read_meta, verify


def resolve_checkpoint(path: Path) -> Path:
    """A verified checkpoint directory: ``path`` itself, or a run directory's newest verified checkpoint
    (skipped damaged ones are reported in one warning line); anything else is a one-line ``CheckpointError``."""
    if (path / "checkpoints").is_dir():
        found = newest_verified(path / "checkpoints")
        if found.path is None:
            raise CheckpointError(f"no usable checkpoint in {path / 'checkpoints'}" + (f": {found.report()}" if found.skipped else ""))
        if found.report():
            print(f"megaseq: warning: {found.report()}", file=sys.stderr)
        return found.path
    if not (path / "meta.json").exists():
        raise CheckpointError(f"{path}: not a megaseq checkpoint or run directory (no meta.json, no checkpoints/)")
    verify(path)
    return path


def load_policy(checkpoint: str | Path, plugins: Plugins) -> tuple[Path, Recipe, LanguageModel]:
    """``(checkpoint directory, its recipe, the model with its weights)``. A run directory means its newest
    verified checkpoint; a checkpoint whose components are not installed is a one-line ``PluginError``."""
    path = resolve_checkpoint(Path(checkpoint))
    meta = read_meta(path)
    recipe = validate_recipe(meta["recipe"], plugins, source=f"{path}/meta.json")
    model = build_model(recipe, plugins)
    load_weights(path, model)
    return path, recipe, model


def _chunk_logprobs(hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float) -> Tensor:
    logits = (hidden @ weight.to(hidden.dtype).t()).float() / temperature
    return F.log_softmax(logits, -1).gather(-1, targets[:, None]).squeeze(-1)


@torch.no_grad()
def _chunk_entropy(hidden: Tensor, weight: Tensor, temperature: float) -> Tensor:
    logp = F.log_softmax((hidden @ weight.to(hidden.dtype).t()).float() / temperature, -1)
    return -(logp.exp() * logp).sum(-1)


def completion_terms(
    model: LanguageModel, tokens: Tensor, prompt_len: int, ctx: ForwardContext, temperature: float, chunk: int
) -> tuple[Tensor, Tensor]:
    """Policy log-probabilities (with gradient) and entropies (without) of ``tokens[:, prompt_len:]``, each
    ``[B, N]`` fp32: one forward over ``tokens[:, :-1]``, the LM head ``chunk`` tokens at a time (recomputed in
    backward), so full-sequence logits never exist. Equals ``megaseq.inference.sequence_logprobs`` there."""
    hidden = model(tokens[:, :-1], ctx)[:, prompt_len - 1 :]
    targets = tokens[:, prompt_len:]
    flat_h, flat_t = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    weight = model.head_weight
    logprobs, entropies = [], []
    # split, not a slice per chunk: a slice's backward writes its gradient into a zero tensor of the whole
    # sequence's size, once per chunk (megaseq.model.chunked_token_losses)
    for h, t in zip(flat_h.split(chunk), flat_t.split(chunk), strict=True):
        if torch.is_grad_enabled():
            logprobs.append(checkpoint(_chunk_logprobs, h, weight, t, temperature, use_reentrant=False))
        else:
            logprobs.append(_chunk_logprobs(h, weight, t, temperature))
        entropies.append(_chunk_entropy(h.detach(), weight.detach(), temperature))
    return torch.cat(logprobs).view(targets.shape), torch.cat(entropies).view(targets.shape)
