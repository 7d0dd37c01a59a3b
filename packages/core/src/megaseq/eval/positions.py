"""Loss by context position: does the model use long context?

A target's position in its window is how much preceding context it had. Positions are grouped into
doubling buckets, [0, f), [f, 2f), [2f, 4f), ..., up to seq_len, so a model that uses long-range context
shows falling bits/base in the later buckets while a baseline of fixed context (a k-mer model) stays flat.

Bucket rule (`bucket_edges`): f = `first` when seq_len > first; otherwise f is the largest power of two
<= max(1, seq_len // 8), which gives about four buckets for any short window. The last bucket ends at
seq_len, so it may be shorter than double the previous one.
"""

import math
from pathlib import Path

import torch

LN2 = math.log(2.0)


def bucket_edges(seq_len: int, first: int = 1024) -> list[int]:
    """[0, f, 2f, 4f, ..., seq_len] with f chosen by the rule in the module docstring."""
    if seq_len < 1 or first < 1:
        raise ValueError(f"seq_len and first must be >= 1, got seq_len={seq_len}, first={first}")
    if seq_len <= first:
        first = 1 << (max(1, seq_len // 8).bit_length() - 1)
    edges = [0]
    edge = first
    while edge < seq_len:
        edges.append(edge)
        edge *= 2
    return [*edges, seq_len]


def _per_base(nats: float, weight: float) -> dict:
    mean = nats / weight if weight > 0 else None
    return {"nats_per_base": mean, "bits_per_base": None if mean is None else mean / LN2}


class PositionLoss:
    """Accumulates weighted per-token losses by window position (float64 sums, so long evals stay exact).

    summary(): weighted mean loss (weights are the loss weights of `Batch.weights`) overall and per bucket;
    "tokens" counts the targets with non-zero weight. A bucket without such targets reports None.
    """

    def __init__(self, seq_len: int, first_bucket: int = 1024) -> None:
        self.seq_len = seq_len
        self.edges = bucket_edges(seq_len, first_bucket)
        self.loss_sum = torch.zeros(seq_len, dtype=torch.float64)
        self.weight_sum = torch.zeros(seq_len, dtype=torch.float64)
        self.token_count = torch.zeros(seq_len, dtype=torch.int64)

    def add(self, token_loss: torch.Tensor, weights: torch.Tensor) -> None:
        """token_loss: [B, seq_len] nats; weights: [B, seq_len] (0 = not scored)."""
        if token_loss.shape != weights.shape or token_loss.dim() != 2 or token_loss.shape[1] != self.seq_len:
            raise ValueError(
                f"token_loss {tuple(token_loss.shape)} and weights {tuple(weights.shape)} must both be "
                f"[batch, {self.seq_len}]"
            )
        weights = weights.detach().to("cpu", torch.float64)
        # Zero-weight targets may carry any loss value (even inf/nan for N); they must not touch the sums.
        losses = torch.where(weights > 0, token_loss.detach().to("cpu", torch.float64), 0.0)
        self.loss_sum += (losses * weights).sum(0)
        self.weight_sum += weights.sum(0)
        self.token_count += (weights > 0).sum(0)

    def summary(self) -> dict:
        buckets = []
        for start, end in zip(self.edges[:-1], self.edges[1:], strict=True):
            bucket = {"start": start, "end": end}
            bucket.update(
                _per_base(self.loss_sum[start:end].sum().item(), self.weight_sum[start:end].sum().item())
            )
            bucket["tokens"] = int(self.token_count[start:end].sum())
            buckets.append(bucket)
        total = _per_base(self.loss_sum.sum().item(), self.weight_sum.sum().item())
        return {**total, "tokens": int(self.token_count.sum()), "buckets": buckets}


def _position_label(position: int) -> str:
    for unit, size in (("M", 1 << 20), ("k", 1 << 10)):
        if position >= size and position % size == 0:
            return f"{position // size}{unit}"
    return str(position)


def _bits(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


def format_table(results: dict[str, dict]) -> str:
    """Bits/base table of PositionLoss summaries: a row per position bucket plus "all", a column per model."""
    if not results:
        raise ValueError("format_table needs at least one result")
    names = list(results)
    edges = [[(b["start"], b["end"]) for b in summary["buckets"]] for summary in results.values()]
    if any(e != edges[0] for e in edges):
        raise ValueError(
            f"results {names} have different position buckets; evaluate them with the same seq_len"
        )
    rows = [["positions", *names]]
    for i, (start, end) in enumerate(edges[0]):
        label = f"{_position_label(start)}-{_position_label(end)}"
        rows.append([label, *(_bits(results[name]["buckets"][i]["bits_per_base"]) for name in names)])
    rows.append(["all", *(_bits(results[name]["bits_per_base"]) for name in names)])
    widths = [max(len(row[col]) for row in rows) for col in range(len(rows[0]))]
    lines = ["  ".join(cell.rjust(width) for cell, width in zip(row, widths, strict=True)) for row in rows]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines) + "\n"


def plot_positions(results: dict[str, dict], path: Path, title: str, unit: str = "base") -> None:
    """PNG of bits per token (``unit``: a base of DNA, a residue of protein) against position bucket (log2 x axis,
    bucket midpoints), one line per model."""
    # Imported here because matplotlib is slow to import and only plotting needs it; the object-oriented
    # Agg API draws without touching pyplot's global backend state.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(6.4, 4.0))
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    for name, summary in results.items():
        points = [((b["start"] + b["end"]) / 2, b["bits_per_base"]) for b in summary["buckets"]]
        points = [(x, y) for x, y in points if y is not None]
        axes.plot([x for x, _ in points], [y for _, y in points], marker="o", label=name)
    axes.set_xscale("log", base=2)
    axes.set_xlabel("position in window (bucket midpoint, tokens of preceding context)")
    axes.set_ylabel(f"bits per {unit}")
    axes.set_title(title)
    axes.grid(True, alpha=0.3)
    axes.legend()
    figure.savefig(path, dpi=120, bbox_inches="tight")
