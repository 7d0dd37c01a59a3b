"""Retrieval evaluation: on targets whose preceding k-mer occurred earlier in the window, does a model use it?

For a held-out window of tokens ``ids[0 .. L]`` (inputs ``ids[:-1]``, targets ``ids[1:]``), the target at
position p is ``ids[p + 1]`` and its preceding k-mer is ``ids[p - k + 1 .. p]``. Its **last earlier
occurrence** is the largest q < p whose k-mer ``ids[q - k + 1 .. q]`` is the same, with no N in either nor
between them (core joins a corpus's records with one N, so what lies before an N may be another document; an
N run inside a record is a gap of unknown length); the **distance** is p - q, and the occurrence's next base ``ids[q + 1]`` is what a copier would predict: the
copy is **right** when it equals the target. A target with p < k - 1, an N in its k-mer, or no earlier
occurrence has no distance ("none").

Targets are grouped by distance into :data:`BUCKETS` (< 512, 512-4k, 4k-16k, 16k-64k, none) for each k in
:data:`KS`. A scorer's losses are summed per (window, k, bucket), over all targets and over the targets
whose copy is right (:class:`RetrievalLoss`), so that with a reference scorer R (the strongest Markov
baseline) the **perfect copier** is defined per bucket: it predicts the right copy with certainty (loss 0)
and is R elsewhere, so its bits are R's minus R's loss on the right-copy targets, and a model M captures
``(R - M) / (R - copier)`` of the copier's gain. Bits and fractions are ratios of sums over targets; their
intervals resample whole windows (``megaseq_genome.bootstrap``).

:class:`RetrievalAnalysis` is the ``retrieval`` eval analysis (``eval.analyses = ["retrieval"]``): the table
and plot for the model and the baselines of ``megaseq eval`` and of a training run's final evaluation.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, get_args

import numpy as np

from megaseq.contracts import EvalInfo
from megaseq.data.tokenizer import N_ID, TOKEN_ID_MASK
from megaseq.errors import ConfigError
from megaseq.eval.positions import LN2
from megaseq_genome.bootstrap import resample_weights
from megaseq_genome.config import RetrievalConfig, RetrievalK

KS: tuple[int, ...] = get_args(RetrievalK)
EDGES = (512, 4096, 16384, 65536)  # distance bucket upper bounds; "none" after them
BUCKETS = ("<512", "512-4k", "4k-16k", "16k-64k", "none")
NONE = len(BUCKETS) - 1


def kmer_codes(ids: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """``(codes, valid)`` for each position t of ``ids``: the k-mer ``ids[t - k + 1 .. t]`` as a base-4 code
    (two bits a base, so k <= 32 fits in 64 bits) and whether it exists (t >= k - 1) and holds no N."""
    if not 1 <= k <= 32:
        raise ValueError(f"k must be in 1..32 (two bits a base in 64), got {k}")
    ids = np.asarray(ids) & TOKEN_ID_MASK
    is_n = ids == N_ID
    digits = np.where(is_n, 0, ids).astype(np.uint64)
    codes = np.zeros(len(ids), dtype=np.uint64)
    for back in range(k):
        codes[back:] |= digits[: len(ids) - back] << np.uint64(2 * back)
    n_before = np.concatenate([[0], np.cumsum(is_n)])  # N count of ids[:j]
    t = np.arange(len(ids))
    valid = (t >= k - 1) & (n_before[t + 1] - n_before[np.maximum(t - k + 1, 0)] == 0)
    return codes, valid


def last_occurrence(ids: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """``(distance, right)`` of each of the window's L targets (module docstring): distance 0 means none."""
    ids = np.asarray(ids) & TOKEN_ID_MASK
    length = len(ids) - 1
    codes, valid = kmer_codes(ids[:-1], k)  # the k-mer ending at input p precedes target p
    segment = np.cumsum(ids[:-1] == N_ID)  # the N-free stretch each input lies in: occurrences never cross an N
    positions = np.flatnonzero(valid)
    # by stretch, then k-mer, then position: an occurrence's predecessor in this order is its last earlier one
    order = positions[np.lexsort((positions, codes[positions], segment[positions]))]
    same = (codes[order[1:]] == codes[order[:-1]]) & (segment[order[1:]] == segment[order[:-1]])
    previous = np.full(length, -1)
    previous[order[1:][same]] = order[:-1][same]
    distance = np.where(previous >= 0, np.arange(length) - previous, 0)
    found = previous >= 0
    right = np.zeros(length, dtype=bool)
    right[found] = ids[previous[found] + 1] == ids[1:][found]
    return distance, right


def bucket_of(distance: np.ndarray) -> np.ndarray:
    """Bucket index (into :data:`BUCKETS`) of each distance; 0 (none) -> the last bucket."""
    return np.where(distance > 0, np.searchsorted(np.asarray(EDGES), distance, side="right"), NONE)


class RetrievalLoss:
    """Loss sums (nats, float64) per (window, k, bucket): over every target (``sums``) and over the targets
    whose copy is right (``right_sums``), with their counts (``counts``, ``right_counts``). With loss weights
    (``add``'s ``weights``, as the held-out evaluation gives them) sums are weighted and counts are the summed
    weights: target counts where every scored target weighs 1."""

    FIELDS = ("sums", "right_sums", "counts", "right_counts")

    def __init__(self, n_windows: int, ks: tuple[int, ...] = KS) -> None:
        self.ks = tuple(ks)
        shape = (n_windows, len(self.ks), len(BUCKETS))
        self.sums, self.right_sums = np.zeros(shape), np.zeros(shape)
        self.counts, self.right_counts = np.zeros(shape), np.zeros(shape)

    def add(self, window: int, ids: np.ndarray, loss: np.ndarray, weights: np.ndarray | None = None) -> None:
        """``ids``: the window's L + 1 tokens; ``loss``: its L targets' losses in nats; ``weights``: their loss
        weights (None: 1 each); a target of weight 0 does not count, whatever its loss (even inf or NaN)."""
        loss = np.asarray(loss, dtype=np.float64).reshape(-1)
        if loss.shape[0] != len(ids) - 1:
            raise ValueError(f"window {window}: {loss.shape[0]} losses for {len(ids) - 1} targets")
        weights = np.ones_like(loss) if weights is None else np.asarray(weights, dtype=np.float64).reshape(-1)
        if weights.shape != loss.shape:
            raise ValueError(f"window {window}: {weights.shape[0]} weights for {loss.shape[0]} targets")
        loss = np.where(weights > 0, loss, 0.0) * weights
        for i, k in enumerate(self.ks):
            distance, right = last_occurrence(ids, k)
            buckets = bucket_of(distance)
            n = len(BUCKETS)
            self.sums[window, i] = np.bincount(buckets, loss, minlength=n)
            self.counts[window, i] = np.bincount(buckets, weights, minlength=n)
            self.right_sums[window, i] = np.bincount(buckets[right], loss[right], minlength=n)
            self.right_counts[window, i] = np.bincount(buckets[right], weights[right], minlength=n)

    def arrays(self) -> dict[str, np.ndarray]:
        return {f"retrieval_{name}": getattr(self, name) for name in self.FIELDS} | {"retrieval_ks": np.asarray(self.ks)}

    @classmethod
    def from_arrays(cls, saved: dict[str, np.ndarray]) -> RetrievalLoss:
        acc = cls(saved["retrieval_sums"].shape[0], tuple(int(k) for k in saved["retrieval_ks"]))
        for name in cls.FIELDS:
            setattr(acc, name, np.asarray(saved[f"retrieval_{name}"], dtype=np.float64))
        return acc


def _ratio(numerator: np.ndarray, denominator: np.ndarray) -> np.ndarray:
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(denominator > 0, numerator / np.where(denominator > 0, denominator, 1), np.nan)


def _summary(values: np.ndarray, resampled: np.ndarray, level: float) -> dict[str, list]:
    """``values [K, B]`` and ``resampled [samples, K, B]`` -> mean and percentile interval, NaN as None."""
    tail = (1 - level) / 2
    with warnings.catch_warnings():  # a bucket without targets (or without gain) is NaN in every resample
        warnings.simplefilter("ignore", RuntimeWarning)
        low, high = np.nanquantile(resampled, tail, axis=0), np.nanquantile(resampled, 1 - tail, axis=0)

    def clean(a: np.ndarray) -> list:
        return [[None if not np.isfinite(x) else float(x) for x in row] for row in a]

    return {"mean": clean(values), "low": clean(low), "high": clean(high)}


def _resampled(weights: np.ndarray, array: np.ndarray) -> np.ndarray:
    """``[samples, K, B]`` sums over each resample's windows of a ``[windows, K, B]`` array."""
    return np.einsum("sw,wkb->skb", weights, array)


def _same_targets(name: str, acc: RetrievalLoss, reference: str, ref: RetrievalLoss) -> None:
    if acc.ks != ref.ks or acc.counts.shape != ref.counts.shape or not np.array_equal(acc.counts, ref.counts):
        raise ValueError(f"retrieval: {name} was not scored on the same targets as {reference}")


def relative_change(
    scores: dict[str, RetrievalLoss], name: str, reference: str, weights: np.ndarray, level: float = 0.95
) -> dict[str, list]:
    """``name``'s bits/base over ``reference``'s, minus 1, per (k, bucket), with the paired interval (both on the
    same window resamples). Both scored the same targets, so it is the ratio of their loss sums."""
    acc, ref = scores[name], scores[reference]
    _same_targets(name, acc, reference, ref)
    return _summary(_ratio(acc.sums.sum(0), ref.sums.sum(0)) - 1,
                    _ratio(_resampled(weights, acc.sums), _resampled(weights, ref.sums)) - 1, level)


def retrieval_table(
    scores: dict[str, RetrievalLoss], reference: str, weights: np.ndarray, level: float = 0.95
) -> dict[str, object]:
    """Per scorer: bits/base per (k, bucket) with intervals, and the fraction of the perfect copier's gain
    (over ``reference``) it captures; the copier's own bits; target counts and right-copy counts. Every
    interval resamples windows with ``weights`` ``[samples, windows]`` (paired across scorers)."""
    ref = scores[reference]

    def resampled(array: np.ndarray) -> np.ndarray:
        return _resampled(weights, array)

    copier_sums = ref.sums - ref.right_sums
    out: dict[str, object] = {
        "ks": list(ref.ks), "buckets": list(BUCKETS), "reference": reference,
        "targets": np.rint(ref.counts.sum(0)).astype(int).tolist(), "right_copies": np.rint(ref.right_counts.sum(0)).astype(int).tolist(),
        "copier_bits": _summary(_ratio(copier_sums.sum(0), ref.counts.sum(0)) / LN2,
                                _ratio(resampled(copier_sums), resampled(ref.counts)) / LN2, level),
        "models": {},
    }
    gain = ref.right_sums  # reference minus copier, per window
    for name, acc in scores.items():
        _same_targets(name, acc, reference, ref)
        bits = _summary(_ratio(acc.sums.sum(0), acc.counts.sum(0)) / LN2,
                        _ratio(resampled(acc.sums), resampled(acc.counts)) / LN2, level)
        captured = _summary(_ratio((ref.sums - acc.sums).sum(0), gain.sum(0)),
                            _ratio(resampled(ref.sums - acc.sums), resampled(gain)), level)
        out["models"][name] = {"bits_per_base": bits, "captured": captured}  # type: ignore[index]
    return out


def _cell(summary: dict[str, list], i: int, b: int, percent: bool = False) -> str:
    mean, low, high = (summary[key][i][b] for key in ("mean", "low", "high"))
    if mean is None:
        return "-"
    if percent:
        return f"{100 * mean:.0f}% [{100 * low:.0f}, {100 * high:.0f}]" if low is not None else f"{100 * mean:.0f}%"
    return f"{mean:.3f} [{low:.3f}, {high:.3f}]" if low is not None else f"{mean:.3f}"


def markdown(table: dict[str, Any], k: int = 20) -> str:
    """The retrieval table of one k: targets and right copies per bucket, the perfect copier's bits, and per
    scorer its bits/base and the share of the copier's gain it captures, with intervals."""
    i = table["ks"].index(k)
    buckets = table["buckets"]
    lines = [
        f"Retrieval (k = {k}): bits/base by the distance back to the last earlier occurrence of each target's preceding "
        f"{k}-mer in its window; the perfect copier predicts that occurrence's next base with certainty where it is "
        f"right and is {table['reference']} elsewhere; captured: the share of the copier's gain over "
        f"{table['reference']} (95% intervals over windows).",
        "",
        "| | " + " | ".join(buckets) + " |",
        "|---|" + "---:|" * len(buckets),
        "| targets | " + " | ".join(f"{n:,}" for n in table["targets"][i]) + " |",
        "| right copies | " + " | ".join(f"{n:,}" for n in table["right_copies"][i]) + " |",
        "| perfect copier, bits | " + " | ".join(_cell(table["copier_bits"], i, b) for b in range(len(buckets))) + " |",
    ]
    for name, scores in table["models"].items():
        lines.append(f"| {name}, bits | " + " | ".join(_cell(scores["bits_per_base"], i, b) for b in range(len(buckets))) + " |")
    for name, scores in table["models"].items():
        if name != table["reference"]:
            lines.append(f"| {name}, captured | " + " | ".join(_cell(scores["captured"], i, b, True) for b in range(len(buckets))) + " |")
    return "\n".join(lines) + "\n"


def plot(table: dict[str, Any], path: Any, k: int = 20) -> None:
    """Bits/base and captured share by distance bucket, one line per scorer, for one k."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    i = table["ks"].index(k)
    x = np.arange(len(table["buckets"]))
    figure = Figure(figsize=(11, 4.2))
    FigureCanvasAgg(figure)
    left, right = figure.add_subplot(1, 2, 1), figure.add_subplot(1, 2, 2)

    def line(axes: Any, summary: dict[str, list], label: str, scale: float = 1.0, style: str = "-") -> None:
        mean = np.array([np.nan if v is None else scale * v for v in summary["mean"][i]])
        low = np.array([np.nan if v is None else scale * v for v in summary["low"][i]])
        high = np.array([np.nan if v is None else scale * v for v in summary["high"][i]])
        axes.errorbar(x, mean, yerr=[mean - low, high - mean], marker="o", ms=3, capsize=2, linestyle=style, label=label)

    line(left, table["copier_bits"], "perfect copier", style=":")
    for name, scores in table["models"].items():
        line(left, scores["bits_per_base"], name, style="--" if name == table["reference"] else "-")
        if name != table["reference"]:
            line(right, scores["captured"], name, scale=100)
    for axes in (left, right):
        axes.set_xticks(x, table["buckets"])
        axes.set_xlabel(f"distance to the last earlier occurrence of the preceding {k}-mer")
        axes.grid(True, alpha=0.3)
        axes.legend(fontsize=7)
    right.axhline(0, color="black", linewidth=0.8)
    right.axhline(100, color="grey", linestyle=":", linewidth=0.8)
    left.set_ylabel("bits per base")
    right.set_ylabel(f"share of the copier's gain over {table['reference']} (%)")
    figure.savefig(path, dpi=120, bbox_inches="tight")


class RetrievalAnalysis:
    """The ``retrieval`` eval analysis (``megaseq.contracts.EvalAnalysis``): every scorer's losses summed by
    distance bucket (:class:`RetrievalLoss`), then the retrieval table over the reference baseline
    (``reference``, else the scored baseline with the lowest loss) with bootstrap intervals over windows, its
    markdown for ``k`` and the plot ``retrieval_by_distance.png``."""

    def __init__(self, config: RetrievalConfig, info: EvalInfo) -> None:
        if not info.baselines:
            raise ConfigError(
                f"{info.source}: eval.analyses: retrieval measures the perfect copier's gain over a baseline and "
                'eval.baselines scores none; add one, e.g. eval.baselines = ["markov"]'
            )
        if config.reference is not None and config.reference not in info.baselines:
            raise ConfigError(
                f"{info.source}: eval_analysis.retrieval.reference: {config.reference!r} is not a scored baseline; "
                f"allowed: {', '.join(info.baselines)}"
            )
        self.config, self.info = config, info
        self.scores = {scorer: RetrievalLoss(info.windows) for scorer in info.scorers}

    def add(self, scorer: str, window: int, ids: np.ndarray, losses: np.ndarray, weights: np.ndarray) -> None:
        self.scores[scorer].add(window, ids, losses, weights)

    def reference(self) -> str:
        if self.config.reference is not None:
            return self.config.reference
        # each target lies in exactly one bucket of each k, so the buckets of the first k sum to the total loss
        return min(self.info.baselines, key=lambda label: self.scores[label].sums[:, 0].sum())

    def finish(self, out_dir: Path | None) -> tuple[dict[str, Any], str]:
        weights = resample_weights(self.info.windows, self.config.bootstrap_samples, seed=0)
        table = retrieval_table(self.scores, self.reference(), weights)
        if out_dir is not None:
            plot(table, Path(out_dir) / "retrieval_by_distance.png", self.config.k)
        return table, markdown(table, self.config.k)


def build(config: RetrievalConfig, info: EvalInfo) -> RetrievalAnalysis:
    return RetrievalAnalysis(config, info)
