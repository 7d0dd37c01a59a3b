"""megaseq-genome: the GRCh37 chromosomes as data sources, k-mer Markov baselines and the context-extension
experiment."""

from megaseq_genome.__about__ import __version__

__all__ = ["__version__"]
