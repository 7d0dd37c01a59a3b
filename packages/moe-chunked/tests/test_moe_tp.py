"""Wrong tensor-parallel MoE layers that core's check (``megaseq_testkit.tensor_parallel``, which the conformance
suite runs on the chunked MoE) must catch: expert blocks that never see the other ranks' rows, and a balance
loss that counts only this rank's chunk (its gradient reaches the wrong tokens)."""

from __future__ import annotations

from typing import Any

import pytest

from megaseq.contracts import ForwardContext
from megaseq.records import ModelDims
from megaseq_moe.config import ChunkedMoEConfig
from megaseq_moe.layer import ChunkedMoE
from megaseq_testkit.tensor_parallel import check_tensor_parallel

pytestmark = pytest.mark.slow  # every test starts gloo ranks

CONFIG = {"n_experts": 4, "top_k": 2, "expert_hidden": 16, "chunk_tokens": 8, "init_std": 0.3, "aux_loss_coef": 0.1}


class UngatheredMoE(ChunkedMoE):
    """Runs its block of the hidden width on its own rows only and never sums the blocks' partial outputs."""

    def _etp_group(self, ctx: ForwardContext) -> Any | None:
        return None


class ChunkCountedMoE(ChunkedMoE):
    """Counts each sequence's assignments over the context-parallel ranks only, not the tensor-parallel ones."""

    def _aux_loss(self, indices, segments, n_segments, affinity_sums, sharing):
        return super()._aux_loss(indices, segments, n_segments, affinity_sums, sharing[:-1])


def build_ungathered(config: dict[str, Any], dims: ModelDims, layer_idx: int) -> ChunkedMoE:
    return UngatheredMoE(ChunkedMoEConfig.model_validate(config), dims, layer_idx)


def build_chunk_counted(config: dict[str, Any], dims: ModelDims, layer_idx: int) -> ChunkedMoE:
    return ChunkCountedMoE(ChunkedMoEConfig.model_validate(config), dims, layer_idx)


@pytest.mark.parametrize(
    ("factory", "message"),
    [(f"{__name__}:build_ungathered", "output"), (f"{__name__}:build_chunk_counted", "input gradient")],
)
def test_wrong_tensor_parallel_moe_layers_are_caught(factory, message):
    with pytest.raises(AssertionError, match=message):
        check_tensor_parallel("moe", "chunked", CONFIG, factory=factory)
