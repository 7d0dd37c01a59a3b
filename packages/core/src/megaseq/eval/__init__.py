"""Evaluation helpers: the Markov baseline and loss by context position."""

from megaseq.eval.markov import MarkovBaseline
from megaseq.eval.positions import PositionLoss, bucket_edges, format_table, plot_positions

__all__ = ["MarkovBaseline", "PositionLoss", "bucket_edges", "format_table", "plot_positions"]
