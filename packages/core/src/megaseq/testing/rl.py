"""Conformance suite for RL algorithms (see ``megaseq.contracts.RLAlgorithm``).

Subclass :class:`RLAlgorithmConformance` in a pytest module and set ``name`` and ``config``; the tests build
the algorithm through the installed plugins (override :meth:`RLAlgorithmConformance.build` for one that is
not a plugin). Class flags describe what the algorithm promises beyond the contract:
``shift_invariant`` (adding a constant to a group's rewards leaves its advantages unchanged: GRPO, RLOO,
DAPO), ``scale_invariant`` (so does multiplying them by a positive constant: GRPO, DAPO) and ``clipped``
(PPO-style trust region: a token whose ratio is far outside the clip range on the side its advantage
pushes gets no gradient). Every check here has a deliberately wrong algorithm in core's own tests
(``packages/core/tests/test_rl_conformance_reference.py``) that it catches.

Tolerances: losses and gradients are compared in float64 to ``atol`` (default 1e-10).
"""

from __future__ import annotations

import itertools
from typing import Any, ClassVar

import pytest
import torch
from torch import Tensor

from megaseq.contracts import RLAlgorithm

GROUPS, GROUP_SIZE, TOKENS = 5, 4, 7


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


class RLAlgorithmConformance:
    """Base class of an RL algorithm's conformance tests."""

    name: ClassVar[str]
    config: ClassVar[dict[str, Any]] = {}
    shift_invariant: ClassVar[bool] = True
    scale_invariant: ClassVar[bool] = False
    clipped: ClassVar[bool] = True
    atol: ClassVar[float] = 1e-10

    def build(self) -> Any:
        from megaseq.testing import installed_plugins

        provided = installed_plugins().get("rl_algorithm", self.name)
        return provided.load()(provided.spec.config(**self.config))

    # -- inputs ---------------------------------------------------------------------------------------
    def rewards(self, seed: int = 0, groups: int = GROUPS, size: int | None = None) -> Tensor:
        size = size or max(GROUP_SIZE, self.build().min_group_size)
        return torch.rand(groups, size, generator=_gen(seed), dtype=torch.float64)

    def batch(self, seed: int = 0, spread: float = 0.3) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """``logprobs`` (a float64 leaf), ``old_logprobs``, ``advantages`` and a ragged ``mask``, ``[B, T]``."""
        b = GROUPS * GROUP_SIZE
        g = _gen(seed)
        old = -torch.rand(b, TOKENS, generator=g, dtype=torch.float64) * 3
        new = (old + spread * torch.randn(b, TOKENS, generator=g, dtype=torch.float64)).requires_grad_(True)
        adv = torch.randn(b, 1, generator=g, dtype=torch.float64).expand(b, TOKENS).contiguous()
        lengths = torch.randint(1, TOKENS + 1, (b,), generator=g)
        mask = torch.arange(TOKENS)[None, :] < lengths[:, None]
        return new, old, adv, mask

    def loss_and_grad(self, algo: Any, new: Tensor, old: Tensor, adv: Tensor, mask: Tensor) -> tuple[Tensor, Tensor, dict]:
        leaf = new.detach().clone().requires_grad_(True)
        loss, metrics = algo.loss(leaf, old, adv, mask)
        loss.backward()
        return loss.detach(), leaf.grad, metrics

    # -- the contract ---------------------------------------------------------------------------------
    def test_protocol(self) -> None:
        algo = self.build()
        assert isinstance(algo, RLAlgorithm), f"{type(algo).__name__} does not implement megaseq.contracts.RLAlgorithm"
        assert isinstance(algo.min_group_size, int) and algo.min_group_size >= 1

    def test_advantages_shape_and_finite(self) -> None:
        algo = self.build()
        rewards = self.rewards()
        adv = algo.advantages(rewards)
        assert adv.shape == rewards.shape, f"advantages {tuple(adv.shape)} for rewards {tuple(rewards.shape)}"
        assert adv.is_floating_point() and torch.isfinite(adv).all()

    def test_advantages_per_group(self) -> None:
        """A group's advantages do not depend on the other groups of the batch."""
        algo = self.build()
        rewards = self.rewards()
        together = algo.advantages(rewards)
        for g in range(rewards.shape[0]):
            alone = algo.advantages(rewards[g : g + 1])
            assert torch.allclose(together[g : g + 1], alone, atol=self.atol, rtol=0), f"group {g} depends on others"

    def test_equal_rewards_give_zero_advantage(self) -> None:
        """A group whose completions all scored the same carries no signal: advantages exactly 0, not NaN."""
        algo = self.build()
        size = max(GROUP_SIZE, algo.min_group_size)
        rewards = torch.tensor([[0.0] * size, [1.0] * size, [-3.5] * size], dtype=torch.float64)
        adv = algo.advantages(rewards)
        assert torch.isfinite(adv).all(), f"equal rewards gave non-finite advantages {adv.tolist()}"
        assert (adv == 0).all(), f"equal rewards gave non-zero advantages {adv.tolist()}"

    def test_smallest_group(self) -> None:
        algo = self.build()
        rewards = self.rewards(size=algo.min_group_size)
        adv = algo.advantages(rewards)
        assert adv.shape == rewards.shape and torch.isfinite(adv).all()

    def test_advantages_shift_invariant(self) -> None:
        if not self.shift_invariant:
            pytest.skip(f"{self.name} declares shift_invariant = False")
        algo = self.build()
        rewards = self.rewards()
        shifted = algo.advantages(rewards + 7.25)
        assert torch.allclose(shifted, algo.advantages(rewards), atol=1e-9, rtol=0), "advantages moved with a reward shift"

    def test_advantages_scale_invariant(self) -> None:
        if not self.scale_invariant:
            pytest.skip(f"{self.name} declares scale_invariant = False")
        algo = self.build()
        rewards = self.rewards()
        scaled = algo.advantages(rewards * 3.0)
        assert torch.allclose(scaled, algo.advantages(rewards), atol=1e-5, rtol=0), "advantages moved with a reward scale"

    def test_advantages_order_with_rewards(self) -> None:
        """Within a group, a better completion never gets a smaller advantage."""
        algo = self.build()
        rewards = self.rewards()
        adv = algo.advantages(rewards)
        order = rewards.argsort(-1)
        assert (adv.gather(-1, order).diff(dim=-1) >= -1e-12).all(), "a higher reward got a lower advantage"

    def test_loss_is_finite_scalar(self) -> None:
        algo = self.build()
        loss, metrics = algo.loss(*self.batch())
        assert loss.dim() == 0 and torch.isfinite(loss), f"loss {loss}"
        assert all(isinstance(v, float) for v in metrics.values()), f"metrics must be floats: {metrics}"

    def test_mask_respected(self) -> None:
        """Masked tokens may hold anything, even inf and NaN: neither the loss nor any gradient sees them."""
        algo = self.build()
        new, old, adv, mask = self.batch()
        loss, grad, _ = self.loss_and_grad(algo, new, old, adv, mask)
        junk = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e30])
        fill = junk[torch.arange(mask.numel()) % 4].view_as(mask).to(new.dtype)
        loss2, grad2, _ = self.loss_and_grad(
            algo, torch.where(mask, new.detach(), fill), torch.where(mask, old, fill.flip(0)), torch.where(mask, adv, fill), mask
        )
        assert torch.isfinite(loss2), f"masked junk reached the loss: {loss2}"
        assert torch.allclose(loss2, loss, atol=self.atol, rtol=0), "masked tokens changed the loss"
        assert torch.isfinite(grad2).all() and (grad2[~mask] == 0).all(), "masked tokens got a gradient"
        assert torch.allclose(grad2, grad, atol=self.atol, rtol=0), "masked tokens changed the gradient"
        # more padding (masked columns) must not matter either: a loss that counts padding would shrink
        pad = lambda t, v: torch.cat([t, torch.full((t.shape[0], 5), v, dtype=t.dtype)], 1)  # noqa: E731
        loss3, grad3, _ = self.loss_and_grad(algo, pad(new.detach(), 0.0), pad(old, 0.0), pad(adv, 1.0), pad(mask, False))
        assert torch.allclose(loss3, loss, atol=self.atol, rtol=0), "padding columns changed the loss"
        assert torch.allclose(grad3[:, : mask.shape[1]], grad, atol=self.atol, rtol=0), "padding changed the gradient"

    def test_finite_on_extreme_ratios(self) -> None:
        """Log-ratios of +-50 and +-1000 (a stale or diverged policy) give a finite loss and gradient."""
        algo = self.build()
        new, old, adv, mask = self.batch()
        for delta in (50.0, -50.0, 1000.0, -1000.0):
            signs = torch.where(torch.arange(new.shape[0])[:, None] % 2 == 0, 1.0, -1.0).to(new.dtype)
            loss, grad, _ = self.loss_and_grad(algo, old + delta, old, adv * signs, mask)
            assert torch.isfinite(loss), f"log-ratio {delta}: loss {loss}"
            assert torch.isfinite(grad).all(), f"log-ratio {delta}: non-finite gradient"

    def test_on_policy_gradient_is_policy_gradient(self) -> None:
        """At ratio 1 the gradient w.r.t. each token's log-probability is ``-w * A`` with one weight ``w > 0``
        per row (the aggregation), i.e. minimising the loss raises tokens with positive advantage."""
        algo = self.build()
        _, old, adv, mask = self.batch()
        _, grad, _ = self.loss_and_grad(algo, old, old, adv, mask)
        weight = torch.where(mask, -grad / adv, float("nan"))
        for row in range(mask.shape[0]):
            w = weight[row][mask[row]]
            assert (w > 0).all(), f"row {row}: gradient does not push along the advantage: {w.tolist()}"
            assert torch.allclose(w, w[0].expand_as(w), rtol=1e-9, atol=0), f"row {row}: unequal token weights"

    def test_clipped_tokens_get_no_gradient(self) -> None:
        if not self.clipped:
            pytest.skip(f"{self.name} declares clipped = False")
        algo = self.build()
        _, old, adv, mask = self.batch()
        pos = adv.abs()
        # ratio e^3 ~ 20 with A > 0 and e^-3 ~ 0.05 with A < 0: outside any clip range on the pushing side
        for delta, a in ((3.0, pos), (-3.0, -pos)):
            _, grad, _ = self.loss_and_grad(algo, old + delta, old, a, mask)
            assert (grad == 0).all(), f"log-ratio {delta}: clipped tokens still get gradient {grad.abs().max():.3e}"

    def test_micro_batches_recombine(self) -> None:
        """``batch_weight`` lets a batch split into micro-batches of rows give exactly the full batch's loss."""
        algo = self.build()
        new, old, adv, mask = self.batch()
        full, _ = algo.loss(new.detach(), old, adv, mask)
        for cuts in ((0, 3, 11, 20), (0, 1, 20), (0, 10, 20)):
            total, weights = 0.0, 0.0
            for a, b in itertools.pairwise(cuts):
                part, _ = algo.loss(new.detach()[a:b], old[a:b], adv[a:b], mask[a:b])
                w = algo.batch_weight(mask[a:b])
                total, weights = total + w * float(part), weights + w
            assert abs(total / weights - float(full)) <= 1e-9, f"micro-batches {cuts} give {total / weights}, full {float(full)}"

    def test_entropy_metric(self) -> None:
        """Given per-token entropy, ``metrics['entropy']`` is its mean over the unmasked tokens."""
        algo = self.build()
        new, old, adv, mask = self.batch()
        ent = torch.rand(mask.shape, generator=_gen(4), dtype=torch.float64)
        ent[~mask] = 1e6
        _, metrics = algo.loss(new.detach(), old, adv, mask, entropy=ent)
        assert "entropy" in metrics, f"no 'entropy' metric: {sorted(metrics)}"
        assert abs(metrics["entropy"] - float(ent[mask].mean())) < 1e-9

    def test_filter(self) -> None:
        algo = self.build()
        rewards = self.rewards()
        truncated = torch.zeros_like(rewards, dtype=torch.bool)
        groups, completions = algo.filter(rewards, truncated)
        assert groups.shape == rewards.shape[:1] and groups.dtype == torch.bool
        assert completions.shape == rewards.shape and completions.dtype == torch.bool
        assert groups.all() and completions.all(), "groups with distinct rewards and no truncation were dropped"

    def test_shape_rewards(self) -> None:
        """Shaping keeps the shape, stays finite, and treats each completion on its own."""
        algo = self.build()
        rewards = self.rewards()
        lengths = torch.randint(1, 33, rewards.shape, generator=_gen(5))
        shaped = algo.shape_rewards(rewards, lengths, 32)
        assert shaped.shape == rewards.shape and torch.isfinite(shaped).all()
        for g in range(rewards.shape[0]):
            alone = algo.shape_rewards(rewards[g : g + 1], lengths[g : g + 1], 32)
            assert torch.equal(alone, shaped[g : g + 1]), "shaping of one group depends on the others"


__all__ = ["RLAlgorithmConformance"]
