"""Bootstrap confidence intervals over held-out windows.

Windows, not tokens, are the independent units: neighbouring bases share repeats and composition, so a
per-token interval would be far too narrow. A resample draws as many windows as there are, with
replacement; a statistic is recomputed on each resample and the interval is the central ``level``
quantile range of those values (percentile bootstrap). Two models are compared on the SAME resamples
(paired), so the interval of their relative difference excludes the variation of the DNA itself, which
both share.

Inputs are ``[windows, columns]`` arrays of per-window mean bits/base (one column per position bucket,
the last one overall), as ``WindowBucketLoss.bits_per_window`` returns: every window has the same number
of targets in a column, so the mean over windows is the mean over targets.
"""

from __future__ import annotations

import numpy as np


def resample_weights(n_windows: int, samples: int, seed: int) -> np.ndarray:
    """``[samples, n_windows]``: how many times each window is drawn in each resample (rows sum to n)."""
    if n_windows < 1 or samples < 1:
        raise ValueError(f"need at least one window and one sample, got {n_windows} and {samples}")
    draws = np.random.default_rng(seed).integers(0, n_windows, size=(samples, n_windows))
    weights = np.zeros((samples, n_windows))
    np.add.at(weights, (np.arange(samples)[:, None], draws), 1.0)
    return weights


def _interval(values: np.ndarray, level: float) -> tuple[np.ndarray, np.ndarray]:
    tail = (1 - level) / 2
    return np.quantile(values, tail, axis=0), np.quantile(values, 1 - tail, axis=0)


def mean_interval(per_window: np.ndarray, weights: np.ndarray, level: float = 0.95) -> dict[str, list[float]]:
    """Mean over windows of each column and its bootstrap interval."""
    means = weights @ per_window / weights.sum(1, keepdims=True)
    low, high = _interval(means, level)
    return {"mean": per_window.mean(0).tolist(), "low": low.tolist(), "high": high.tolist()}


def relative_interval(
    per_window: np.ndarray, reference: np.ndarray, weights: np.ndarray, level: float = 0.95
) -> dict[str, list[float]]:
    """Relative change ``mean(a) / mean(ref) - 1`` per column and its paired bootstrap interval."""
    if per_window.shape != reference.shape:
        raise ValueError(f"paired comparison needs equal shapes, got {per_window.shape} and {reference.shape}")
    ratios = (weights @ per_window) / (weights @ reference) - 1
    low, high = _interval(ratios, level)
    return {
        "mean": (per_window.mean(0) / reference.mean(0) - 1).tolist(),
        "low": low.tolist(),
        "high": high.tolist(),
    }


def flat_within_intervals(low: list[float], high: list[float]) -> bool:
    """Whether one value lies inside every interval (a curve that could be constant, given its noise)."""
    return max(low) <= min(high)
