"""Context parallelism of the DSA layer on 4 gloo ranks equals one rank: outputs, input gradients, parameter
gradients (summed over ranks) and the indexer loss (its per-rank shares summed), with the loss in the backward.
Each rank's selection must run with its local queries only (T / world of them) over the T gathered keys.

All configurations run in one process group, since spawning dominates the cost; the suite's 2-rank test runs
the plain sparse configuration in test_conformance.py. Tolerance: max abs error <= 1e-5 x max(1, max |ref|).
"""

from __future__ import annotations

import pytest
import torch

from megaseq_dsa.testing import context_parallel_cases
from megaseq_testkit.attention import check_context_parallel
from megaseq_testkit.distributed import run_gloo

D_MODEL = 16
SMALL = {"n_heads": 3, "head_dim": 8, "q_lora_rank": 12, "kv_lora_rank": 8, "index_heads": 2, "index_dim": 8}
ROPE = {"rope": True, "rope_dim": 4}

# name -> (config, batch, length, cu_seqlens)
CASES = {
    "sparse_batch_2": ({**SMALL, "topk": 8}, 2, 32, None),
    "sparse_pooled_rope_packed": ({**SMALL, **ROPE, "topk": 8, "index_pool": 4}, 1, 32, [0, 3, 17, 32]),
    "dense_warmup_rope_packed": (
        {**SMALL, **ROPE, "mode": "dense_warmup", "freeze_main_in_warmup": False},
        1,
        32,
        [0, 8, 8, 13, 32],
    ),
    "short_is_dense_packed": ({**SMALL, "topk": 64}, 1, 16, [0, 5, 16]),
}


@pytest.mark.slow
def test_four_ranks_equal_one_rank() -> None:
    gen = torch.Generator().manual_seed(0)
    cases = []
    for config, batch, length, cu in CASES.values():
        x = torch.randn(batch, length, D_MODEL, generator=gen)
        grad_out = torch.randn(batch, length, D_MODEL, generator=gen)
        cases.append((config, x, grad_out, None if cu is None else torch.tensor(cu, dtype=torch.int32)))
    world = 4
    results = run_gloo(world, context_parallel_cases, cases)
    check_context_parallel("dsa", D_MODEL, cases, world, results=results)
    for case_index, (name, (config, x, _, _)) in enumerate(zip(CASES, cases, strict=True)):
        length = x.shape[1]
        # Local queries over the gathered keys: O(T_local x T) selection work per rank.
        want = [] if config.get("mode") == "dense_warmup" else [(length // world, length)]
        for rank in range(world):
            assert results[rank][case_index]["selections"] == want, f"{name} rank {rank} selection shapes"
