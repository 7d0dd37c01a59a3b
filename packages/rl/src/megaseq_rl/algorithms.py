"""GRPO, RLOO and DAPO with the definitions of verl and SkyRL, so that results compare.

Advantages, per group of n completions of one prompt (rewards r [G, n]):

    grpo:  A_i = (r_i - mean(r)) / (std(r) + 1e-6)      std with Bessel's correction; a group of one gives 0
    rloo:  A_i = r_i - mean_{j != i} r_j = n / (n - 1) * (r_i - mean(r))           needs n >= 2

Policy loss per token, with ratio rho = exp(logprobs - old_logprobs) and advantage A:

    l = max(-rho * A, -clip(rho, 1 - eps_low, 1 + eps_high) * A)       (= -min(rho A, clip(rho) A))
    dual clip c (A < 0 only):  l = min(l, -c * A)

Aggregation: ``token-mean`` = sum of l over every unmasked token of the batch / their count;
``seq-mean-token-mean`` = mean over sequences (with at least one unmasked token) of each one's token mean.

Numerics: the log-ratio is clamped to [-20, 20] before exp (as verl does): identical for |log-ratio| < 20,
finite and gradient-free beyond, so a stale or diverged policy cannot produce inf. Masked tokens are
replaced by zeros before any arithmetic, so NaN or inf held in padding never reaches the loss or the
gradient (``x * mask`` would turn NaN into NaN).

Metrics: ``clip_frac_low`` (A < 0 and rho < 1 - eps_low: the lower clip binds), ``clip_frac_high`` (A > 0
and rho > 1 + eps_high), ``clip_frac_dual`` (the dual-clip cap binds), ``approx_kl`` (Schulman's k3
estimate of KL(old || new): mean of (rho - 1) - log rho, >= 0), ``entropy`` when given; all means over
unmasked tokens.

DAPO (defaults eps 0.2/0.28, dual clip 3, token mean) adds dynamic sampling (groups whose rewards are all
equal carry no gradient: dropped, and the RL loop draws new prompts), overlong filtering (truncated
completions contribute no tokens) and the soft overlong penalty: with buffer b and length limit L,
a completion of length l gets ``penalty * clamp(((L - b) - l) / b, -1, 0)`` added to its reward.
"""

from __future__ import annotations

import torch
from torch import Tensor

from megaseq_rl.config import DAPOConfig, GRPOConfig, PolicyLossConfig, RLOOConfig

LOG_RATIO_LIMIT = 20.0


def grpo_advantages(rewards: Tensor) -> Tensor:
    if rewards.shape[-1] == 1:
        return torch.zeros_like(rewards)
    centred = rewards - rewards.mean(-1, keepdim=True)
    return centred / (rewards.std(-1, keepdim=True) + 1e-6)


def rloo_advantages(rewards: Tensor) -> Tensor:
    n = rewards.shape[-1]
    if n < 2:
        raise ValueError(f"rloo needs at least 2 completions per prompt, got {n}")
    others = (rewards.sum(-1, keepdim=True) - rewards) / (n - 1)
    return rewards - others


def policy_loss_per_token(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, config: PolicyLossConfig
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-token loss ``l``, the ratio ``rho`` and the clipped-only loss (before the dual clip)."""
    log_ratio = (logprobs - old_logprobs).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    rho = log_ratio.exp()
    unclipped = -advantages * rho
    clipped = -advantages * rho.clamp(1 - config.eps_low, 1 + config.eps_high)
    loss = torch.maximum(unclipped, clipped)
    if config.dual_clip is None:
        return loss, rho, loss
    capped = torch.minimum(loss, -config.dual_clip * advantages)
    return torch.where(advantages < 0, capped, loss), rho, loss


def aggregate(per_token: Tensor, mask: Tensor, how: str) -> Tensor:
    if how == "token-mean":
        return per_token.sum() / mask.sum().clamp_min(1)
    counts = mask.sum(-1)
    rows = counts > 0
    per_row = per_token.sum(-1) / counts.clamp_min(1)
    return per_row[rows].sum() / rows.sum().clamp_min(1)


class PolicyGradient:
    """The shared part of the algorithms: clipped policy loss, aggregation, metrics, micro-batch weights."""

    min_group_size = 1

    def __init__(self, config: PolicyLossConfig) -> None:
        self.config = config

    def shape_rewards(self, rewards: Tensor, lengths: Tensor, max_new_tokens: int) -> Tensor:
        return rewards

    def filter(self, rewards: Tensor, truncated: Tensor) -> tuple[Tensor, Tensor]:
        return torch.ones(rewards.shape[0], dtype=torch.bool, device=rewards.device), torch.ones_like(truncated, dtype=torch.bool)

    def advantages(self, rewards: Tensor) -> Tensor:
        raise NotImplementedError

    def loss(
        self, logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, entropy: Tensor | None = None
    ) -> tuple[Tensor, dict[str, float]]:
        mask = mask.bool()
        zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
        lp, old, adv = (torch.where(mask, t.to(logprobs.dtype), zero) for t in (logprobs, old_logprobs, advantages))
        per_token, rho, before_dual = policy_loss_per_token(lp, old, adv, self.config)
        per_token = torch.where(mask, per_token, zero)
        loss = aggregate(per_token, mask, self.config.loss_agg)
        with torch.no_grad():
            n = mask.sum().clamp_min(1)
            frac = lambda hit: float((hit & mask).sum() / n)  # noqa: E731
            c = self.config
            log_ratio = (lp - old).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
            metrics = {
                "clip_frac_low": frac((adv < 0) & (rho < 1 - c.eps_low)),
                "clip_frac_high": frac((adv > 0) & (rho > 1 + c.eps_high)),
                "clip_frac_dual": frac((adv < 0) & (before_dual > -c.dual_clip * adv)) if c.dual_clip else 0.0,
                "approx_kl": float(torch.where(mask, rho - 1 - log_ratio, zero).sum() / n),
            }
            if entropy is not None:
                metrics["entropy"] = float(torch.where(mask, entropy.to(logprobs.dtype), zero).sum() / n)
        return loss, metrics

    def batch_weight(self, mask: Tensor) -> float:
        if self.config.loss_agg == "token-mean":
            return float(mask.sum())
        return float((mask.sum(-1) > 0).sum())


class GRPO(PolicyGradient):
    def advantages(self, rewards: Tensor) -> Tensor:
        return grpo_advantages(rewards)


class RLOO(PolicyGradient):
    min_group_size = 2

    def advantages(self, rewards: Tensor) -> Tensor:
        return rloo_advantages(rewards)


class DAPO(GRPO):
    """GRPO advantages with clip-higher, dual clip, dynamic sampling and overlong filtering/penalty."""

    min_group_size = 2  # a group of one always has equal rewards: dynamic sampling would drop every group

    config: DAPOConfig

    def shape_rewards(self, rewards: Tensor, lengths: Tensor, max_new_tokens: int) -> Tensor:
        buffer = self.config.overlong_buffer
        if buffer == 0:
            return rewards
        if buffer > max_new_tokens:
            raise ValueError(f"dapo: overlong_buffer {buffer} exceeds max_new_tokens {max_new_tokens}")
        over = ((max_new_tokens - buffer) - lengths.to(rewards.dtype)) / buffer
        return rewards + self.config.overlong_penalty * over.clamp(-1, 0)

    def filter(self, rewards: Tensor, truncated: Tensor) -> tuple[Tensor, Tensor]:
        groups, completions = super().filter(rewards, truncated)
        if self.config.dynamic_sampling:
            groups = rewards.amax(-1) > rewards.amin(-1)
        if self.config.overlong_filter:
            completions = ~truncated.bool()
        return groups, completions


def build_grpo(config: GRPOConfig) -> GRPO:
    return GRPO(config)


def build_rloo(config: RLOOConfig) -> RLOO:
    return RLOO(config)


def build_dapo(config: DAPOConfig) -> DAPO:
    return DAPO(config)
