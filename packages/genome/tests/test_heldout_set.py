"""The fixed held-out set (window rule, N handling, per-window bucket sums) and bootstrap intervals."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from megaseq.data.tokenizer import N_ID
from megaseq.errors import UserError
from megaseq_genome.bootstrap import flat_within_intervals, mean_interval, relative_interval, resample_weights
from megaseq_genome.heldout_set import WindowBucketLoss, score_windows, select_heldout
from megaseq_genome.markov import MarkovBaseline


def bases(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 4, n).astype(np.uint8)


def test_windows_with_any_n_are_dropped_including_the_shared_last_token():
    tokens = bases(1000)
    # region [100, 1000), length 99: candidate i covers tokens 100 + 99 i .. 100 + 99 (i + 1) inclusive
    tokens[100 + 99 * 2 + 5] = N_ID  # inside window 2
    tokens[100 + 99 * 5] = N_ID  # last token of window 4 = first of window 5: both dropped
    tokens[100 + 99 * 7 + 3] = N_ID | 8  # a soft-masked N is an N
    held = select_heldout(tokens, "t", (100, 1000), 99, 100)
    assert held.candidates == 9 - 4
    assert held.starts == tuple(100 + 99 * i for i in (0, 1, 3, 6, 8))
    for start in held.starts:
        assert not ((tokens[start : start + 100] & 7) == N_ID).any()
    inputs, targets = next(held.windows(tokens))
    assert inputs.shape == targets.shape == (1, 99)
    assert torch.equal(inputs[0, 1:], targets[0, :-1]) and int(targets[0, -1]) == tokens[100 + 99]


def test_windows_are_evenly_spaced_and_the_region_is_clipped():
    held = select_heldout(bases(10_000), "t", (0, 50_000), 100, 4)
    assert held.region_end == 10_000 and held.candidates == 99
    assert held.starts == (0, 3300, 6500, 9800)  # candidates 0, 33, 65, 98: linspace(0, 98, 4) rounded


@pytest.mark.parametrize(("region", "length"), [((0, 100), 100), ((0, 1000), 50)])
def test_no_valid_window_is_a_user_error(region, length):
    tokens = bases(1000)
    tokens[::40] = N_ID  # an N every 40 bases: no 51-token window is clean
    with pytest.raises(UserError, match=r"held-out set: t \[0, \d+\) has no window of \d+ tokens without N"):
        select_heldout(tokens, "t", region, length, 3)


def test_bucket_sums_hand_computed_and_guarded():
    acc = WindowBucketLoss(8, first_bucket=2, n_windows=2)  # buckets [0,2) [2,4) [4,8)
    acc.add(0, torch.arange(8, dtype=torch.float32))
    with pytest.raises(ValueError, match="never scored"):
        acc.bits_per_window()
    acc.add(1, torch.full((1, 8), math.log(2)))
    bits = acc.bits_per_window()
    np.testing.assert_allclose(bits[0], np.array([0.5, 2.5, 5.5, 3.5]) / math.log(2))
    np.testing.assert_allclose(bits[1], [1, 1, 1, 1])
    with pytest.raises(ValueError, match="non-finite"):
        acc.add(0, torch.tensor([0, 1, 2, 3, 4, 5, 6, float("nan")]))
    with pytest.raises(ValueError, match="expected 8"):
        acc.add(0, torch.zeros(7))


def test_markov_scored_on_the_set_matches_its_own_token_losses():
    tokens = bases(5000, seed=1)
    markov = MarkovBaseline(3).fit(bases(20_000, seed=2))
    held = select_heldout(tokens, "t", (0, 5000), 256, 6)
    acc = score_windows(held, tokens, 32, markov.token_losses)
    inputs = torch.cat([i for i, _ in held.windows(tokens)])
    targets = torch.cat([t for _, t in held.windows(tokens)])
    expected = markov.token_losses(inputs, targets).numpy().mean(1) / math.log(2)
    np.testing.assert_allclose(acc.bits_per_window()[:, -1], expected, rtol=1e-12)


def test_bootstrap_resamples_windows():
    weights = resample_weights(7, 500, seed=0)
    assert weights.shape == (500, 7) and (weights.sum(1) == 7).all()
    assert len({tuple(row) for row in weights}) > 300, "resamples should differ (1,716 multisets of 7 exist)"
    per_window = np.random.default_rng(0).normal(2.0, 0.1, size=(7, 3))
    ci = mean_interval(per_window, weights)
    for mean, low, high in zip(ci["mean"], ci["low"], ci["high"], strict=True):
        assert low < mean < high
    same = mean_interval(np.ones((7, 3)), weights)
    assert same["low"] == same["high"] == [1.0, 1.0, 1.0]


def test_paired_interval_removes_shared_window_variation():
    rng = np.random.default_rng(0)
    dna = rng.normal(1.9, 0.1, size=(32, 1))  # what the windows' content does to every model alike
    reference = dna + rng.normal(0, 0.001, size=(32, 1))
    better = 0.98 * dna + rng.normal(0, 0.001, size=(32, 1))
    weights = resample_weights(32, 1000, seed=1)
    paired = relative_interval(better, reference, weights)
    assert paired["high"][0] < -0.015 and paired["low"][0] > -0.025, paired
    # unpaired intervals of the two means overlap: only pairing resolves the 2% difference
    a, b = mean_interval(better, weights), mean_interval(reference, resample_weights(32, 1000, seed=2))
    assert a["high"][0] > b["low"][0]
    exact = relative_interval(0.9 * reference, reference, weights)
    np.testing.assert_allclose([exact["low"][0], exact["high"][0]], [-0.1, -0.1], atol=1e-12)


@pytest.mark.parametrize(
    ("low", "high", "flat"),
    [([1.0, 1.1, 0.9], [1.2, 1.3, 1.15], True), ([1.0, 1.2], [1.1, 1.3], False), ([1.0], [1.0], True)],
)
def test_flat_within_intervals(low, high, flat):
    assert flat_within_intervals(low, high) is flat
