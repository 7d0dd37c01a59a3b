"""Evaluation helpers: loss by context position, for the model and its baselines."""

from megaseq.eval.positions import PositionLoss, bucket_edges, format_table, plot_positions

__all__ = ["PositionLoss", "bucket_edges", "format_table", "plot_positions"]
