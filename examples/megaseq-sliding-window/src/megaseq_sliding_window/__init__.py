"""Sliding-window causal attention for megaseq: each query attends to the last ``window`` keys (itself included).

The implementation lives in :mod:`megaseq_sliding_window.layer` and is imported only when a recipe uses it;
importing this package (or its ``plugin`` module) does not import torch.
"""

from megaseq_sliding_window.__about__ import __version__

__all__ = ["__version__"]
