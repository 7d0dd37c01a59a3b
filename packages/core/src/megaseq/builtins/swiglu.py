"""Dense SwiGLU feed-forward: ``W2 (silu(W1 x) * W3 x)``.

Tensor parallelism: a rank holds ``hidden / tp`` of the hidden width (rows of ``w1`` and ``w3``, columns of
``w2``); it gathers the sequence chunks and reduce-scatters its partial output
(``megaseq.contracts.TensorParallel``)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from megaseq.contracts import ForwardContext
from megaseq.parallel import tp_gather, tp_reduce_scatter
from megaseq.records import MemoryEstimate, ModelDims

from .config import SwiGLUConfig


def hidden_size(config: SwiGLUConfig, dims: ModelDims) -> int:
    if config.hidden is not None:
        return config.hidden
    return -(-8 * dims.d_model // 3 // 64) * 64


class SwiGLU(nn.Module):
    def __init__(self, d_model: int, hidden: int, out_std: float) -> None:
        super().__init__()
        self.w1 = nn.Linear(d_model, hidden, bias=False)
        self.w3 = nn.Linear(d_model, hidden, bias=False)
        self.w2 = nn.Linear(hidden, d_model, bias=False)
        for w in (self.w1, self.w3):
            nn.init.normal_(w.weight, std=0.02)
        nn.init.normal_(self.w2.weight, std=out_std)

    def forward(self, x: Tensor, ctx: ForwardContext) -> Tensor:
        if ctx.tp is None:
            return self.w2(_SiLUGate.apply(self.w1(x), self.w3(x)))
        x = tp_gather(x, ctx.tp)
        return tp_reduce_scatter(self.w2(_SiLUGate.apply(self.w1(x), self.w3(x))), ctx.tp)


class _SiLUGate(torch.autograd.Function):
    """``silu(a) * b`` keeping only a and b for backward (silu(a) is recomputed there); plain autograd would also
    keep silu(a). Backward runs the operations autograd would (so the gradients are bitwise autograd's), with
    at most two hidden-wide temporaries besides the incoming gradient."""

    @staticmethod
    def forward(ctx: Any, a: Tensor, b: Tensor) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(a, b)
        return F.silu(a) * b

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor]:  # type: ignore[override]
        a, b = ctx.saved_tensors
        grad_a = torch.ops.aten.silu_backward(grad * b, a)
        return grad_a, F.silu(a).mul_(grad)


def build(config: SwiGLUConfig, dims: ModelDims, layer_idx: int) -> SwiGLU:
    # residual-branch outputs shrink with depth so the residual stream's variance stays O(1) at init
    hidden = hidden_size(config, dims)
    if hidden % dims.tp_size:
        raise ValueError(f"ffn.swiglu: hidden width {hidden} is not a multiple of tp {dims.tp_size}")
    return SwiGLU(dims.d_model, hidden // dims.tp_size, out_std=0.02 / (2 * dims.n_layers) ** 0.5)


def memory_estimate(config: SwiGLUConfig, dims: ModelDims, seq_len: int) -> MemoryEstimate:
    hidden = hidden_size(config, dims)
    if hidden % dims.tp_size:
        raise ValueError(f"ffn.swiglu: hidden width {hidden} is not a multiple of tp {dims.tp_size}")
    h = hidden // dims.tp_size  # this rank's, over the gathered sequence under tensor parallelism
    # saved for backward per token (fp32, measured with saved-tensor hooks): the input, the w1 and w3 outputs
    # and their gated product (w2's input); silu(w1 x) is recomputed in backward. Temporary: backward's
    # gradients of a hidden-wide tensor and of two model-wide ones, over the whole call (measured, 4k-64k tokens)
    return MemoryEstimate(
        parameters=3 * dims.d_model * h * 4,
        saved_per_token=(dims.d_model + 3 * h) * 4,
        temporary=(h + 2 * dims.d_model) * 4 * seq_len,
    )
