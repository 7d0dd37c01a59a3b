"""Config schemas of megaseq-genome's components (light: the plugin module imports this when plugins are
listed)."""

from __future__ import annotations

from pydantic import Field

from megaseq.records import ComponentConfig

MAX_MARKOV_ORDER = 12


class MarkovConfig(ComponentConfig):
    """``[baseline.markov]``."""

    order: int = Field(8, ge=0, le=MAX_MARKOV_ORDER, description="bases of context (k of the k-mer model)")
