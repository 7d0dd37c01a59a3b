"""A tiny loop-over-experts MoE that satisfies the contract, and deliberately wrong variants of it (built
through the suite's ``factory`` knob; see ``test_moe_conformance_reference.py``).

The reference MoE deliberately differs from the ``chunked`` plugin (softmax router, GELU experts, no shared
expert), so the suite is checked against more than one way of satisfying the contract.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from megaseq.contracts import ForwardContext
from megaseq.records import ModelDims

N_EXPERTS, TOP_K, HIDDEN = 6, 2, 16


class LoopMoE(nn.Module):
    """Softmax top-k router, renormalised weights, one small GELU MLP per expert, a loop over experts."""

    def __init__(self, config: dict[str, Any], dims: ModelDims, layer_idx: int) -> None:
        super().__init__()
        d = dims.d_model
        self.n_experts, self.top_k, self.chunk_tokens = N_EXPERTS, TOP_K, None
        self.router = nn.Linear(d, N_EXPERTS, bias=False)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(d, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, d)) for _ in range(N_EXPERTS)
        )
        self.last_load: Tensor | None = None

    def route(self, x: Tensor, indices: Tensor | None = None) -> tuple[Tensor, Tensor]:
        probs = self.router(x).softmax(-1)
        if indices is None:
            indices = probs.topk(self.top_k, dim=-1).indices
        chosen = probs.gather(-1, indices)
        return indices, chosen / chosen.sum(-1, keepdim=True)

    def expert_forward(self, expert: int, x: Tensor) -> Tensor:
        return self.experts[expert](x)

    def shared_forward(self, x: Tensor) -> Tensor:
        return torch.zeros_like(x)

    def load_stats(self) -> dict[str, float]:
        if self.last_load is None:
            return {}
        load = self.last_load.double()
        share = load / load.sum()
        return {
            "tokens_per_expert_max": load.max().item(),
            "tokens_per_expert_mean": load.mean().item(),
            "tokens_per_rank_max": load.sum().item(),
            "tokens_per_rank_mean": load.sum().item(),
            "routing_entropy": -(share * share.clamp_min(1e-300).log()).sum().item(),
        }

    def select(self, x: Tensor, ctx: ForwardContext) -> Tensor:
        indices, _ = self.route(x)
        return ctx.routing.route("layer0", indices) if ctx.routing is not None else indices

    def combine(self, x: Tensor, indices: Tensor, weights: Tensor) -> Tensor:
        out = torch.zeros_like(x)
        for e in range(self.n_experts):
            for slot in range(self.top_k):
                rows = (indices[:, slot] == e).nonzero().squeeze(-1)
                out = out.index_add(0, rows, weights[rows, slot, None] * self.experts[e](x[rows]))
        return out

    def forward(self, x: Tensor, ctx: ForwardContext) -> Tensor:
        flat = x.reshape(-1, x.shape[-1])
        indices = self.select(flat, ctx)
        if self.training:
            self.last_load = torch.bincount(indices.reshape(-1), minlength=self.n_experts)
        _, weights = self.route(flat, indices)
        chunks = flat.shape[0] if self.chunk_tokens is None else self.chunk_tokens
        parts = [
            self.combine(*p)
            for p in zip(flat.split(chunks), indices.split(chunks), weights.split(chunks), strict=True)
        ]
        return torch.cat(parts).view_as(x)


class CappedMoE(LoopMoE):
    """Drops the assignments beyond a per-expert capacity: not dropless."""

    def combine(self, x: Tensor, indices: Tensor, weights: Tensor) -> Tensor:
        capacity = x.shape[0] * self.top_k // self.n_experts + 1
        kept = torch.zeros_like(indices, dtype=torch.bool)
        for e in range(self.n_experts):
            positions = (indices == e).nonzero()[:capacity]
            kept[positions[:, 0], positions[:, 1]] = True
        return super().combine(x, indices, weights * kept)


class ReplayIgnoringMoE(LoopMoE):
    """Records its routing but routes by itself when asked to replay."""

    def select(self, x: Tensor, ctx: ForwardContext) -> Tensor:
        indices, _ = self.route(x)
        if ctx.routing is not None and ctx.routing.mode == "record":
            ctx.routing.route("layer0", indices)
        return indices


class DetachedExpertMoE(LoopMoE):
    """Every expert's first weight is used detached, in the forward and in ``expert_forward`` alike: the
    dense reference (built from the module's own functions) agrees, finite differences do not."""

    def expert_forward(self, expert: int, x: Tensor) -> Tensor:
        first, act, second = self.experts[expert]
        return second(act(F.linear(x, first.weight.detach(), first.bias)))

    def combine(self, x: Tensor, indices: Tensor, weights: Tensor) -> Tensor:
        out = torch.zeros_like(x)
        for e in range(self.n_experts):
            for slot in range(self.top_k):
                rows = (indices[:, slot] == e).nonzero().squeeze(-1)
                out = out.index_add(0, rows, weights[rows, slot, None] * self.expert_forward(e, x[rows]))
        return out


class NoisyRouterMoE(LoopMoE):
    """Router jitter drawn from torch's global generator."""

    def route(self, x: Tensor, indices: Tensor | None = None) -> tuple[Tensor, Tensor]:
        indices, weights = super().route(x, indices)
        return indices, weights * (1 + 1e-3 * torch.randn_like(weights))


class NormalisedRouterMoE(LoopMoE):
    """Routes on the token's direction, normalised without epsilon: NaN for an all-zero (padding) token."""

    def route(self, x: Tensor, indices: Tensor | None = None) -> tuple[Tensor, Tensor]:
        return super().route(x / x.norm(dim=-1, keepdim=True), indices)


class IgnoresGivenIndices(LoopMoE):
    """``route(x, indices)`` picks its own experts instead of weighting the given ones."""

    def route(self, x: Tensor, indices: Tensor | None = None) -> tuple[Tensor, Tensor]:
        return super().route(x)


class UnnormalisedForward(LoopMoE):
    """The forward combines with the raw router probabilities, ``route`` renormalises them."""

    def forward(self, x: Tensor, ctx: ForwardContext) -> Tensor:
        flat = x.reshape(-1, x.shape[-1])
        indices = self.select(flat, ctx)
        weights = self.router(flat).softmax(-1).gather(-1, indices)
        return self.combine(flat, indices, weights).view_as(x)


class _HalfGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:  # type: ignore[override]
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:  # type: ignore[override]
        return 0.5 * grad


class WrongBackwardMoE(LoopMoE):
    """A hand-written backward (of the identity, on the combined output) with a mistake."""

    def forward(self, x: Tensor, ctx: ForwardContext) -> Tensor:
        return _HalfGradient.apply(super().forward(x, ctx))


class ChunkCappedMoE(LoopMoE):
    """Scales each chunk's output down when the chunk holds more than 4 tokens (a per-chunk budget): the output
    depends on ``chunk_tokens``."""

    def combine(self, x: Tensor, indices: Tensor, weights: Tensor) -> Tensor:
        return super().combine(x, indices, weights * min(1.0, 4 / x.shape[0]))


class EvalCountsAsLoad(LoopMoE):
    """Counts the load of eval-mode forwards too."""

    def forward(self, x: Tensor, ctx: ForwardContext) -> Tensor:
        out = super().forward(x, ctx)
        if not self.training:
            self.last_load = torch.bincount(self.select(x.reshape(-1, x.shape[-1]), ctx).reshape(-1), minlength=self.n_experts)
        return out


class OverflowingRouter(LoopMoE):
    """Exponentiates sharpened router logits without subtracting their maximum: inf / inf = NaN at large
    inputs."""

    def route(self, x: Tensor, indices: Tensor | None = None) -> tuple[Tensor, Tensor]:
        scores = (10 * self.router(x)).exp()
        probs = scores / scores.sum(-1, keepdim=True)
        if indices is None:
            indices = probs.topk(self.top_k, dim=-1).indices
        chosen = probs.gather(-1, indices)
        return indices, chosen / chosen.sum(-1, keepdim=True)


def softmax_given_weights(module: LoopMoE, x: Tensor, indices: Tensor) -> Tensor:
    """``LoopMoE``'s weights of given experts, written apart from its ``route``: softmax of the router's logits
    at those experts, renormalised over them."""
    logits = x @ module.router.weight.t()
    chosen = torch.exp(logits - logits.logsumexp(-1, keepdim=True)).gather(-1, indices)
    return chosen / chosen.sum(-1, keepdim=True)


class OwnWeightsForGiven(LoopMoE):
    """Given experts from outside, returns the weights of the router's own top-k instead of theirs."""

    def route(self, x: Tensor, indices: Tensor | None = None) -> tuple[Tensor, Tensor]:
        own, weights = super().route(x)
        return (own if indices is None else indices), weights


class LastChunkLoad(LoopMoE):
    """Counts the load chunk by chunk and keeps the last chunk's count only."""

    def forward(self, x: Tensor, ctx: ForwardContext) -> Tensor:
        out = super().forward(x, ctx)
        if self.training and self.chunk_tokens is not None:
            indices, _ = self.route(x.reshape(-1, x.shape[-1])[-self.chunk_tokens :])
            self.last_load = torch.bincount(indices.reshape(-1), minlength=self.n_experts)
        return out
