"""The baseline suite (megaseq_testkit.baseline) on a reference baseline, and on wrong ones it must catch;
baselines in recipes (eval.baselines, [baseline.NAME]) and in the held-out evaluation."""

from __future__ import annotations

import math
import re

import pytest
import torch

from megaseq.config import validate_recipe
from megaseq.data.tokenizer import N_ID
from megaseq.errors import ConfigError, PluginError
from megaseq.eval.evaluate import build_baselines, heldout_windows, score_baseline
from megaseq.hookspecs import hookimpl
from megaseq.records import BaselineSpec, ComponentConfig
from megaseq_testkit import fresh_plugins
from megaseq_testkit.baseline import BaselineConformance


class WindowUnigramConfig(ComponentConfig):
    pseudo: float = 1.0


class WindowUnigram:
    """Reference: p(next base) from the counts of A, C, G, T among the window's inputs up to the target (plus
    ``pseudo`` each); N inputs are not counted, N targets cost 0."""

    label = "window-unigram"

    def __init__(self, pseudo: float = 1.0) -> None:
        self.pseudo = pseudo

    def probabilities(self, inputs: torch.Tensor) -> torch.Tensor:
        one_hot = torch.nn.functional.one_hot(inputs.clamp(max=4), 5)[..., :4].double()
        counts = one_hot.cumsum(dim=1) + self.pseudo
        return counts / counts.sum(-1, keepdim=True)

    def token_losses(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        p = self.probabilities(inputs).gather(-1, targets.clamp(max=3)[..., None])[..., 0]
        return torch.where(targets == N_ID, 0.0, -p.log())


def build(config: WindowUnigramConfig, train) -> WindowUnigram:
    return WindowUnigram(config.pseudo)


def build_from_dict(config: dict, train) -> WindowUnigram:
    """The reference as a suite's `factory` builds it: from the plain config dict."""
    return WindowUnigram(**config)


class Plugin:
    @hookimpl
    def megaseq_baseline(self):
        return [BaselineSpec(name="window-unigram", target=f"{__name__}:build", config=WindowUnigramConfig, summary="test",
                             replaces={"eval.unigram_pseudo": "pseudo"})]  # a key of core's it took over


def test_reference_is_a_slow_loop():
    """The reference's vectorised losses equal a loop over positions written from its definition."""
    inputs = torch.tensor([[0, 1, 1, N_ID, 2, 3, 3, 3]])
    targets = torch.tensor([[1, 1, N_ID, 2, 3, 3, 3, 0]])
    losses = WindowUnigram().token_losses(inputs, targets)
    for p in range(inputs.shape[1]):
        if targets[0, p] == N_ID:
            assert losses[0, p] == 0
            continue
        seen = [int(t) for t in inputs[0, : p + 1] if t != N_ID]
        expected = -math.log((seen.count(int(targets[0, p])) + 1) / (len(seen) + 4))
        assert losses[0, p].item() == pytest.approx(expected, rel=1e-12)


class TestReferenceConformance(BaselineConformance):
    name = "window-unigram"
    factory = f"{__name__}:build_from_dict"
    config = {"pseudo": 0.5}


class TestRegisteredReferenceConformance(BaselineConformance):
    """Through a plugin manager, as an installed baseline is tested (its record's alphabets included)."""

    name = "window-unigram"

    def plugins(self):
        plugins = fresh_plugins()
        plugins.register(Plugin(), name="unigram-test")
        return plugins


class Peeking(WindowUnigram):
    """Looks at the next input, which is the target."""

    def token_losses(self, inputs, targets):
        ahead = torch.cat([inputs[:, 1:], inputs[:, -1:]], dim=1)
        return torch.where(ahead == targets, 0.01, super().token_losses(inputs, targets))


class ChargesN(WindowUnigram):
    def token_losses(self, inputs, targets):
        p = self.probabilities(inputs).gather(-1, targets.clamp(max=3)[..., None])[..., 0]
        return -p.log()


class Overconfident(WindowUnigram):
    """Half the loss it should have: probabilities that sum to more than 1."""

    def token_losses(self, inputs, targets):
        return super().token_losses(inputs, targets) / 2


class AcrossRows(WindowUnigram):
    """Counts the bases of every row in the batch."""

    def probabilities(self, inputs):
        one_hot = torch.nn.functional.one_hot(inputs.clamp(max=4), 5)[..., :4].double()
        counts = one_hot.sum(0, keepdim=True).cumsum(dim=1) + self.pseudo
        return (counts / counts.sum(-1, keepdim=True)).expand(inputs.shape[0], -1, -1)


class Unlabelled(WindowUnigram):
    label = ""


class Drifting(WindowUnigram):
    """Each build differs (an unseeded random pseudo-count)."""

    def __init__(self) -> None:
        super().__init__(1.0 + torch.rand(()).item())


class TargetAsContext(WindowUnigram):
    """Takes its context from the targets: inputs[0] and targets[:p + 1], which holds the target itself. It
    changes nothing when only later inputs change, so the inputs half of test_causal cannot see it."""

    def token_losses(self, inputs, targets):
        history = torch.cat([inputs[:, :1], targets], dim=1)
        p = self.probabilities(history)[:, 1:].gather(-1, targets.clamp(max=3)[..., None])[..., 0]
        return torch.where(targets == N_ID, 0.0, -p.log())


class Float32(WindowUnigram):
    def token_losses(self, inputs, targets):
        return super().token_losses(inputs, targets).float()


@pytest.mark.parametrize(
    ("wrong", "check"),
    [
        (Peeking, "test_causal"),
        (ChargesN, "test_losses_finite_non_negative_and_zero_on_n"),
        (Overconfident, "test_a_distribution_over_letters"),
        (TargetAsContext, "test_causal"),
        (Float32, "test_losses_finite_non_negative_and_zero_on_n"),
        (AcrossRows, "test_rows_independent"),
        (Unlabelled, "test_protocol"),
        (Drifting, "test_deterministic"),
    ],
    ids=lambda v: v.__name__ if isinstance(v, type) else v,
)
def test_suite_catches_wrong_baseline(wrong: type, check: str) -> None:
    class Suite(BaselineConformance):
        name = wrong.__name__

        def build(self):
            return wrong()

    Suite().test_protocol() if check != "test_protocol" else None
    with pytest.raises(AssertionError):
        getattr(Suite(), check)()


def test_target_as_context_passes_the_inputs_half_of_causality_only():
    """Changing later inputs alone leaves this baseline's earlier losses as they are: only a check that also
    changes the targets (test_causal does) catches it."""
    inputs, targets = BaselineConformance.windows(TestReferenceConformance())
    wrong = TargetAsContext()
    before = wrong.token_losses(inputs, targets)
    changed = inputs.clone()
    changed[:, 37:] = (changed[:, 37:] + 1) % 4
    assert torch.equal(wrong.token_losses(changed, targets)[:, :37], before[:, :37])


def test_messages_name_the_quantity_and_the_bound():
    suite = TestReferenceConformance()
    with pytest.raises(AssertionError) as err:
        suite.assert_equal(torch.tensor([1.0, 2.5]), torch.tensor([1.0, 2.0]), "two builds", "loss")
    assert str(err.value) == ("two builds: the loss at (1,) is 2.5, expected 2 (off by 0.5; allowed: tolerance 1e-06 "
                              "x max(1, |2|) = 2e-06)")
    suite.build = Overconfident
    with pytest.raises(AssertionError, match=r"^sum over A C G T of p\(letter\): the sum of probabilities at \(\d+, \d+\) "
                       r"is 1\.99\d+, expected 1 \(off by 0\.99\d; allowed: tolerance 1e-06 x max\(1, \|1\|\) = 1e-06\)$"):
        suite.test_a_distribution_over_letters()


def test_a_baseline_that_does_not_declare_the_alphabet_it_is_tested_on():
    class Suite(TestRegisteredReferenceConformance):
        train = "proteins"

        def plugins(self):
            from megaseq.records import DataSourceSpec

            class Proteins:
                @hookimpl
                def megaseq_data_source(self):
                    return [DataSourceSpec(name="proteins", target="megaseq.data.sources:excerpt_chr20",
                                           alphabet="protein", summary="test")]

            plugins = super().plugins()
            plugins.register(Proteins(), name="proteins")
            return plugins

    with pytest.raises(AssertionError, match=r"tested on protein \(proteins\) but its record declares alphabets \['dna'\]"):
        Suite().test_handles_the_alphabet()


RAW = {
    "run": {"device": "cpu"},
    "data": {"train": "excerpt-chr20", "heldout": "excerpt-chrX", "seq_len": 64},
    "model": {"d_model": 16, "n_layers": 1},
    "eval": {"windows": 3, "batch_size": 2, "first_bucket": 16},
}


def test_recipe_names_baselines_and_the_evaluation_scores_them():
    plugins = fresh_plugins()
    plugins.register(Plugin(), name="unigram-test")
    recipe = validate_recipe({**RAW, "eval": {**RAW["eval"], "baselines": ["window-unigram"]},
                              "baseline": {"window-unigram": {"pseudo": 0.5}}}, plugins, "r.toml")
    assert recipe.component("baseline", "window-unigram").pseudo == 0.5
    assert "baseline" in recipe.to_dict() and recipe.to_dict()["eval"]["baselines"] == ["window-unigram"]
    (built,) = build_baselines(recipe, plugins)
    windows, indices = heldout_windows(recipe, plugins)
    summary = score_baseline(built, recipe, windows, indices)
    batch = windows.batch(indices)
    expected = built.token_losses(batch.inputs, batch.targets).sum().item() / batch.weights.sum().item() / math.log(2)
    assert summary["bits_per_base"] == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"eval": {"baselines": ["nope"]}}, "r.toml: eval.baselines[0]: no baseline named 'nope'; available: window-unigram"),
        ({"baseline": {"window-unigram": {}}}, "r.toml: [baseline.window-unigram] is configured but not used by eval.baselines"),
        ({"eval": {"baselines": ["window-unigram"]}, "baseline": {"window-unigram": {"k": 1}}},
         "r.toml: baseline.window-unigram.k: unknown key; allowed: pseudo"),
    ],
)
def test_baseline_mistakes_are_one_line(raw, message):
    plugins = fresh_plugins()
    plugins.register(Plugin(), name="unigram-test")
    with pytest.raises((ConfigError, PluginError)) as err:
        validate_recipe({**RAW, **raw}, plugins, "r.toml")
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_a_stored_recipe_with_a_replaced_key_reads_in_the_current_keys(tmp_path):
    """A checkpoint's recipe holding a key of core's that a component replaces (``Component.replaces``) reads as
    that component selected with the key's value; the stored dict is left as it was."""
    import json

    from megaseq.config import stored_recipe
    from megaseq.train.checkpoint import read_meta

    plugins = fresh_plugins()
    plugins.register(Plugin(), name="unigram-test")
    old = {**RAW, "eval": {**RAW["eval"], "unigram_pseudo": 0.25}}
    new = stored_recipe(old, plugins)
    assert new["eval"] == {**RAW["eval"], "baselines": ["window-unigram"]} and new["baseline"] == {"window-unigram": {"pseudo": 0.25}}
    assert old["eval"]["unigram_pseudo"] == 0.25 and "baseline" not in old
    assert stored_recipe(RAW, plugins) is RAW
    # already selected and configured alike: nothing added twice
    both = {**old, "eval": {**old["eval"], "baselines": ["window-unigram"]}, "baseline": {"window-unigram": {"pseudo": 0.25}}}
    assert stored_recipe(both, plugins) == new
    with pytest.raises(ConfigError, match=r"^m.json: eval.unigram_pseudo = 0.25 disagrees with baseline.window-unigram.pseudo = 2$"):
        stored_recipe({**old, "baseline": {"window-unigram": {"pseudo": 2}}}, plugins, "m.json")

    (tmp_path / "meta.json").write_text(json.dumps({"step": 3, "recipe": old}))
    stored = read_meta(tmp_path)["recipe"]
    assert stored == old  # as written; validation reads it in the current keys
    recipe = validate_recipe(stored, plugins, "meta.json")
    assert recipe.eval.baselines == ["window-unigram"] and recipe.component("baseline", "window-unigram").pseudo == 0.25


def test_a_recipe_file_with_a_replaced_key_is_refused_saying_what_to_write(tmp_path):
    from megaseq.config import load_recipe

    plugins = fresh_plugins()
    plugins.register(Plugin(), name="unigram-test")
    (tmp_path / "r.toml").write_text("[eval]\nunigram_pseudo = 0.5\n")
    expected = (f"{tmp_path / 'r.toml'}: eval.unigram_pseudo: not a recipe key; baseline 'window-unigram' ((local)) replaces it: "
                'add "window-unigram" to eval.baselines and pseudo = 0.5 in [baseline.window-unigram]')
    for overrides in ([], ["eval.windows=2"]):
        with pytest.raises(ConfigError) as err:
            load_recipe(tmp_path / "r.toml", plugins, overrides)
        assert str(err.value) == expected
    (tmp_path / "r.toml").write_text("")
    with pytest.raises(ConfigError, match="eval.unigram_pseudo: not a recipe key"):
        load_recipe(tmp_path / "r.toml", plugins, ["eval.unigram_pseudo=0.5"])
    # without the component installed it is an unknown key like any other
    with pytest.raises(ConfigError, match="eval.unigram_pseudo: unknown key; allowed: windows"):
        load_recipe(tmp_path / "r.toml", fresh_plugins(), ["eval.unigram_pseudo=0.5"])


class AlsoReplaces:
    @hookimpl
    def megaseq_baseline(self):
        return [BaselineSpec(name="other", target=f"{__name__}:build", config=WindowUnigramConfig,
                             replaces={"eval.unigram_pseudo": "pseudo"})]


def test_replaced_keys_are_declared_precisely():
    for replaces, problem in (
        ({"eval.windows": "pseudo"}, "replaces 'eval.windows': it is a current recipe key"),
        ({"baseline.pseudo": "pseudo"}, "replaces 'baseline.pseudo': not 'TABLE.KEY' with TABLE one of core's recipe tables"),
        ({"eval.old_key": "k"}, "replaces 'eval.old_key': its config has no field 'k' (fields: pseudo)"),
    ):
        with pytest.raises(ValueError, match=re.escape(problem)):
            BaselineSpec(name="b", target="m:build", config=WindowUnigramConfig, replaces=replaces)
    plugins = fresh_plugins()
    plugins.register(Plugin(), name="unigram-test")
    plugins.register(AlsoReplaces(), name="also")
    with pytest.raises(ConfigError, match=r"^m.json: eval.unigram_pseudo: replaced by both baseline 'other' \(\(local\)\) and "
                                          r"baseline 'window-unigram' \(\(local\)\); uninstall all but one"):
        validate_recipe({"eval": {"unigram_pseudo": 1.0}}, plugins, "m.json")
