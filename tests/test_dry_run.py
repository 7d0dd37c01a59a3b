"""``megaseq train --dry-run``: the launch's checks, every rank's groups and the memory plan, with no worker
started and no device used. The groups it prints are computed without ``torch.distributed``
(``megaseq.distributed.groups.rank_groups``); on a gloo world of 8 ranks they must be the groups
megatron-core's ``parallel_state`` creates, and a rank order other than megatron's is caught."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("megatron.core", reason="needs the distributed extra: pip install 'megaseq-core[distributed]'")

from megaseq.cli import main
from megaseq.distributed.groups import rank_groups
from megaseq.distributed.layout import Layout
from megaseq_testkit.distributed import run_gloo

pytestmark = pytest.mark.usefixtures("module_cache")  # tests/conftest.py

GLM5 = Path(__file__).parents[1] / "recipes" / "glm5-flash-1m.toml"
# megaseq's name of each group -> the parallel_state getter of this rank's group of that kind
GETTERS = {
    "tp": ("get_tensor_model_parallel_group", {}),
    "cp": ("get_context_parallel_group", {}),
    "dp": ("get_data_parallel_group", {}),
    "dp x cp": ("get_data_parallel_group", {"with_context_parallel": True}),
    "ep": ("get_expert_model_parallel_group", {}),
    "etp": ("get_expert_tensor_parallel_group", {}),
    "expert dp": ("get_expert_data_parallel_group", {}),
}
# every dimension above 1 in some layout, on one gloo world of 8 ranks (a world costs seconds per rank to start)
LAYOUTS = [Layout(dp=2, cp=2, tp=2, ep=2, etp=2), Layout(dp=2, cp=2, tp=2, ep=4), Layout(cp=2, tp=4, ep=2, etp=2)]


def _created_groups(rank: int, world: int, layouts: list[Layout]) -> list[dict[str, list[int]]]:
    """This rank's group of each kind, as parallel_state creates them for each layout in turn."""
    import torch.distributed as dist

    from megaseq.distributed.groups import destroy_process_groups, import_parallel_state, init_process_groups

    ps = import_parallel_state()
    out = []
    for layout in layouts:
        init_process_groups(layout)
        try:
            out.append({name: dist.get_process_group_ranks(getattr(ps, getter)(**kw)) for name, (getter, kw) in GETTERS.items()})
        finally:
            destroy_process_groups()
    return out


def mismatches(layout: Layout, created: list[dict[str, list[int]]], order: str = "tp-cp-ep-dp-pp") -> list[str]:
    """Where the computed groups of ``layout`` differ from those each rank was given (``created[rank]``)."""
    computed = rank_groups(layout, order)
    wrong = []
    for rank, groups in enumerate(created):
        for name, ranks in groups.items():
            mine = [g for g in computed[name] if rank in g]
            if mine != [sorted(ranks)]:
                wrong.append(f"rank {rank} {name}: computed {mine}, created {sorted(ranks)}")
    return wrong


@pytest.mark.slow
def test_computed_groups_are_the_groups_parallel_state_creates():
    created = run_gloo(8, _created_groups, LAYOUTS)  # [rank][layout]
    for i, layout in enumerate(LAYOUTS):
        per_rank = [created[r][i] for r in range(8)]
        assert mismatches(layout, per_rank) == [], layout
        if layout.dp > 1 and layout.cp > 1:  # the check catches another rank order (data-parallel before context)
            assert mismatches(layout, per_rank, order="tp-dp-cp-ep-pp"), layout


def test_groups_cover_every_rank_once_per_kind():
    layout = Layout(dp=4, cp=2, tp=8, ep=32, etp=2)
    groups = rank_groups(layout)
    sizes = {"tp": 8, "cp": 2, "dp": 4, "dp x cp": 8, "ep": 32, "etp": 2, "expert dp": 1}
    for name, members in groups.items():
        assert sorted(r for g in members for r in g) == list(range(64)), name
        assert {len(g) for g in members} == {sizes[name]}, name
    assert groups["tp"][0] == list(range(8)) and groups["cp"][0] == [0, 8]  # megatron's order: tp innermost, then cp


def test_a_layout_whose_experts_do_not_tile_the_ranks_is_one_line():
    with pytest.raises(Exception, match=r"ep x etp = 6 does not divide the 4 ranks"):
        rank_groups(Layout(dp=2, tp=2, ep=3, etp=2))


@pytest.mark.slow
def test_the_reported_layout_dry_run_checks_prints_groups_and_plan_and_starts_nothing(tmp_path, capsys, monkeypatch):
    import megaseq.distributed.launch as launch
    import megaseq.train.trainer as trainer

    def must_not_run(*args, **kwargs):
        raise AssertionError("a dry run started training")

    monkeypatch.setattr(launch, "run_with_ray", must_not_run)
    monkeypatch.setattr(trainer.Trainer, "__init__", must_not_run)
    out = tmp_path / "run"
    args = ["train", str(GLM5), "--out", str(out), "--dry-run", "--parallel", "dp=4,cp=2,ep=32,tp=8,etp=2"]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "parallel dp=4,cp=2,ep=32,tp=8,etp=2: 64 rank(s)" in printed
    assert "  tp         8 of 8: 0-7  8-15  16-23" in printed and "  etp        32 of 2: 0,1  2,3" in printed
    assert "  ep         2 of 32: 0,2,4," in printed and "  expert dp  64 of 1: 0  1" in printed
    assert "\n    63" in printed  # the rank table's last row
    assert "memory plan per cuda device" in printed and "recompute(reuse_kept=False) + offload: peak" in printed
    groups = printed[printed.index("groups ("):printed.index("rank -> group")]
    assert max(len(line) for line in groups.splitlines()) <= 110  # 64 ranks' groups wrapped
    assert not out.exists()
    # the same pre-flight refuses what the launch refuses, in one line
    assert main([*args[:-1], "dp=4,cp=2,ep=5,tp=8"]) == 2
    err = capsys.readouterr().err
    assert "ep x etp = 5 x 1 does not divide the 64 workers" in err and err.count("\n") == 1, err
