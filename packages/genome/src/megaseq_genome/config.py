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
