"""megaseq memory policies: ``recompute`` (activation recomputation, optionally in sequence tiles) and
``offload`` (saved tensors to pinned host memory on CUDA, to a scratch file on local disk on CPU)."""

from megaseq_offload.__about__ import __version__

__all__ = ["__version__"]
