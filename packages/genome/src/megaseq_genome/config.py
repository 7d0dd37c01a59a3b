"""Config schemas of megaseq-genome's components (light: the plugin module imports this when plugins are
listed)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from megaseq.records import ComponentConfig

MAX_MARKOV_ORDER = 12


class MarkovConfig(ComponentConfig):
    """``[baseline.markov]``."""

    order: int = Field(8, ge=0, le=MAX_MARKOV_ORDER, description="bases of context (k of the k-mer model)")


RetrievalK = Literal[12, 16, 20, 32]  # the k-mer lengths the retrieval evaluation measures (megaseq_genome.retrieval.KS)


class RetrievalConfig(ComponentConfig):
    """``[eval_analysis.retrieval]``."""

    reference: str | None = Field(
        None,
        description="label of the baseline whose loss the perfect copier improves on (e.g. 'markov-8'); None: the "
        "scored baseline with the lowest loss on the held-out windows",
    )
    k: RetrievalK = Field(20, description="k-mer length of the printed table and the plot (heldout.json holds every k)")
    bootstrap_samples: int = Field(1000, ge=100, description="resamples of the held-out windows behind each 95% interval")


class ReverseComplementConfig(ComponentConfig):
    """``[data_transform.reverse-complement]``."""

    p: float = Field(0.5, ge=0, le=1, description="probability that a training window is replaced by its reverse complement")


MIN_PLANTED_SEGMENT = 32  # the shortest planted segment, in bases (megaseq_genome.transforms.PlantedRepeats)


class PlantedRepeatsConfig(ComponentConfig):
    """``[data_transform.planted-repeats]``."""

    share: float = Field(0.5, ge=0, le=1, description="share of training windows given a planted repeat (at step 1 "
                         "when annealed)")
    segment: int = Field(256, ge=MIN_PLANTED_SEGMENT, description="longest planted segment in bases (each is 32 to this "
                         "many, at most half the window), copied at least its length further on")
    anneal_from_step: int = Field(
        1, ge=1, description="the last step at the full share when annealed: a copying circuit forms while every "
        "planted window still asks for it",
    )
    anneal_until_step: int | None = Field(
        None, ge=2, description="the share falls linearly from its value at anneal_from_step to 0 at this step, so "
        "that training ends on natural data; None: the same share throughout",
    )
