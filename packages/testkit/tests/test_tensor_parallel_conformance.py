"""The tensor-parallel conformance check (``megaseq_testkit.tensor_parallel``) on core's components, and the
wrong components it must catch."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from megaseq.builtins.config import SDPAConfig
from megaseq.builtins.sdpa import KVCache, SDPAttention
from megaseq.builtins.swiglu import SwiGLU
from megaseq.contracts import ForwardContext
from megaseq.parallel import tp_gather, tp_split
from megaseq.records import ModelDims
from megaseq_testkit.tensor_parallel import check_tensor_parallel

pytestmark = pytest.mark.slow  # every test starts gloo ranks


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


class WholeCacheSDPA(SDPAttention):
    """Splits its heads but keeps a decoding cache for every rank's heads."""

    def __init__(self, d_model: int, config: SDPAConfig, n_layers: int, tp_size: int) -> None:
        super().__init__(d_model, config, n_layers, tp_size)
        self.tp_size = tp_size

    def init_cache(self, batch_size: int, *, device: torch.device, dtype: torch.dtype) -> KVCache:
        empty = torch.zeros(batch_size, self.n_heads * self.tp_size, 0, self.head_dim, device=device, dtype=dtype)
        return KVCache(empty, empty.clone())


def build_whole_cache(config: dict[str, Any], dims: ModelDims, layer_idx: int) -> SDPAttention:
    return WholeCacheSDPA(dims.d_model, SDPAConfig(**config), dims.n_layers, dims.tp_size)


def test_a_decoding_cache_of_every_rank_s_heads_is_caught():
    with pytest.raises(AssertionError, match="the ranks failed"):
        check_tensor_parallel("attention", "sdpa", {"n_heads": 4}, factory=f"{__name__}:build_whole_cache")


def _cross_entropy_rank(rank: int, world: int, logits: Tensor, targets: Tensor, vocab: int) -> dict[str, Tensor]:
    import torch.distributed as dist

    from megaseq.contracts import TensorParallel
    from megaseq.distributed.experts import block
    from megaseq.parallel import vocab_parallel_cross_entropy

    tp = TensorParallel(group=dist.group.WORLD, rank=rank, world_size=world)
    mine = block(logits, 1, rank, world).requires_grad_(True)  # padded past the vocabulary on the last ranks
    losses = vocab_parallel_cross_entropy(mine, targets, tp, vocab)
    (losses * torch.arange(1.0, len(targets) + 1)).sum().backward()
    return {"losses": losses.detach(), "grad": mine.grad}


def test_vocab_parallel_cross_entropy_with_padded_blocks_equals_the_whole_vocabulary():
    """5 ids over 4 ranks: blocks of 2, the third rank holds one real id, the fourth none (all padding)."""
    from megaseq.distributed.experts import block
    from megaseq_testkit import assert_close
    from megaseq_testkit.distributed import run_gloo

    gen = torch.Generator().manual_seed(0)
    logits = 4 * torch.randn(7, 5, generator=gen)
    targets = torch.tensor([0, 4, 2, 3, 1, 4, 0])
    whole = logits.clone().requires_grad_(True)
    expected = torch.nn.functional.cross_entropy(whole, targets, reduction="none")
    (expected * torch.arange(1.0, 8)).sum().backward()
    for rank, got in enumerate(run_gloo(4, _cross_entropy_rank, logits, targets, 5)):
        assert_close(got["losses"], expected.detach(), 1e-6, f"rank {rank} losses")
        assert_close(got["grad"], block(whole.grad, 1, rank, 4), 1e-6, f"rank {rank} logit gradient")


def _unsplit_sequence_rank(rank: int, world: int, x: Tensor, w: Tensor, v: Tensor, grad_out: Tensor) -> dict[str, Tensor]:
    import torch.distributed as dist

    from megaseq.contracts import TensorParallel
    from megaseq.parallel import tp_chunk, tp_reduce_scatter

    tp = TensorParallel(group=dist.group.WORLD, rank=rank, world_size=world, sequence_parallel=False)
    x = tp_chunk(x, tp).clone().requires_grad_(True)  # every rank holds the whole sequence
    w_block = w.chunk(world, 0)[rank].clone().requires_grad_(True)
    v_block = v.chunk(world, 1)[rank].clone().requires_grad_(True)
    out = tp_reduce_scatter(tp_gather(x, tp) @ w_block.t() @ v_block.t(), tp)
    (out * grad_out).sum().backward()
    return {"out": out.detach(), "x_grad": x.grad, "w_grad": w_block.grad, "v_grad": v_block.grad}


def test_the_mappings_without_sequence_parallelism_equal_one_rank_forward_and_backward():
    """Decoding's mode: the gather is the identity (backward: the gradient summed over ranks) and the
    reduce-scatter an all-reduce (backward: the identity), around a column- then row-split product."""
    from megaseq_testkit import assert_close
    from megaseq_testkit.distributed import run_gloo

    gen = torch.Generator().manual_seed(0)
    x, w, v, grad_out = (torch.randn(*shape, generator=gen) for shape in ((1, 5, 4), (6, 4), (4, 6), (1, 5, 4)))
    whole = x.clone().requires_grad_(True)
    w_whole, v_whole = w.clone().requires_grad_(True), v.clone().requires_grad_(True)
    expected = whole @ w_whole.t() @ v_whole.t()
    (expected * grad_out).sum().backward()
    for rank, got in enumerate(run_gloo(2, _unsplit_sequence_rank, x, w, v, grad_out)):
        assert_close(got["out"], expected.detach(), 1e-6, f"rank {rank} output")
        assert_close(got["x_grad"], whole.grad, 1e-6, f"rank {rank} input gradient")
        assert_close(got["w_grad"], w_whole.grad.chunk(2, 0)[rank], 1e-6, f"rank {rank} column block gradient")
        assert_close(got["v_grad"], v_whole.grad.chunk(2, 1)[rank], 1e-6, f"rank {rank} row block gradient")
