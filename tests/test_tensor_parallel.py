"""Tensor parallelism (with sequence parallelism) on gloo ranks equals the single process.

A dense recipe (core's sdpa attention and SwiGLU FFN, the 5-id vocabulary split over ranks in padded blocks) trains two optimizer
steps under tp=2 and under tp=2 x cp=2 and must log the same loss, tokens, gradient norm and metrics and
reach the same weights as one process (fp32, 1e-5 relative); so does recipes/kda-cpu.toml (KDA attention,
heads split over ranks), shrunk to tiny widths and 96 tokens. Each tp=2 rank holds half of every split
tensor's bytes. The tp=2 checkpoint, written per tensor-parallel block, resumes in one process. Layouts the
recipe's components cannot run (core's and the plugins' heads or widths that tp does not divide, a component
without tensor parallelism) are one line, exit 2, before any worker starts.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("megatron.core", reason="needs the distributed extra: pip install 'megaseq-core[distributed]'")

from megaseq.cli import main
from megaseq.distributed.layout import Layout
from megaseq_testkit.distributed import run_gloo
from megaseq_testkit.layouts import assert_same_run, single_trainer, train_single, train_under_layouts

pytestmark = pytest.mark.usefixtures("module_cache")  # tests/conftest.py

RTOL = 1e-5

DENSE: dict[str, Any] = {
    "run": {"name": "dense", "device": "cpu"},
    "data": {"train": "excerpt-chr20", "heldout": "excerpt-chrX", "seq_len": 96},
    "model": {"d_model": 32, "n_layers": 2, "layer_pattern": ["sdpa"], "tie_embeddings": False},
    "attention": {"sdpa": {"n_heads": 4}},
    "ffn": {"swiglu": {"hidden": 64}},
    "train": {"steps": 3, "batch_size": 2, "warmup_steps": 1, "log_every": 1, "loss_chunk": 64},
    "eval": {"windows": 2, "batch_size": 2},
}



def kda_recipe() -> dict[str, Any]:
    """recipes/kda-cpu.toml (KDA attention in every layer, SwiGLU), shrunk to seconds per step."""
    raw = tomllib.loads((Path(__file__).parents[1] / "recipes" / "kda-cpu.toml").read_text())
    return {
        **raw,
        "run": {**raw["run"], "device": "cpu"},
        "data": {**raw["data"], "seq_len": 96},
        "model": {**raw["model"], "d_model": 32, "n_layers": 2},
        "attention": {"kda": {**raw["attention"]["kda"], "head_dim": 8}},
        "ffn": {"swiglu": {"hidden": 64}},
        "train": {**DENSE["train"], "lr": raw["train"]["lr"]},
        "eval": DENSE["eval"],
    }


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """The one-process run: its first two steps, then its third."""
    trainer = single_trainer(DENSE, tmp_path_factory.mktemp("single"))
    return train_single(trainer, 2), train_single(trainer, 1)


@pytest.mark.slow
def test_tp2_equals_one_process_holds_half_the_split_bytes_and_its_checkpoint_resumes_on_one(tmp_path, single):
    first_two, third = single
    ranks = run_gloo(2, train_under_layouts, DENSE, [Layout(tp=2)], str(tmp_path), 2, True)
    assert_same_run(ranks[0][0], first_two, RTOL, "tp=2")

    # every weight but the norms is split: a rank holds half of them, plus the replicated norms; the vocabulary
    # (5 ids) is padded to 2 blocks of 3 rows in the embedding and in the head
    weights = first_two["weights"]
    norms = sum(t.numel() * 4 for n, t in weights.items() if "norm" in n)
    split = sum(t.numel() * 4 for t in weights.values()) - norms
    padding = 2 * (3 * 2 - 5) * DENSE["model"]["d_model"] * 4
    for rank in ranks:
        assert rank[0]["parameter_bytes"] == (split + padding) // 2 + norms

    saved = Path(ranks[0][0]["checkpoint"])
    assert sorted(p.name for p in (saved / "shards").iterdir()) == [
        "rank0.optimizer.safetensors", "rank0.safetensors", "rank1.optimizer.safetensors", "rank1.safetensors"]
    resumed = single_trainer(DENSE, saved.parents[1])
    assert resumed.resume() and resumed.step == 2
    assert_same_run(train_single(resumed, 1), third, RTOL, "tp=2 checkpoint resumed with tp=1")


@pytest.mark.slow
def test_tp2_cp2_equals_one_process(tmp_path, single):
    layouts = [Layout(cp=2, tp=2)]
    assert_same_run(run_gloo(4, train_under_layouts, DENSE, layouts, str(tmp_path), 2)[0][0], single[0], RTOL, "tp=2,cp=2")


@pytest.fixture(scope="module")
def kda_single(tmp_path_factory):
    """The kda recipe's first two steps in one process."""
    return train_single(single_trainer(kda_recipe(), tmp_path_factory.mktemp("kda")), 2)


@pytest.mark.slow
def test_kda_recipe_tp2_equals_one_process(tmp_path, kda_single):
    ranks = run_gloo(2, train_under_layouts, kda_recipe(), [Layout(tp=2)], str(tmp_path), 2)
    assert_same_run(ranks[0][0], kda_single, RTOL, "kda recipe tp=2")


@pytest.mark.slow
def test_kda_recipe_tp2_cp2_equals_one_process(tmp_path, kda_single):
    ranks = run_gloo(4, train_under_layouts, kda_recipe(), [Layout(cp=2, tp=2)], str(tmp_path), 2)
    assert_same_run(ranks[0][0], kda_single, RTOL, "kda recipe tp=2,cp=2")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--parallel", "tp=2", "--set", "attention.sdpa.n_heads=3"], "parallel ep=1,tp=2: attention.sdpa: n_heads 3 is not a multiple of tp 2"),
        (["--parallel", "tp=2", "--set", "ffn.swiglu.hidden=63"], "ffn.swiglu: hidden width 63 is not a multiple of tp 2"),
        (["--parallel", "tp=2", "--memory-policy", "recompute", "--set", "memory_policy.recompute.tile_tokens=32"],
         "memory_policy.recompute.tile_tokens cannot run under tensor parallelism (tp=2"),
        (["--parallel", "tp=2", "--set", "train.optimizer_shard=true"], "train.optimizer_shard shards over data- and context-parallel ranks only"),
    ],
)
def test_impossible_tensor_parallel_layouts_are_one_line_exit_2(tmp_path, recipe_toml, capsys, args, message):
    recipe = tmp_path / "dense.toml"
    recipe.write_text(recipe_toml({**DENSE, "run": {**DENSE["run"], "out_dir": str(tmp_path / "run")}}))
    assert main(["train", str(recipe), *args]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
    assert not (tmp_path / "run").exists()


# The plugins' attentions under tp=2 with heads that tp does not divide (on the dense recipe's SwiGLU).
PLUGIN_HEADS = [
    ("kda", {"n_heads": 3, "head_dim": 8}, "attention.kda: n_heads 3 is not a multiple of tp 2"),
    ("dsa", {"n_heads": 3, "head_dim": 8, "index_heads": 3, "index_dim": 8}, "attention.dsa: n_heads 3 is not a multiple of tp 2"),
]


@pytest.mark.parametrize(("attention", "config", "message"), PLUGIN_HEADS)
def test_plugin_heads_that_tp_does_not_divide_are_one_line_exit_2(tmp_path, recipe_toml, capsys, attention, config, message):
    recipe = tmp_path / "plugin.toml"
    raw = {**DENSE, "run": {**DENSE["run"], "out_dir": str(tmp_path / "run")},
           "model": {**DENSE["model"], "layer_pattern": [attention]}, "attention": {attention: config}}
    recipe.write_text(recipe_toml(raw))
    assert main(["train", str(recipe), "--parallel", "tp=2"]) == 2
    err = capsys.readouterr().err
    assert f"parallel ep=1,tp=2: {message}" in err and err.count("\n") == 1, err
    assert not (tmp_path / "run").exists()


def test_a_component_without_tensor_parallelism_refuses_tp(tmp_path, recipe_toml, capsys):
    recipe = tmp_path / "window.toml"
    raw = {**DENSE, "run": {**DENSE["run"], "out_dir": str(tmp_path / "run")},
           "model": {**DENSE["model"], "layer_pattern": ["sliding-window"]},
           "attention": {"sliding-window": {"n_heads": 2, "window": 16}}}
    recipe.write_text(recipe_toml(raw))
    assert main(["train", str(recipe), "--parallel", "tp=2"]) == 2
    err = capsys.readouterr().err
    assert "attention 'sliding-window' (megaseq-sliding-window" in err, err
    assert "does not declare tensor_parallel; use tp=1" in err and err.count("\n") == 1, err
