"""Retrieval evaluation: the last earlier occurrence of each target's k-mer against a slow search, planted
repeats landing in the expected distance buckets, and an exact copier getting the perfect copier's bits."""

from __future__ import annotations

import numpy as np
import pytest

from megaseq.data.tokenizer import N_ID
from megaseq_genome.bootstrap import resample_weights
from megaseq_genome.retrieval import (
    BUCKETS,
    KS,
    RetrievalLoss,
    bucket_of,
    last_occurrence,
    markdown,
    plot,
    retrieval_table,
)


def slow_last_occurrence(ids: list[int], k: int) -> tuple[list[int], list[bool]]:
    """The definition, position by position: compare the k-mer before each target with every earlier one back to
    the last N (another document may lie before it)."""
    distance, right = [], []
    for p in range(len(ids) - 1):
        kmer = ids[p - k + 1 : p + 1] if p >= k - 1 else None
        found = None
        if kmer is not None and N_ID not in kmer:
            for q in range(p - 1, k - 2, -1):
                if ids[q + 1] == N_ID:
                    break
                if ids[q - k + 1 : q + 1] == kmer:
                    found = q
                    break
        distance.append(0 if found is None else p - found)
        right.append(found is not None and ids[found + 1] == ids[p + 1])
    return distance, right


@pytest.mark.parametrize("k", [1, 2, 3, 5])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_last_occurrence_matches_the_slow_search(k, seed):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 4 if k > 2 else 3, size=301)
    ids[rng.integers(0, 301, size=6)] = N_ID  # N inside some k-mers and as some targets
    ids[150:190] = ids[20:60]  # a repeat
    distance, right = last_occurrence(ids, k)
    want_distance, want_right = slow_last_occurrence(ids.tolist(), k)
    assert distance.tolist() == want_distance
    assert right.tolist() == want_right


def test_bucket_edges():
    assert bucket_of(np.array([1, 511, 512, 4095, 4096, 16383, 16384, 65535, 0])).tolist() == [0, 0, 1, 1, 2, 2, 3, 3, 4]
    assert BUCKETS[4] == "none"


@pytest.mark.parametrize(("distance", "bucket"), [(300, "<512"), (1000, "512-4k"), (5000, "4k-16k"), (20000, "16k-64k")])
def test_a_planted_repeat_lands_in_its_bucket(distance, bucket):
    rng = np.random.default_rng(7)
    length, source, size = 24_000, 100, 200
    ids = rng.integers(0, 4, size=length + 1)
    ids[source + distance : source + distance + size] = ids[source : source + size]
    end = source + distance + size
    # the copy starts and ends here: no k-mer reaching past either end matches by chance
    ids[source + distance - 1] = (ids[source - 1] + 1) % 4
    ids[end] = (ids[source + size] + 1) % 4
    for k in KS:
        found, right = last_occurrence(ids, k)
        # targets whose whole k-mer lies in the copy, except the copy's last base (its next base is not copied)
        inside = np.arange(source + distance + k - 1, source + distance + size - 1)
        assert (found[inside] == distance).all() and right[inside].all(), k
        names = [BUCKETS[b] for b in bucket_of(found[inside])]
        assert set(names) == {bucket}
        # random DNA: 4^-k per pair, so outside the copy nothing of k >= 16 repeats
        if k >= 16:
            outside = np.ones(length, dtype=bool)
            outside[source + distance + k - 1 : end] = False  # the copy's k-mers, the last one's target not copied
            assert (found[outside] == 0).all()


def test_an_exact_copier_gets_the_copiers_bits_and_captures_all_of_its_gain():
    rng = np.random.default_rng(3)
    windows = [rng.integers(0, 4, size=6001) for _ in range(5)]
    for w, ids in enumerate(windows):  # repeats at several distances
        ids[3000 + 200 * w : 3400 + 200 * w] = ids[100 * w : 100 * w + 400]
        ids[5500:5700] = ids[5000:5200]
    k = 20
    reference, copier, half = RetrievalLoss(5), RetrievalLoss(5), RetrievalLoss(5)
    for w, ids in enumerate(windows):
        ref_loss = rng.uniform(0.5, 2.0, size=6000)
        _, right = last_occurrence(ids, k)
        reference.add(w, ids, ref_loss)
        copier.add(w, ids, np.where(right, 0.0, ref_loss))
        half.add(w, ids, np.where(right, ref_loss / 2, ref_loss))
    table = retrieval_table({"markov": reference, "copier": copier, "half": half}, "markov", resample_weights(5, 200, 0))
    i = table["ks"].index(k)
    bits, want = table["models"]["copier"]["bits_per_base"]["mean"][i], table["copier_bits"]["mean"][i]
    present = [b for b, n in enumerate(table["targets"][i]) if n > 0]
    assert present == [0, 1, 4] and [bits[b] for b in range(len(BUCKETS)) if b not in present] == [None, None]
    assert [bits[b] for b in present] == pytest.approx([want[b] for b in present], rel=1e-12)
    captured = table["models"]["copier"]["captured"]
    gained = [b for b, n in enumerate(table["right_copies"][i]) if n > 0]
    assert gained == [0, 1] and table["right_copies"][i][BUCKETS.index("none")] == 0
    for b in gained:
        assert captured["mean"][i][b] == pytest.approx(1.0) and captured["low"][i][b] == pytest.approx(1.0)
        assert table["models"]["half"]["captured"]["mean"][i][b] == pytest.approx(0.5)
        assert table["models"]["markov"]["captured"]["mean"][i][b] == pytest.approx(0.0)
    assert captured["mean"][i][BUCKETS.index("none")] is None  # no right copy: nothing to capture


def test_scorers_on_other_targets_are_refused():
    ids = np.random.default_rng(0).integers(0, 4, size=101)
    repeated = ids.copy()
    repeated[60:100] = ids[0:40]
    a, b = RetrievalLoss(1), RetrievalLoss(1)
    a.add(0, ids, np.ones(100))
    b.add(0, repeated, np.ones(100))
    with pytest.raises(ValueError, match="not scored on the same targets"):
        retrieval_table({"a": a, "b": b}, "a", resample_weights(1, 10, 0))


def test_table_in_markdown_and_a_plot(tmp_path):
    rng = np.random.default_rng(5)
    ids = rng.integers(0, 4, size=3001)
    ids[2000:2400] = ids[100:500]
    reference, copier = RetrievalLoss(1), RetrievalLoss(1)
    ref_loss = rng.uniform(0.5, 2.0, size=3000)
    reference.add(0, ids, ref_loss)
    copier.add(0, ids, np.where(last_occurrence(ids, 20)[1], 0.0, ref_loss))
    table = retrieval_table({"markov-2": reference, "copier": copier}, "markov-2", resample_weights(1, 20, 0))
    text = markdown(table, k=20)
    right = int(last_occurrence(ids, 20)[1].sum())  # the copy's k-mers: about 400 - 19
    assert 375 <= right <= 385 and f"| right copies | 0 | {right} | 0 | 0 | 0 |" in text
    assert "| copier, captured | - | 100% [100, 100] | - | - | - |" in text
    assert "markov-2, captured" not in text
    plot(table, tmp_path / "retrieval.png", k=20)
    assert (tmp_path / "retrieval.png").stat().st_size > 1000


def test_score_windows_sums_every_target_once_per_k():
    """The held-out scorer feeds each window's tokens and losses: per k, the buckets add up to the window."""
    import torch

    from megaseq_genome.heldout_set import score_windows, select_heldout

    tokens = np.random.default_rng(4).integers(0, 4, size=5000).astype(np.uint8)
    tokens[3000:3300] = tokens[1000:1300]
    heldout = select_heldout(tokens, "synthetic", (0, 5000), 1024, 3)
    acc = RetrievalLoss(len(heldout.starts))
    positions = score_windows(heldout, tokens, 64, lambda inputs, targets: (targets.double() + 1) / 4, acc)
    assert np.allclose(acc.sums.sum(2), positions.sums.sum(1, keepdims=True), rtol=1e-12)
    assert (acc.counts.sum(2) == 1024).all()
    for w, start in enumerate(heldout.starts):
        ids = tokens[start : start + 1025].astype(np.int64)
        _, right = last_occurrence(ids, 20)
        assert acc.right_counts[w, KS.index(20)].sum() == right.sum()
        assert torch.isfinite(torch.tensor(acc.sums[w])).all()
