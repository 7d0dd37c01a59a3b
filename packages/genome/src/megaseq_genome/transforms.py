"""Data transforms of DNA training windows (``megaseq.contracts.DataTransform``): ``reverse-complement``, the
standard augmentation of DNA language models, and ``planted-repeats``, which gives a model copies to learn from.

Both work on a window as its ``T + 1`` bases: a row's inputs and the last target (``inputs[:, :1]`` then the
targets), with the targets' weights carried with their bases, so that every row stays a window and an N target
keeps weight 0 wherever it moves. All draws come from the call's generator, and every row's are made whether
or not the row is changed, so that a share (or an annealed one) never shifts the draws of the other rows.
"""

from __future__ import annotations

import torch
from torch import Tensor

from megaseq.data.tokenizer import N_ID
from megaseq.data.windows import Batch
from megaseq.errors import ConfigError
from megaseq_genome.config import MIN_PLANTED_SEGMENT, PlantedRepeatsConfig, ReverseComplementConfig

COMPLEMENT = torch.tensor([3, 2, 1, 0, N_ID])  # A C G T N -> T G C A N


def _uniform_ints(u: Tensor, low: Tensor | int, high: Tensor | int) -> Tensor:
    """Integers uniform in ``[low, high]`` from uniforms ``u`` in ``[0, 1)`` (float64: exact for any window)."""
    return (low + torch.floor(u * (high - low + 1))).long()


class ReverseComplement:
    """With probability ``p`` a window is replaced by its reverse complement: the genome's other strand read in
    its own direction (A <-> T, C <-> G, N stays, the order reversed).

    The weights are reversed with the bases: the new target at position ``t`` is the window's base ``T - 1 - t``
    and takes that base's weight. The new last target is the window's first base, which the data never scored
    in this window (it is no target of it), so its weight is not known: it gets 0 (not scored) rather than a
    guessed soft-mask weight.
    """

    min_length = 1

    def __init__(self, p: float) -> None:
        self.p = p

    def __call__(self, batch: Batch, *, step: int, generator: torch.Generator) -> Batch:
        chosen = (torch.rand(batch.inputs.shape[0], generator=generator, dtype=torch.float64) < self.p)[:, None]
        window = torch.cat([batch.inputs[:, :1], batch.targets], dim=1)
        flipped = COMPLEMENT.to(window.device)[window.flip(1)]
        # the weight of each base of the window as a target: the first base's is unknown (0)
        base_weights = torch.cat([torch.zeros_like(batch.weights[:, :1]), batch.weights], dim=1)
        window = torch.where(chosen, flipped, window)
        weights = torch.where(chosen, base_weights.flip(1)[:, 1:], batch.weights)
        return Batch(window[:, :-1], window[:, 1:], weights)


class PlantedRepeats:
    """In a share of the windows, a random segment of ``32 .. segment`` bases (at most half the window) is copied
    at least its length further on, its weights with it: the copy is predictable from the first, whatever the
    data around it.

    Segment, distance and place are drawn uniformly, in the window's targets (``T`` bases, each with a known
    weight): a length ``s``, a distance ``d`` in ``[s, T - s]`` and a start ``a`` in ``[0, T - d - s]``; targets
    ``[a + d, a + d + s)`` become a copy of targets ``[a, a + s)`` and the inputs follow (each row a window).
    With ``anneal_until_step`` the share holds its value until ``anneal_from_step`` (step 1 by default), then falls
    linearly to 0 at ``anneal_until_step`` and stays 0, so that a curriculum ends on natural data.
    """

    min_length = 2 * MIN_PLANTED_SEGMENT  # the shortest segment and its copy

    def __init__(self, share: float, segment: int, anneal_until_step: int | None = None, anneal_from_step: int = 1) -> None:
        self.share = share
        self.segment = segment
        self.anneal_until_step = anneal_until_step
        self.anneal_from_step = anneal_from_step

    def share_at(self, step: int) -> float:
        """The share of windows planted at optimizer step ``step`` (from 1)."""
        if self.anneal_until_step is None or step <= self.anneal_from_step:
            return self.share
        span = self.anneal_until_step - self.anneal_from_step
        return self.share * max(0.0, (self.anneal_until_step - step) / span)

    def __call__(self, batch: Batch, *, step: int, generator: torch.Generator) -> Batch:
        rows, length = batch.targets.shape
        u = torch.rand(rows, 4, generator=generator, dtype=torch.float64)
        planted = u[:, 0] < self.share_at(step)
        seg = _uniform_ints(u[:, 1], MIN_PLANTED_SEGMENT, min(self.segment, length // 2))
        distance = _uniform_ints(u[:, 2], seg, length - seg)
        start = _uniform_ints(u[:, 3], 0, length - distance - seg)
        j = torch.arange(length)
        copy_to = planted[:, None] & (j >= (start + distance)[:, None]) & (j < (start + distance + seg)[:, None])
        source = torch.where(copy_to, j - distance[:, None], j)  # the copy's sources lie before it: d >= s
        targets = batch.targets.gather(1, source)
        return Batch(torch.cat([batch.inputs[:, :1], targets[:, :-1]], dim=1), targets, batch.weights.gather(1, source))


def build_reverse_complement(config: ReverseComplementConfig) -> ReverseComplement:
    return ReverseComplement(config.p)


def build_planted_repeats(config: PlantedRepeatsConfig) -> PlantedRepeats:
    if config.anneal_until_step is None:
        if config.anneal_from_step != 1:
            raise ConfigError(f"anneal_from_step {config.anneal_from_step}: there is no anneal_until_step (the step "
                              "the share reaches 0); allowed: anneal_from_step only with anneal_until_step")
    elif config.share == 0:
        raise ConfigError(f"anneal_until_step {config.anneal_until_step}: share is 0, there is nothing to anneal; "
                          "allowed: a share above 0, or no anneal_until_step")
    elif config.anneal_from_step >= config.anneal_until_step:
        raise ConfigError(f"anneal_from_step {config.anneal_from_step}: must be before anneal_until_step "
                          f"{config.anneal_until_step}")
    return PlantedRepeats(config.share, config.segment, config.anneal_until_step, config.anneal_from_step)
