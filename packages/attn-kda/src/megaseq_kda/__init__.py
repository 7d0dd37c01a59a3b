"""Kimi Delta Attention for megaseq: the ``kda`` attention component (``megaseq_kda.layer``), its operations
(``megaseq_kda.ops``), backend dispatch and exact context parallelism.

Kept free of imports: the plugin entry point (``megaseq_kda.plugin``) loads this package when plugins
are listed.
"""

from megaseq_kda.__about__ import __version__

__all__ = ["__version__"]
