"""The ``dsa`` layer passes core's attention conformance suite in every mode that changes its code path.

Sizes make the interesting cases happen: topk 8 < 48 tokens (queries really choose), pooled keys with a tail,
the decoupled rotary part, the dense warm-up (SDPA per document), and topk above the length (dense through the
sparse op). The suite's context-parallel test (two gloo ranks, ~20 s per spawn here) runs for the main
configuration; test_parallel.py checks the other configurations on four ranks in one spawn. Tensor parallelism
(two ranks) runs with 4 query and 4 indexer heads, two of each per rank, so that a rank's partial indexer
scores sum more than one head.
"""

from typing import Any, ClassVar

from megaseq_testkit.attention import AttentionConformance
from megaseq_testkit.tensor_parallel import check_tensor_parallel

SMALL = {"n_heads": 3, "head_dim": 8, "q_lora_rank": 12, "kv_lora_rank": 8, "index_heads": 2, "index_dim": 8}


class DSAConformance(AttentionConformance):
    def test_tensor_parallel(self) -> None:
        check_tensor_parallel("attention", self.name, {**self.config, "n_heads": 4, "index_heads": 4}, self.d_model,
                              tolerance=self.tolerance)


class TestSparseTopk(DSAConformance):
    name = "dsa"
    config: ClassVar[dict[str, Any]] = {**SMALL, "topk": 8}


class TestSparsePooledRope(DSAConformance):
    name = "dsa"
    config: ClassVar[dict[str, Any]] = {**SMALL, "topk": 8, "index_pool": 4, "rope": True, "rope_dim": 4}
    test_context_parallel = None  # in test_parallel.py, with the other configurations


class TestDenseWarmup(DSAConformance):
    name = "dsa"
    config: ClassVar[dict[str, Any]] = {
        **SMALL,
        "mode": "dense_warmup",
        "rope": True,
        "rope_dim": 4,
        "freeze_main_in_warmup": False,
    }
    test_context_parallel = None  # in test_parallel.py, with the other configurations


class TestShortSequenceIsDense(DSAConformance):
    name = "dsa"
    config: ClassVar[dict[str, Any]] = {**SMALL, "topk": 64}
    test_context_parallel = None  # in test_parallel.py, with the other configurations
