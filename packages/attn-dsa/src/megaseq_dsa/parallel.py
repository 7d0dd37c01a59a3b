"""Context parallelism for DSA over a zig-zag shard (see ``megaseq.contracts.ContextParallel``).

Every query may select any earlier key of the whole sequence, so each rank all-gathers the per-token key
tensors (the latent key/value with its rotary part, and the index key) and keeps its queries local at their
global positions. The gather is ``torch.distributed.nn.functional.all_gather``: autograd-aware, and on gloo
its backward emulates reduce-scatter by all-to-all (which gloo has), so every key's gradient, summed over the
ranks whose queries used it, returns to the rank that owns the token.
"""

from __future__ import annotations

import torch.distributed.nn.functional as dist_fn
from torch import Tensor

from megaseq.contracts import ContextParallel
from megaseq.parallel import zigzag_unshard


def gather_sequence(local: Tensor, cp: ContextParallel) -> Tensor:
    """The whole sequence ``[B, seq_len, ...]`` in global order from every rank's zig-zag share ``local``."""
    return zigzag_unshard(list(dist_fn.all_gather(local.contiguous(), group=cp.group)), dim=1)
