"""Context parallelism of the KDA layer on 4 gloo ranks equals one rank, in outputs and all gradients.

The cases (one process group for all of them, since spawning dominates the cost) cover what the suite's
2-rank test does not: batch > 1, document boundaries inside segments, on segment starts and empty documents,
segments shorter than the convolution's history (the halo then spans several segments), the softplus gate.
Tolerance: max abs error <= 1e-5 x max(1, max |reference|) (the suite's ``check_context_parallel``).
"""

from __future__ import annotations

import torch

from megaseq.testing.attention import check_context_parallel
from megaseq_kda.parallel import segment_documents

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


def test_four_ranks_equal_one_rank() -> None:
    gen = torch.Generator().manual_seed(0)
    cases = []
    for config, batch, length, cu in CASES.values():
        x = torch.randn(batch, length, D_MODEL, generator=gen)
        grad_out = torch.randn(batch, length, D_MODEL, generator=gen)
        cases.append((config, x, grad_out, None if cu is None else torch.tensor(cu, dtype=torch.int32)))
    check_context_parallel("kda", D_MODEL, cases, world=4)


def test_segment_documents() -> None:
    cu = torch.tensor([0, 3, 8, 8, 12, 20])
    offsets, continues = segment_documents(cu, 0, 4)  # a document starts at 0, another at 3
    assert offsets.tolist() == [0, 3, 4] and not continues
    offsets, continues = segment_documents(cu, 4, 8)  # continues the document begun at 3
    assert offsets.tolist() == [0, 4] and continues
    offsets, continues = segment_documents(cu, 8, 16)  # an empty document and one starting at 8, one at 12
    assert offsets.tolist() == [0, 4, 8] and not continues
    assert segment_documents(None, 4, 8) == (None, True)
