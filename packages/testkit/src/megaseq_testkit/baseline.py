"""Conformance suite for baselines (see ``megaseq.contracts.Baseline``).

Subclass :class:`BaselineConformance` in a pytest module and set ``name`` and ``config``; the tests build the
baseline through the installed plugins, fitted on ``train`` (a data source or FASTA path; default the
``excerpt-chr20`` excerpt shipped with core), and score windows of random letters of ``train``'s alphabet.
``factory`` names a builder ``build(config_dict, train)`` to test instead of an installed baseline; or override
:meth:`BaselineConformance.build`. Every check here has a deliberately wrong baseline in the kit's own tests
(``packages/testkit/tests/test_baseline_conformance.py``) that it catches.

The checks: the protocol and a label; float64 losses, finite and non-negative, 0 on unknown (N) targets; a
distribution over the alphabet's letters at every position; causality (neither a later input nor any target
but the scored one changes a loss); rows scored independently; two builds agreeing; the record declaring the
alphabet it is tested on.

Tolerance: losses are compared relative to their size, ``tolerance`` (default 1e-6) times max(1, |value|).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor

from megaseq.alphabets import Alphabet
from megaseq.contracts import Baseline
from megaseq.data.sources import Corpus

ROWS, LENGTH = 3, 97  # an odd length: no power-of-two block boundary lines up with the window


class BaselineConformance:
    """Base class of a baseline's conformance tests."""

    name: ClassVar[str]
    config: ClassVar[dict[str, Any]] = {}
    factory: ClassVar[str | None] = None
    train: ClassVar[str] = "excerpt-chr20"
    tolerance: ClassVar[float] = 1e-6

    def plugins(self) -> Any:
        from megaseq_testkit import installed_plugins

        return installed_plugins()

    def corpus(self) -> Corpus:
        """``train`` as the evaluation hands it to the baseline."""
        return Corpus(self.train, plugins=self.plugins())

    @property
    def alphabet(self) -> Alphabet:
        return self.corpus().alphabet

    def build(self) -> Any:
        if self.factory is not None:
            from megaseq_testkit import load_factory

            return load_factory(self.factory)(dict(self.config), self.corpus())
        provided = self.plugins().get("baseline", self.name)
        return provided.load()(provided.spec.config(**self.config), self.corpus())

    # -- inputs ---------------------------------------------------------------------------------------
    def windows(self, seed: int = 0, n_runs: bool = True) -> tuple[Tensor, Tensor]:
        """``inputs`` and ``targets`` ``[ROWS, LENGTH]`` cut from random letters (targets = inputs shifted by
        one), with a run of the unknown symbol in the middle of the first row when ``n_runs``."""
        g = torch.Generator().manual_seed(seed)
        window = torch.randint(0, len(self.alphabet.letters), (ROWS, LENGTH + 1), generator=g)
        window[:, 40:60] = window[:, 10:30]  # a repeat: baselines that copy get something to copy
        if n_runs:
            window[0, 70:74] = self.alphabet.unknown_id
        return window[:, :-1].contiguous(), window[:, 1:].contiguous()

    def losses(self, baseline: Any, inputs: Tensor, targets: Tensor) -> Tensor:
        out = baseline.token_losses(inputs, targets)
        assert isinstance(out, Tensor) and out.shape == targets.shape, (
            f"token_losses returned {type(out).__name__} {getattr(out, 'shape', '')}, expected a tensor {tuple(targets.shape)}"
        )
        assert out.dtype == torch.float64, f"token_losses returned {out.dtype}; the contract is float64 losses"
        return out

    def assert_equal(self, actual: Tensor, expected: Tensor, what: str, quantity: str = "loss") -> None:
        """Each ``quantity`` of ``actual`` within ``tolerance x max(1, |expected|)`` of ``expected``."""
        bound = self.tolerance * torch.clamp(expected.abs(), min=1.0)
        excess = (actual - expected).abs() - bound
        worst = int(excess.argmax())
        if excess.flatten()[worst] > 0:
            at = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), excess.shape))
            got, want = actual.flatten()[worst].item(), expected.flatten()[worst].item()
            raise AssertionError(
                f"{what}: the {quantity} at {at} is {got:.10g}, expected {want:.10g} (off by {abs(got - want):.3g}; "
                f"allowed: tolerance {self.tolerance:g} x max(1, |{want:.4g}|) = {bound.flatten()[worst].item():.3g})"
            )

    # -- the contract ---------------------------------------------------------------------------------
    def test_protocol(self) -> None:
        baseline = self.build()
        assert isinstance(baseline, Baseline), f"{type(baseline).__name__} does not implement megaseq.contracts.Baseline"
        assert isinstance(baseline.label, str) and baseline.label, "label must be a non-empty string (its results column)"

    def test_handles_the_alphabet(self) -> None:
        """The record declares the alphabet the suite scores it on (a recipe in another is refused)."""
        if self.factory is not None or type(self).build is not BaselineConformance.build:
            return  # built without a record: its author declares the alphabets when registering it
        alphabets = self.plugins().get("baseline", self.name).spec.alphabets
        assert self.alphabet.name in alphabets, (
            f"{self.name}: tested on {self.alphabet.name} ({self.train}) but its record declares alphabets "
            f"{sorted(alphabets)}"
        )

    def test_losses_finite_non_negative_and_zero_on_n(self) -> None:
        inputs, targets = self.windows()
        out = self.losses(self.build(), inputs, targets)
        assert torch.isfinite(out).all(), "losses must be finite"
        assert (out >= 0).all(), f"losses are nats, never negative (min {out.min().item():.3g})"
        unknown = targets == self.alphabet.unknown_id
        assert unknown.any() and (out[unknown] == 0).all(), f"a target that is {self.alphabet.unknown} must have loss 0"
        assert (out[~unknown] > 0).any(), "every loss is 0: nothing was predicted"

    def test_a_distribution_over_letters(self) -> None:
        """At every position, the probabilities of the alphabet's letters (exp(-loss) with each as the target)
        sum to 1: a baseline claims no more certainty than it has."""
        baseline = self.build()
        inputs, _ = self.windows(n_runs=False)
        total = sum(
            torch.exp(-self.losses(baseline, inputs, torch.full_like(inputs, letter)))
            for letter in range(len(self.alphabet.letters))
        )
        self.assert_equal(total, torch.ones_like(total), f"sum over {' '.join(self.alphabet.letters)} of p(letter)",
                          "sum of probabilities")

    def test_causal(self) -> None:
        """The target at p is predicted from inputs[:, :p + 1] only. Changing the inputs from position j on
        leaves every loss before j unchanged; changing the targets before j (not the inputs) leaves every loss
        from j on unchanged: the targets are looked up, never read as context (the target itself included,
        which a context taken from the targets holds)."""
        baseline = self.build()
        inputs, targets = self.windows()
        before = self.losses(baseline, inputs, targets)
        n = len(self.alphabet.letters)
        for j in (1, 37, LENGTH - 1):
            changed = inputs.clone()
            changed[:, j:] = (changed[:, j:] + 1) % n
            after = self.losses(baseline, changed, targets)
            self.assert_equal(after[:, :j], before[:, :j], f"losses before position {j} after changing inputs from {j} on")
            other = targets.clone()
            other[:, :j] = (other[:, :j] + 1) % n
            after = self.losses(baseline, inputs, other)
            self.assert_equal(after[:, j:], before[:, j:], f"losses from position {j} on after changing the targets "
                              f"before {j} (a baseline reading the targets as context)")

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
