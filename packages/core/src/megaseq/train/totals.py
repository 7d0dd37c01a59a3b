"""What one optimizer step saw, summed on each rank and reduced over ranks once.

The rules (each makes every process layout log what the single process logs):

- ``loss``: each rank's LM loss is its share of the global micro-batch's weighted mean (normalised by
  the global batch's weight), so the shares are summed; the step's loss is the mean over micro-batches.
- auxiliary losses (``ForwardContext.add_loss``) are means over the rows a replica holds; under context
  parallelism each rank holds a share that adds up to its replica's value (the contract). So they are
  summed over all ranks and divided by the number of data-parallel replicas, then averaged over
  micro-batches.
- metrics (``ForwardContext.log``) are means: every value reported under one name in a step (one per
  layer, per micro-batch, per rank) counts once, and the step's value is their mean. Components report
  means over their own tokens; all ranks hold equally many tokens, so this is the single-process mean.
- ``tokens``: tokens actually processed, summed over ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from megaseq.contracts import ForwardContext


@dataclass
class StepTotals:
    """Sums of a step's micro-batches on this rank. The values the device produced (losses, logged tensors) stay
    tensors until :meth:`reduce` reads them all at once: one host synchronisation per step, not one per
    micro-batch and value."""

    loss: Tensor | float = 0.0
    tokens: int = 0
    aux: dict[str, Tensor | float] = field(default_factory=dict)
    metric_sums: dict[str, Tensor | float] = field(default_factory=dict)
    metric_counts: dict[str, int] = field(default_factory=dict)

    def add(self, loss_share: Tensor, tokens: int, ctx: ForwardContext) -> None:
        """One micro-batch on this rank: its LM loss share, tokens processed, and what the components reported."""
        self.loss = self.loss + loss_share.detach().double()  # summed in float64, as the host would
        self.tokens += tokens
        for name, value in ctx.losses.items():
            self.aux[name] = self.aux.get(name, 0.0) + value.detach().double()
        for name, mean in ctx.metrics.items():
            count = ctx.metric_counts[name]
            self.metric_sums[name] = self.metric_sums.get(name, 0.0) + _detached(mean) * count
            self.metric_counts[name] = self.metric_counts.get(name, 0) + count

    def reduce(self, sum_over_ranks, dp: int, micro_batches: int) -> tuple[float, int, dict[str, float], dict[str, float]]:
        """``(loss, tokens, aux losses, metrics)`` of the whole step, from one sum over all ranks.

        ``sum_over_ranks`` sums a tensor over the ranks in place; every rank must have reported the same names.
        """
        aux, metrics = sorted(self.aux), sorted(self.metric_sums)
        values = [
            self.loss,
            self.tokens,
            *(self.aux[n] for n in aux),
            *(self.metric_sums[n] for n in metrics),
            *(self.metric_counts[n] for n in metrics),
        ]
        device = next((v.device for v in values if isinstance(v, Tensor)), torch.device("cpu"))
        packed = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=device) for v in values])
        values = sum_over_ranks(packed).tolist()
        loss, tokens, rest = values[0] / micro_batches, round(values[1]), values[2:]
        aux_losses = {n: v / (dp * micro_batches) for n, v in zip(aux, rest, strict=False)}
        sums, counts = rest[len(aux) : len(aux) + len(metrics)], rest[len(aux) + len(metrics) :]
        means = {n: s / c for n, s, c in zip(metrics, sums, counts, strict=True)}
        return loss, tokens, aux_losses, means


def _detached(value: Tensor | float) -> Tensor | float:
    return value.detach().double() if isinstance(value, Tensor) else value
