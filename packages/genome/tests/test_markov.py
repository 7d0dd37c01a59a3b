"""Order-k Markov baseline: counts against a dict oracle, smoothing, the in-window context rule, real DNA."""

import math
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from megaseq.data import GenomeWindows, encode, tokenized
from megaseq.eval import PositionLoss
from megaseq_genome import markov
from megaseq_genome.config import MarkovConfig
from megaseq_genome.markov import MarkovBaseline
from megaseq_testkit.baseline import BaselineConformance

BASES = "ACGT"


@pytest.fixture(autouse=True)
def isolated_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MEGASEQ_CACHE", str(tmp_path / "cache"))


def code_of(context: str) -> int:
    """Base-4 code with the most recent (last) base as the lowest digit."""
    return sum(BASES.index(base) * 4**back for back, base in enumerate(reversed(context)))


def oracle_counts(seq: str, order: int) -> list[Counter]:
    """counts[j][(context, next)] by brute force over every position."""
    counts = [Counter() for _ in range(order + 1)]
    for t, target in enumerate(seq):
        if target == "N":
            continue
        for j in range(min(order, t) + 1):
            context = seq[t - j : t]
            if "N" not in context:
                counts[j][(context, target)] += 1
    return counts


def oracle_loss(model: MarkovBaseline, inputs: list[int], target: int, position: int) -> float:
    if target == 4:
        return 0.0
    context = "".join("ACGTN"[i] for i in inputs[max(0, position - model.order + 1) : position + 1])
    context = context.rsplit("N", 1)[-1]
    return -float(model.log_prob_table(len(context))[code_of(context), target])


def random_genome(rng: np.random.Generator, length: int) -> np.ndarray:
    ids = rng.choice(4, size=length, p=[0.3, 0.2, 0.2, 0.3]).astype(np.uint8)
    ids[rng.random(length) < 0.05] = 4
    ids[rng.random(length) < 0.2] |= 8  # soft-mask flags must be ignored
    return ids


@pytest.mark.parametrize("fit_block", [7, 1 << 22])
def test_counts_match_oracle(monkeypatch: pytest.MonkeyPatch, fit_block: int) -> None:
    monkeypatch.setattr(markov, "_FIT_BLOCK", fit_block)
    rng = np.random.default_rng(fit_block)
    for order, length in [(0, 50), (1, 101), (3, 257), (5, 333)]:
        tokens = random_genome(rng, length)
        seq = "".join("ACGTN"[t & 7] for t in tokens)
        model = MarkovBaseline(order).fit(tokens)
        for j, expected in enumerate(oracle_counts(seq, order)):
            expected_cells = {(code_of(context), BASES.index(x)): n for (context, x), n in expected.items()}
            got_cells = {
                (int(c), int(x)): int(model.counts[j][c, x])
                for c, x in zip(*model.counts[j].nonzero(), strict=True)
            }
            assert got_cells == expected_cells


def test_probabilities_sum_to_one_per_context() -> None:
    model = MarkovBaseline(4).fit(random_genome(np.random.default_rng(0), 2000))
    for j in range(5):
        table = model.log_prob_table(j)
        assert table.shape == (4**j, 4)
        np.testing.assert_allclose(np.exp(table).sum(1), 1.0, rtol=0, atol=1e-12)


def test_hand_checked_order_one_example() -> None:
    model = MarkovBaseline(1, alpha=0.5).fit(encode(b"AACAG"))
    # Order 0: A 3, C 1, G 1 of 5 -> (n + 0.5) / 7.
    np.testing.assert_allclose(np.exp(model.log_prob_table(0)[0]), [3.5 / 7, 1.5 / 7, 1.5 / 7, 0.5 / 7])
    # After A: A, C, G once each -> (n + 0.5) / 5; after C: A once -> (n + 0.5) / 3; G, T never seen -> 1/4.
    probs = np.exp(model.log_prob_table(1))
    np.testing.assert_allclose(probs[0], [0.3, 0.3, 0.3, 0.1])
    np.testing.assert_allclose(probs[1], [1.5 / 3, 0.5 / 3, 0.5 / 3, 0.5 / 3])
    np.testing.assert_allclose(probs[2:], 0.25)
    # Window inputs A C N G, targets C N G A: contexts A | C | (after N: none) | G.
    losses = model.token_losses(torch.tensor([[0, 1, 4, 2]]), torch.tensor([[1, 4, 2, 0]]))
    expected = [-math.log(0.3), 0.0, -math.log(1.5 / 7), -math.log(0.25)]
    torch.testing.assert_close(losses, torch.tensor([expected], dtype=torch.float64), rtol=0, atol=1e-12)


def test_token_losses_use_only_in_window_context() -> None:
    rng = np.random.default_rng(1)
    model = MarkovBaseline(5).fit(random_genome(rng, 5000))
    windows = (random_genome(rng, 3 * 38) & 7).reshape(3, 38).astype(np.int64)
    inputs, targets = torch.from_numpy(windows[:, :-1]), torch.from_numpy(windows[:, 1:])
    losses = model.token_losses(inputs, targets)
    assert losses.shape == (3, 37) and losses.dtype == torch.float64
    for row in range(3):
        for position in range(37):
            expected = oracle_loss(model, windows[row, :-1].tolist(), int(targets[row, position]), position)
            assert abs(losses[row, position].item() - expected) <= 1e-12 * max(1.0, abs(expected))
    # Position 0 sees exactly one token even though the model has order 5.
    table = model.log_prob_table(1)
    first = inputs[:, 0]
    usable = (first < 4) & (targets[:, 0] < 4)
    expected_first = -table[first[usable].numpy(), targets[usable, 0].numpy()]
    np.testing.assert_allclose(losses[usable, 0].numpy(), expected_first, rtol=0, atol=1e-12)


def test_save_load_round_trip(tmp_path: Path) -> None:
    model = MarkovBaseline(3, alpha=0.25).fit(random_genome(np.random.default_rng(2), 800))
    model.save(tmp_path / "markov.npz")
    loaded = MarkovBaseline.load(tmp_path / "markov.npz")
    assert (loaded.order, loaded.alpha) == (3, 0.25)
    for j in range(4):
        np.testing.assert_array_equal(loaded.counts[j], model.counts[j])
        np.testing.assert_array_equal(loaded.log_prob_table(j), model.log_prob_table(j))


def test_an_interrupted_save_keeps_the_previous_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "markov.npz"
    MarkovBaseline(2).fit(random_genome(np.random.default_rng(3), 400)).save(path)
    before = path.read_bytes()

    def savez_then_fail(file, **arrays):
        file.write(b"partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(np, "savez", savez_then_fail)
    with pytest.raises(KeyboardInterrupt):
        MarkovBaseline(2).save(path)
    assert path.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["markov.npz"]


def test_invalid_settings() -> None:
    with pytest.raises(ValueError, match=r"Markov order must be in 0\.\.12, got 13"):
        MarkovBaseline(13)
    with pytest.raises(ValueError, match="alpha must be > 0"):
        MarkovBaseline(2, alpha=0.0)


def held_out_bits_per_base(order: int) -> float:
    model = MarkovBaseline(order).fit(tokenized("excerpt-chr20"))
    windows = GenomeWindows(tokenized("excerpt-chrX"), 256)
    batch = windows.batch(range(len(windows)))
    positions = PositionLoss(256)
    positions.add(model.token_losses(batch.inputs, batch.targets), batch.weights)
    return positions.summary()["bits_per_base"]


def test_real_dna_held_out_bits_per_base() -> None:
    # Measured: order 0 2.0152, order 4 1.9355 (fit on 300 kb of chr20, scored on 200 kb of chrX).
    order4 = held_out_bits_per_base(4)
    assert 1.90 < order4 < 1.97
    assert order4 < held_out_bits_per_base(0) - 0.05


class TestMarkovConformance(BaselineConformance):
    name = "markov"
    config = {"order": 3}


def test_markov_baseline_is_fitted_once_on_data_train(tmp_path: Path) -> None:
    first = markov.build(MarkovConfig(order=2), "excerpt-chr20")
    assert first.label == "markov-2" and first.counts[2].sum() > 0
    cached = list((tmp_path / "cache" / "markov").iterdir())
    assert len(cached) == 1
    again = markov.build(MarkovConfig(order=2), "excerpt-chr20")  # read back from the cache
    assert all((a == b).all() for a, b in zip(first.counts, again.counts, strict=True))
    assert list((tmp_path / "cache" / "markov").iterdir()) == cached


def test_checkpoints_that_hold_eval_markov_order_still_load(tmp_path):
    """Checkpoints of megaseq-core 0.1.0 hold the Markov order as core's ``eval.markov_order``: the baseline's
    record replaces that key, so their recipe reads as ``eval.baselines = ["markov"]`` with ``[baseline.markov]
    order``, and a recipe file holding it is refused in one line saying what to write."""
    import json

    from megaseq.config import ConfigError, load_recipe, validate_recipe
    from megaseq.plugins import get_plugins
    from megaseq.train.checkpoint import read_meta

    plugins = get_plugins()
    stored = {"data": {"seq_len": 64}, "model": {"d_model": 16, "n_layers": 1}, "eval": {"windows": 3, "markov_order": 2}}
    (tmp_path / "meta.json").write_text(json.dumps({"step": 3, "recipe": stored}))
    recipe = validate_recipe(read_meta(tmp_path)["recipe"], plugins, f"{tmp_path}/meta.json")
    assert recipe.eval.baselines == ["markov"] and recipe.component("baseline", "markov") == MarkovConfig(order=2)
    assert recipe.eval.windows == 3

    (tmp_path / "r.toml").write_text("[eval]\nmarkov_order = 8\n")
    with pytest.raises(ConfigError) as err:
        load_recipe(tmp_path / "r.toml", plugins)
    assert str(err.value).startswith(f"{tmp_path / 'r.toml'}: eval.markov_order: not a recipe key; baseline 'markov' "
                                     "(megaseq-genome ") and str(err.value).endswith(
        'replaces it: add "markov" to eval.baselines and order = 8 in [baseline.markov]')
