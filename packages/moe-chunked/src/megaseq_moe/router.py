"""Sigmoid router with an auxiliary-loss-free balancing bias (DeepSeek-V3 / GLM style).

Affinity ``s = sigmoid(x W^T)`` per expert (computed in fp32). Each token picks the ``k`` experts with the
largest ``s + b``; the per-expert bias ``b`` only steers the choice, never the weights, which are the chosen
affinities normalised to sum 1, times ``routed_scaling_factor``. After each optimizer step ``b`` moves by a
fixed rate towards balance: ``b_e += rate * sign(mean_load - load_e)``.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from megaseq.dtypes import compute_dtype


class Router(nn.Module):
    def __init__(self, d_model: int, n_experts: int, top_k: int, scaling: float, init_std: float) -> None:
        super().__init__()
        self.top_k = top_k
        self.scaling = scaling
        self.weight = nn.Parameter(torch.randn(n_experts, d_model) * init_std)
        # fp32 buffer, in the state dict so that checkpoints carry the balance; not a parameter (no gradient)
        self.register_buffer("expert_bias", torch.zeros(n_experts, dtype=torch.float32))

    def affinities(self, x: Tensor) -> Tensor:
        """``sigmoid(x W^T)``, ``[N, E]``, in fp32 or wider: routing decisions are sensitive to rounding."""
        dtype = compute_dtype(x.dtype)
        return torch.sigmoid(x.to(dtype) @ self.weight.to(dtype).t())

    def select(self, affinities: Tensor) -> Tensor:
        """Indices ``[N, k]`` of the top-k of ``affinity + bias``."""
        return torch.topk(affinities + self.expert_bias, self.top_k, dim=-1).indices

    def combine_weights(self, affinities: Tensor, indices: Tensor) -> Tensor:
        """Normalised affinities of the chosen experts times the scaling factor, ``[N, k]`` fp32."""
        chosen = affinities.gather(-1, indices)
        return chosen / chosen.sum(-1, keepdim=True) * self.scaling

    @torch.no_grad()
    def update_bias(self, load: Tensor, rate: float) -> None:
        """Nudge the bias of under-loaded experts up and of over-loaded ones down by ``rate``."""
        load = load.float()
        self.expert_bias += rate * torch.sign(load.mean() - load)
