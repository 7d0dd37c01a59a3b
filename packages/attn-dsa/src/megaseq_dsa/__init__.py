"""DeepSeek Sparse Attention for megaseq: the ``dsa`` attention component and its operations.

Importing the package is cheap (the plugin record and config only); ``megaseq_dsa.layer`` holds the module
and ``megaseq_dsa.ops`` the selection and sparse-attention operations.
"""

from megaseq_dsa.__about__ import __version__
from megaseq_dsa.config import DSAConfig

__all__ = ["DSAConfig", "__version__"]
