"""Imported once by ``run_gloo``'s fork server (``megaseq_testkit.distributed.PRELOAD``), so that every rank
starts with megatron-core's ``parallel_state`` loaded: every layout's groups come from it, and importing it
costs each rank seconds (tens on a busy 2-core machine). Imported as ``megaseq.distributed.groups`` imports it
(its warnings about Transformer Engine and Apex silenced); without core's ``distributed`` extra it imports
nothing.
"""

from __future__ import annotations

import contextlib

from megaseq.distributed.groups import import_parallel_state
from megaseq.errors import UserError

with contextlib.suppress(UserError):
    import_parallel_state()
