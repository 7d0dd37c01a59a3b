"""Triton kernels for KDA. Importing this subpackage imports triton; nothing else in megaseq_kda does."""

from .chunk import chunk_kda_triton

__all__ = ["chunk_kda_triton"]
