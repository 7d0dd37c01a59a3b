"""The tensor-parallel conformance check (``megaseq.testing.tensor_parallel``) on core's components, and the
wrong components it must catch."""

from __future__ import annotations

from typing import Any

import pytest
import torch.nn.functional as F
from torch import Tensor

from megaseq.builtins.swiglu import SwiGLU
from megaseq.contracts import ForwardContext
from megaseq.parallel import tp_gather, tp_split
from megaseq.records import ModelDims
from megaseq.testing.tensor_parallel import check_tensor_parallel


@pytest.mark.parametrize(
    ("kind", "name", "config"),
    [("attention", "sdpa", {"n_heads": 4}), ("attention", "sdpa", {"n_heads": 2, "rope": False}),
     ("ffn", "swiglu", {"hidden": 64})],
)
def test_core_components_under_tp2_equal_one_rank(kind, name, config):
    check_tensor_parallel(kind, name, config)


class UnreducedSwiGLU(SwiGLU):
    """Keeps its own hidden block's contribution to its chunk instead of summing every rank's (no reduce)."""

    def forward(self, x: Tensor, ctx: ForwardContext) -> Tensor:
        x = tp_gather(x, ctx.tp) if ctx.tp is not None else x
        out = self.w2(F.silu(self.w1(x)) * self.w3(x))
        return tp_split(out, ctx.tp) if ctx.tp is not None else out


class ChunkOnlySwiGLU(SwiGLU):
    """Splits the hidden width but never gathers the sequence: each rank's block sees only its chunk."""

    def forward(self, x: Tensor, ctx: ForwardContext) -> Tensor:
        from megaseq.parallel import collectives

        out = self.w2(F.silu(self.w1(x)) * self.w3(x))
        return out if ctx.tp is None else collectives.all_gather(out, ctx.tp.group).sum(0)


def build_unreduced(config: dict[str, Any], dims: ModelDims, layer_idx: int) -> SwiGLU:
    return UnreducedSwiGLU(dims.d_model, config["hidden"] // dims.tp_size, out_std=0.02)


def build_chunk_only(config: dict[str, Any], dims: ModelDims, layer_idx: int) -> SwiGLU:
    return ChunkOnlySwiGLU(dims.d_model, config["hidden"] // dims.tp_size, out_std=0.02)


def build_unsplit(config: dict[str, Any], dims: ModelDims, layer_idx: int) -> SwiGLU:
    return SwiGLU(dims.d_model, config["hidden"], out_std=0.02)


@pytest.mark.parametrize(
    ("factory", "message"),
    [
        (f"{__name__}:build_unreduced", "output"),
        (f"{__name__}:build_chunk_only", "output"),
        (f"{__name__}:build_unsplit", "no tensor is split"),
    ],
)
def test_wrong_tensor_parallel_components_are_caught(factory, message):
    with pytest.raises(AssertionError, match=message):
        check_tensor_parallel("ffn", "swiglu", {"hidden": 64}, factory=factory)
