"""Conformance suite for baselines (see ``megaseq.contracts.Baseline``).

Subclass :class:`BaselineConformance` in a pytest module and set ``name`` and ``config``; the tests build the
baseline through the installed plugins, fitted on ``train`` (a data source or FASTA path; default the
``excerpt-chr20`` excerpt shipped with core). Override :meth:`BaselineConformance.build` for one that is not
a plugin. Every check here has a deliberately wrong baseline in core's own tests
(``packages/testkit/tests/test_baseline_conformance.py``) that it catches.

Tolerance: losses are compared relative to their size, ``tolerance`` (default 1e-6) times max(1, |loss|).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor

from megaseq.contracts import Baseline
from megaseq.data.tokenizer import N_ID

ROWS, LENGTH = 3, 97  # an odd length: no power-of-two block boundary lines up with the window


class BaselineConformance:
    """Base class of a baseline's conformance tests."""

    name: ClassVar[str]
    config: ClassVar[dict[str, Any]] = {}
    train: ClassVar[str] = "excerpt-chr20"
    tolerance: ClassVar[float] = 1e-6

    def build(self) -> Any:
        from megaseq_testkit import installed_plugins

        provided = installed_plugins().get("baseline", self.name)
        return provided.load()(provided.spec.config(**self.config), self.train)

    # -- inputs ---------------------------------------------------------------------------------------
    def windows(self, seed: int = 0, n_runs: bool = True) -> tuple[Tensor, Tensor]:
        """``inputs`` and ``targets`` ``[ROWS, LENGTH]`` cut from random bases (targets = inputs shifted by
        one), with a run of N in the middle of the first row when ``n_runs``."""
        g = torch.Generator().manual_seed(seed)
        window = torch.randint(0, 4, (ROWS, LENGTH + 1), generator=g)
        window[:, 40:60] = window[:, 10:30]  # a repeat: baselines that copy get something to copy
        if n_runs:
            window[0, 70:74] = N_ID
        return window[:, :-1].contiguous(), window[:, 1:].contiguous()

    def losses(self, baseline: Any, inputs: Tensor, targets: Tensor) -> Tensor:
        out = baseline.token_losses(inputs, targets)
        assert isinstance(out, Tensor) and out.shape == targets.shape, (
            f"token_losses returned {type(out).__name__} {getattr(out, 'shape', '')}, expected a tensor {tuple(targets.shape)}"
        )
        return out.double()

    def assert_equal(self, a: Tensor, b: Tensor, what: str) -> None:
        limit = self.tolerance * torch.clamp(torch.maximum(a.abs(), b.abs()), min=1.0)
        worst = ((a - b).abs() - limit).max().item()
        assert worst <= 0, f"{what}: losses differ by up to {(a - b).abs().max().item():.3g}"

    # -- the contract ---------------------------------------------------------------------------------
    def test_protocol(self) -> None:
        baseline = self.build()
        assert isinstance(baseline, Baseline), f"{type(baseline).__name__} does not implement megaseq.contracts.Baseline"
        assert isinstance(baseline.label, str) and baseline.label, "label must be a non-empty string (its results column)"

    def test_losses_finite_non_negative_and_zero_on_n(self) -> None:
        inputs, targets = self.windows()
        out = self.losses(self.build(), inputs, targets)
        assert out.dtype.is_floating_point and torch.isfinite(out).all(), "losses must be finite floats"
        assert (out >= 0).all(), f"losses are nats, never negative (min {out.min().item():.3g})"
        is_n = targets == N_ID
        assert is_n.any() and (out[is_n] == 0).all(), "a target that is N must have loss 0"
        assert (out[~is_n] > 0).any(), "every loss is 0: nothing was predicted"

    def test_a_distribution_over_bases(self) -> None:
        """At every position, the probabilities of the four bases (exp(-loss) with each as the target) sum
        to 1: a baseline claims no more certainty than it has."""
        baseline = self.build()
        inputs, _ = self.windows(n_runs=False)
        total = sum(torch.exp(-self.losses(baseline, inputs, torch.full_like(inputs, base))) for base in range(4))
        self.assert_equal(total, torch.ones_like(total), "sum over A, C, G, T of p(base)")

    def test_causal(self) -> None:
        """The target at p is predicted from inputs[:, :p + 1] only: changing the inputs from position j on
        (not the targets) leaves every loss before j unchanged."""
        baseline = self.build()
        inputs, targets = self.windows()
        before = self.losses(baseline, inputs, targets)
        for j in (1, 37, LENGTH - 1):
            changed = inputs.clone()
            changed[:, j:] = (changed[:, j:] + 1) % 4
            after = self.losses(baseline, changed, targets)
            self.assert_equal(after[:, :j], before[:, :j], f"losses before position {j} after changing inputs from {j} on")

    def test_rows_independent(self) -> None:
        """Each window is scored on its own: a row's losses do not depend on the other rows of the batch."""
        baseline = self.build()
        inputs, targets = self.windows()
        whole = self.losses(baseline, inputs, targets)
        for row in range(ROWS):
            alone = self.losses(baseline, inputs[row : row + 1], targets[row : row + 1])
            self.assert_equal(alone[0], whole[row], f"row {row} alone vs in the batch")

    def test_deterministic(self) -> None:
        inputs, targets = self.windows()
        first = self.losses(self.build(), inputs, targets)
        self.assert_equal(self.losses(self.build(), inputs, targets), first, "two builds, the same windows")
