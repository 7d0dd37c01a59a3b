"""A tiny correct feed-forward component and deliberately wrong variants of it, one per conformance check
(built through the suite's ``factory`` knob; see ``test_ffn_suite.py``)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from megaseq.contracts import ForwardContext
from megaseq.records import MemoryEstimate, ModelDims


class ToyFFN(nn.Module):
    """``W2 tanh(W1 x)``, per token."""

    def __init__(self, config: dict[str, Any], dims: ModelDims, layer_idx: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dims.d_model, 2 * dims.d_model)
        self.w2 = nn.Linear(2 * dims.d_model, dims.d_model)

    def hidden(self, x: Tensor) -> Tensor:
        return torch.tanh(self.w1(x))

    def forward(self, x: Tensor, ctx: ForwardContext) -> Tensor:
        return self.w2(self.hidden(x))


class UpcastsOutput(ToyFFN):
    def forward(self, x: Tensor, ctx: ForwardContext) -> Tensor:
        return super().forward(x, ctx).double()


class MixesTokens(ToyFFN):
    """Adds the mean over the sequence: permuting tokens still permutes outputs, one token changes all."""

    def forward(self, x: Tensor, ctx: ForwardContext) -> Tensor:
        return super().forward(x + x.mean(1, keepdim=True), ctx)


class DetachedWeight(ToyFFN):
    """The first layer's weight is used detached."""

    def hidden(self, x: Tensor) -> Tensor:
        return torch.tanh(F.linear(x, self.w1.weight.detach(), self.w1.bias))


class WrongBackward(ToyFFN):
    """A hand-written backward of tanh that forgets the chain rule's factor (1 - tanh^2)."""

    def hidden(self, x: Tensor) -> Tensor:
        return _Tanh.apply(self.w1(x))


class _Tanh(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:  # type: ignore[override]
        return torch.tanh(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:  # type: ignore[override]
        return grad


class GlobalNoise(ToyFFN):
    def forward(self, x: Tensor, ctx: ForwardContext) -> Tensor:
        return super().forward(x, ctx) + 1e-3 * torch.randn_like(x)


class NormalisesWithoutEpsilon(ToyFFN):
    def forward(self, x: Tensor, ctx: ForwardContext) -> Tensor:
        return super().forward(x / x.norm(dim=-1, keepdim=True), ctx)


class ReadsBoundariesEveryLayer(ToyFFN):
    """Reads the document layout afresh in every layer (instead of ``ctx.documents``)."""

    def forward(self, x: Tensor, ctx: ForwardContext) -> Tensor:
        if ctx.cu_seqlens is not None:
            ForwardContext(cu_seqlens=ctx.cu_seqlens).documents  # noqa: B018 - a host read per layer
        return super().forward(x, ctx)


def toy_memory(config: dict[str, Any], dims: ModelDims, seq_len: int) -> MemoryEstimate:
    """``ToyFFN``'s estimate: autograd keeps the input (``w1``'s backward) and ``tanh``'s output (its own
    backward and ``w2``'s), ``d + 2d`` fp32 values per token; backward's working set is the gradients of the
    hidden activations after and before ``tanh``, ``2d + 2d`` per token."""
    return MemoryEstimate(parameters=4 * (4 * dims.d_model**2 + 3 * dims.d_model), saved_per_token=4 * 3 * dims.d_model,
                          temporary=4 * 4 * dims.d_model * seq_len)


def toy_memory_temporary_tenth(config: dict[str, Any], dims: ModelDims, seq_len: int) -> MemoryEstimate:
    """A tenth of ``ToyFFN``'s working set: the estimate of an author who counted one hidden gradient's row."""
    estimate = toy_memory(config, dims, seq_len)
    return MemoryEstimate(parameters=estimate.parameters, saved_per_token=estimate.saved_per_token,
                          temporary=estimate.temporary // 10)


def toy_memory_third(config: dict[str, Any], dims: ModelDims, seq_len: int) -> MemoryEstimate:
    """3x below what autograd keeps (it forgot the hidden activations and half the input)."""
    estimate = toy_memory(config, dims, seq_len)
    return MemoryEstimate(parameters=estimate.parameters, saved_per_token=estimate.saved_per_token / 3)


class StashesInput(ToyFFN):
    """A hand-written second layer that keeps its input on the module for its backward: a second forward
    before the backward overwrites it, so the first forward's weight gradient uses the second's input."""

    def forward(self, x: Tensor, ctx: ForwardContext) -> Tensor:
        h = self.hidden(x)
        self.stash = h.detach()
        return _StashedLinear.apply(h, self.w2.weight, self.w2.bias, self)


class _StashedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, h: Tensor, weight: Tensor, bias: Tensor, module: StashesInput) -> Tensor:  # type: ignore[override]
        ctx.module, ctx.weight = module, weight.detach()
        return F.linear(h, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, Tensor, None]:  # type: ignore[override]
        h = ctx.module.stash
        flat, hflat = grad.reshape(-1, grad.shape[-1]), h.reshape(-1, h.shape[-1])
        return grad @ ctx.weight, flat.t() @ hflat, flat.sum(0), None
