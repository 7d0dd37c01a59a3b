"""Expert parallelism over 2 gloo processes equals one rank holding every expert, in outputs and gradients.

Each rank holds half of the experts and its own tokens (different counts, so different numbers of chunks);
the reference is one unsharded layer run on each rank's tokens in turn. Router and shared-expert gradients
are summed over ranks (as data parallelism would); each rank's expert gradients are its slice of the
reference's. Tolerance: max abs error <= 1e-5 * max(1, max |reference|).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor

from megaseq.contracts import ForwardContext, RoutingReplay
from megaseq.parallel import collectives
from megaseq.records import ModelDims
from megaseq_moe.config import ChunkedMoEConfig
from megaseq_moe.layer import AUX_LOSS_NAME, ChunkedMoE, build
from megaseq_testkit.distributed import run_gloo

D, WORLD = 32, 2
BASE = {"n_experts": 4, "top_k": 2, "expert_hidden": 24, "init_std": 0.2, "swiglu_limit": 1.0}
CASES = {
    "balanced-chunked-aux": ({**BASE, "chunk_tokens": 4, "aux_loss_coef": 0.2}, False),
    "skewed-chunked": ({**BASE, "chunk_tokens": 3}, True),
    "balanced-unchunked": ({**BASE, "chunk_tokens": None}, False),
}
SHAPES = [(2, 7), (1, 5)]  # tokens of rank 0 and rank 1


def make(config: dict, ep_rank: int = 0, ep_size: int = 1) -> ChunkedMoE:
    dims = ModelDims(d_model=D, n_layers=1, vocab_size=8, ep_rank=ep_rank, ep_size=ep_size)
    return build(ChunkedMoEConfig(**config), dims, 0).train()


def run(
    module: ChunkedMoE, x: Tensor, grad_out: Tensor, skew: bool, group: Any | None
) -> tuple[Tensor, Tensor]:
    """Forward (all tokens to experts 0 and 1 when ``skew``) and backward; returns output and input grad."""
    routing = None
    if skew:
        routing = RoutingReplay("replay")
        routing.indices["layer0"] = torch.tensor([0, 1]).expand(x.shape[0] * x.shape[1], -1).contiguous()
    ctx = ForwardContext(routing=routing, ep_group=group)
    x = x.clone().requires_grad_(True)
    out = module(x, ctx)
    loss = (out * grad_out).sum() + ctx.losses.get(AUX_LOSS_NAME, 0.0)
    loss.backward()
    return out.detach(), x.grad


def shard(state: dict[str, Tensor], rank: int) -> dict[str, Tensor]:
    return {k: v.chunk(WORLD)[rank] if k.startswith("experts.") else v for k, v in state.items()}


def ep_worker(rank: int, world: int, states: dict, inputs: list, grad_outs: list) -> dict[str, Any]:
    results = {}
    for name, (config, skew) in CASES.items():
        module = make(config, rank, world)
        module.load_state_dict(shard(states[name], rank))
        out, x_grad = run(module, inputs[rank], grad_outs[rank], skew, dist.group.WORLD)
        grads = {}
        for pname, p in module.named_parameters():
            if not pname.startswith("experts."):
                collectives.all_reduce(p.grad, dist.group.WORLD)  # replicated weights: gradients summed over ranks
            grads[pname] = p.grad
        results[name] = {"out": out, "x_grad": x_grad, "grads": grads, "stats": module.load_stats()}
    return results


@pytest.mark.slow
def test_expert_parallel_equals_one_rank() -> None:
    gen = torch.Generator().manual_seed(0)
    inputs = [torch.randn(*shape, D, generator=gen) for shape in SHAPES]
    grad_outs = [torch.randn(*shape, D, generator=gen) for shape in SHAPES]
    states, expected = {}, {}
    for name, (config, skew) in CASES.items():
        torch.manual_seed(1)
        module = make(config)
        states[name] = {k: v.clone() for k, v in module.state_dict().items()}
        per_rank = [run(module, inputs[r], grad_outs[r], skew, None) for r in range(WORLD)]
        expected[name] = (per_rank, {n: p.grad.clone() for n, p in module.named_parameters()})

    results = run_gloo(WORLD, ep_worker, states, inputs, grad_outs)

    for name in CASES:
        per_rank, ref_grads = expected[name]
        for rank, res in enumerate(results):
            got = res[name]
            ref_out, ref_x_grad = per_rank[rank]
            assert_close(got["out"], ref_out, f"{name}: rank {rank} output")
            assert_close(got["x_grad"], ref_x_grad, f"{name}: rank {rank} input gradient")
            for pname, g in got["grads"].items():
                assert_close(g, shard(ref_grads, rank)[pname], f"{name}: rank {rank} gradient of {pname}")
            stats = got["stats"]  # over both ranks' tokens: 19 tokens x top-2
            assert stats["tokens_per_expert_mean"] == 19 * 2 / 4 and stats["tokens_per_rank_mean"] == 19
        if CASES[name][1]:  # all 38 assignments land on rank 0's experts
            assert results[0][name]["stats"]["tokens_per_rank_max"] == 38


def assert_close(actual: Tensor, expected: Tensor, what: str) -> None:
    err = (actual.double() - expected.double()).abs().max().item()
    assert err <= 1e-5 * max(1.0, expected.abs().max().item()), f"{what}: error {err:.3e}"


def test_the_planner_reports_an_expert_split_the_layer_refuses():
    """The experts' split is the layer's own business: the planner reports the memory estimate's refusal
    in one line, as the build would refuse it."""
    from megaseq.config import validate_recipe
    from megaseq.distributed.layout import Layout
    from megaseq.errors import UserError
    from megaseq.memory.machine import GiB, Machine
    from megaseq.memory.plan import plan
    from megaseq.plugins import get_plugins

    plugins = get_plugins()
    raw = {"run": {"device": "cpu"}, "data": {"seq_len": 32}, "model": {"d_model": 8, "n_layers": 2, "moe": "chunked"},
           "moe": {"chunked": {**BASE, "n_experts": 6}}, "attention": {"sdpa": {"n_heads": 2}}}
    recipe = validate_recipe(raw, plugins, source="r.toml")
    with pytest.raises(UserError, match=r"moe 'chunked' .*n_experts \(6\) must be a multiple of the expert-parallel size \(4\)"):
        plan(recipe, plugins, layout=Layout(dp=4, ep=4), machine=Machine("cpu", 64 * GiB, None), policies="none")
