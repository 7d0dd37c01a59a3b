"""The document layout is read to the host once per forward, not once per layer (a device stall each on CUDA).

``cu_seqlens`` is watched (``megaseq_testkit.watch_host_syncs``): every ``.tolist()``, ``.item()``, ``.cpu()``
or Python conversion of it or of a copy of it counts. Three layers share one context; the count must be 1,
the layout's own construction. The chunked path and the context-parallel path are checked here, the Triton
wrapper in test_layer.py (it needs the Triton interpreter in a subprocess).
"""

from __future__ import annotations

import pytest
import torch

from megaseq_kda.testing import host_reads_context_parallel, host_reads_of_layers
from megaseq_testkit.distributed import run_gloo

CONFIG = {"n_heads": 2, "head_dim": 8, "backend": "chunk"}
CU = torch.tensor([0, 3, 3, 40, 70], dtype=torch.int32)


def test_chunked_path_reads_boundaries_once() -> None:
    x = torch.randn(1, 70, 16, generator=torch.Generator().manual_seed(0))
    assert host_reads_of_layers(CONFIG, x, CU, n_layers=3) == 1


@pytest.mark.slow  # gloo processes
def test_context_parallel_path_reads_boundaries_once() -> None:
    x = torch.randn(1, 32, 16, generator=torch.Generator().manual_seed(0))
    cu = torch.tensor([0, 3, 8, 8, 24, 32], dtype=torch.int32)
    assert run_gloo(2, host_reads_context_parallel, CONFIG, x, cu) == [1, 1]
