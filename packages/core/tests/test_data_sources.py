"""Data sources with a recipe section and an alphabet: an outside author's protein source (sequences one per
line, split into a training and a held-out part) configured by ``[data_source.NAME]``, trained and evaluated
end to end on the CPU; the recipe's checks of data, vocabulary and the alphabets baselines and analyses handle;
fetch requests and the shim for ``fetch(cache_dir)``; a source's file named by a relative path, read alike by the
one-process trainer and a launcher's workers."""

from __future__ import annotations

import hashlib
import json
import math
import random
import warnings
from pathlib import Path

import pytest
import torch

from megaseq.alphabets import PROTEIN
from megaseq.config import apply_overrides, load_recipe, validate_recipe
from megaseq.data import Corpus, fetch, token_metadata, tokenized
from megaseq.data.errors import DataError
from megaseq.distributed.launch import with_absolute_paths
from megaseq.errors import ConfigError, PluginError
from megaseq.hookspecs import hookimpl
from megaseq.records import BaselineSpec, ComponentConfig, DataSourceSpec, EvalAnalysisSpec, FetchRequest, LocalPath
from megaseq.train.trainer import Trainer
from megaseq_testkit import fresh_plugins, registered


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGASEQ_CACHE", str(tmp_path / "cache"))


# -- the outside author's plugin ---------------------------------------------------------------------------


class SeqLinesConfig(ComponentConfig):
    path: LocalPath
    heldout_lines: int = 3


def fetch_seqlines(request: FetchRequest) -> Path:
    """One protein a line; the last ``heldout_lines`` lines are the held-out part, the others the training part.
    The FASTA is written once per input file version and part, into ``cache_dir / name``."""
    source = Path(request.config.path)
    stat = source.stat()
    key = hashlib.sha256(f"{source.resolve()}:{stat.st_size}:{stat.st_mtime_ns}:{request.config.heldout_lines}".encode())
    out = request.cache_dir / request.name / f"{key.hexdigest()[:12]}-{request.part}.fa"
    if not out.is_file():
        lines = [line.strip() for line in source.read_text().splitlines() if line.strip()]
        cut = len(lines) - request.config.heldout_lines
        chosen = list(enumerate(lines))[:cut] if request.part == "train" else list(enumerate(lines))[cut:]
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text("".join(f">line{i + 1}\n{seq}\n" for i, seq in chosen))
    return out


class UniformConfig(ComponentConfig):
    pass


class UniformOverLetters:
    """A baseline for any alphabet: every letter equally likely."""

    def __init__(self, train: Corpus) -> None:
        self.alphabet = train.alphabet
        self.label = f"uniform-{self.alphabet.name}"

    def token_losses(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = torch.full(targets.shape, math.log(len(self.alphabet.letters)), dtype=torch.float64)
        return torch.where(targets == self.alphabet.unknown_id, 0.0, loss)


def build_uniform(config: UniformConfig, train: Corpus) -> UniformOverLetters:
    return UniformOverLetters(train)


def build_dna_only(config: UniformConfig, train: Corpus) -> UniformOverLetters:
    raise AssertionError("a baseline that does not handle the data's alphabet was built")


class ProteinPlugin:
    @hookimpl
    def megaseq_data_source(self):
        return [DataSourceSpec(name="seqlines", target=f"{__name__}:fetch_seqlines", config=SeqLinesConfig,
                               alphabet=PROTEIN, parts=True, summary="proteins, one a line")]

    @hookimpl
    def megaseq_baseline(self):
        return [
            BaselineSpec(name="uniform", target=f"{__name__}:build_uniform", config=UniformConfig,
                         alphabets=frozenset({"dna", "protein"}), summary="every letter equally likely"),
            BaselineSpec(name="dna-only", target=f"{__name__}:build_dna_only", config=UniformConfig, summary="DNA"),
        ]

    @hookimpl
    def megaseq_eval_analysis(self):
        return [EvalAnalysisSpec(name="dna-analysis", target=f"{__name__}:build_dna_only", summary="DNA")]


def protein_file(tmp_path: Path, lines: int = 30, seed: int = 0) -> Path:
    rng = random.Random(seed)
    path = tmp_path / "proteins.txt"
    path.write_text("".join("".join(rng.choices(PROTEIN.letters, k=rng.randint(60, 140))) + "\n" for _ in range(lines)))
    return path


def protein_recipe(tmp_path: Path, plugins, **extra) -> dict:
    return {
        "run": {"name": "protein", "out_dir": str(tmp_path / "run"), "device": "cpu"},
        "data": {"train": "seqlines", "heldout": "seqlines", "seq_len": 32},
        "data_source": {"seqlines": {"path": str(protein_file(tmp_path))}},
        "model": {"d_model": 16, "n_layers": 1},
        "attention": {"sdpa": {"n_heads": 2}},
        "train": {"steps": 3, "batch_size": 2, "warmup_steps": 1, "log_every": 1},
        "eval": {"windows": 3, "batch_size": 2, "first_bucket": 8},
        **extra,
    }


# -- end to end ----------------------------------------------------------------------------------------------


def test_a_protein_data_source_trains_and_evaluates_end_to_end(tmp_path):
    plugins = fresh_plugins()
    with registered(ProteinPlugin(), plugins, "protein-plugin"):
        raw = protein_recipe(tmp_path, plugins, eval={"windows": 3, "batch_size": 2, "first_bucket": 8,
                                                      "baselines": ["uniform"]})
        recipe = validate_recipe(raw, plugins, "p.toml")
        assert recipe.alphabet is PROTEIN and recipe.model.vocab_size == 21  # the vocabulary from the alphabet
        assert recipe.to_dict()["data_source"] == {"seqlines": {"path": raw["data_source"]["seqlines"]["path"],
                                                                "heldout_lines": 3}}
        trainer = Trainer(recipe, plugins, progress=False, tensorboard=False)
        assert int(trainer.train_windows.batch([0, 1]).targets.max()) >= 5  # ids beyond DNA's
        result = trainer.run()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [row["bits_per_base"] for row in rows if "loss" in row]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)
    # an untrained model over 21 tokens starts near log2(21) bits per residue, not log2(5)
    assert abs(losses[0] - math.log2(21)) < 1.0
    heldout = json.loads((tmp_path / "run" / "eval" / "step_0000003" / "heldout.json").read_text())
    assert (heldout["alphabet"], heldout["unit"]) == ("protein", "residue")
    assert set(heldout["results"]) == {"model", "uniform-protein"}
    assert heldout["results"]["uniform-protein"]["bits_per_base"] == pytest.approx(math.log2(20))
    assert result.eval is not None and result.eval["windows"] == 3


def test_the_two_parts_of_a_source_are_fetched_apart(tmp_path):
    plugins = fresh_plugins()
    with registered(ProteinPlugin(), plugins, "protein-plugin"):
        recipe = validate_recipe(protein_recipe(tmp_path, plugins), plugins, "p.toml")
        train, heldout = recipe.corpus("train", plugins), recipe.corpus("heldout", plugins)
        assert (train.part, heldout.part, str(train)) == ("train", "heldout", "seqlines")
        names = [[r["name"] for r in token_metadata(c)["records"]] for c in (train, heldout)]
        assert names[1] == ["line28", "line29", "line30"] and names[0][-1] == "line27" and len(names[0]) == 27
        assert token_metadata(train)["alphabet"] == "protein" and tokenized(train).max() < 64


# -- recipe checks -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda raw: raw["data_source"]["seqlines"].update(lines=3),
         "p.toml: data_source.seqlines.lines: unknown key; allowed: path, heldout_lines"),
        (lambda raw: raw.pop("data_source"), "p.toml: data_source.seqlines.path: Field required"),
        (lambda raw: raw["data"].update(train="excerpt-chr20", heldout="excerpt-chrX"),
         "p.toml: [data_source.seqlines] is configured but not used by data.train or data.heldout"),
        (lambda raw: raw["data"].update(heldout="excerpt-chrX"),
         "p.toml: data.heldout: 'excerpt-chrX' is dna but data.train 'seqlines' is protein; held-out data must be in"),
        (lambda raw: raw["eval"].update(baselines=["dna-only"]),
         "p.toml: eval.baselines[0]: baseline 'dna-only' handles dna, not protein (the alphabet of data.train "
         "'seqlines'); allowed: uniform"),
        (lambda raw: raw["eval"].update(analyses=["dna-analysis"]),
         "p.toml: eval.analyses[0]: eval_analysis 'dna-analysis' handles dna, not protein (the alphabet of data.train "
         "'seqlines'); allowed: no installed eval_analysis handles protein"),
        (lambda raw: raw.update(data_source={"seqlinse": {"path": "x"}}, data={"train": "seqlinse", "heldout": "x.fa"}),
         "p.toml: data.train: no data_source named 'seqlinse'; available: excerpt-chr20, excerpt-chrX, seqlines"),
        (lambda raw: raw["model"].update(vocab_size=5), "p.toml: model.vocab_size: 5 is below the 21 tokens of the data's "
         "alphabet protein"),
        (lambda raw: raw["data"].update(token_ids=[0, 1, 2, 3, 4]), "p.toml: data.token_ids: gives the ids of A, C, G, "
         "T, N (an imported DNA model), but the data is protein"),
    ],
)
def test_data_mistakes_are_one_line(tmp_path, change, message):
    plugins = fresh_plugins()
    with registered(ProteinPlugin(), plugins, "protein-plugin"):
        raw = protein_recipe(tmp_path, plugins)
        change(raw)
        with pytest.raises((ConfigError, PluginError)) as err:
            validate_recipe(raw, plugins, "p.toml")
    assert str(err.value).startswith(message) and "\n" not in str(err.value), str(err.value)


def test_a_source_without_parts_is_not_both_train_and_heldout():
    with pytest.raises(ConfigError, match=r"^r.toml: data.heldout: 'excerpt-chr20' is also data.train, and its data "
                       "source declares no separate held-out part"):
        validate_recipe({"data": {"train": "excerpt-chr20", "heldout": "excerpt-chr20"}}, fresh_plugins(), "r.toml")


def test_set_configures_a_data_source_and_deselecting_drops_its_section(tmp_path):
    plugins = fresh_plugins()
    with registered(ProteinPlugin(), plugins, "protein-plugin"):
        raw = protein_recipe(tmp_path, plugins)
        (tmp_path / "other").mkdir()
        other = protein_file(tmp_path / "other", seed=1)
        recipe = validate_recipe(apply_overrides(raw, [f"data_source.seqlines.path={other}",
                                                       "data_source.seqlines.heldout_lines=4"]), plugins, "p.toml")
        assert recipe.component("data_source", "seqlines") == SeqLinesConfig(path=str(other), heldout_lines=4)
        # one of the two keys still selects seqlines: its section stays
        kept = apply_overrides(raw, ["data.heldout=seqlines", "data.train=seqlines"])
        assert "seqlines" in kept["data_source"]
        dropped = apply_overrides(raw, ["data.train=excerpt-chr20", "data.heldout=excerpt-chrX"])
        assert "seqlines" not in dropped.get("data_source", {})
        validate_recipe(dropped, plugins, "p.toml")


# -- a relative path to a source's file ----------------------------------------------------------------------


def test_a_relative_source_path_reaches_the_workers_as_the_one_process_trainer_reads_it(tmp_path, monkeypatch):
    # the guide's layout: the recipe in a folder of its own, the data file in the working directory, which the
    # path is relative to; a file of the same name where the workers start is not the one meant
    launch, workers = tmp_path / "launch", tmp_path / "ray-worker"
    for folder, seed in ((launch, 0), (workers, 1)):
        folder.mkdir()
        protein_file(folder, seed=seed)
    (launch / "recipes").mkdir()
    (launch / "recipes" / "p.toml").write_text(
        '[data]\ntrain = "seqlines"\nheldout = "seqlines"\nseq_len = 32\n\n'
        '[data_source.seqlines]\npath = "proteins.txt"\n'
    )
    plugins = fresh_plugins()
    with registered(ProteinPlugin(), plugins, "protein-plugin"):
        monkeypatch.chdir(launch)
        recipe = load_recipe("recipes/p.toml", plugins)  # what `megaseq train` reads, with or without workers
        one_process = tokenized(recipe.corpus("train", plugins), plugins=plugins)
        handed = with_absolute_paths(recipe).to_dict()  # what the launcher hands its workers
        monkeypatch.chdir(workers)
        worker = validate_recipe(handed, plugins, source=recipe.source)  # what each worker reads (run_worker)
        assert worker.component("data_source", "seqlines").path == str(launch / "proteins.txt")
        assert (tokenized(worker.corpus("train", plugins), plugins=plugins) == one_process).all()


class PathDefaults(ComponentConfig):
    given: LocalPath = "given.txt"
    default: LocalPath = "default.txt"
    optional: LocalPath | None = "optional"
    absent: LocalPath | None = None
    text: str = "not-a-path"


def test_a_local_path_is_absolute_against_the_working_directory_its_default_too(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = PathDefaults(given="~/data/x.txt")
    assert config == PathDefaults(given=str(Path.home() / "data" / "x.txt"), default=str(tmp_path / "default.txt"),
                                  optional=str(tmp_path / "optional"), absent=None, text="not-a-path")
    monkeypatch.chdir(tmp_path.parent)
    assert PathDefaults(**config.model_dump()) == config  # read again elsewhere: the same files


# -- fetch requests ------------------------------------------------------------------------------------------


def fetch_by_name(request: FetchRequest) -> Path:
    """One target for two records: the request names the record."""
    path = request.cache_dir / request.name / "x.fa"
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists():
        path.write_text(f">{request.name}\n{'ACGT' if request.name == 'first' else 'GGCC'}\n")
    return path


def fetch_old(cache_dir: Path) -> Path:
    path = cache_dir / "old" / "x.fa"
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists():
        path.write_text(">old\nACGT\n")
    return path


class ByName:
    @hookimpl
    def megaseq_data_source(self):
        return [DataSourceSpec(name=name, target=f"{__name__}:fetch_by_name", summary=name) for name in ("first", "second")]


class Old:
    @hookimpl
    def megaseq_data_source(self):
        return [DataSourceSpec(name="old", target=f"{__name__}:fetch_old", summary="fetch(cache_dir)")]


def test_a_fetch_target_is_told_its_record(tmp_path):
    plugins = fresh_plugins()
    with registered(ByName(), plugins, "by-name"):
        assert fetch("first", tmp_path, plugins).read_text() == ">first\nACGT\n"
        assert fetch("second", tmp_path, plugins).read_text() == ">second\nGGCC\n"


def test_fetch_cache_dir_still_works_with_a_warning(tmp_path):
    plugins = fresh_plugins()
    with registered(Old(), plugins, "old"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert fetch("old", tmp_path, plugins) == tmp_path / "old" / "x.fa"
    (warning,) = [w for w in caught if issubclass(w.category, DeprecationWarning)]
    assert "fetch(cache_dir) is deprecated; take fetch(request: megaseq.records.FetchRequest)" in str(warning.message)


def test_a_config_mistake_outside_a_recipe_is_one_line(tmp_path):
    plugins = fresh_plugins()
    with registered(ProteinPlugin(), plugins, "protein-plugin"), pytest.raises(DataError) as err:
        fetch("seqlines", tmp_path, plugins, config={"heldout_lines": 2})
    assert str(err.value) == ("data_source.seqlines.path: Field required; allowed keys: path, heldout_lines (set them in "
                              "the recipe's [data_source.seqlines] section)")
