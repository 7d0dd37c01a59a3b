"""A rank builds only its own shards (``megaseq.distributed.experts.build_local_model``): the local model on the
meta device, filled one block at a time from the one-process model's initialisation.

- Every layout starts from the one-process model (``build_model``'s): the tp=2 ranks' blocks (the dense sdpa
  recipe) and the ep=2 ranks' experts (the hybrid recipe) join into exactly its weights, and the global
  generator is left where it leaves it.
- Memory: a rank holds 1/N of the split tensors' bytes, and building it peaks (measured by torch's profiler,
  every CPU allocation and free) at most at what it holds plus one whole block plus one tensor's copy and a
  small constant. Building the whole model and cutting it, the scheme this replaces, exceeds that bound: the
  measurement would catch a regression to it.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from megaseq.config import validate_recipe
from megaseq.distributed.experts import (
    build_local_model,
    initial_parts,
    layout_expert_dims,
    layout_tp_dims,
    model_dims,
    shard,
    split_lengths,
    unshard,
)
from megaseq.model import build_model
from megaseq.plugins import get_plugins

DENSE: dict[str, Any] = {
    "run": {"name": "dense", "device": "cpu"},
    "data": {"train": "excerpt-chr20", "heldout": "excerpt-chrX", "seq_len": 96},
    "model": {"d_model": 32, "n_layers": 2, "layer_pattern": ["sdpa"], "tie_embeddings": False},
    "attention": {"sdpa": {"n_heads": 4}},
    "ffn": {"swiglu": {"hidden": 64}},
}
SLACK = 16 * 1024  # bytes: the seed draw and the profiler's own small allocations


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def measured_peak(fn):
    """``fn()`` and the peak of the CPU bytes it allocated and had not yet freed (torch's profiler, each allocation
    and free once: its ``self`` figures)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    events = sorted((e for e in prof.events() if e.self_cpu_memory_usage), key=lambda e: e.time_range.start)
    live = peak = 0
    for e in events:
        live += e.self_cpu_memory_usage
        peak = max(peak, live)
    return out, peak


def layouts(hybrid):
    """(recipe, what splits, the split dims under 2 ranks, keyword arguments of each of the 2 ranks)."""
    plugins = get_plugins()
    dense, moe = validate_recipe(DENSE, plugins), validate_recipe(hybrid, plugins)
    return [
        (dense, "tp", layout_tp_dims(dense, plugins, 2), [{"tp_rank": r, "tp_size": 2} for r in range(2)]),
        (moe, "ep", layout_expert_dims(moe, plugins, 2), [{"ep_rank": r, "ep_size": 2} for r in range(2)]),
    ]


def test_every_layout_starts_from_the_one_process_model(hybrid):
    plugins = get_plugins()
    for recipe, what, dims, ranks in layouts(hybrid):
        torch.manual_seed(3)
        one = build_model(recipe, plugins).state_dict()
        after_one = torch.rand(4)
        blocks = []
        for kwargs in ranks:
            torch.manual_seed(3)
            blocks.append(build_local_model(recipe, plugins, **kwargs).state_dict())
            assert torch.equal(torch.rand(4), after_one), f"{what}: the generator is left elsewhere"
        torch.manual_seed(3)
        alone = build_local_model(recipe, plugins).state_dict()
        assert torch.equal(torch.rand(4), after_one), what
        assert all(torch.equal(alone[n], t) for n, t in one.items()), what
        assert dims, what
        joined = unshard(blocks, dims, split_lengths(recipe, plugins, dims))
        assert joined.keys() == one.keys(), what
        for name, value in one.items():
            assert torch.equal(joined[name], value), f"{what}=2: {name} differs from the one-process model"
        # a different seed is a different model (the check is not comparing constants)
        torch.manual_seed(4)
        other = build_local_model(recipe, plugins).state_dict()
        assert any(not torch.equal(other[n], one[n]) for n in dims), what


def whole_then_cut(recipe, plugins, dims, **kwargs):
    """The scheme ``build_local_model`` replaces: the whole model initialised, each rank keeping its blocks."""
    local = build_model(recipe, plugins, model_dims(recipe, **kwargs))
    rank = kwargs.get("tp_rank", kwargs.get("ep_rank"))
    local.load_state_dict(shard(build_model(recipe, plugins).state_dict(), dims, rank, 2))
    return local


def test_a_rank_holds_and_builds_only_its_shards(hybrid, capsys):
    plugins = get_plugins()
    lines = []
    for recipe, what, dims, ranks in layouts(hybrid):
        parts = [m for _, m in initial_parts(recipe, plugins)]
        largest_part = max(nbytes([*m.parameters(), *m.buffers()]) for m in parts)
        largest_tensor = max(t.numel() * t.element_size() for m in parts for t in m.state_dict().values())
        whole = build_model(recipe, plugins).state_dict()
        split_whole = nbytes(whole[n] for n in dims)
        rest_whole = nbytes(t for n, t in whole.items() if n not in dims)
        one, one_peak = measured_peak(partial(build_local_model, recipe, plugins))
        assert one_peak >= nbytes(one.state_dict().values())  # the profiler sees the parameters
        lines.append(f"{what}=1: holds {nbytes(one.state_dict().values())} B, building peaked at {one_peak} B")
        for kwargs in ranks:
            local, peak = measured_peak(partial(build_local_model, recipe, plugins, **kwargs))
            state = local.state_dict()
            held_split, held_rest = nbytes(state[n] for n in dims), nbytes(t for n, t in state.items() if n not in dims)
            padding = sum(state[n].numel() * state[n].element_size() // state[n].shape[d] for n, d in dims.items())
            assert held_split <= split_whole / 2 + padding and held_rest == rest_whole, (what, kwargs)
            bound = held_split + held_rest + largest_part + largest_tensor + SLACK
            assert peak <= bound, (what, kwargs, peak, bound)
            lines.append(f"{what}=2 rank {kwargs}: holds {held_split} of {split_whole} split B + {held_rest} B whole, "
                         f"building peaked at {peak} B (bound {bound} B)")
            _, old_peak = measured_peak(partial(whole_then_cut, recipe, plugins, dims, **kwargs))
            assert old_peak > bound, (what, kwargs, old_peak, bound)  # the bound catches the whole-model scheme
            lines.append(f"  whole model then cut: {old_peak} B")
    with capsys.disabled():
        print("\n" + "\n".join(lines))


def _evaluate_under_layouts(rank: int, world: int, raw: dict[str, Any], layouts: list, out_dir: str) -> list:
    """One training step and the held-out evaluation under each layout, with gathering a whole model refused."""
    from pathlib import Path

    from megaseq.distributed.groups import Parallel, destroy_process_groups, init_process_groups
    from megaseq.testing import installed_plugins
    from megaseq.testing.layouts import _recipe
    from megaseq.train.trainer import Trainer

    def refuse(*args, **kwargs):
        raise AssertionError("evaluation gathered experts or tensor-parallel blocks onto one rank")

    Parallel.gather_experts = Parallel.gather_tensor_parallel = refuse
    results = []
    for layout in layouts:
        parallel = init_process_groups(layout)
        try:
            trainer = Trainer(_recipe(raw, layout, Path(out_dir) / str(layout).replace(",", "_")), installed_plugins(),
                              parallel=parallel, progress=False, tensorboard=False)
            trainer.train_step()
            results.append(trainer.eval(baseline=False))
        finally:
            destroy_process_groups()
    return results


@pytest.mark.slow
def test_evaluation_runs_on_the_sharded_model_and_equals_one_process(hybrid, tmp_path):
    pytest.importorskip("megatron.core", reason="needs the distributed extra: pip install 'megaseq-core[distributed]'")
    from megaseq.distributed.layout import Layout
    from megaseq.testing.distributed import run_gloo
    from megaseq.testing.layouts import single_trainer

    single = single_trainer(hybrid, tmp_path / "single")
    single.train_step()
    expected = single.eval(baseline=False)["results"]["model"]
    layouts = [Layout(tp=2), Layout(dp=2, ep=2)]
    ranks = run_gloo(2, _evaluate_under_layouts, hybrid, layouts, str(tmp_path))
    for i, layout in enumerate(layouts):
        assert ranks[1][i] is None, layout  # rank 0 reports
        got = ranks[0][i]["results"]["model"]
        pairs = [(got["bits_per_base"], expected["bits_per_base"])]
        pairs += [(a["bits_per_base"], b["bits_per_base"]) for a, b in zip(got["buckets"], expected["buckets"], strict=True)
                  if b["bits_per_base"] is not None]
        for a, b in pairs:
            assert a == pytest.approx(b, rel=1e-5), (layout, a, b)
