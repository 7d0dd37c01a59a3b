"""The RL-algorithm conformance suite run on a small PPO-clip/GRPO and a GSPO defined here (built through the
suite's ``factory`` knob), and failing wrong ones.

Each wrong algorithm breaks exactly one promise and is shown to be caught by the check named beside it.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from megaseq_testkit.rl import RLAlgorithmConformance


class GroupNormPPO:
    """GRPO advantages (Bessel std, +1e-6), PPO clip 0.2, token mean; written independently of megaseq-rl."""

    min_group_size = 1
    eps = 0.2

    def __init__(self, config: dict | None = None) -> None:
        self.config = config or {}

    def shape_rewards(self, rewards: Tensor, lengths: Tensor, max_new_tokens: int) -> Tensor:
        return rewards

    def filter(self, rewards: Tensor, truncated: Tensor) -> tuple[Tensor, Tensor]:
        return torch.ones(rewards.shape[0], dtype=torch.bool), torch.ones_like(truncated)

    def advantages(self, rewards: Tensor) -> Tensor:
        if rewards.shape[1] == 1:
            return torch.zeros_like(rewards)
        centred = rewards - rewards.mean(-1, keepdim=True)
        return centred / (rewards.std(-1, keepdim=True) + 1e-6)

    def ratio(self, logprobs: Tensor, old: Tensor) -> Tensor:
        return torch.exp((logprobs - old).clamp(-20, 20))

    def token_loss(self, logprobs: Tensor, old: Tensor, adv: Tensor) -> Tensor:
        rho = self.ratio(logprobs, old)
        return -torch.minimum(rho * adv, rho.clamp(1 - self.eps, 1 + self.eps) * adv)

    def loss(self, logprobs, old_logprobs, advantages, mask, entropy=None):
        zero = torch.zeros((), dtype=logprobs.dtype)
        lp, old, adv = (torch.where(mask, t, zero) for t in (logprobs, old_logprobs, advantages))
        per_token = torch.where(mask, self.token_loss(lp, old, adv), zero)
        loss = per_token.sum() / mask.sum().clamp_min(1)
        metrics = {} if entropy is None else {"entropy": float(entropy[mask].mean())}
        return loss, metrics

    def batch_weight(self, mask: Tensor) -> float:
        return float(mask.sum())


class GSPO(GroupNormPPO):
    """GSPO: one ratio per sequence, ``exp`` of the length-normalised (mean) log-ratio of its tokens, clipped
    to ``[1 - 3e-4, 1 + 4e-4]``; sequences averaged (a row weighs 1 in ``batch_weight``)."""

    eps_low, eps_high = 3e-4, 4e-4

    def sequence_log_ratio(self, log_ratio: Tensor, mask: Tensor) -> Tensor:
        return log_ratio.sum(-1) / mask.sum(-1).clamp_min(1)

    def loss(self, logprobs, old_logprobs, advantages, mask, entropy=None):
        zero = torch.zeros((), dtype=logprobs.dtype)
        log_ratio = torch.where(mask, logprobs - torch.where(mask, old_logprobs, zero), zero)
        rho = torch.exp(self.sequence_log_ratio(log_ratio, mask).clamp(-20, 20))
        adv = torch.where(mask, advantages, zero).sum(-1) / mask.sum(-1).clamp_min(1)
        per_row = -torch.minimum(rho * adv, rho.clamp(1 - self.eps_low, 1 + self.eps_high) * adv)
        rows = mask.any(-1)
        loss = torch.where(rows, per_row, zero).sum() / rows.sum().clamp_min(1)
        metrics = {} if entropy is None else {"entropy": float(entropy[mask].mean())}
        return loss, metrics

    def batch_weight(self, mask: Tensor) -> float:
        return float(mask.any(-1).sum())


class StdEpsilonPPO(GroupNormPPO):
    """Correct, with the common std epsilon of 1e-6, which moves advantages by ~1e-5 under a reward scale."""

    def advantages(self, rewards: Tensor) -> Tensor:
        if rewards.shape[1] == 1:
            return torch.zeros_like(rewards)
        return (rewards - rewards.mean(-1, keepdim=True)) / (rewards.std(-1, keepdim=True) + 1e-6)


class TestReferenceConformance(RLAlgorithmConformance):
    name = "group-norm-ppo"
    factory = f"{__file__}:GroupNormPPO"
    scale_invariant = True


class TestGSPOConformance(RLAlgorithmConformance):
    name = "gspo"
    factory = f"{__file__}:GSPO"
    scale_invariant = True
    clip_range = (3e-4, 4e-4)


class TestStdEpsilonConformance(RLAlgorithmConformance):
    name = "std-epsilon"
    factory = f"{__file__}:StdEpsilonPPO"
    scale_invariant = True


# --- wrong algorithms, each with the check that must catch it --------------------------------------------
class BatchNormalised(GroupNormPPO):
    def advantages(self, rewards):  # normalises over the whole batch, not per group
        return (rewards - rewards.mean()) / (rewards.std() + 1e-6)


class NoEpsilon(GroupNormPPO):
    def advantages(self, rewards):  # 0 / 0 on a group of equal rewards
        return (rewards - rewards.mean(-1, keepdim=True)) / rewards.std(-1, keepdim=True)


class NotCentred(GroupNormPPO):
    def advantages(self, rewards):  # divides by the std but forgets the mean
        return rewards / (rewards.std(-1, keepdim=True) + 1e-6)


class NotScaled(GroupNormPPO):
    def advantages(self, rewards):  # "GRPO" without the division: RLOO-like, not scale invariant
        return rewards - rewards.mean(-1, keepdim=True)


class Reversed(GroupNormPPO):
    def advantages(self, rewards):  # sign flipped: rewards the worst completion
        return -super().advantages(rewards)


class NoSingletonRule(GroupNormPPO):
    def advantages(self, rewards):  # std of one sample is NaN
        return (rewards - rewards.mean(-1, keepdim=True)) / (rewards.std(-1, keepdim=True) + 1e-6)


class MaskAfter(GroupNormPPO):
    def loss(self, logprobs, old_logprobs, advantages, mask, entropy=None):  # NaN * 0 = NaN
        per_token = self.token_loss(logprobs, old_logprobs, advantages) * mask
        return per_token.sum() / mask.sum(), {}


class MeanOverAll(GroupNormPPO):
    def loss(self, logprobs, old_logprobs, advantages, mask, entropy=None):  # padding counts in the mean
        zero = torch.zeros((), dtype=logprobs.dtype)
        lp, old, adv = (torch.where(mask, t, zero) for t in (logprobs, old_logprobs, advantages))
        return self.token_loss(lp, old, adv).mean(), {}

    def batch_weight(self, mask):
        return float(mask.numel())


class Unclamped(GroupNormPPO):
    def ratio(self, logprobs, old):  # exp(1000) = inf
        return torch.exp(logprobs - old)


class SignFlipped(GroupNormPPO):
    def token_loss(self, logprobs, old, adv):
        return -super().token_loss(logprobs, old, adv)


class Unclipped(GroupNormPPO):
    def token_loss(self, logprobs, old, adv):
        return -self.ratio(logprobs, old) * adv


class UnitWeights(GroupNormPPO):
    def batch_weight(self, mask):  # averages micro-batch means: wrong when rows hold different token counts
        return 1.0


class EntropyOverAll(GroupNormPPO):
    def loss(self, logprobs, old_logprobs, advantages, mask, entropy=None):
        loss, _ = super().loss(logprobs, old_logprobs, advantages, mask)
        return loss, {} if entropy is None else {"entropy": float(entropy.mean())}


class DropsEverything(GroupNormPPO):
    def filter(self, rewards, truncated):
        return torch.zeros(rewards.shape[0], dtype=torch.bool), torch.zeros_like(truncated)


class ShapesAcrossGroups(GroupNormPPO):
    def shape_rewards(self, rewards, lengths, max_new_tokens):  # a penalty relative to the batch's longest
        return rewards - (lengths == lengths.max()).to(rewards.dtype)


class ScalarAdvantage(GroupNormPPO):
    def advantages(self, rewards):  # one number per group instead of one per completion
        return super().advantages(rewards).mean(-1, keepdim=True)


class SummedLogRatioGSPO(GSPO):
    def sequence_log_ratio(self, log_ratio, mask):  # GSPO's sequence log-ratio not normalised by the length
        return log_ratio.sum(-1)


class NarrowClip(GroupNormPPO):
    eps = 0.15  # clips tokens at ratio 1.18 that the declared clip_range (0.2) says count


class WideClip(GroupNormPPO):
    eps = 0.25  # lets tokens at ratio 1.22 through that the declared clip_range (0.2) says are clipped


class TooMuchEpsilon(GroupNormPPO):
    def advantages(self, rewards):  # an epsilon that is not small against the std: not scale invariant
        return (rewards - rewards.mean(-1, keepdim=True)) / (rewards.std(-1, keepdim=True) + 1e-2)


@pytest.mark.filterwarnings("ignore:std.*degrees of freedom")
@pytest.mark.parametrize(
    ("wrong", "check"),
    [
        (BatchNormalised, "test_advantages_per_group"),
        (NoEpsilon, "test_equal_rewards_give_zero_advantage"),
        (NotCentred, "test_advantages_shift_invariant"),
        (NotScaled, "test_advantages_scale_invariant"),
        (Reversed, "test_advantages_order_with_rewards"),
        (NoSingletonRule, "test_smallest_group"),
        (MaskAfter, "test_mask_respected"),
        (MeanOverAll, "test_mask_respected"),
        (Unclamped, "test_finite_on_extreme_ratios"),
        (SignFlipped, "test_on_policy_gradient_is_policy_gradient"),
        (Unclipped, "test_clip_edges"),
        (NarrowClip, "test_clip_edges"),
        (WideClip, "test_clip_edges"),
        (TooMuchEpsilon, "test_advantages_scale_invariant"),
        (UnitWeights, "test_micro_batches_recombine"),
        (EntropyOverAll, "test_entropy_metric"),
        (DropsEverything, "test_filter"),
        (ShapesAcrossGroups, "test_shape_rewards"),
        (ScalarAdvantage, "test_advantages_shape_and_finite"),
    ],
    ids=lambda v: v.__name__ if isinstance(v, type) else v,
)
def test_suite_catches_wrong_algorithm(wrong: type, check: str) -> None:
    class Suite(RLAlgorithmConformance):
        name = wrong.__name__
        factory = f"{__file__}:{wrong.__name__}"
        scale_invariant = True

    run = getattr(Suite(), check)
    with pytest.raises(AssertionError):
        run("high") if check == "test_clip_edges" else run()
    if check == "test_clip_edges":  # the low edge too, where the wrong clip acts on both sides
        if wrong is not Unclipped:
            with pytest.raises(AssertionError):
                run("low")


def test_suite_catches_summed_sequence_log_ratio() -> None:
    """GSPO with the summed log-ratio agrees with GSPO at ratio 1 (the on-policy check passes); the clip check
    just inside the edges catches it."""

    class Suite(RLAlgorithmConformance):
        name = "summed-gspo"
        factory = f"{__file__}:SummedLogRatioGSPO"
        clip_range = (3e-4, 4e-4)

    Suite().test_on_policy_gradient_is_policy_gradient()
    for edge in ("high", "low"):
        with pytest.raises(AssertionError, match="inside the"):
            Suite().test_clip_edges(edge)
