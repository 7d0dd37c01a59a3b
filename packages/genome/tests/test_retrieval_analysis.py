"""The ``retrieval`` eval analysis: its conformance suite, planted repeats through the held-out evaluation
(``evaluate_heldout`` and ``megaseq train``'s final evaluation), and its one-line refusals."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

import megaseq_genome.plugin
from megaseq.cli import main
from megaseq.config import validate_recipe
from megaseq.contracts import EvalInfo
from megaseq.data.tokenizer import N_ID
from megaseq.errors import ConfigError
from megaseq.eval.evaluate import evaluate_heldout
from megaseq.hookspecs import hookimpl
from megaseq.model import build_model
from megaseq.records import BaselineSpec
from megaseq_genome.config import RetrievalConfig
from megaseq_genome.retrieval import BUCKETS, RetrievalLoss, build, last_occurrence
from megaseq_testkit import fresh_plugins
from megaseq_testkit.eval_analysis import EvalAnalysisConformance

REPO = Path(__file__).resolve().parents[3]
K = 20


class TestRetrievalConformance(EvalAnalysisConformance):
    name = "retrieval"
    config = {"bootstrap_samples": 200}


def test_weight_zero_targets_do_not_count():
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 4, size=301)
    ids[200:260] = ids[20:80]
    losses = rng.uniform(0.5, 2.0, size=300)
    weights = np.ones(300)
    weights[[5, 210, 250]] = 0.0
    wild, zeroed = RetrievalLoss(1), RetrievalLoss(1)
    wild.add(0, ids, np.where(weights > 0, losses, np.nan), weights)
    zeroed.add(0, ids, np.where(weights > 0, losses, 0.0), weights)
    for field in RetrievalLoss.FIELDS:
        np.testing.assert_array_equal(getattr(wild, field), getattr(zeroed, field))
    assert wild.counts[0].sum(1).tolist() == [297.0] * 4  # every k: the 300 targets but the three of weight 0


def copier_losses(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """ln 4 (uniform) everywhere, but 0 where the last earlier occurrence of the target's 20-mer is followed
    by the target: an exact copier at every distance."""
    out = torch.full(targets.shape, math.log(4.0), dtype=torch.float64)
    for row in range(targets.shape[0]):
        ids = torch.cat([inputs[row], targets[row, -1:]]).numpy()
        out[row, torch.from_numpy(last_occurrence(ids, K)[1])] = 0.0
    return torch.where(targets == N_ID, 0.0, out)


class Uniform:
    label = "uniform"

    def token_losses(self, inputs, targets):
        return torch.where(targets == N_ID, 0.0, torch.full(targets.shape, math.log(4.0), dtype=torch.float64))


class Copier:
    label = "copier"

    def token_losses(self, inputs, targets):
        return copier_losses(inputs, targets)


def build_uniform(config, train):
    return Uniform()


def build_copier(config, train):
    return Copier()


class BaselinesPlugin:
    @hookimpl
    def megaseq_baseline(self):
        return [BaselineSpec(name="uniform", target=f"{__name__}:build_uniform", summary="test"),
                BaselineSpec(name="copier", target=f"{__name__}:build_copier", summary="test")]


SEQ_LEN, SOURCE, SIZE = 1024, 100, 60
DISTANCES = (700, 200)  # window 0: 512-4k; window 1: < 512


def planted_fasta(path: Path) -> Path:
    """Two held-out windows of random bases, each with 60 bases copied from 100 to 100 + distance; the bases
    just before and after the copy differ from the source's, so exactly the targets whose 20-mer lies in the
    copy (41 of them) find it, and the last one's copy is wrong."""
    rng = np.random.default_rng(11)
    tokens = rng.integers(0, 4, size=2 * SEQ_LEN + 1)
    for window, distance in enumerate(DISTANCES):
        ids = tokens[window * SEQ_LEN : (window + 1) * SEQ_LEN + 1]  # a view: windows start every SEQ_LEN
        ids[SOURCE + distance : SOURCE + distance + SIZE] = ids[SOURCE : SOURCE + SIZE]
        ids[SOURCE + distance - 1] = (ids[SOURCE - 1] + 1) % 4
        ids[SOURCE + distance + SIZE] = (ids[SOURCE + SIZE] + 1) % 4
    path.write_text(">planted\n" + "".join("ACGT"[t] for t in tokens) + "\n")
    return path


def recipe_for(fasta: Path, plugins, **retrieval) -> object:
    raw = {
        "run": {"device": "cpu", "name": "retrieval-test"},
        "data": {"train": str(fasta), "heldout": str(fasta), "seq_len": SEQ_LEN},
        "model": {"d_model": 16, "n_layers": 1},
        "eval": {"windows": 2, "batch_size": 1, "baselines": ["uniform", "copier"], "analyses": ["retrieval"]},
        "eval_analysis": {"retrieval": {"bootstrap_samples": 200, **retrieval}},
    }
    return validate_recipe(raw, plugins, "r.toml")


def genome_plugins():
    plugins = fresh_plugins()
    plugins.register(megaseq_genome.plugin, name="megaseq-genome-test")
    plugins.register(BaselinesPlugin(), name="retrieval-test-baselines")
    return plugins


def test_planted_repeats_land_in_their_buckets_through_the_evaluation(tmp_path):
    """evaluate_heldout with eval.analyses = ["retrieval"]: the planted targets are counted in their distance
    buckets, the exact copier gets the perfect copier's bits there and captures all of its gain, the
    reference none; heldout.json, the table and the plot hold it."""
    plugins = genome_plugins()
    recipe = recipe_for(planted_fasta(tmp_path / "planted.fa"), plugins, reference="uniform")
    torch.manual_seed(0)
    out = tmp_path / "eval"
    result = evaluate_heldout(build_model(recipe, plugins), recipe, torch.device("cpu"), plugins, out_dir=out)
    table = result["analyses"]["retrieval"]
    i = table["ks"].index(K)
    assert table["reference"] == "uniform" and set(table["models"]) == {"model", "uniform", "copier"}
    expected = dict.fromkeys(BUCKETS, 0) | {"<512": SIZE - K + 1, "512-4k": SIZE - K + 1}
    expected["none"] = 2 * SEQ_LEN - 2 * (SIZE - K + 1)
    assert table["targets"][i] == list(expected.values())
    assert table["right_copies"][i] == [SIZE - K, SIZE - K, 0, 0, 0]
    copier = table["models"]["copier"]
    for b in (BUCKETS.index("<512"), BUCKETS.index("512-4k")):
        assert copier["bits_per_base"]["mean"][i][b] == pytest.approx(table["copier_bits"]["mean"][i][b], rel=1e-12)
        assert copier["captured"]["mean"][i][b] == pytest.approx(1.0)
        assert table["models"]["uniform"]["captured"]["mean"][i][b] == pytest.approx(0.0)
    assert copier["captured"]["mean"][i][BUCKETS.index("none")] is None  # no right copy there
    saved = json.loads((out / "heldout.json").read_text())["analyses"]["retrieval"]
    assert saved["result"] == json.loads(json.dumps(table)) and saved["table"] in result["table"]
    assert "| copier, captured | 100% [100, 100] | 100% [100, 100] | - | - | - |" in result["table"]
    assert (out / "retrieval_by_distance.png").stat().st_size > 1000


def test_the_default_reference_is_the_strongest_baseline(tmp_path):
    plugins = genome_plugins()
    recipe = recipe_for(planted_fasta(tmp_path / "planted.fa"), plugins)
    result = evaluate_heldout(build_model(recipe, plugins), recipe, torch.device("cpu"), plugins)
    assert result["analyses"]["retrieval"]["reference"] == "copier"  # its loss is the lowest


def test_refusals_are_one_line():
    info = EvalInfo("r.toml", 64, 2, ())
    with pytest.raises(ConfigError) as err:
        build(RetrievalConfig(), info)
    assert str(err.value) == ("r.toml: eval.analyses: retrieval measures the perfect copier's gain over a baseline and "
                              'eval.baselines scores none; add one, e.g. eval.baselines = ["markov"]')
    with pytest.raises(ConfigError) as err:
        build(RetrievalConfig(reference="markov-11"), EvalInfo("r.toml", 64, 2, ("markov-8",)))
    assert str(err.value) == ("r.toml: eval_analysis.retrieval.reference: 'markov-11' is not a scored baseline; "
                              "allowed: markov-8")


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (['eval.analyses=["retrieval"]', "eval.baselines=[]"], "eval.baselines scores none"),
        (['eval.analyses=["retrievl"]'], "eval.analyses[0]: no eval_analysis named 'retrievl'; available: retrieval"),
        (['eval.analyses=["retrieval"]', 'eval.baselines=["markov"]', "eval_analysis.retrieval.k=21"],
         "eval_analysis.retrieval.k: Input should be 12, 16, 20 or 32"),
    ],
)
def test_train_refuses_a_recipe_the_analysis_cannot_serve_before_training(sets, message, tmp_path, capsys):
    args = ["train", str(REPO / "recipes" / "tiny.toml"), "--set", f"run.out_dir={tmp_path / 'run'}", "--no-progress"]
    assert main([*args, *(item for s in sets for item in ("--set", s))]) == 2
    # one error line (reading the held-out data for its alphabet may first tokenise it, which says so)
    (line,) = [line for line in capsys.readouterr().err.strip().splitlines() if not line.startswith("megaseq: tokenised")]
    assert message in line, line
    assert not (tmp_path / "run").exists()  # nothing trained


def test_train_prints_the_retrieval_table_of_its_final_evaluation(tmp_path, capsys):
    """megaseq train with eval.analyses = ["retrieval"]: the final evaluation's table, printed under the
    position table, counts the planted targets in their buckets; heldout.json and the plot are written."""
    fasta = str(planted_fasta(tmp_path / "planted.fa"))
    sets = [f"data.train={fasta}", f"data.heldout={fasta}", f"data.seq_len={SEQ_LEN}", "train.steps=1",
            "train.batch_size=1", "eval.windows=2", "eval.batch_size=1", 'eval.baselines=["markov"]',
            "baseline.markov.order=2", 'eval.analyses=["retrieval"]', "eval_analysis.retrieval.bootstrap_samples=100",
            f"run.out_dir={tmp_path / 'run'}"]
    args = ["train", str(REPO / "recipes" / "tiny.toml"), "--no-progress", *(item for s in sets for item in ("--set", s))]
    assert main(args) == 0
    out = capsys.readouterr().out
    none = 2 * SEQ_LEN - 2 * (SIZE - K + 1)
    assert f"| targets | {SIZE - K + 1} | {SIZE - K + 1} | 0 | 0 | {none:,} |" in out, out
    assert f"| right copies | {SIZE - K} | {SIZE - K} | 0 | 0 | 0 |" in out and "| model, captured |" in out, out
    where = tmp_path / "run" / "eval" / "step_0000001"
    assert json.loads((where / "heldout.json").read_text())["analyses"]["retrieval"]["result"]["reference"] == "markov-2"
    assert (where / "retrieval_by_distance.png").stat().st_size > 1000
