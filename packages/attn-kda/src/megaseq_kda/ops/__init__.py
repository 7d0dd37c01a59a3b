"""KDA operations, in fla's calling convention so implementations can be swapped.

``naive_recurrent_kda`` is the token-loop oracle, ``chunk_kda`` the chunked CPU fast path.
"""

from megaseq_kda.ops.chunk import chunk_kda
from megaseq_kda.ops.naive import naive_recurrent_kda

__all__ = ["chunk_kda", "naive_recurrent_kda"]
