"""Whole training runs under data, context and expert parallelism equal the single process.

The hybrid recipe (kda, dsa, chunked MoE) at tiny width, two optimizer steps, on gloo ranks: CP=2, DP=2
(same global batch), EP=2 (over the DP ranks) and dp=2 x cp=2 x ep=2 on 4 processes must log the same loss,
tokens, gradient norm and metrics and reach the same weights as one process (fp32, 1e-5). One process
launch per world size serves every layout of that size. A checkpoint saved with ep=2 resumes in one
process (ep=1) exactly where the single process is after the same steps, and ``megaseq eval`` reads it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("megatron.core", reason="needs the distributed extra: pip install 'megaseq-core[distributed]'")

from megaseq.cli import main
from megaseq.contracts import LOAD_STAT_KEYS
from megaseq.distributed.layout import Layout
from megaseq_testkit.distributed import run_gloo
from megaseq_testkit.layouts import assert_same_run, single_trainer, train_single, train_under_layouts

pytestmark = pytest.mark.usefixtures("module_cache")  # tests/conftest.py

RTOL = 1e-5
# the MoE's busiest expert-parallel rank over the mean: 1 by definition with one rank
EP_METRICS = frozenset({"moe/rank_max_over_mean"})
# each MoE layer's load_stats() describe the last micro-batch the rank routed: how the batch is split decides them
LOAD_METRICS = frozenset(f"moe/load/{key}" for key in LOAD_STAT_KEYS)



@pytest.fixture(scope="module")
def hybrid(layouts_recipe):
    return layouts_recipe


def _check(results, layouts, expected):
    for result, layout in zip(results, layouts, strict=True):
        assert_same_run(result, expected, RTOL, str(layout), LOAD_METRICS | (EP_METRICS if layout.ep > 1 else frozenset()))


@pytest.mark.slow
def test_two_ranks_cp_dp_ep_equal_one_and_ep_checkpoint_resumes_on_one(tmp_path, hybrid, single, capsys):
    first_two, third = single
    layouts = [Layout(cp=2), Layout(dp=2), Layout(dp=2, ep=2)]
    ranks = run_gloo(2, train_under_layouts, hybrid, layouts, str(tmp_path), 2, True)
    _check(ranks[0], layouts, first_two)
    assert any(k.startswith("moe/") for k in first_two["metrics"][0]) and "aux/dsa_indexer" in first_two["metrics"][0]

    # the run header's parameter counts under ep=2: the whole model's (one process's) and each rank's, labelled
    whole = ranks[0][0]["parameters"].split("M parameters; layers:")[0]  # cp=2: every rank holds every parameter
    assert ranks[0][2]["parameters"].startswith(f"{whole}M parameters in all, "), ranks[0][2]["parameters"]
    assert "M on each rank (experts over ep=2); layers:" in ranks[0][2]["parameters"]
    saved = Path(ranks[0][2]["checkpoint"])  # dp=2, ep=2: experts in two blocks
    assert sorted(p.name for p in (saved / "shards").iterdir()) == [
        "rank0.optimizer.safetensors", "rank0.safetensors", "rank1.optimizer.safetensors", "rank1.safetensors"]
    resumed = single_trainer(hybrid, saved.parents[1])
    assert resumed.resume() and resumed.step == 2
    assert_same_run(train_single(resumed, 1), third, RTOL, "ep=2 checkpoint resumed with ep=1")

    assert main(["eval", str(saved), "--no-baseline"]) == 0
    assert "step 2: held-out" in capsys.readouterr().out


@pytest.mark.slow
def test_four_ranks_dp_cp_ep_equal_one(tmp_path, hybrid, single):
    layouts = [Layout(dp=2, cp=2, ep=2)]
    _check(run_gloo(4, train_under_layouts, hybrid, layouts, str(tmp_path), 2)[0], layouts, single[0])


def test_impossible_hybrid_layouts_and_foreign_checkpoints_are_one_line_exit_2(tmp_path, hybrid, recipe_toml, capsys):
    recipe = tmp_path / "hybrid.toml"
    recipe.write_text(recipe_toml({**hybrid, "run": {**hybrid["run"], "out_dir": str(tmp_path / "run")}}))
    assert main(["train", str(recipe), "--workers", "4", "--parallel", "dp=4,ep=4", "--set", "train.batch_size=4",
                 "--set", "moe.chunked.n_experts=6"]) == 2
    err = capsys.readouterr().err
    assert "parallel ep=4: n_experts (6) must be a multiple of the expert-parallel size (4)" in err and err.count("\n") == 1

    # tiles cannot run under CP: refused before any worker starts, and no run directory is made
    assert main(["train", str(recipe), "--workers", "2", "--parallel", "cp=2", "--memory-policy", "recompute",
                 "--set", "memory_policy.recompute.tile_tokens=64"]) == 2
    err = capsys.readouterr().err
    assert "memory_policy.recompute.tile_tokens cannot run under context parallelism (cp=2" in err and err.count("\n") == 1
    assert not (tmp_path / "run").exists()

    trained = tmp_path / "trained"
    trainer = single_trainer(hybrid, trained)
    train_single(trainer, 1)
    trainer.save()
    capsys.readouterr()
    recipe.write_text(recipe_toml({**hybrid, "run": {**hybrid["run"], "out_dir": str(trained)}}))
    assert main(["train", str(recipe), "--workers", "2", "--resume", "--set", "moe.chunked.n_experts=8"]) == 2
    err = capsys.readouterr().err
    assert "cannot resume" in err and "the model changed, not only the layout" in err and err.count("\n") == 1


@pytest.mark.slow
def test_a_window_length_schedule_under_cp_equals_one_process(tmp_path, hybrid):
    """``data.schedule`` under cp=2: step 1 in 48-base windows (each 96-base window cut in two, each piece
    zig-zag sharded on its own), step 2 in whole windows, as one process does."""
    raw = {**hybrid, "data": {**hybrid["data"], "schedule": [{"seq_len": 48, "until_step": 1}]}}
    expected = train_single(single_trainer(raw, tmp_path / "single"), 2)
    assert [m["seq_len"] for m in expected["metrics"]] == [48, 96]
    ranks = run_gloo(2, train_under_layouts, raw, [Layout(cp=2)], str(tmp_path), 2)
    _check(ranks[0], [Layout(cp=2)], expected)


@pytest.mark.slow
def test_data_transforms_under_dp_equal_one_process(tmp_path, hybrid):
    """``data.transforms`` under dp=2: every rank transforms the whole global micro-batch with the same generators,
    then takes its share, so the run is the one process's."""
    raw = {**hybrid, "data": {**hybrid["data"], "transforms": ["reverse-complement", "planted-repeats"]},
           "data_transform": {"planted-repeats": {"share": 1.0, "segment": 40}}}
    expected = train_single(single_trainer(raw, tmp_path / "single"), 2)
    ranks = run_gloo(2, train_under_layouts, raw, [Layout(dp=2)], str(tmp_path), 2)
    _check(ranks[0], [Layout(dp=2)], expected)
