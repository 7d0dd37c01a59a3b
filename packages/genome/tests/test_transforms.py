"""The ``reverse-complement`` and ``planted-repeats`` data transforms: their conformance suites, each against
its definition written as a loop, the annealed share, and their one-line refusals in a recipe."""

from __future__ import annotations

import pytest
import torch

import megaseq_genome.plugin
from megaseq.config import validate_recipe
from megaseq.data.tokenizer import N_ID
from megaseq.data.transforms import build_transforms, transform_generator
from megaseq.data.windows import Batch
from megaseq.errors import UserError
from megaseq_genome.transforms import PlantedRepeats, ReverseComplement
from megaseq_testkit import fresh_plugins
from megaseq_testkit.data_transform import DataTransformConformance


class TestReverseComplementConformance(DataTransformConformance):
    name = "reverse-complement"
    config = {"p": 0.5}


class TestReverseComplementAlwaysConformance(DataTransformConformance):
    name = "reverse-complement"
    config = {"p": 1.0}
    random = False


class TestPlantedRepeatsConformance(DataTransformConformance):
    name = "planted-repeats"
    config = {"share": 0.5, "segment": 64}


class TestPlantedRepeatsAnnealedConformance(DataTransformConformance):
    name = "planted-repeats"
    config = {"share": 1.0, "segment": 300, "anneal_until_step": 4}  # longer than half the window: capped


class TestPlantedRepeatsHeldThenAnnealedConformance(DataTransformConformance):
    name = "planted-repeats"
    config = {"share": 1.0, "segment": 64, "anneal_from_step": 2, "anneal_until_step": 5}


def windows(rows: int, length: int, seed: int = 0, n_run: bool = True) -> Batch:
    """Random windows, N in the first row when ``n_run``, distinct weights (so a weight names its base)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 4, (rows, length + 1), generator=g)
    if n_run:
        ids[0, 5:9] = N_ID
    weights = 0.5 + torch.rand(rows, length, generator=g) / 2
    weights[ids[:, 1:] == N_ID] = 0.0
    return Batch(ids[:, :-1].clone(), ids[:, 1:].clone(), weights)


def call(transform, batch: Batch, seed: int = 0, step: int = 1) -> Batch:
    return transform(batch, step=step, generator=transform_generator(seed, step, 0, 0))


def reverse_complement_of_row(inputs: list[int], targets: list[int], weights: list[float]):
    """The definition: the window's bases read backwards on the other strand; each target base keeps its weight,
    the window's first base (never a target of it) is not scored."""
    window = [inputs[0], *targets]
    weight_of = [0.0, *weights]  # base i's weight as a target
    pair = {0: 3, 1: 2, 2: 1, 3: 0, N_ID: N_ID}
    rc = [pair[b] for b in reversed(window)]
    rc_weights = list(reversed(weight_of))
    return rc[:-1], rc[1:], rc_weights[1:]


def test_reverse_complement_is_its_definition():
    given = windows(64, 23)
    out = call(ReverseComplement(0.5), given)
    changed = 0
    for r in range(64):
        row = [t[r].tolist() for t in (given.inputs, given.targets, given.weights)]
        got = [t[r].tolist() for t in (out.inputs, out.targets, out.weights)]
        if got != row:
            assert got == list(reverse_complement_of_row(*row)), f"row {r}"
            changed += 1
    assert 16 < changed < 48  # about half, p = 0.5
    assert all(call(ReverseComplement(1.0), given).targets[r].tolist() == reverse_complement_of_row(
        *(t[r].tolist() for t in (given.inputs, given.targets, given.weights)))[1] for r in range(64))
    assert torch.equal(call(ReverseComplement(0.0), given).targets, given.targets)
    twice = call(ReverseComplement(1.0), call(ReverseComplement(1.0), given), seed=1)
    assert torch.equal(twice.inputs, given.inputs) and torch.equal(twice.targets, given.targets)  # the strand's strand


def plant_of_row(given: Batch, out: Batch, r: int, longest: int) -> tuple[int, int, int] | None:
    """``(start, distance, length)`` of the repeat planted in row ``r`` (``None``: the row is unchanged), checked
    against the definition: targets [a + d, a + d + s) are a copy of targets [a, a + s), weights with them, the
    rest as it was, 32 <= s <= longest, d >= s; the inputs are the window's."""
    weights = given.weights[r].tolist()
    source = [weights.index(w) for w in out.weights[r].tolist()]  # distinct weights: each names its position
    moved = [j for j, s in enumerate(source) if s != j]
    assert torch.equal(out.targets[r], given.targets[r][source]), f"row {r}: targets do not follow their weights"
    assert torch.equal(out.inputs[r], torch.cat([given.inputs[r, :1], out.targets[r, :-1]])), f"row {r}: not a window"
    if not moved:
        return None
    first, length = moved[0], len(moved)
    distance = first - source[first]
    assert moved == list(range(first, first + length)), f"row {r}: the copy is not one segment"
    assert all(source[j] == j - distance for j in moved), f"row {r}: the copy is not of one segment"
    assert 32 <= length <= longest and distance >= length, f"row {r}: segment {length}, distance {distance}"
    return first - distance, distance, length


def test_planted_repeats_is_its_definition():
    given = windows(200, 150, n_run=False)
    planted = [plant_of_row(given, call(PlantedRepeats(0.5, 64), given), r, 64) for r in range(200)]
    assert 70 < sum(p is not None for p in planted) < 130  # about half
    lengths = {p[2] for p in planted if p}
    assert min(lengths) < 40 and max(lengths) > 56  # 32..64, uniform
    capped = call(PlantedRepeats(1.0, 1000), given)
    assert all(plant_of_row(given, capped, r, 75) for r in range(200))  # every row; at most half the window


def test_planted_repeats_keep_n_at_weight_zero():
    given = windows(50, 100)
    given.inputs[:, 40:60] = N_ID
    given.targets[:, 39:59] = N_ID
    given.weights[:, 39:59] = 0.0
    out = call(PlantedRepeats(1.0, 50), given)
    assert (out.weights[out.targets == N_ID] == 0).all() and (out.weights[out.targets != N_ID] > 0).all()


def test_the_share_anneals_to_zero_by_its_step():
    transform = PlantedRepeats(0.8, 64, anneal_until_step=5)
    assert [transform.share_at(s) for s in (1, 3, 5, 6, 100)] == pytest.approx([0.8, 0.4, 0.0, 0.0, 0.0])
    given = windows(40, 150)
    for step in (5, 9):
        out = call(transform, given, step=step)
        assert all(torch.equal(getattr(out, f), getattr(given, f)) for f in ("inputs", "targets", "weights"))
    assert not torch.equal(call(PlantedRepeats(1.0, 64, anneal_until_step=5), given, step=2).targets, given.targets)
    assert PlantedRepeats(0.3, 64).share_at(10_000) == 0.3


def test_the_share_holds_until_its_first_step_then_anneals():
    transform = PlantedRepeats(1.0, 64, anneal_until_step=8, anneal_from_step=4)
    assert [transform.share_at(s) for s in (1, 4, 5, 6, 8, 9)] == pytest.approx([1.0, 1.0, 0.75, 0.5, 0.0, 0.0])
    given = windows(40, 150)  # the same draws as the transform annealed from step 1, at the full share until step 4
    for step in (1, 4):
        held = call(transform, given, step=step)
        assert torch.equal(held.targets, call(PlantedRepeats(1.0, 64), given, step=step).targets)


def genome_plugins():
    plugins = fresh_plugins()
    plugins.register(megaseq_genome.plugin, name="megaseq-genome-test")
    return plugins


@pytest.mark.parametrize(("raw", "message"), [
    ({"data_transform": {"planted-repeats": {"segment": 16}}},
     "r.toml: data_transform.planted-repeats.segment: Input should be greater than or equal to 32 (got 16)"),
    ({"data_transform": {"planted-repeats": {"anneal_until_step": 1}}},
     "r.toml: data_transform.planted-repeats.anneal_until_step: Input should be greater than or equal to 2 (got 1)"),
    ({"data_transform": {"planted-repeats": {"share": 0, "anneal_until_step": 100}}},
     "r.toml: [data_transform.planted-repeats] anneal_until_step 100: share is 0, there is nothing to anneal; allowed: "
     "a share above 0, or no anneal_until_step"),
    ({"data_transform": {"planted-repeats": {"anneal_from_step": 50}}},
     "r.toml: [data_transform.planted-repeats] anneal_from_step 50: there is no anneal_until_step (the step the share "
     "reaches 0); allowed: anneal_from_step only with anneal_until_step"),
    ({"data_transform": {"planted-repeats": {"anneal_from_step": 100, "anneal_until_step": 100}}},
     "r.toml: [data_transform.planted-repeats] anneal_from_step 100: must be before anneal_until_step 100"),
    ({"data_transform": {"planted-repeats": {"plant": 0.5}}},
     "r.toml: data_transform.planted-repeats.plant: unknown key; allowed: share, segment, anneal_from_step, "
     "anneal_until_step"),
    ({"data_transform": {"reverse-complement": {"p": 1.5}}},
     "r.toml: data_transform.reverse-complement.p: Input should be less than or equal to 1 (got 1.5)"),
    ({"data": {"seq_len": 256, "schedule": [{"seq_len": 32, "until_step": 10}]}},
     "r.toml: data.schedule[0].seq_len 32: data transform 'planted-repeats' ([data_transform.planted-repeats]) acts on "
     "windows of at least 64 tokens"),
])
def test_refusals_are_one_line(raw, message):
    recipe = {"data": {"seq_len": 256, "transforms": ["reverse-complement", "planted-repeats"], **raw.get("data", {})},
              "data_transform": raw.get("data_transform", {})}
    plugins = genome_plugins()
    with pytest.raises(UserError) as caught:
        build_transforms(validate_recipe(recipe, plugins, "r.toml"), plugins)
    assert str(caught.value).startswith(message) and "\n" not in str(caught.value), str(caught.value)


def test_the_records_declare_what_they_do_to_the_distribution():
    plugins = genome_plugins()
    assert plugins.get("data_transform", "reverse-complement").spec.changes_distribution is False
    assert plugins.get("data_transform", "planted-repeats").spec.changes_distribution is True
