"""Context parallelism of the KDA layer on 4 gloo ranks equals one rank, in outputs and all gradients.

The cases (one process group for all of them, since spawning dominates the cost) cover what the suite's
2-rank test does not: batch > 1, document boundaries inside segments, on segment starts and empty documents,
segments shorter than the convolution's history (the halo then spans several segments), the softplus gate.
Tolerance: max abs error <= 1e-5 x max(1, max |reference|) (the suite's ``check_context_parallel``).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import megaseq_kda.ops.chunk as chunk_module
from megaseq.contracts import ContextParallel
from megaseq_kda.ops import chunk_kda
from megaseq_kda.parallel import context_parallel_kda
from megaseq_testkit.attention import assert_close, check_context_parallel

D_MODEL = 16
BOUNDED = {"n_heads": 2, "head_dim": 8}
SOFTPLUS = {"n_heads": 2, "head_dim": 8, "gate": "softplus"}

# name -> (config, batch, length, cu_seqlens)
CASES = {
    "batch_2": (BOUNDED, 2, 32, None),
    "docs_inside_segments": (BOUNDED, 1, 32, [0, 3, 17, 32]),
    "docs_on_segment_starts_and_empty": (SOFTPLUS, 1, 32, [0, 8, 8, 12, 32]),
    "one_token_segments": (BOUNDED, 1, 8, None),
    "one_token_segments_packed": (BOUNDED, 1, 8, [0, 2, 5, 8]),
}


@pytest.mark.slow
def test_four_ranks_equal_one_rank() -> None:
    gen = torch.Generator().manual_seed(0)
    cases = []
    for config, batch, length, cu in CASES.values():
        x = torch.randn(batch, length, D_MODEL, generator=gen)
        grad_out = torch.randn(batch, length, D_MODEL, generator=gen)
        cases.append((config, x, grad_out, None if cu is None else torch.tensor(cu, dtype=torch.int32)))
    check_context_parallel("kda", D_MODEL, cases, world=4)


def test_one_backend_pass_per_segment(monkeypatch: pytest.MonkeyPatch) -> None:
    """The backend runs once per local segment (with K more value columns, which carry the segment's state
    map) and nothing else does the intra-chunk work (the gated Gram matrices are built as often as in two
    plain calls; a separate transition pass built them again), and the result equals one pass over the whole
    sequence: one gloo rank, two segments, documents starting inside the first one."""
    gen = torch.Generator().manual_seed(0)
    q, k = (F.normalize(torch.randn(1, 150, 2, 8, generator=gen), dim=-1) for _ in range(2))
    v, g, beta = torch.randn(1, 150, 2, 8, generator=gen), -5 * torch.rand(1, 150, 2, 8), torch.rand(1, 150, 2)
    cu = torch.tensor([0, 40, 41, 150])
    calls, grams = [], []
    kernels = chunk_module.PYTORCH_KERNELS
    counting = dataclasses.replace(kernels, grams=lambda *a: grams.append(1) or kernels.grams(*a))
    monkeypatch.setattr(chunk_module, "PYTORCH_KERNELS", counting)

    def counted(*args, **kwargs):
        calls.append(1)
        return chunk_kda(*args, **kwargs)

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        cp = ContextParallel(group=dist.group.WORLD, rank=0, world_size=1, seq_len=150)
        o = context_parallel_kda(counted, q, k, v, g, beta, cp, cu)
    finally:
        dist.destroy_process_group()
    assert len(calls) == 2
    cp_grams, grams[:] = len(grams), []
    for start, end, offsets in ((0, 75, [0, 40, 41, 75]), (75, 150, [0, 75])):
        chunk_kda(*(x[:, start:end] for x in (q, k, v, g, beta)), cu_seqlens=torch.tensor(offsets))
    assert cp_grams == len(grams) > 0
    assert_close(o, chunk_kda(q, k, v, g, beta, cu_seqlens=cu)[0], 1e-5, "context parallel output")
