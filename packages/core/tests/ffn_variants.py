"""A tiny correct feed-forward component and deliberately wrong variants of it, one per conformance check
(built through the suite's ``factory`` knob; see ``test_ffn_suite.py``)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from megaseq.contracts import ForwardContext
from megaseq.records import ModelDims


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
