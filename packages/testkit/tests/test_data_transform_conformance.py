"""The data-transform suite (megaseq_testkit.data_transform) on a reference transform, and on wrong ones it
must catch, each named with the check that catches it."""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from megaseq.data.tokenizer import N_ID
from megaseq.data.windows import Batch, GenomeWindows
from megaseq_testkit.data_transform import DataTransformConformance

HERE = __file__


class Relabel:
    """Reference: with probability ``p`` a window's bases are renamed by a random permutation of A, C, G, T
    (N stays N), the same renaming for the inputs and targets, so every row stays a window and weights stay with
    their positions."""

    min_length = 1

    def __init__(self, p: float = 0.5) -> None:
        self.p = p

    def permutations(self, rows: int, generator: torch.Generator) -> torch.Tensor:
        """``[rows, 5]`` id maps: a permutation of 0..3 for the chosen rows, the identity for the others; 4 -> 4."""
        chosen = torch.rand(rows, generator=generator) < self.p
        perms = torch.argsort(torch.rand(rows, 4, generator=generator), dim=1)
        identity = torch.arange(4).expand(rows, 4)
        maps = torch.where(chosen[:, None], perms, identity)
        return torch.cat([maps, torch.full((rows, 1), N_ID)], dim=1)

    def __call__(self, batch: Batch, *, step: int, generator: torch.Generator) -> Batch:
        maps = self.permutations(batch.inputs.shape[0], generator)
        return Batch(maps.gather(1, batch.inputs), maps.gather(1, batch.targets), batch.weights.clone())


def build(config: dict) -> Relabel:
    return Relabel(**config)


class TestReferenceConformance(DataTransformConformance):
    name = "relabel"
    factory = f"{HERE}:build"


class TestReferenceNotDrawingConformance(DataTransformConformance):
    """Configured to draw nothing that matters (p = 0): declared not random, and held to it."""

    name = "relabel"
    factory = f"{HERE}:build"
    config = {"p": 0.0}
    random = False


# -- wrong transforms, each caught by the check named beside it in the table below ----------------------------
class GlobalRandom(Relabel):
    """Draws from torch's global generator."""

    def __call__(self, batch, *, step, generator):
        return super().__call__(batch, step=step, generator=torch.Generator().manual_seed(int(torch.randint(0, 2**31, ()))))


class NumpyRandom(Relabel):
    """Takes its seed from numpy's global generator."""

    def __call__(self, batch, *, step, generator):
        return super().__call__(batch, step=step, generator=torch.Generator().manual_seed(int(np.random.randint(2**31))))


class StdRandom(Relabel):
    """Takes its seed from the random module."""

    def __call__(self, batch, *, step, generator):
        return super().__call__(batch, step=step, generator=torch.Generator().manual_seed(random.getrandbits(31)))


class IgnoresSeed(Relabel):
    """Draws from its own fixed generator: every micro-batch gets the same choices."""

    def __call__(self, batch, *, step, generator):
        return super().__call__(batch, step=step, generator=torch.Generator().manual_seed(0))


class KeepsState(Relabel):
    """Acts on every other call only (a counter kept across calls): a resumed run would act on other batches."""

    def __init__(self, p: float = 0.5) -> None:
        super().__init__(p)
        self.calls = 0

    def __call__(self, batch, *, step, generator):
        self.calls += 1
        out = super().__call__(batch, step=step, generator=generator)
        return out if self.calls % 2 else Batch(batch.inputs.clone(), batch.targets.clone(), batch.weights.clone())


class InPlace(Relabel):
    def __call__(self, batch, *, step, generator):
        out = super().__call__(batch, step=step, generator=generator)
        batch.inputs.copy_(out.inputs)
        batch.targets.copy_(out.targets)
        return batch


class DropsARow(Relabel):
    def __call__(self, batch, *, step, generator):
        out = super().__call__(batch, step=step, generator=generator)
        return Batch(out.inputs[1:], out.targets[1:], out.weights[1:])


class Int32(Relabel):
    def __call__(self, batch, *, step, generator):
        out = super().__call__(batch, step=step, generator=generator)
        return Batch(out.inputs.int(), out.targets.int(), out.weights)


class InputsOnly(Relabel):
    """Renames the inputs but not the targets: rows are no longer windows."""

    def __call__(self, batch, *, step, generator):
        out = super().__call__(batch, step=step, generator=generator)
        return Batch(out.inputs, batch.targets.clone(), out.weights)


class NBeyondAlphabet(Relabel):
    """Writes N as 5 (another vocabulary's id)."""

    def __call__(self, batch, *, step, generator):
        out = super().__call__(batch, step=step, generator=generator)
        return Batch(*(torch.where(t == N_ID, 5, t) for t in (out.inputs, out.targets)), out.weights)


class WeighsN(Relabel):
    """Scores every target, N included."""

    def __call__(self, batch, *, step, generator):
        out = super().__call__(batch, step=step, generator=generator)
        return Batch(out.inputs, out.targets, torch.ones_like(out.weights))


class PatchesTheData(Relabel):
    """Makes every window the data gives relabelled, by patching GenomeWindows.batch when built: held-out
    windows change too."""

    def __init__(self, p: float = 0.5) -> None:
        super().__init__(p)
        original = GenomeWindows.batch

        def batch(windows, indices):
            out = original(windows, indices)
            return self(out, step=1, generator=torch.Generator().manual_seed(len(indices)))

        GenomeWindows.batch = batch


class NoMinLength:
    def __call__(self, batch, *, step, generator):
        return batch


# what each Suite's factory knob names: "file.py:WRONG.Name" builds the wrong transform Name
WRONG = SimpleNamespace(**{cls.__name__: (lambda config, cls=cls: cls(**config)) for cls in (
    GlobalRandom, NumpyRandom, StdRandom, IgnoresSeed, KeepsState, InPlace, DropsARow, Int32, InputsOnly, NBeyondAlphabet,
    WeighsN, PatchesTheData,
)}, NoMinLength=lambda config: NoMinLength())


@pytest.mark.parametrize(
    ("wrong", "check"),
    [
        ("GlobalRandom", "test_same_seed_same_result"),
        ("GlobalRandom", "test_global_generators_untouched"),
        ("NumpyRandom", "test_global_generators_untouched"),
        ("StdRandom", "test_global_generators_untouched"),
        ("IgnoresSeed", "test_seed_changes_result"),
        ("KeepsState", "test_fresh_instance_reproduces_a_long_lived_one"),
        ("InPlace", "test_input_left_as_it_was"),
        ("DropsARow", "test_result_is_a_batch_of_windows"),
        ("Int32", "test_result_is_a_batch_of_windows"),
        ("InputsOnly", "test_result_is_a_batch_of_windows"),
        ("NBeyondAlphabet", "test_result_is_a_batch_of_windows"),
        ("WeighsN", "test_result_is_a_batch_of_windows"),
        ("PatchesTheData", "test_heldout_windows_unchanged"),
        ("NoMinLength", "test_protocol"),
    ],
)
def test_suite_catches_wrong_transform(wrong: str, check: str, monkeypatch) -> None:
    monkeypatch.setattr(GenomeWindows, "batch", GenomeWindows.batch)  # undone after the test, whatever it patched

    class Suite(DataTransformConformance):
        name = wrong
        factory = f"{HERE}:WRONG.{wrong}"

    if check != "test_protocol":
        Suite().test_protocol()
    with pytest.raises(AssertionError):
        getattr(Suite(), check)()


def test_a_random_transform_declared_not_random_is_caught() -> None:
    class Suite(DataTransformConformance):
        name = "relabel"
        factory = f"{HERE}:build"
        random = False

    with pytest.raises(AssertionError, match="random = False"):
        Suite().test_seed_changes_result()


def test_the_wrong_transforms_pass_the_checks_they_are_not_named_for() -> None:
    """Each wrong transform is wrong in one way: a stateful one still seeds correctly from a fresh build, one
    that ignores its seed still leaves its input alone, so each check is shown to catch its own mistake."""

    for wrong, passes in [("KeepsState", "test_same_seed_same_result"), ("IgnoresSeed", "test_input_left_as_it_was"),
                          ("IgnoresSeed", "test_fresh_instance_reproduces_a_long_lived_one")]:
        class Suite(DataTransformConformance):
            name = wrong
            factory = f"{HERE}:WRONG.{wrong}"

        getattr(Suite(), passes)()
