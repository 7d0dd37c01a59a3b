"""A rank builds only its own shards (``megaseq.distributed.experts.build_local_model``): the local model on the
meta device, filled one block at a time from the one-process model's initialisation.

- Every layout starts from the one-process model (``build_model``'s): the tp=2 ranks' blocks (the dense sdpa
  recipe) and the ep=2 ranks' experts (the hybrid recipe) join into exactly its weights, and the global
  generator is left where it leaves it.
- Memory: a rank holds 1/N of the split tensors' bytes, and building it peaks (measured by torch's profiler,
  every CPU allocation and free) at most at what it holds plus one whole block plus one tensor's copy and a
  small constant. Building the whole model and cutting it, the scheme this replaces, exceeds that bound: the
  measurement would catch a regression to it.
- Checkpoints (``megaseq.distributed.sharded``): the ranks of tp=2 x ep=2 x etp=2 each write the blocks they
  are the first holder of, and one process, ep=4, tp=2 x etp=2 and etp=2 read exactly their blocks of the
  one-process model's weights and AdamW moments back, holding nothing but them while reading (reading every
  tensor whole and cutting it exceeds that). A checkpoint missing a block, or of another model, is refused.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from megaseq.config import validate_recipe
from megaseq.distributed.experts import (
    block,
    build_local_model,
    initial_parts,
    join,
    layout_splits,
    model_dims,
)
from megaseq.distributed.sharded import (
    Placement,
    Split,
    local_optimizer_state,
    read_full_weights,
    read_local_weights,
    shards_meta,
    write_shard,
)
from megaseq.model import build_model
from megaseq.plugins import get_plugins
from megaseq.train.checkpoint import CheckpointError, ShapeMismatch, optimizer_param_names

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


def shard(full, dims, rank, size):
    """Rank ``rank``'s view of a full state: the split tensors cut to their block, the rest as they are."""
    return {name: block(t, dims[name], rank, size) if name in dims else t for name, t in full.items()}


def unshard(blocks, dims, lengths):
    """The full state from every rank's blocks (in rank order): split tensors joined and cut to ``lengths`` (the
    padding dropped), the rest from rank 0."""
    return {name: join([b[name] for b in blocks], dims[name], lengths[name]) if name in dims else t
            for name, t in blocks[0].items()}


def measured_peak(fn, mapped=frozenset()):
    """``fn()`` and the peak of the CPU bytes it allocated and had not yet freed (torch's profiler, each allocation
    and free once: its ``self`` figures). ``mapped``: the sizes of files that ``fn`` memory-maps whole (safetensors
    does), left out: a mapping reads only the pages that are touched, into the page cache."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    events = sorted((e for e in prof.events() if e.self_cpu_memory_usage
                     and not (e.name == "[memory]" and abs(e.self_cpu_memory_usage) in mapped)),
                    key=lambda e: e.time_range.start)
    live = peak = 0
    for e in events:
        live += e.self_cpu_memory_usage
        peak = max(peak, live)
    return out, peak


def layouts(hybrid):
    """(recipe, what splits, the split dims under 2 ranks, keyword arguments of each of the 2 ranks). The hybrid
    has wider experts here (8 of hidden width 128), so that a MoE block's expert stack outweighs its other
    tensors, as at scale."""
    plugins = get_plugins()
    wide = {**hybrid, "moe": {"chunked": {**hybrid["moe"]["chunked"], "n_experts": 8, "expert_hidden": 128}}}
    dense, moe = validate_recipe(DENSE, plugins), validate_recipe(wide, plugins)
    return [
        (dense, "tp", layout_splits(dense, plugins, tp_size=2).tp, [{"tp_rank": r, "tp_size": 2} for r in range(2)]),
        (moe, "ep", layout_splits(moe, plugins, ep_size=2).ep, [{"ep_rank": r, "ep_size": 2} for r in range(2)]),
        (moe, "etp", layout_splits(moe, plugins, etp_size=2).etp, [{"etp_rank": r, "etp_size": 2} for r in range(2)]),
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
        shapes = layout_splits(recipe, plugins).shapes
        joined = unshard(blocks, dims, {name: shapes[name][dim] for name, dim in dims.items()})
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
    rank = next(v for k, v in kwargs.items() if k.endswith("_rank"))
    local.load_state_dict(shard(build_model(recipe, plugins).state_dict(), dims, rank, 2))
    return local


def whole_parts_then_cut(recipe, plugins, dims, **kwargs):
    """A scheme between the two: the local model filled one whole block at a time (every expert of an MoE block),
    each cut to the rank's blocks."""
    with torch.device("meta"):
        local = build_model(recipe, plugins, model_dims(recipe, **kwargs))
    local = local.to_empty(device="cpu")
    rank = next(v for k, v in kwargs.items() if k.endswith("_rank"))
    targets = local.state_dict(keep_vars=True)
    with torch.no_grad():
        for prefix, part in initial_parts(recipe, plugins):
            for name, value in part.state_dict().items():
                name = prefix + name
                targets[name].copy_(block(value, dims[name], rank, 2) if name in dims else value)
            del part
    return local


def expert_kwargs(kwargs):
    """The expert-parallel and expert-tensor-parallel arguments among a rank's."""
    return {k: v for k, v in kwargs.items() if k.startswith(("ep_", "etp_"))}


@pytest.mark.slow  # gloo ranks under torch's profiler
def test_a_rank_holds_and_builds_only_its_shards(hybrid, capsys):
    plugins = get_plugins()
    lines = []
    for recipe, what, dims, ranks in layouts(hybrid):
        whole = build_model(recipe, plugins).state_dict()
        split_whole = nbytes(whole[n] for n in dims)
        rest_whole = nbytes(t for n, t in whole.items() if n not in dims)
        one, one_peak = measured_peak(partial(build_local_model, recipe, plugins))
        assert one_peak >= nbytes(one.state_dict().values())  # the profiler sees the parameters
        lines.append(f"{what}=1: holds {nbytes(one.state_dict().values())} B, building peaked at {one_peak} B")
        for kwargs in ranks:
            # the parts a rank builds: whole blocks but for the experts, only its own
            parts = [m for _, m in initial_parts(recipe, plugins, **expert_kwargs(kwargs))]
            largest_part = max(nbytes([*m.parameters(), *m.buffers()]) for m in parts)
            largest_tensor = max(t.numel() * t.element_size() for m in parts for t in m.state_dict().values())
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
            if expert_kwargs(kwargs):  # and a rank that builds every expert of a block, one block at a time
                _, parts_peak = measured_peak(partial(whole_parts_then_cut, recipe, plugins, dims, **kwargs))
                assert parts_peak > bound, (what, kwargs, parts_peak, bound)
                lines.append(f"  whole blocks (every expert) then cut: {parts_peak} B")
    with capsys.disabled():
        print("\n" + "\n".join(lines))


def _evaluate_under_layouts(rank: int, world: int, raw: dict[str, Any], layouts: list, out_dir: str) -> list:
    """One training step and the held-out evaluation under each layout, with gathering a whole model refused.
    Per layout: the evaluation's result and the lengths of the windows this rank's model ran in it."""
    from pathlib import Path

    from megaseq.distributed.groups import Parallel, destroy_process_groups, init_process_groups
    from megaseq.train.trainer import Trainer
    from megaseq_testkit import installed_plugins
    from megaseq_testkit.layouts import _recipe

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
            lengths: list[int] = []
            hook = trainer.model.register_forward_pre_hook(lambda module, args, seen=lengths: seen.append(args[0].shape[1]))
            results.append((trainer.eval(baseline=False), lengths))
            hook.remove()
        finally:
            destroy_process_groups()
    return results


@pytest.mark.slow
def test_evaluation_runs_on_the_sharded_model_and_equals_one_process(hybrid, tmp_path):
    """Under tp, ep and cp the evaluation runs on every rank's part (cp: each rank its zig-zag shard of every
    window, as in training) and equals one process's."""
    pytest.importorskip("megatron.core", reason="needs the distributed extra: pip install 'megaseq-core[distributed]'")
    from megaseq.distributed.layout import Layout
    from megaseq_testkit.distributed import run_gloo
    from megaseq_testkit.layouts import single_trainer

    single = single_trainer(hybrid, tmp_path / "single")
    single.train_step()
    expected = single.eval(baseline=False)["results"]["model"]
    layouts = [Layout(tp=2), Layout(dp=2, ep=2), Layout(cp=2)]
    ranks = run_gloo(2, _evaluate_under_layouts, hybrid, layouts, str(tmp_path))
    seq_len = hybrid["data"]["seq_len"]
    for i, layout in enumerate(layouts):
        assert ranks[1][i][0] is None, layout  # rank 0 reports
        for rank in range(2):  # every rank runs every window, under cp its zig-zag shard, never the whole window
            lengths = ranks[rank][i][1]
            assert lengths and set(lengths) == {seq_len // layout.cp}, (layout, rank, lengths)
        got = ranks[0][i][0]["results"]["model"]
        pairs = [(got["bits_per_base"], expected["bits_per_base"])]
        pairs += [(a["bits_per_base"], b["bits_per_base"]) for a, b in zip(got["buckets"], expected["buckets"], strict=True)
                  if b["bits_per_base"] is not None]
        for a, b in pairs:
            assert a == pytest.approx(b, rel=1e-5), (layout, a, b)


# -- checkpoints: each rank writes its blocks, any layout reads only its part ---------------------------------
def stepped(model):
    """``model`` after one AdamW step whose gradient is the weights themselves: elementwise, so a rank's block of
    the weights and of the moments is the block of the one-process model's."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for p in model.parameters():
        p.grad = p.detach().clone()
    optimizer.step()
    return optimizer


def placement_of(recipe, plugins, shapes, tp=(0, 1), ep=(0, 1), etp=(0, 1), writes=(True, True)):
    """The placement of one rank of ``tp``, ``ep`` and ``etp`` (each ``(rank, size)``); ``writes``: whether it
    writes its tensor-parallel and its expert blocks."""
    return Placement.of(shapes, [
        Split("ep", layout_splits(recipe, plugins, ep_size=ep[1]).ep, *ep, writes=writes[1]),
        Split("etp", layout_splits(recipe, plugins, etp_size=etp[1]).etp, *etp, writes=writes[1]),
        Split("tp", layout_splits(recipe, plugins, tp_size=tp[1]).tp, *tp, writes=writes[0]),
    ])


def write_layout(path, recipe, plugins, ranks):
    """A checkpoint's weights and optimizer state written by ``ranks`` (``{rank: (tp, ep, etp, writes)}``, every
    block by one of them); its ``meta.json`` entries."""
    shapes, described = layout_splits(recipe, plugins).shapes, []
    for rank, (tp, ep, etp, writes) in ranks.items():
        torch.manual_seed(3)
        model = build_local_model(recipe, plugins, tp_rank=tp[0], tp_size=tp[1], ep_rank=ep[0], ep_size=ep[1],
                                  etp_rank=etp[0], etp_size=etp[1])
        optimizer = stepped(model)
        names = optimizer_param_names(optimizer, model)
        placement = placement_of(recipe, plugins, shapes, tp, ep, etp, writes)
        described.append(write_shard(path, model, optimizer, names, {} if rank == 0 else None, placement, rank)[1])
    return shards_meta(described, placement)


@pytest.mark.slow  # gloo ranks under torch's profiler
def test_a_checkpoint_written_per_shard_is_read_by_slices_under_any_layout(hybrid, tmp_path, capsys):
    plugins = get_plugins()
    recipe = validate_recipe(hybrid, plugins)
    shapes = layout_splits(recipe, plugins).shapes
    torch.manual_seed(3)
    one = build_model(recipe, plugins)
    one_optimizer = stepped(one)
    whole = one.state_dict()
    moments = {n: one_optimizer.state[p] for n, p in one.named_parameters()}

    # tp=2 x ep=2 x etp=2: 8 ranks; the ep=0, etp=0 ranks write the tensor-parallel blocks, the tp=0 ranks the experts'
    ranks = {r: ((r % 2, 2), (r // 2 % 2, 2), (r // 4, 2), (r // 2 == 0, r % 2 == 0)) for r in range(8)}
    meta = write_layout(tmp_path, recipe, plugins, ranks)
    assert len(meta["shards"]) == 5  # ranks 0, 1 (tensor-parallel blocks) and 0, 2, 4, 6 (the experts') write
    assert all(n in meta["shapes"] for names in meta["shards"].values() for n in names)
    state = torch.load(tmp_path / "state.pt", weights_only=False, mmap=True)

    readers = {"one process": {}, "tp=1, ep=4": {"ep": (3, 4)}, "tp=2, etp=2": {"tp": (1, 2), "etp": (0, 2)},
               "etp=2": {"etp": (1, 2)}}
    lines = []
    mapped = {f.stat().st_size for f in tmp_path.rglob("*.safetensors")}
    for what, cuts in readers.items():
        placement = placement_of(recipe, plugins, shapes, **cuts)
        weights, peak = measured_peak(partial(read_local_weights, tmp_path, meta, placement), mapped)
        saved, names = local_optimizer_state(tmp_path, meta, state, placement)
        index = {n: i for group, group_names in zip(saved["param_groups"], names, strict=True)
                 for i, n in zip(group["params"], group_names, strict=True)}
        cut_by = [(getattr(layout_splits(recipe, plugins, **{f"{kind}_size": size}), kind), rank, size)
                  for kind, (rank, size) in cuts.items()]

        def cut(name, t, cut_by=cut_by):
            for dims, rank, size in cut_by:
                t = block(t, dims[name], rank, size) if name in dims else t
            return t

        assert weights.keys() == whole.keys(), what
        for name, value in whole.items():
            assert torch.equal(weights[name], cut(name, value)), (what, name)
            for key in ("exp_avg", "exp_avg_sq") if name in moments else ():
                assert torch.equal(saved["state"][index[name]][key], cut(name, moments[name][key])), (what, name, key)
        # reading holds this rank's weights and at most one tensor's part besides
        held = nbytes(weights.values())
        bound = held + max(nbytes([t]) for t in weights.values()) + SLACK
        assert peak <= bound, (what, peak, bound)
        lines.append(f"reading {what}: {held} B held, peaked at {peak} B (bound {bound} B)")
        if cuts:  # reading every tensor whole and cutting it, as one process does, exceeds the bound
            _, whole_peak = measured_peak(
                lambda p=placement: {n: _cut(t, p.slices.get(n)) for n, t in read_full_weights(tmp_path, meta).items()}, mapped)
            assert whole_peak > bound, (what, whole_peak, bound)
            lines.append(f"  reading every tensor whole, then cutting: {whole_peak} B")
    with capsys.disabled():
        print("\n" + "\n".join(lines))


def _cut(t, slices):
    return t if slices is None else t[tuple(slice(a, min(b, n)) for (a, b), n in zip(slices, t.shape, strict=True))].clone()


def test_a_checkpoint_missing_a_block_or_of_another_model_is_refused(hybrid, tmp_path):
    plugins = get_plugins()
    recipe = validate_recipe(hybrid, plugins)
    ranks = {r: ((0, 1), (r, 2), (0, 1), (True, True)) for r in range(2)}
    meta = write_layout(tmp_path, recipe, plugins, ranks)
    lost = {**meta, "shards": {f: names for f, names in meta["shards"].items() if "rank1" not in f}}
    with pytest.raises(CheckpointError, match="its shards are incomplete"):
        read_full_weights(tmp_path, lost)
    shapes = layout_splits(validate_recipe({**hybrid, "moe": {"chunked": {**hybrid["moe"]["chunked"], "expert_hidden": 16}}}, plugins), plugins).shapes
    with pytest.raises(ShapeMismatch, match=r"does not fit the model: shapes differ: blocks\.1\.ffn\.experts\.w_gate_up \[4, 32, 2, 32\] -> \[4, 32, 2, 16\]"):
        read_local_weights(tmp_path, meta, Placement.of(shapes, []))


def test_a_checkpoint_whose_shards_cannot_be_re_laid_is_one_line_exit_2(hybrid, tmp_path, recipe_toml, capsys):
    from megaseq.cli import main
    from megaseq.train import checkpoint

    plugins = get_plugins()
    run = tmp_path / "run"
    recipe = tmp_path / "hybrid.toml"
    recipe.write_text(recipe_toml({**hybrid, "run": {**hybrid["run"], "out_dir": str(run)}}))
    staged = checkpoint.staging_dir(run / "checkpoints", 2)
    meta = write_layout(staged, validate_recipe(hybrid, plugins), plugins, {r: ((r, 2), (0, 1), (0, 1), (True, True)) for r in range(2)})
    # the second tensor-parallel rank's blocks are left out of the description: the checkpoint verifies, yet
    # half of every split tensor is nowhere
    meta["shards"].pop("shards/rank1.safetensors")
    checkpoint.commit(run / "checkpoints", 2, {"layout": {"tp": 2}, **meta})
    capsys.readouterr()
    assert main(["train", str(recipe), "--workers", "2", "--parallel", "tp=2", "--resume"]) == 2
    err = capsys.readouterr().err
    assert "the checkpoint cannot be re-laid" in err and err.count("\n") == 1, err
    # heads that the new tp does not divide
    assert main(["train", str(recipe), "--workers", "4", "--parallel", "tp=4", "--resume"]) == 2
    err = capsys.readouterr().err
    assert "n_heads 2 is not a multiple of tp 4" in err and err.count("\n") == 1, err
    assert not (run / "metrics.jsonl").exists()  # no worker trained
