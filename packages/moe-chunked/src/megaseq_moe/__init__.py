"""megaseq-moe-chunked: the ``chunked`` mixture-of-experts strategy for megaseq.

The layer lives in ``megaseq_moe.layer`` (``ChunkedMoE``, ``build``, ``memory_estimate``); this package
root stays light because listing plugins imports it.
"""

from megaseq_moe.__about__ import __version__
from megaseq_moe.config import ChunkedMoEConfig

__all__ = ["ChunkedMoEConfig", "__version__"]
