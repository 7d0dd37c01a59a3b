"""The chunked layer beyond the conformance suite: balance loss, memory behaviour, load/bias step hook,
plugin registration, config validation, memory estimate, bf16.

Tolerance (fp32 against float64 oracles): max abs error <= 1e-5 * max(1, max |reference|).
"""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import megaseq_moe.plugin
from megaseq.contracts import ContextParallel, ForwardContext, RoutingReplay
from megaseq.records import ModelDims
from megaseq.train.state import StepInfo
from megaseq_moe.config import ChunkedMoEConfig
from megaseq_moe.layer import AUX_LOSS_NAME, ChunkedMoE, build, memory_estimate
from megaseq_testkit import fresh_plugins, registered
from megaseq_testkit.moe import dense_reference

D = 32
RTOL = 1e-5
BASE = {"n_experts": 8, "top_k": 2, "expert_hidden": 24, "init_std": 0.2}


def make(seed: int = 0, **overrides: object) -> ChunkedMoE:
    torch.manual_seed(seed)
    return build(
        ChunkedMoEConfig(**{**BASE, **overrides}), ModelDims(d_model=D, n_layers=2, vocab_size=8), 3
    ).train()


def assert_close(actual: Tensor, expected: Tensor, what: str) -> None:
    err = (actual.double() - expected.double()).abs().max().item()
    assert err <= RTOL * max(1.0, expected.abs().max().item()), f"{what}: error {err:.3e}"


def aux_loss_oracle(module: nn.Module, x: Tensor, indices: Tensor, segments: Tensor, coef: float) -> Tensor:
    """DeepSeek-V3 sequence-wise balance loss, one sequence at a time."""
    e, k = module.n_experts, module.top_k
    s = module.router.affinities(x)
    per_sequence = []
    for seg in segments.unique().tolist():
        rows = segments == seg
        f = torch.bincount(indices[rows].reshape(-1), minlength=e) * e / (k * rows.sum())
        p = (s[rows] / s[rows].sum(-1, keepdim=True)).mean(0)
        per_sequence.append((f * p).sum())
    return coef * torch.stack(per_sequence).mean()


@pytest.mark.parametrize("packed", [False, True], ids=["rows", "documents"])
def test_aux_loss_value_and_gradients_match_oracle(packed: bool) -> None:
    module = make(aux_loss_coef=0.3, chunk_tokens=3, routed_scaling_factor=2.5)
    gen = torch.Generator().manual_seed(1)
    shape = (1, 17, D) if packed else (2, 11, D)
    x = torch.randn(*shape, generator=gen).requires_grad_(True)
    grad_out = torch.randn(*shape, generator=gen)
    cu = torch.tensor([0, 4, 9, 17], dtype=torch.int32) if packed else None
    ctx = ForwardContext(cu_seqlens=cu, routing=RoutingReplay())
    out = module(x, ctx)
    ((out * grad_out).sum() + ctx.losses[AUX_LOSS_NAME]).backward()

    ref_module = copy.deepcopy(module).double()
    ref_module.zero_grad(set_to_none=True)
    x64 = x.detach().double().reshape(-1, D).requires_grad_(True)
    (indices,) = ctx.routing.indices.values()
    segments = (
        torch.repeat_interleave(torch.arange(3), torch.tensor([4, 5, 8]))
        if packed
        else torch.arange(2).repeat_interleave(11)
    )
    ref_aux = aux_loss_oracle(ref_module, x64, indices, segments, 0.3)
    ref_out = dense_reference(ref_module, x64, indices)
    ((ref_out * grad_out.double().reshape(-1, D)).sum() + ref_aux).backward()

    assert_close(ctx.losses[AUX_LOSS_NAME].detach(), ref_aux.detach(), "aux loss")
    assert_close(x.grad.reshape(-1, D), x64.grad, "input gradient")
    ref_params = dict(ref_module.named_parameters())
    for name, p in module.named_parameters():
        assert_close(p.grad, ref_params[name].grad, f"gradient of {name}")


def test_no_aux_loss_when_off_or_in_eval() -> None:
    x = torch.randn(2, 5, D)
    ctx = ForwardContext()
    make(aux_loss_coef=0.0)(x, ctx)
    make(aux_loss_coef=0.3).eval()(x, ctx)
    assert ctx.losses == {}


CP_LENGTH = 16
CP_DOCUMENTS = torch.tensor([0, 5, 9, 16], dtype=torch.int32)  # boundaries inside the zig-zag segments


def _balance_loss_run(rank: int, world: int, packed: bool) -> dict[str, Tensor]:
    """One rank's (or, with ``world == 1``, the whole sequence's) loss share and gradients."""
    import torch.distributed as dist

    module = make(aux_loss_coef=0.3, chunk_tokens=3)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1, CP_LENGTH, D, generator=gen)
    grad_out = torch.randn(1, CP_LENGTH, D, generator=gen)
    cp = ContextParallel(group=dist.group.WORLD, rank=rank, world_size=world, seq_len=CP_LENGTH) if world > 1 else None
    local = cp.positions() if cp is not None else torch.arange(CP_LENGTH)
    x = x[:, local].requires_grad_(True)
    ctx = ForwardContext(cp=cp, cu_seqlens=CP_DOCUMENTS if packed else None)
    out = module(x, ctx)
    ((out * grad_out[:, local]).sum() + ctx.losses[AUX_LOSS_NAME]).backward()
    grads = {name: p.grad for name, p in module.named_parameters()}
    return {"aux": ctx.losses[AUX_LOSS_NAME].detach(), "x_grad": x.grad[0], "positions": local, **grads}


@pytest.mark.parametrize("packed", [False, True], ids=["one-sequence", "documents"])
def test_balance_loss_shares_under_context_parallelism_add_up(packed: bool) -> None:
    """Under CP=2 each rank's loss is a share: the shares, the parameter gradients summed over ranks and the
    input gradients put back in place equal one process on the whole sequence."""
    from megaseq_testkit.distributed import run_gloo

    whole = _balance_loss_run(0, 1, packed)
    ranks = run_gloo(2, _balance_loss_run, packed)
    assert_close(sum(r["aux"] for r in ranks), whole["aux"], "balance loss")
    x_grad = torch.zeros_like(whole["x_grad"])
    for r in ranks:
        x_grad[r["positions"]] = r["x_grad"]
    assert_close(x_grad, whole["x_grad"], "input gradient")
    for name in whole:
        if name not in ("aux", "x_grad", "positions"):
            assert_close(sum(r[name] for r in ranks), whole[name], f"gradient of {name}")


def saved_bytes(module: ChunkedMoE, n_tokens: int) -> int:
    total = 0

    def pack(t: Tensor) -> Tensor:
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(torch.randn(1, n_tokens, D, requires_grad=True), ForwardContext())
    return total


@pytest.mark.parametrize("chunk", [4, None], ids=["chunked", "unchunked"])
def test_autograd_keeps_only_input_and_indices(chunk: int | None) -> None:
    """Between forward and backward the layer holds its input and the expert indices: nothing else per token
    (router probabilities and dispatch buffers are not in the graph), whatever the chunk size."""
    module = make(chunk_tokens=chunk)
    per_token = 4 * D + 8 * module.top_k
    assert saved_bytes(module, 40) == 40 * per_token
    assert saved_bytes(module, 200) == 200 * per_token


class TensorSizes(TorchDispatchMode):
    """Records the shape of every tensor an operator produces."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.shapes += [tuple(t.shape) for t in tree_leaves(out) if isinstance(t, Tensor)]
        return out


def largest_chunk_sized_tensor(module: ChunkedMoE, n_tokens: int) -> int:
    """Elements of the largest tensor made in forward + backward, other than parameter-shaped ones and the
    full-length input, output and indices, which scale with the sequence by definition."""
    x = torch.randn(1, n_tokens, D, requires_grad=True)
    with TensorSizes() as sizes:
        (module(x, ForwardContext()) * torch.randn(1, n_tokens, D)).sum().backward()
    full_length = {(n_tokens, D), (1, n_tokens, D), (n_tokens, module.top_k), (n_tokens * module.top_k,)}
    params = {tuple(p.shape) for p in module.parameters()}
    params |= {(*s[:2], s[2] * s[3]) for s in params if len(s) == 4}  # [E, d, 2, h] is multiplied as [E, d, 2h]
    params |= {(*s[:-2], s[-1], s[-2]) for s in params}  # weight gradients are also formed transposed
    return max(torch.Size(s).numel() for s in sizes.shapes if s not in full_length and s not in params)


def test_working_tensors_are_bounded_by_the_chunk() -> None:
    chunk, n_tokens = 4, 300
    module = make(chunk_tokens=chunk)
    rows = chunk * module.top_k
    bound = rows * (2 * D + 1)  # the backward payload [x | dy | w] of one chunk is the largest
    assert largest_chunk_sized_tensor(module, n_tokens) <= bound
    module.chunk_tokens = None  # the same measurement sees sequence-sized buffers without chunking
    assert largest_chunk_sized_tensor(module, n_tokens) > n_tokens * module.top_k * D


def test_step_end_updates_bias_from_the_step_load_and_reports_metrics() -> None:
    module = make(bias_update_rate=0.01)
    model = nn.Sequential(module)
    x1, x2 = torch.randn(2, 9, D), torch.randn(1, 7, D)
    module(x1, ForwardContext())
    first = module.last_load.clone()
    module(x2, ForwardContext())
    load = first + module.last_load
    assert load.sum() == (18 + 7) * module.top_k
    module.eval()
    with torch.no_grad():
        module(torch.randn(1, 50, D), ForwardContext())  # eval forwards are not training load
    assert torch.equal(module.step_load, load)

    metrics: dict[str, float] = {}
    with registered(megaseq_moe.plugin, fresh_plugins()) as plugins:
        plugins.hooks.step_end(StepInfo(step=1, total_steps=2, tokens=25, lr=1e-3), model, metrics)
        expected_bias = 0.01 * torch.sign(load.float().mean() - load.float())
        assert torch.allclose(module.router.expert_bias, expected_bias)
        assert module.step_load.sum() == 0
        ratio = (load.max() / load.float().mean()).item()
        assert metrics["moe/layer3/expert_max_over_mean"] == pytest.approx(ratio)
        assert metrics["moe/expert_max_over_mean"] == pytest.approx(ratio)
        assert metrics["moe/rank_max_over_mean"] == pytest.approx(1.0)
        assert 0 < metrics["moe/routing_entropy"] <= torch.log(torch.tensor(8.0)).item()
        assert metrics["moe/bias_abs_max"] == pytest.approx(0.01)
        # a step without training forwards changes nothing and reports nothing
        later: dict[str, float] = {}
        plugins.hooks.step_end(StepInfo(step=2, total_steps=2, tokens=0, lr=1e-3), model, later)
        assert later == {} and torch.allclose(module.router.expert_bias, expected_bias)


def test_bias_rate_zero_keeps_bias_frozen() -> None:
    module = make(bias_update_rate=0.0)
    module(torch.randn(2, 9, D), ForwardContext())
    metrics: dict[str, float] = {}
    megaseq_moe.plugin.megaseq_step_end(StepInfo(1, 1, 18, 1e-3), nn.Sequential(module), metrics)
    assert torch.equal(module.router.expert_bias, torch.zeros(8)) and "moe/expert_max_over_mean" in metrics


def test_registered_through_the_entry_point() -> None:
    with registered(megaseq_moe.plugin, fresh_plugins()) as plugins:
        provided = plugins.get("moe", "chunked")
        assert provided.spec.config is ChunkedMoEConfig
        assert provided.load() is build and provided.spec.load_memory() is memory_estimate
    from megaseq.plugins import get_plugins

    assert get_plugins().get("moe", "chunked").plugin.dist == "megaseq-moe-chunked"


def test_listing_the_plugin_does_not_import_torch() -> None:
    code = "import sys, megaseq_moe.plugin; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"top_k": 9}, "top_k (9) must be <= n_experts (8)"),
        ({"chunk_tokens": 0}, "chunk_tokens"),
        ({"swiglu_limit": -1.0}, "swiglu_limit"),
        ({"bias_update_rate": -0.1}, "bias_update_rate"),
        ({"n_expert": 8}, "n_expert"),
    ],
)
def test_config_errors_name_the_problem(overrides: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ChunkedMoEConfig(**{**BASE, **overrides})


def test_build_and_forward_errors_are_one_line() -> None:
    with pytest.raises(
        ValueError, match=r"n_experts \(8\) must be a multiple of the expert-parallel size \(3\)"
    ):
        build(ChunkedMoEConfig(**BASE), ModelDims(d_model=D, n_layers=1, vocab_size=8, ep_size=3), 0)
    sharded = build(
        ChunkedMoEConfig(**BASE), ModelDims(d_model=D, n_layers=1, vocab_size=8, ep_rank=1, ep_size=2), 0
    )
    with pytest.raises(ValueError, match="built for 2 expert-parallel ranks, ctx.ep_group has 1"):
        sharded(torch.randn(1, 3, D), ForwardContext())
    with pytest.raises(ValueError, match=r"expert 0 is not on expert-parallel rank 1 \(it holds 4..7\)"):
        sharded.expert_forward(0, torch.randn(2, D))


def test_memory_estimate() -> None:
    config = ChunkedMoEConfig(**BASE, chunk_tokens=64)
    dims = ModelDims(d_model=D, n_layers=1, vocab_size=8)
    module = build(config, dims, 0)
    est = memory_estimate(config, dims, 1000)
    param_bytes = sum(p.numel() * 4 for p in module.parameters()) + 4 * config.n_experts
    assert est.parameters == param_bytes
    assert (
        est.saved_per_token == 4 * D + 8 * config.top_k
    )  # what test_autograd_keeps_only_input_and_indices measures
    assert memory_estimate(config, dims, 10**6).temporary == est.temporary  # bounded by the chunk
    unchunked = ChunkedMoEConfig(**BASE, chunk_tokens=None)
    assert (
        memory_estimate(unchunked, dims, 2000).temporary
        > 1.9 * memory_estimate(unchunked, dims, 1000).temporary
    )


def test_bf16_close_to_fp32() -> None:
    """bf16 weights and activations (the grouped_mm path on CPU) track the fp32 layer to bf16 precision."""
    module = make(chunk_tokens=5)
    x = torch.randn(2, 9, D)
    ctx = ForwardContext(routing=RoutingReplay())
    ref = module(x, ctx)
    low = copy.deepcopy(module).bfloat16()
    out = low(x.bfloat16(), ForwardContext(routing=ctx.routing.replay()))
    assert out.dtype == torch.bfloat16
    assert (out.float() - ref).abs().max() <= 3e-2 * ref.abs().max()
    xb = x.bfloat16().requires_grad_(True)
    low(xb, ForwardContext(routing=ctx.routing.replay())).float().square().sum().backward()
    assert torch.isfinite(xb.grad.float()).all() and all(
        torch.isfinite(p.grad.float()).all() for p in low.parameters()
    )


def test_bf16_autocast_does_not_reach_inside_the_layer() -> None:
    """Under a caller's bf16 autocast on CPU the layer routes and computes in its input's dtype: outputs, routing
    and gradients are bitwise the fp32 run's (a bf16 router would flip near-tied choices; its forward would then
    disagree with the fp32 recomputation in backward)."""

    def run(autocast: bool) -> list[Tensor]:
        module = make(chunk_tokens=5)
        x = torch.randn(2, 9, D, generator=torch.Generator().manual_seed(3)).requires_grad_(True)
        ctx = ForwardContext(routing=RoutingReplay())
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = module(x, ctx)
        out.square().sum().backward()
        return [out, *ctx.routing.indices.values(), x.grad, *(p.grad for p in module.parameters())]

    for a, b in zip(run(True), run(False), strict=True):
        assert torch.equal(a, b)


def test_experts_follow_a_cuda_bf16_autocast(monkeypatch) -> None:
    """What a CUDA device gets under a bf16 autocast, on CPU: the dtype choice is the CUDA one, the rest of the
    layer is the same code. The routed experts run in bf16 through grouped_mm, and the shared expert in bf16,
    in forward and in the recomputation of backward; the router stays fp32, so routing equals the fp32 run's; the output keeps the input's dtype
    and tracks the fp32 layer to bf16 precision."""
    import megaseq_moe.experts as experts
    import megaseq_moe.layer as layer
    from megaseq_moe.router import Router

    real_expert_dtype = layer.expert_dtype
    monkeypatch.setattr(layer, "expert_dtype", lambda kind, dtype, autocast: real_expert_dtype("cuda", dtype, autocast))
    products, routers = [], []
    real_linear, real_affinities = experts.grouped_linear, Router.affinities

    def spy_linear(x, weight, counts, use_grouped_mm, sizes=None):
        products.append((x.dtype, weight.dtype, use_grouped_mm))
        return real_linear(x, weight, counts, use_grouped_mm, sizes)

    def spy_affinities(self, x):
        out = real_affinities(self, x)
        routers.append(out.dtype)
        return out

    shared, real_shared = [], experts.SharedExpert.forward

    def spy_shared(self, x, dtype=None):
        shared.append(dtype or x.dtype)
        return real_shared(self, x, dtype)

    monkeypatch.setattr(experts, "grouped_linear", spy_linear)
    monkeypatch.setattr(Router, "affinities", spy_affinities)
    monkeypatch.setattr(experts.SharedExpert, "forward", spy_shared)

    def run(autocast: bool) -> tuple[list[Tensor], dict]:
        module = make(chunk_tokens=5)
        x = torch.randn(2, 9, D, generator=torch.Generator().manual_seed(3)).requires_grad_(True)
        ctx = ForwardContext(routing=RoutingReplay())
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = module(x, ctx)
        out.square().sum().backward()
        return [out, x.grad, *(p.grad for p in module.parameters())], ctx.routing.indices

    want, want_routes = run(False)
    assert {dtype for dtype, _, _ in products} == set(shared) == {torch.float32}
    products.clear()
    shared.clear()
    got, routes = run(True)
    chunks = 4  # 18 tokens in chunks of 5
    assert len(products) == 2 * 2 * chunks  # two products a chunk, in forward and in backward's recomputation
    assert set(products) == {(torch.bfloat16, torch.bfloat16, hasattr(torch.nn.functional, "grouped_mm"))}
    assert set(shared) == {torch.bfloat16} and len(shared) == 2 * chunks
    assert set(routers) == {torch.float32}
    assert all(torch.equal(routes[k], want_routes[k]) for k in want_routes)
    assert got[0].dtype == torch.float32
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert (g - w).abs().max() <= 3e-2 * w.abs().max(), f"tensor {i}: bf16 experts far from the fp32 layer"
