"""GRPO, RLOO and DAPO against values computed by hand on small tensors, and the conformance suite."""

from __future__ import annotations

import math

import pytest
import torch

from megaseq_rl.algorithms import DAPO, GRPO, RLOO
from megaseq_rl.config import DAPOConfig, GRPOConfig, RLOOConfig
from megaseq_testkit.rl import RLAlgorithmConformance


class TestGRPOConformance(RLAlgorithmConformance):
    name = "grpo"
    scale_invariant = True


class TestRLOOConformance(RLAlgorithmConformance):
    name = "rloo"


class TestDAPOConformance(RLAlgorithmConformance):
    name = "dapo"
    scale_invariant = True
    clip_range = (0.2, 0.28)


class TestGRPOSeqMeanConformance(RLAlgorithmConformance):
    name = "grpo"
    config = {"loss_agg": "seq-mean-token-mean", "dual_clip": 2.0}
    scale_invariant = True


def test_defaults_are_the_issues():
    assert (GRPOConfig().eps_low, GRPOConfig().eps_high, GRPOConfig().dual_clip, GRPOConfig().loss_agg) == (0.2, 0.2, None, "token-mean")
    assert (RLOOConfig().eps_low, RLOOConfig().eps_high, RLOOConfig().dual_clip, RLOOConfig().loss_agg) == (0.2, 0.2, None, "token-mean")
    d = DAPOConfig()
    assert (d.eps_low, d.eps_high, d.dual_clip, d.loss_agg, d.dynamic_sampling, d.overlong_filter) == (0.2, 0.28, 3.0, "token-mean", True, True)


def test_grpo_advantages_by_hand():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [3.0, 3.0, 3.0, 3.0]], dtype=torch.float64)
    std = math.sqrt((4 * 0.25) / 3)  # Bessel: sum of squared deviations / (n - 1)
    expected = torch.tensor([[0.5, -0.5, -0.5, 0.5], [0.0] * 4], dtype=torch.float64) / (std + 1e-6)
    assert torch.allclose(GRPO(GRPOConfig()).advantages(rewards), expected, atol=1e-12, rtol=0)
    assert torch.equal(GRPO(GRPOConfig()).advantages(torch.tensor([[2.0], [5.0]])), torch.zeros(2, 1))


def test_rloo_advantages_by_hand():
    rewards = torch.tensor([[1.0, 2.0, 6.0]], dtype=torch.float64)
    # A_i = r_i - mean of the others: 1 - 4, 2 - 3.5, 6 - 1.5
    assert torch.allclose(RLOO(RLOOConfig()).advantages(rewards), torch.tensor([[-3.0, -1.5, 4.5]], dtype=torch.float64))
    with pytest.raises(ValueError, match="at least 2"):
        RLOO(RLOOConfig()).advantages(torch.tensor([[1.0]]))


def small_batch():
    """2 rows x 3 tokens, masks [1 1 0] and [1 0 0]; A = +1 (row 0), -2 (row 1); ratios 1.5, 0.9 | 0.5."""
    old = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -1.0, -1.0]], dtype=torch.float64)
    ratios = torch.tensor([[1.5, 0.9, 7.0], [0.5, 3.0, 3.0]], dtype=torch.float64)
    new = (old + ratios.log()).requires_grad_(True)
    adv = torch.tensor([[1.0] * 3, [-2.0] * 3], dtype=torch.float64)
    mask = torch.tensor([[True, True, False], [True, False, False]])
    return new, old, adv, mask


def test_grpo_loss_gradient_and_metrics_by_hand():
    new, old, adv, mask = small_batch()
    loss, metrics = GRPO(GRPOConfig()).loss(new, old, adv, mask)
    # (0,0): rho 1.5 clipped to 1.2 -> -1.2; (0,1): rho 0.9 inside -> -0.9; (1,0): rho 0.5, A -2: max(1.0, 1.6) = 1.6
    assert loss.item() == pytest.approx((-1.2 - 0.9 + 1.6) / 3, abs=1e-12)
    loss.backward()
    # only the unclipped token has a gradient: d(-A rho)/d logprob = -A rho = -0.9, over 3 tokens
    assert torch.allclose(new.grad, torch.tensor([[0.0, -0.3, 0.0], [0.0, 0.0, 0.0]], dtype=torch.float64), atol=1e-12)
    assert metrics["clip_frac_high"] == pytest.approx(1 / 3) and metrics["clip_frac_low"] == pytest.approx(1 / 3)
    assert metrics["clip_frac_dual"] == 0.0
    kl = sum(r - 1 - math.log(r) for r in (1.5, 0.9, 0.5)) / 3
    assert metrics["approx_kl"] == pytest.approx(kl, abs=1e-12)


def test_seq_mean_token_mean_by_hand():
    new, old, adv, mask = small_batch()
    loss, _ = GRPO(GRPOConfig(loss_agg="seq-mean-token-mean")).loss(new, old, adv, mask)
    assert loss.item() == pytest.approx(((-1.2 - 0.9) / 2 + 1.6) / 2, abs=1e-12)


def test_dapo_loss_by_hand():
    new, old, adv, mask = small_batch()
    loss, _ = DAPO(DAPOConfig()).loss(new, old, adv, mask)
    # clip-higher: rho 1.5 clipped to 1.28
    assert loss.item() == pytest.approx((-1.28 - 0.9 + 1.6) / 3, abs=1e-12)


def test_dual_clip_by_hand():
    old = torch.zeros(1, 1, dtype=torch.float64)
    new = torch.full((1, 1), math.log(5.0), dtype=torch.float64, requires_grad=True)
    adv = torch.full((1, 1), -2.0, dtype=torch.float64)
    mask = torch.ones(1, 1, dtype=torch.bool)
    # rho 5, A -2: max(10, 2 x 1.28) = 10, capped at -3 x A = 6
    loss, metrics = DAPO(DAPOConfig()).loss(new, old, adv, mask)
    assert loss.item() == pytest.approx(6.0) and metrics["clip_frac_dual"] == 1.0
    loss.backward()
    assert new.grad.item() == 0.0
    plain, _ = GRPO(GRPOConfig()).loss(new.detach(), old, adv, mask)
    assert plain.item() == pytest.approx(10.0)


def test_dapo_dynamic_sampling_and_overlong_filter():
    rewards = torch.tensor([[1.0, 1.0], [0.0, 1.0], [0.5, 0.5]])
    truncated = torch.tensor([[True, False], [False, False], [False, True]])
    groups, completions = DAPO(DAPOConfig()).filter(rewards, truncated)
    assert groups.tolist() == [False, True, False]
    assert completions.tolist() == [[False, True], [True, True], [True, False]]
    off = DAPO(DAPOConfig(dynamic_sampling=False, overlong_filter=False)).filter(rewards, truncated)
    assert off[0].all() and off[1].all()


def test_dapo_overlong_penalty_by_hand():
    algo = DAPO(DAPOConfig(overlong_buffer=4, overlong_penalty=1.0))
    rewards = torch.zeros(1, 4)
    lengths = torch.tensor([[5, 6, 8, 10]])
    # max 10, buffer 4: no penalty up to 6, then linear to -1 at 10
    assert torch.allclose(algo.shape_rewards(rewards, lengths, 10), torch.tensor([[0.0, 0.0, -0.5, -1.0]]))
    assert torch.equal(DAPO(DAPOConfig()).shape_rewards(rewards, lengths, 10), rewards)


def test_min_group_sizes():
    assert (GRPO(GRPOConfig()).min_group_size, RLOO(RLOOConfig()).min_group_size, DAPO(DAPOConfig()).min_group_size) == (1, 2, 2)
