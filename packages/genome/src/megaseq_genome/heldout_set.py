"""A fixed held-out set: which windows, which positions, and how N runs are handled.

Rule. The held-out tokens in ``[region_start, region_end)`` are cut into consecutive windows of
``length + 1`` tokens starting at ``region_start`` (window i starts at ``region_start + i * length``; the
last token of a window is the first of the next, so every base of the region is a target once). A window
whose tokens include any N is dropped: no context crosses an assembly gap, and every target has weight 1.
Of the remaining candidates, ``count`` are taken evenly spaced (``linspace`` over their indices, rounded).
Every target of every chosen window is scored; the target at position p (0-based) is predicted from the
window's p + 1 tokens before it, never from anything outside the window.

Every model and baseline is scored on exactly these targets, one window at a time, and the losses are kept
per window and per position bucket (:class:`WindowBucketLoss`), so confidence intervals can resample
whole windows (``megaseq_genome.bootstrap``) and two models can be compared on the same resample.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch

from megaseq.data.tokenizer import N_ID, TOKEN_ID_MASK
from megaseq.errors import UserError
from megaseq.eval.positions import LN2, bucket_edges
from megaseq_genome.retrieval import RetrievalLoss


@dataclass(frozen=True)
class HeldoutSet:
    """The chosen windows of one held-out token array (see the module docstring)."""

    dataset: str
    region_start: int
    region_end: int
    length: int
    candidates: int
    starts: tuple[int, ...]

    def describe(self) -> dict:
        return {
            "dataset": self.dataset,
            "region": [self.region_start, self.region_end],
            "window_targets": self.length,
            "candidate_windows_without_n": self.candidates,
            "windows": len(self.starts),
            "starts": list(self.starts),
            "rule": "consecutive windows of length+1 tokens from region_start; any window with an N dropped; "
            "count of the rest evenly spaced; every target scored with the window's own preceding tokens",
        }

    def windows(self, tokens: np.ndarray) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """``(inputs [1, length], targets [1, length])`` token ids of each window in order."""
        for start in self.starts:
            ids = torch.from_numpy((np.asarray(tokens[start : start + self.length + 1]) & TOKEN_ID_MASK).astype(np.int64))
            yield ids[None, :-1], ids[None, 1:]


def select_heldout(
    tokens: np.ndarray, dataset: str, region: tuple[int, int], length: int, count: int
) -> HeldoutSet:
    """Choose the windows by the rule in the module docstring; a set with no valid window is a UserError."""
    start, end = max(0, region[0]), min(len(tokens), region[1])
    if length < 1 or count < 1:
        raise UserError(f"held-out set: window length ({length}) and count ({count}) must be >= 1")
    n_candidates = max(0, (end - start - 1) // length)
    ids = np.asarray(tokens[start : start + n_candidates * length + 1]) & TOKEN_ID_MASK
    n_before = np.concatenate([[0], np.cumsum(ids == N_ID)])  # N count of ids[:j]
    window_starts = np.arange(n_candidates) * length
    n_in_window = n_before[window_starts + length + 1] - n_before[window_starts]
    valid = np.flatnonzero(n_in_window == 0)
    if len(valid) == 0:
        raise UserError(
            f"held-out set: {dataset} [{start}, {end}) has no window of {length + 1} tokens without N "
            f"(region has {end - start} tokens); choose another region or a shorter window"
        )
    chosen = valid[np.unique(np.linspace(0, len(valid) - 1, min(count, len(valid))).round().astype(int))]
    return HeldoutSet(dataset, start, end, length, len(valid), tuple(int(start + i * length) for i in chosen))


class WindowBucketLoss:
    """Loss sums in nats per (window, position bucket), float64. Every target has weight 1 (no N)."""

    def __init__(self, length: int, first_bucket: int, n_windows: int) -> None:
        self.edges = bucket_edges(length, first_bucket)
        self.widths = np.diff(self.edges).astype(np.float64)
        self.sums = np.zeros((n_windows, len(self.widths)))
        self.filled = np.zeros(n_windows, dtype=bool)

    def add(self, window: int, token_loss: torch.Tensor) -> None:
        """token_loss: ``[length]`` nats of one window's targets in position order."""
        loss = token_loss.detach().to("cpu", torch.float64).reshape(-1).numpy()
        if loss.shape[0] != self.edges[-1]:
            raise ValueError(f"window {window}: {loss.shape[0]} losses, expected {self.edges[-1]}")
        if not np.isfinite(loss).all():
            raise ValueError(f"window {window}: non-finite token loss")
        self.sums[window] = np.add.reduceat(loss, self.edges[:-1])
        self.filled[window] = True

    def bits_per_window(self) -> np.ndarray:
        """``[windows, buckets + 1]`` mean bits/base of each window in each bucket; the last column: all."""
        if not self.filled.all():
            raise ValueError(f"windows {np.flatnonzero(~self.filled).tolist()[:5]} were never scored")
        per_bucket = self.sums / self.widths
        overall = self.sums.sum(1, keepdims=True) / self.widths.sum()
        return np.concatenate([per_bucket, overall], axis=1) / LN2


def score_windows(
    heldout: HeldoutSet,
    tokens: np.ndarray,
    first_bucket: int,
    token_losses: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    retrieval: RetrievalLoss | None = None,
) -> WindowBucketLoss:
    """Run ``token_losses(inputs [1, L], targets [1, L]) -> [1, L] nats`` over every window of the set; with
    ``retrieval``, also sum the losses by distance to each target's last earlier k-mer occurrence there."""
    acc = WindowBucketLoss(heldout.length, first_bucket, len(heldout.starts))
    for i, (inputs, targets) in enumerate(heldout.windows(tokens)):
        loss = token_losses(inputs, targets)
        acc.add(i, loss)
        if retrieval is not None:
            ids = torch.cat([inputs[0], targets[0, -1:]]).numpy()
            retrieval.add(i, ids, loss.detach().to("cpu", torch.float64).reshape(-1).numpy())
    return acc
