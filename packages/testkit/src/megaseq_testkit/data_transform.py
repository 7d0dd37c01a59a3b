"""Conformance suite for data transforms (see ``megaseq.contracts.DataTransform``).

Subclass :class:`DataTransformConformance` in a pytest module and set ``name`` and ``config``; the tests build
the transform through the installed plugins, or from ``factory`` (``"module:attr"`` or ``"/path/file.py:attr"``
of a ``build(config_dict)``) for one that is not an installed plugin, and call it as the trainer does: on
batches of ``batch`` windows of ``seq_len`` tokens (random bases, a run of N targets at weight 0, soft-masked
stretches at weight 0.5), with the generator core seeds for each call
(``megaseq.data.transforms.transform_generator``). ``random`` says whether the transform draws from that
generator (``False`` for one that does not, or for a random one configured to draw nothing, e.g. a
probability of 0). Every check here has a deliberately wrong transform in the kit's own tests
(``packages/testkit/tests/test_data_transform_conformance.py``) that it catches.

The checks: the protocol and ``min_length``; the result is a batch of windows (shapes, dtypes, ids 0..4, finite
weights >= 0 and 0 on N targets, each row's targets its inputs shifted by one); the input is left as it was;
the same seed gives the same result and, for a random transform, different seeds different results; the global
generators (torch, numpy, ``random``) are untouched; a freshly built transform reproduces, call by call, what a
long-lived one produced at the same steps (no state across calls: what a resumed run needs); the held-out
windows, read as core's evaluation reads them, are the same after the transform was built and applied to
training batches. Results are compared bitwise.
"""

from __future__ import annotations

import random as std_random
from typing import Any, ClassVar

import numpy as np
import torch

from megaseq.contracts import DataTransform
from megaseq.data.tokenizer import N_ID
from megaseq.data.transforms import transform_generator
from megaseq.data.windows import Batch

FIELDS = ("inputs", "targets", "weights")


def same(a: Batch, b: Batch) -> bool:
    """Whether two batches are bitwise equal (shapes, dtypes, values)."""
    return all(
        getattr(a, f).shape == getattr(b, f).shape and getattr(a, f).dtype == getattr(b, f).dtype
        and torch.equal(getattr(a, f), getattr(b, f))
        for f in FIELDS
    )


class DataTransformConformance:
    """Base class of a data transform's conformance tests (the knobs are documented in megaseq_testkit)."""

    name: ClassVar[str]
    config: ClassVar[dict[str, Any]] = {}
    factory: ClassVar[str | None] = None
    random: ClassVar[bool] = True
    seq_len: ClassVar[int] = 150
    batch: ClassVar[int] = 16

    def build(self) -> Any:
        from megaseq_testkit import installed_plugins, load_factory

        if self.factory is not None:
            return load_factory(self.factory)(dict(self.config))
        provided = installed_plugins().get("data_transform", self.name)
        return provided.load()(provided.spec.config(**self.config))

    # -- inputs ---------------------------------------------------------------------------------------
    def windows(self, seed: int = 0) -> Batch:
        """``batch`` windows of ``seq_len`` tokens, as the data gives them: random bases with repeats (something
        for a transform that looks at content), a run of N in the first row (weight 0), soft-masked stretches
        (weight 0.5) in every other row."""
        g = torch.Generator().manual_seed(10_000 + seed)
        length = self.seq_len
        ids = torch.randint(0, 4, (self.batch, length + 1), generator=g)
        half = length // 2
        ids[:, half : half + length // 4] = ids[:, : length // 4]
        ids[0, length // 3 : length // 3 + 7] = N_ID
        weights = torch.ones(self.batch, length)
        weights[::2, length // 5 : length // 5 + length // 6] = 0.5
        targets = ids[:, 1:]
        weights[targets == N_ID] = 0.0
        return Batch(ids[:, :-1].clone(), targets.clone(), weights)

    def apply(self, transform: Any, batch: Batch, seed: int = 0, step: int = 1, micro_batch: int = 0) -> Batch:
        """The transform called as the trainer calls it (first in ``data.transforms``)."""
        return transform(batch, step=step, generator=transform_generator(seed, step, micro_batch, 0))

    def results(self, seeds: range, step: int = 1) -> list[Batch]:
        """The results for each seed, each from a freshly built transform on the same windows."""
        return [self.apply(self.build(), self.windows(), seed=seed, step=step) for seed in seeds]

    # -- the contract ---------------------------------------------------------------------------------
    def test_protocol(self) -> None:
        transform = self.build()
        assert isinstance(transform, DataTransform), (
            f"{type(transform).__name__} does not implement megaseq.contracts.DataTransform (min_length, __call__)"
        )
        assert isinstance(transform.min_length, int) and transform.min_length >= 1, (
            f"min_length must be a positive int (the shortest window it acts on), got {transform.min_length!r}"
        )
        assert self.seq_len >= transform.min_length, (
            f"the suite's seq_len {self.seq_len} is shorter than the transform's min_length {transform.min_length}: "
            "set the seq_len knob"
        )

    def test_result_is_a_batch_of_windows(self) -> None:
        """The same shapes and dtypes, ids of the data's alphabet, finite weights >= 0 and 0 on N targets, and
        every row still a window (its targets are its inputs shifted by one)."""
        given = self.windows()
        for seed, out in enumerate(self.results(range(4))):
            assert isinstance(out, Batch), f"seed {seed}: returned {type(out).__name__}, not a megaseq.data.windows.Batch"
            for field in FIELDS:
                old, new = getattr(given, field), getattr(out, field)
                assert (new.shape, new.dtype) == (old.shape, old.dtype), (
                    f"seed {seed}: {field} is {new.dtype} {tuple(new.shape)}, was {old.dtype} {tuple(old.shape)}"
                )
            for field in ("inputs", "targets"):
                ids = getattr(out, field)
                assert int(ids.min()) >= 0 and int(ids.max()) <= N_ID, f"seed {seed}: {field} outside ids 0..{N_ID}"
            assert torch.isfinite(out.weights).all() and (out.weights >= 0).all(), f"seed {seed}: weights must be finite, >= 0"
            assert (out.weights[out.targets == N_ID] == 0).all(), f"seed {seed}: an N target must weigh 0"
            assert torch.equal(out.targets[:, :-1], out.inputs[:, 1:]), (
                f"seed {seed}: a row is no longer a window (targets[:, :-1] must equal inputs[:, 1:])"
            )

    def test_input_left_as_it_was(self) -> None:
        transform = self.build()
        given = self.windows()
        kept = Batch(*(getattr(given, f).clone() for f in FIELDS))
        for seed in range(4):
            self.apply(transform, given, seed=seed)
            assert same(given, kept), f"seed {seed}: the transform changed its input batch in place"

    def test_same_seed_same_result(self) -> None:
        first, again = self.results(range(3)), self.results(range(3))
        for seed, (a, b) in enumerate(zip(first, again, strict=True)):
            assert same(a, b), f"seed {seed}: two calls with generators of the same seed gave different batches"

    def test_seed_changes_result(self) -> None:
        """A random transform's result depends on its generator (one that ignores it repeats itself in every
        micro-batch); one declared not random (``random = False``) does not depend on it."""
        out = self.results(range(5))
        differ = [seed for seed in range(1, 5) if not same(out[0], out[seed])]
        if self.random:
            assert differ, "seeds 0..4 all gave the same batch: the transform ignores its generator (or set random = False)"
        else:
            assert not differ, f"seeds {differ} gave another batch than seed 0, but the suite says random = False"

    def test_global_generators_untouched(self) -> None:
        torch_state, np_state, std_state = torch.get_rng_state(), np.random.get_state(), std_random.getstate()
        transform = self.build()
        for seed in range(3):
            self.apply(transform, self.windows(seed), seed=seed, step=seed + 1)
        assert torch.equal(torch.get_rng_state(), torch_state), "torch's global generator moved: draw from `generator` only"
        np_now = np.random.get_state()
        assert np_now[0] == np_state[0] and np.array_equal(np_now[1], np_state[1]) and np_now[2:] == np_state[2:], (
            "numpy's global generator moved: draw from `generator` only"
        )
        assert std_random.getstate() == std_state, "the random module's generator moved: draw from `generator` only"

    def test_fresh_instance_reproduces_a_long_lived_one(self) -> None:
        """A run resumed at any step builds its transforms afresh: each call must give what the transform built
        at the start of the run gave there (no state from call to call)."""
        calls = [(step, micro) for step in (1, 2, 3, 5, 8) for micro in (0, 1)]
        long_lived = self.build()
        seen = [self.apply(long_lived, self.windows(10 * step + micro), seed=7, step=step, micro_batch=micro)
                for step, micro in calls]
        for (step, micro), out in zip(calls, seen, strict=True):
            fresh = self.apply(self.build(), self.windows(10 * step + micro), seed=7, step=step, micro_batch=micro)
            assert same(fresh, out), f"step {step}, micro-batch {micro}: a fresh transform differs from the long-lived one"

    def test_heldout_windows_unchanged(self) -> None:
        """Core's evaluation reads the same held-out windows after the transform was built and applied to
        training batches: nothing of the data outside the batch it returns changes."""
        from megaseq.config import validate_recipe
        from megaseq.data.windows import recipe_windows
        from megaseq.eval.evaluate import heldout_windows
        from megaseq_testkit import fresh_plugins

        plugins = fresh_plugins()
        length = max(self.seq_len, 64)
        recipe = validate_recipe({"data": {"seq_len": length}, "eval": {"windows": 6}}, plugins, "<conformance>")

        def heldout() -> Batch:
            windows, indices = heldout_windows(recipe, plugins)
            return windows.batch(indices)

        before = heldout()
        transform = self.build()
        train = recipe_windows(recipe, "train", plugins)
        for step in (1, 2):
            self.apply(transform, train.batch(list(range(step, step + 4))), step=step)
        assert same(heldout(), before), "the held-out windows core's evaluation reads changed after the transform ran"
