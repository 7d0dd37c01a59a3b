"""Conformance suite for RL algorithms (see ``megaseq.contracts.RLAlgorithm``).

Subclass :class:`RLAlgorithmConformance` in a pytest module and set ``name`` and ``config``; the tests build
the algorithm through the installed plugins, or from ``factory`` (``"module:attr"`` or
``"/path/file.py:attr"`` of a ``build(config_dict)``) for one that is not an installed plugin. Class knobs
describe what the algorithm promises beyond the contract: ``shift_invariant`` (adding a constant to a
group's rewards leaves its advantages unchanged: GRPO, RLOO, DAPO), ``scale_invariant`` (so does multiplying
them by a positive constant: GRPO, DAPO) and ``clip_range`` (``(eps_low, eps_high)`` of a PPO-style trust
region: a token whose ratio is outside ``[1 - eps_low, 1 + eps_high]`` on the side its advantage pushes gets
no gradient, one inside does; ``None`` for an algorithm without one). Every check has a deliberately wrong
algorithm in the kit's own tests (``packages/testkit/tests/test_rl_conformance_reference.py``) that it catches.

The clip check moves every token of a row by the same log-ratio, just inside and just outside each clip edge
(10% of the clip range either side), so a token-level ratio and a sequence-level one (GSPO's length-normalised
log-ratio) are the same number there, and a sequence ratio built from the summed log-ratio lands far outside.

Tolerances: losses and gradients are compared in float64 to ``tolerance`` (default 1e-10) times
``max(1, magnitude)``; the shift and scale invariance of advantages to ``invariance_tolerance`` (default
1e-4) relative to the largest advantage, since an epsilon beside a standard deviation moves advantages by
about ``eps / std`` of themselves when rewards are scaled.
"""

from __future__ import annotations

import itertools
from typing import Any, ClassVar

import pytest
import torch
from torch import Tensor

from megaseq.contracts import RLAlgorithm


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


class RLAlgorithmConformance:
    """Base class of an RL algorithm's conformance tests (the knobs are documented in megaseq_testkit)."""

    name: ClassVar[str]
    config: ClassVar[dict[str, Any]] = {}
    factory: ClassVar[str | None] = None
    shift_invariant: ClassVar[bool] = True
    scale_invariant: ClassVar[bool] = False
    clip_range: ClassVar[tuple[float, float] | None] = (0.2, 0.2)
    tolerance: ClassVar[float] = 1e-10
    invariance_tolerance: ClassVar[float] = 1e-4
    groups: ClassVar[int] = 5
    group_size: ClassVar[int] = 4
    tokens: ClassVar[int] = 7

    def build(self) -> Any:
        from megaseq_testkit import installed_plugins, load_factory

        if self.factory is not None:
            return load_factory(self.factory)(dict(self.config))
        provided = installed_plugins().get("rl_algorithm", self.name)
        return provided.load()(provided.spec.config(**self.config))

    def close(self, actual: Tensor | float, expected: Tensor | float, what: str) -> None:
        """``|actual - expected| <= tolerance * max(1, |expected|)``, elementwise maximum."""
        actual, expected = torch.as_tensor(actual, dtype=torch.float64), torch.as_tensor(expected, dtype=torch.float64)
        err = (actual - expected).abs().max().item() if expected.numel() else 0.0
        scale = max(1.0, expected.abs().max().item() if expected.numel() else 0.0)
        assert err <= self.tolerance * scale, f"{self.name}: {what}: error {err:.3e} > {self.tolerance:.1e} x {scale:.3e}"

    # -- inputs ---------------------------------------------------------------------------------------
    def rewards(self, seed: int = 0, groups: int | None = None, size: int | None = None) -> Tensor:
        groups = groups or self.groups
        size = size or max(self.group_size, self.build().min_group_size)
        return torch.rand(groups, size, generator=_gen(seed), dtype=torch.float64)

    def batch(self, seed: int = 0, spread: float = 0.3) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """``logprobs`` (a float64 leaf), ``old_logprobs``, ``advantages`` and a ragged ``mask``, ``[B, T]``."""
        b, t = self.groups * self.group_size, self.tokens
        g = _gen(seed)
        old = -torch.rand(b, t, generator=g, dtype=torch.float64) * 3
        new = (old + spread * torch.randn(b, t, generator=g, dtype=torch.float64)).requires_grad_(True)
        adv = torch.randn(b, 1, generator=g, dtype=torch.float64).expand(b, t).contiguous()
        lengths = torch.randint(1, t + 1, (b,), generator=g)
        mask = torch.arange(t)[None, :] < lengths[:, None]
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
            self.close(alone, together[g : g + 1], f"advantages of group {g} alone vs in the batch (depends on others?)")

    def test_equal_rewards_give_zero_advantage(self) -> None:
        """A group whose completions all scored the same carries no signal: advantages exactly 0, not NaN."""
        algo = self.build()
        size = max(self.group_size, algo.min_group_size)
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
        self.assert_invariant(algo.advantages(rewards + 7.25), algo.advantages(rewards), "a reward shift of 7.25")

    def test_advantages_scale_invariant(self) -> None:
        if not self.scale_invariant:
            pytest.skip(f"{self.name} declares scale_invariant = False")
        algo = self.build()
        rewards = self.rewards()
        self.assert_invariant(algo.advantages(rewards * 3.0), algo.advantages(rewards), "a reward scale of 3")

    def assert_invariant(self, moved: Tensor, base: Tensor, what: str) -> None:
        err = (moved - base).abs().max().item()
        bound = self.invariance_tolerance * base.abs().max().item()
        assert err <= bound, f"{self.name}: advantages moved by {err:.3e} with {what} (bound {bound:.3e}: invariance_tolerance x max |A|)"

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
        self.close(loss2, loss, "loss with junk in masked tokens")
        assert torch.isfinite(grad2).all() and (grad2[~mask] == 0).all(), "masked tokens got a gradient"
        self.close(grad2, grad, "gradient with junk in masked tokens")
        # more padding (masked columns) must not matter either: a loss that counts padding would shrink
        pad = lambda t, v: torch.cat([t, torch.full((t.shape[0], 5), v, dtype=t.dtype)], 1)  # noqa: E731
        loss3, grad3, _ = self.loss_and_grad(algo, pad(new.detach(), 0.0), pad(old, 0.0), pad(adv, 1.0), pad(mask, False))
        self.close(loss3, loss, "loss with padding columns")
        self.close(grad3[:, : mask.shape[1]], grad, "gradient with padding columns")

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

    @pytest.mark.parametrize("edge", ["high", "low"])
    def test_clip_edges(self, edge: str) -> None:
        """Every token of a row at the same ratio just inside a clip edge on the side its advantage pushes (ratio
        above 1 with A > 0, below 1 with A < 0) gets a gradient along the advantage; just outside, none."""
        if self.clip_range is None:
            pytest.skip(f"{self.name} declares clip_range = None")
        algo = self.build()
        _, old, adv, mask = self.batch()
        eps_low, eps_high = self.clip_range
        eps, sign = (eps_high, 1.0) if edge == "high" else (eps_low, -1.0)
        a = sign * adv.abs()
        for side, factor in (("inside", 0.9), ("outside", 1.1)):
            ratio = 1 + sign * factor * eps
            _, grad, _ = self.loss_and_grad(algo, old + torch.log(torch.tensor(ratio, dtype=old.dtype)), old, a, mask)
            where = f"ratio {ratio:.4g}, {side} the {edge} clip edge {1 + sign * eps:.4g}"
            if side == "outside":
                assert (grad == 0).all(), f"{self.name}: {where}: tokens still get gradient {grad.abs().max():.3e}"
                continue
            pushed = (-grad * a.sign())[mask]
            assert (pushed > 0).all(), (
                f"{self.name}: {where}: {int((pushed <= 0).sum())} of {int(mask.sum())} tokens get no gradient along "
                "their advantage (a clip range narrower than clip_range, or a sequence ratio from a summed log-ratio)"
            )

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
            self.close(total / weights, float(full), f"micro-batches {cuts} recombined vs the full batch")

    def test_entropy_metric(self) -> None:
        """Given per-token entropy, ``metrics['entropy']`` is its mean over the unmasked tokens."""
        algo = self.build()
        new, old, adv, mask = self.batch()
        ent = torch.rand(mask.shape, generator=_gen(4), dtype=torch.float64)
        ent[~mask] = 1e6
        _, metrics = algo.loss(new.detach(), old, adv, mask, entropy=ent)
        assert "entropy" in metrics, f"no 'entropy' metric: {sorted(metrics)}"
        self.close(metrics["entropy"], float(ent[mask].mean()), "metrics['entropy'] vs the mean over unmasked tokens")

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
