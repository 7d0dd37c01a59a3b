"""The hybrid recipe under tensor parallelism (megatron-core's layout, the chunked MoE's included) equals the
single process.

The hybrid recipe (kda, kda, kda, dsa; a dense first layer, then chunked MoE with the balance loss on) at tiny
width, two optimizer steps on gloo ranks: tp=2 (every rank holds its experts whole and routes
its sequence chunk), tp=2 with etp=2 (each rank holds half of every expert's hidden width), tp=2 with ep=2 (the
tensor-parallel ranks share the experts), tp=2 x cp=2, and dp=2 x tp=2 x ep=2 x etp=2 on 4 processes must log the same loss, tokens, gradient norm and metrics (except
the per-micro-batch load, ``moe/load/*``) and reach the same weights as one process (fp32, 1e-5 relative).
Checkpoints of the tp=2 and of the 4-process layout resume in one process, the 4-process one (each rank's
expert blocks and tensor-parallel blocks written by that rank, none joined first) also under dp=2 x cp=2 x ep=4,
where every block is cut differently, and ``megaseq eval`` reads them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("megatron.core", reason="needs the distributed extra: pip install 'megaseq-core[distributed]'")

from megaseq.cli import main
from megaseq.contracts import LOAD_STAT_KEYS
from megaseq.distributed.layout import Layout
from megaseq_testkit.distributed import run_gloo
from megaseq_testkit.layouts import (
    assert_same_run,
    resume_under_layout,
    single_trainer,
    train_single,
    train_under_layouts,
)

pytestmark = pytest.mark.usefixtures("module_cache")  # tests/conftest.py

RTOL = 1e-5
# each MoE layer's load_stats() describe the last micro-batch the rank routed; the busiest expert-parallel rank
# over the mean is 1 by definition with one rank
LAYOUT_METRICS = frozenset(f"moe/load/{key}" for key in LOAD_STAT_KEYS) | {"moe/rank_max_over_mean"}


@pytest.fixture(scope="module")
def moe(layouts_recipe) -> dict[str, Any]:
    return layouts_recipe


def _check(results, layouts, expected):
    for result, layout in zip(results, layouts, strict=True):
        assert_same_run(result, expected, RTOL, str(layout), LAYOUT_METRICS)


def _resumes_on_one(saved: Path, raw: dict[str, Any], third: dict[str, Any], what: str) -> None:
    resumed = single_trainer(raw, saved.parents[1])
    assert resumed.resume() and resumed.step == 2
    assert_same_run(train_single(resumed, 1), third, RTOL, f"{what} checkpoint resumed on one process", LAYOUT_METRICS)


@pytest.mark.slow
def test_tp2_with_whole_split_and_shared_experts_equals_one_process_and_resumes_on_one(tmp_path, moe, single):
    first_two, third = single
    layouts = [Layout(tp=2), Layout(tp=2, etp=2), Layout(tp=2, ep=2)]
    ranks = run_gloo(2, train_under_layouts, moe, layouts, str(tmp_path), 2, True)
    _check(ranks[0], layouts, first_two)
    assert "moe/aux" in {k.removeprefix("aux/") for k in first_two["metrics"][0]}

    # under etp=2 a rank holds half of each routed expert's hidden width, besides its tensor-parallel blocks
    experts = sum(t.numel() * 4 for n, t in first_two["weights"].items() if ".experts." in n)
    for rank in ranks:
        assert rank[0]["parameter_bytes"] - rank[1]["parameter_bytes"] == experts // 2
    assert "expert widths over etp=2" in ranks[0][1]["parameters"], ranks[0][1]["parameters"]
    _resumes_on_one(Path(ranks[0][0]["checkpoint"]), moe, third, "tp=2")
    _resumes_on_one(Path(ranks[0][1]["checkpoint"]), moe, third, "tp=2,etp=2")


def _train_then_resume(rank: int, world: int, raw: dict[str, Any], layouts: list[Layout], out_dir: str, other: Layout):
    """Two steps under each layout (saving a checkpoint), then the last one's run resumed for one step under
    ``other``."""
    results = train_under_layouts(rank, world, raw, layouts, out_dir, 2, True)
    return results, resume_under_layout(rank, world, raw, other, str(Path(results[-1]["checkpoint"]).parents[1]), 1)


@pytest.mark.slow
def test_four_ranks_tp_cp_and_tp_ep_etp_equal_one_process_and_resume_under_any_layout(tmp_path, moe, single, capsys):
    first_two, third = single
    layouts = [Layout(cp=2, tp=2), Layout(dp=2, tp=2, ep=2, etp=2)]
    # resumed with every block cut differently: no tensor parallelism, each rank one whole expert of the four
    other = Layout(dp=2, cp=2, ep=4)
    ranks = run_gloo(4, _train_then_resume, moe, layouts, str(tmp_path), other)
    _check(ranks[0][0], layouts, first_two)
    saved = Path(ranks[0][0][1]["checkpoint"])  # every rank writes its expert blocks, the dp=0 ranks their tp blocks
    assert sorted(p.name for p in (saved / "shards").iterdir()) == sorted(
        f"rank{r}{kind}.safetensors" for r in range(4) for kind in ("", ".optimizer"))
    meta = json.loads((saved / "meta.json").read_text())
    experts = [n for n in meta["shapes"] if ".experts." in n]
    assert experts and all(sum(n in names for names in meta["shards"].values()) == 4 for n in experts)
    assert_same_run(ranks[0][1], third, RTOL, f"dp=2,tp=2,ep=2,etp=2 checkpoint resumed under {other}", LAYOUT_METRICS)
    _resumes_on_one(saved, moe, third, "dp=2,tp=2,ep=2,etp=2")
    capsys.readouterr()
    assert main(["eval", str(saved), "--no-baseline"]) == 0
    assert "step 2: held-out" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--parallel", "tp=2,etp=2", "--set", "moe.chunked.expert_hidden=31"],
         "parallel ep=1,etp=2: moe.chunked: expert_hidden 31 is not a multiple of etp 2"),
        (["--parallel", "tp=2,etp=4"], "ep x etp = 1 x 4 does not divide the 2 workers"),
        (["--parallel", "dp=2,ep=2,etp=2"], "ep x etp = 2 x 2 does not divide the 2 workers"),
    ],
)
def test_impossible_expert_tensor_parallel_layouts_are_one_line_exit_2(tmp_path, moe, recipe_toml, capsys, args, message):
    """Bad expert-tensor-parallel layouts of an MoE recipe (etp without experts: packages/core/tests/test_parallel_rules.py)."""
    recipe = tmp_path / "recipe.toml"
    recipe.write_text(recipe_toml({**moe, "run": {**moe["run"], "out_dir": str(tmp_path / "run")}}))
    assert main(["train", str(recipe), *args]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
    assert not (tmp_path / "run").exists()
