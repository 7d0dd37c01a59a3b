"""The eval analysis suite (megaseq_testkit.eval_analysis) on a reference analysis, and on wrong ones it must
catch; analyses in recipes (eval.analyses, [eval_analysis.NAME]) and in the held-out evaluation."""

from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest
import torch

from megaseq.config import validate_recipe
from megaseq.contracts import EvalInfo
from megaseq.data.tokenizer import N_ID
from megaseq.errors import ConfigError, PluginError
from megaseq.eval.evaluate import evaluate_heldout, heldout_windows
from megaseq.hookspecs import hookimpl
from megaseq.model import build_model
from megaseq.records import BaselineSpec, ComponentConfig, EvalAnalysisSpec
from megaseq_testkit import fresh_plugins
from megaseq_testkit.eval_analysis import EvalAnalysisConformance


class MeanLossConfig(ComponentConfig):
    scale: float = 1.0


class MeanLoss:
    """Reference: each scorer's weighted mean loss (times ``scale``) and its gain over the first baseline;
    with an out_dir, also a text file of them. Needs a baseline."""

    def __init__(self, config: MeanLossConfig, info: EvalInfo) -> None:
        if not info.baselines:
            raise ConfigError(f"{info.source}: [eval_analysis.mean-loss] needs a baseline; eval.baselines is empty")
        self.scale, self.info = config.scale, info
        self.sums = {s: np.zeros(info.windows) for s in info.scorers}
        self.weights = {s: np.zeros(info.windows) for s in info.scorers}

    def add(self, scorer, window, ids, losses, weights):
        self.sums[scorer][window] = np.where(weights > 0, losses, 0.0) @ weights
        self.weights[scorer][window] = weights.sum()

    def result(self) -> dict:
        means = {s: self.scale * float(self.sums[s].sum() / self.weights[s].sum()) for s in self.info.scorers}
        reference = self.info.baselines[0]
        return {"mean": means, "gain": {s: means[reference] - m for s, m in means.items()}}

    def finish(self, out_dir):
        result = self.result()
        table = "".join(f"{s}: {m:.4f}\n" for s, m in result["mean"].items())
        if out_dir is not None:
            (out_dir / "mean_loss.txt").write_text(table)
        return result, table


def build(config: MeanLossConfig, info: EvalInfo) -> MeanLoss:
    return MeanLoss(config, info)


def build_from_dict(config: dict, info: EvalInfo) -> MeanLoss:
    """The reference as a suite's `factory` builds it: from the plain config dict."""
    return MeanLoss(MeanLossConfig(**config), info)


class Uniform:
    """A baseline that gives each base probability 1/4."""

    label = "uniform"

    def token_losses(self, inputs, targets):
        return torch.where(targets == N_ID, 0.0, math.log(4.0)).expand(targets.shape).double()


def build_uniform(config, train):
    return Uniform()


class Plugin:
    @hookimpl
    def megaseq_eval_analysis(self):
        return [EvalAnalysisSpec(name="mean-loss", target=f"{__name__}:build", config=MeanLossConfig, summary="test")]

    @hookimpl
    def megaseq_baseline(self):
        return [BaselineSpec(name="uniform", target=f"{__name__}:build_uniform", summary="test")]


class TestReferenceConformance(EvalAnalysisConformance):
    name = "mean-loss"
    factory = f"{__name__}:build_from_dict"
    config = {"scale": 2.0}


class TestRegisteredReferenceConformance(EvalAnalysisConformance):
    """Through a plugin manager, as an installed analysis is tested (its record's alphabets included)."""

    name = "mean-loss"

    def plugins(self):
        return _plugins()


class TestProteinReferenceConformance(TestReferenceConformance):
    """The same analysis fed protein windows (it reads no ids, so any alphabet serves)."""

    alphabet = "protein"


class NoFinish:
    def __init__(self, config, info) -> None:
        pass

    def add(self, scorer, window, ids, losses, weights):
        pass


class NumpyResult(MeanLoss):
    """Returns numpy arrays, which json cannot write."""

    def result(self):
        return {**super().result(), "sums": self.sums}


class WritesToCwd(MeanLoss):
    def finish(self, out_dir):
        result, table = super().finish(out_dir)
        with open("mean_loss.txt", "w") as f:  # the current directory, whatever out_dir is
            f.write(table)
        return result, table


class FirstFedIsReference(MeanLoss):
    """The gain is over whichever scorer was fed first."""

    def add(self, scorer, window, ids, losses, weights):
        self.__dict__.setdefault("first", scorer)
        super().add(scorer, window, ids, losses, weights)

    def result(self):
        result = super().result()
        return {**result, "gain": {s: result["mean"][self.first] - m for s, m in result["mean"].items()}}


class CountsUnscored(MeanLoss):
    """Weights the losses without leaving out the weight-0 targets: inf x 0 is NaN."""

    def add(self, scorer, window, ids, losses, weights):
        with np.errstate(invalid="ignore"):
            self.sums[scorer][window] = (losses * weights).sum()
        self.weights[scorer][window] = weights.sum()


class Drifting(MeanLoss):
    """Each build differs (an unseeded random scale)."""

    def __init__(self, config, info) -> None:
        super().__init__(config, info)
        self.scale = 1.0 + random.random()


class PerWindowMean(MeanLoss):
    """Averages each window's targets, then the windows: a window of few scored targets counts as much as a full
    one."""

    def result(self):
        means = {s: self.scale * float(np.mean(self.sums[s] / self.weights[s])) for s in self.info.scorers}
        reference = self.info.baselines[0]
        return {"mean": means, "gain": {s: means[reference] - m for s, m in means.items()}}


class CrossesDocuments(MeanLoss):
    """Also reports each scorer's mean loss on targets whose preceding 8 letters occurred earlier in the window,
    looking back across N (into the previous document)."""

    K = 8

    def __init__(self, config, info) -> None:
        super().__init__(config, info)
        self.repeat_sums = {s: np.zeros(info.windows) for s in info.scorers}
        self.repeat_weights = {s: np.zeros(info.windows) for s in info.scorers}

    def repeated(self, ids):
        seen, out = set(), np.zeros(len(ids) - 1, dtype=bool)
        for p in range(len(ids) - 1):
            if p >= self.K - 1:
                kmer = tuple(ids[p - self.K + 1 : p + 1])
                out[p] = kmer in seen
                seen.add(kmer)
        return out

    def add(self, scorer, window, ids, losses, weights):
        super().add(scorer, window, ids, losses, weights)
        chosen = np.where(self.repeated(ids), weights, 0.0)
        self.repeat_sums[scorer][window] = np.where(chosen > 0, losses, 0.0) @ chosen
        self.repeat_weights[scorer][window] = chosen.sum()

    def result(self):
        repeats = {s: float(self.repeat_sums[s].sum() / max(self.repeat_weights[s].sum(), 1e-300)) for s in self.info.scorers}
        return {**super().result(), "repeats": repeats}


@pytest.mark.parametrize(
    ("wrong", "check"),
    [
        (NoFinish, "test_protocol"),
        (NumpyResult, "test_result_is_json_and_table_is_text"),
        (WritesToCwd, "test_writes_only_into_out_dir"),
        (FirstFedIsReference, "test_feed_order_does_not_matter"),
        (CountsUnscored, "test_unscored_targets_do_not_count"),
        (Drifting, "test_deterministic"),
        (PerWindowMean, "test_targets_count_by_weight"),
        (CrossesDocuments, "test_context_stops_at_n"),
    ],
    ids=lambda v: v.__name__ if isinstance(v, type) else v,
)
def test_suite_catches_wrong_analysis(wrong: type, check: str, tmp_path, monkeypatch) -> None:
    class Suite(EvalAnalysisConformance):
        name = wrong.__name__

        def build(self):
            return wrong(MeanLossConfig(), self.info())

    method = getattr(Suite(), check)
    kwargs = {"tmp_path": tmp_path, "monkeypatch": monkeypatch} if check == "test_writes_only_into_out_dir" else {}
    with pytest.raises(AssertionError):
        method(**kwargs)


@pytest.mark.parametrize("wrong", [PerWindowMean, CrossesDocuments], ids=lambda v: v.__name__)
def test_the_new_wrong_analyses_pass_every_other_check(wrong, tmp_path, monkeypatch):
    """Only the check named for each catches it."""
    class Suite(EvalAnalysisConformance):
        name = wrong.__name__

        def build(self):
            return wrong(MeanLossConfig(), self.info())

    caught = {PerWindowMean: "test_targets_count_by_weight", CrossesDocuments: "test_context_stops_at_n"}[wrong]
    for check in (n for n in dir(Suite) if n.startswith("test_") and n != caught):
        kwargs = {"tmp_path": tmp_path / check, "monkeypatch": monkeypatch} if check == "test_writes_only_into_out_dir" else {}
        if kwargs:
            kwargs["tmp_path"].mkdir()
        getattr(Suite(), check)(**kwargs)


RAW = {
    "run": {"device": "cpu", "name": "analysis-test"},
    "data": {"train": "excerpt-chr20", "heldout": "excerpt-chrX", "seq_len": 64},
    "model": {"d_model": 16, "n_layers": 1},
    "eval": {"windows": 3, "batch_size": 2, "first_bucket": 16},
}


def _plugins():
    plugins = fresh_plugins()
    plugins.register(Plugin(), name="mean-loss-test")
    return plugins


def test_the_evaluation_feeds_every_scorer_and_reports_the_analysis(tmp_path):
    """evaluate_heldout feeds the model's and a baseline's losses (megaseq's ids, the loss weights) to the
    analysis: its means equal the evaluation's own bits/base; heldout.json holds its result, the table its
    text, out_dir its file."""
    plugins = _plugins()
    recipe = validate_recipe({**RAW, "eval": {**RAW["eval"], "baselines": ["uniform"], "analyses": ["mean-loss"]},
                              "eval_analysis": {"mean-loss": {"scale": 2.0}}}, plugins, "r.toml")
    assert recipe.to_dict()["eval_analysis"] == {"mean-loss": {"scale": 2.0}}
    torch.manual_seed(0)
    model = build_model(recipe, plugins)
    out = tmp_path / "eval"
    result = evaluate_heldout(model, recipe, torch.device("cpu"), plugins, out_dir=out)
    means = result["analyses"]["mean-loss"]["mean"]
    for scorer in ("model", "uniform"):
        assert means[scorer] / 2.0 / math.log(2) == pytest.approx(result["results"][scorer]["bits_per_base"], rel=1e-5)
    saved = json.loads((out / "heldout.json").read_text())
    assert saved["analyses"]["mean-loss"]["result"] == result["analyses"]["mean-loss"]
    assert saved["analyses"]["mean-loss"]["table"] == (out / "mean_loss.txt").read_text()
    assert "uniform: " in result["table"] and (out / "mean_loss.txt").read_text() in result["table"]
    no_baseline = evaluate_heldout(model, recipe, torch.device("cpu"), plugins, baseline=False)
    assert no_baseline["analyses"] == {}  # --no-baseline: neither baselines nor analyses


def test_the_analysis_sees_each_window_once_with_its_ids():
    """The ids fed are each window's inputs followed by its last target, in megaseq's token ids."""
    seen = {}

    class Recorder(MeanLoss):
        def add(self, scorer, window, ids, losses, weights):
            assert (scorer, window) not in seen
            seen[(scorer, window)] = ids.copy()
            super().add(scorer, window, ids, losses, weights)

    plugins = _plugins()
    recipe = validate_recipe({**RAW, "eval": {**RAW["eval"], "baselines": [], "analyses": []}}, plugins, "r.toml")
    from megaseq.eval.evaluate import score_model

    windows, indices = heldout_windows(recipe, plugins)
    analysis = Recorder(MeanLossConfig(), EvalInfo("r.toml", 64, len(indices), ("unused",)))
    score_model(build_model(recipe, plugins), recipe, windows, indices, torch.device("cpu"), analyses=[analysis])
    assert sorted(seen) == [("model", w) for w in range(len(indices))]
    for w, index in enumerate(indices):
        batch = windows.batch([index])
        assert seen[("model", w)].tolist() == [*batch.inputs[0].tolist(), batch.targets[0, -1].item()]


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"eval": {"analyses": ["nope"]}}, "r.toml: eval.analyses[0]: no eval_analysis named 'nope'; available: mean-loss"),
        ({"eval_analysis": {"mean-loss": {}}}, "r.toml: [eval_analysis.mean-loss] is configured but not used by eval.analyses"),
        ({"eval": {"analyses": ["mean-loss"]}, "eval_analysis": {"mean-loss": {"k": 1}}},
         "r.toml: eval_analysis.mean-loss.k: unknown key; allowed: scale"),
    ],
)
def test_analysis_mistakes_are_one_line(raw, message):
    with pytest.raises((ConfigError, PluginError)) as err:
        validate_recipe({**RAW, **raw}, _plugins(), "r.toml")
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_an_analysis_that_cannot_serve_the_recipe_refuses_before_scoring():
    plugins = _plugins()
    recipe = validate_recipe({**RAW, "eval": {**RAW["eval"], "analyses": ["mean-loss"]}}, plugins, "r.toml")

    class Unscorable(torch.nn.Module):
        def forward(self, *args):
            raise AssertionError("the model was scored before the analysis refused")

    with pytest.raises(ConfigError, match=r"^r.toml: \[eval_analysis.mean-loss\] needs a baseline"):
        evaluate_heldout(Unscorable(), recipe, torch.device("cpu"), plugins)
