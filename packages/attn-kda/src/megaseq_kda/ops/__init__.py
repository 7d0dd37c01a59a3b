"""KDA operations, in fla's calling convention so implementations can be swapped.

``naive_recurrent_kda`` is the token-loop oracle, ``chunk_kda`` the chunked CPU fast path, and
``kda_affine_map`` / ``kda_transition`` the state map of a segment (final = M S0 + S) without outputs, for
context parallelism.
"""

from megaseq_kda.ops.chunk import chunk_kda
from megaseq_kda.ops.naive import naive_recurrent_kda
from megaseq_kda.ops.transition import kda_affine_map, kda_transition

__all__ = ["chunk_kda", "kda_affine_map", "kda_transition", "naive_recurrent_kda"]
