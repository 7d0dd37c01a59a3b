"""Conformance suite for mixture-of-experts strategies (see ``megaseq.contracts.MoE``).

Subclass :class:`MoEConformance` in a pytest module and set ``name`` and ``config`` (a small config); every
test below then runs against the component built through the installed plugins. An MoE is a feed-forward
block, so the suite includes every test of ``megaseq_testkit.ffn.FeedForwardConformance`` (per-token
outputs, float64 finite-difference gradients, determinism under a moved global generator, zero inputs,
one host sync per batch); the tests here add what is specific to experts and routing.

The reference is the contract's per-token definition, ``shared_forward(x) + sum_j w_j expert_forward(e_j, x)``
with ``(e, w) = route(x)``, evaluated on a float64 copy of the module with the experts the module itself
chose (recorded through ``ctx.routing``), so near-ties in the top-k cannot make the comparison flaky; a
separate check asserts that those recorded experts are the router's own choice. Error bound: outputs and
gradients agree to ``tolerance`` (fp32 default 1e-5) times ``max(1, max |reference|)``. The reference is
built from the module's own ``route``/``expert_forward``/``shared_forward``, so a mistake shared by them
and the forward (a detached expert weight) is caught by the finite-difference check, not here.

``route(x, indices)`` with experts given from outside (routing replay, the skew test) is checked against
:meth:`MoEConformance.given_weights`, the weights of those experts computed by the plugin's test
independently of ``route`` (e.g. the router's softmax gathered at the given experts and renormalised), and,
independently of any formula, against the module's own choice permuted: the weight follows its expert.

Under expert parallelism (``expert_parallel``) and expert tensor parallelism (an MoE's ``tensor_parallel``) each
rank builds only its own experts (``megaseq.distributed.experts.initial_parts``), so a layer built as one rank of
two must hold exactly the one-process layer's block of each expert tensor from the same seed, every other tensor
equal, and leave the global generator where building the whole layer leaves it (:func:`check_local_experts`).

``load_stats()`` must report at least ``megaseq.contracts.LOAD_STAT_KEYS`` (the trainer logs them as
``moe/load/KEY``; floats or 0-dim tensors) for the last training forward, counting
(token, expert) assignments, the same chunked (``chunk_tokens``) as unchunked; ``routing_entropy`` is in nats
of the share of assignments per expert.
"""

from __future__ import annotations

import copy
import math
from typing import Any, ClassVar

import pytest
import torch
from torch import Tensor, nn

from megaseq.contracts import LOAD_STAT_KEYS, ForwardContext, MoE, RoutingReplay
from megaseq.distributed.experts import block, split_dims
from megaseq.records import ModelDims
from megaseq_testkit import assert_close, build_component
from megaseq_testkit.ffn import FeedForwardConformance


def dense_reference(module: Any, x: Tensor, indices: Tensor | None = None) -> Tensor:
    """The contract's per-token definition of the MoE output for ``x [N, d]`` (differentiable)."""
    indices, weights = module.route(x, indices)
    out = module.shared_forward(x)
    for expert in indices.unique().tolist():
        chosen = indices == expert
        rows = chosen.any(-1).nonzero().squeeze(-1)
        w = (weights * chosen).sum(-1)[rows, None].to(x.dtype)
        out = out.index_add(0, rows, w * module.expert_forward(expert, x[rows]))
    return out


def _grad(p: Tensor) -> Tensor:
    """A parameter's gradient; zeros when no gradient reached it (e.g. an expert no token chose)."""
    return p.grad if p.grad is not None else torch.zeros_like(p)


def _load_stats(module: nn.Module) -> dict[str, float]:
    """``module.load_stats()`` with every value as a float (the contract allows 0-dim tensors)."""
    return {key: float(value) for key, value in module.load_stats().items()}


def _record(module: nn.Module, x: Tensor) -> tuple[Tensor, RoutingReplay]:
    """Forward ``x`` while recording the routing; returns the output and the record."""
    routing = RoutingReplay("record")
    out = module(x, ForwardContext(routing=routing))
    assert len(routing.indices) == 1, (
        f"one MoE layer must record one routing entry, got {sorted(routing.indices)}"
    )
    return out, routing


def check_local_experts(
    name: str, config: dict[str, Any], capabilities: frozenset[str], d_model: int = 32, factory: str | None = None
) -> int:
    """Each rank of two under ep (with ``expert_parallel`` declared) and under etp (with ``tensor_parallel``) builds
    the one-process layer's block of each expert tensor and every other tensor whole, drawing what one process
    draws from the global generator. Returns how many layouts were checked (a config the layout does not divide,
    refused with a ValueError at construction, is not one)."""

    def build(**parallel: int) -> tuple[dict[str, Tensor], Tensor]:
        torch.manual_seed(0)
        dims = ModelDims(d_model=d_model, n_layers=2, vocab_size=8, **parallel)
        module = build_component("moe", name, config, dims, factory=factory)
        return module.state_dict(), torch.rand(4)

    whole, after = build()
    checked = 0
    for what, declared in (("ep", "expert_parallel"), ("etp", "tensor_parallel")):
        if declared not in capabilities:
            continue
        try:
            ranks = [build(**{f"{what}_rank": r, f"{what}_size": 2}) for r in range(2)]
        except ValueError:
            continue
        dims = split_dims(whole, ranks[0][0], 2, what)
        assert dims, f"moe {name!r}: built as {what} rank 0 of 2, it holds every tensor whole"
        for rank, (local, after_local) in enumerate(ranks):
            assert torch.equal(after_local, after), (
                f"moe {name!r}: built as {what} rank {rank} of 2, it leaves the global generator elsewhere than the "
                f"one-process layer does (it must draw every expert as one process does)")
            for tensor, value in whole.items():
                expected = block(value, dims[tensor], rank, 2) if tensor in dims else value
                assert torch.equal(local[tensor], expected), (
                    f"moe {name!r}: {tensor} built as {what} rank {rank} of 2 is not the one-process layer's block "
                    f"from the same seed")
        checked += 1
    return checked


class MoEConformance(FeedForwardConformance):
    """Base class of an MoE strategy's conformance tests (the knobs are documented in
    docs/writing-a-plugin.md)."""

    kind: ClassVar[str] = "moe"
    chunk_sizes: ClassVar[tuple[int, ...]] = (7, 1)

    def reference(self, module: nn.Module, x: Tensor, indices: Tensor) -> tuple[nn.Module, Tensor, Tensor]:
        """A float64 copy of ``module``, a float64 leaf copy of ``x``, the reference output ``[B, T, d]``."""
        ref_module = copy.deepcopy(module).double()
        ref_module.zero_grad(set_to_none=True)
        x64 = x.detach().double().requires_grad_(True)
        out = dense_reference(ref_module, x64.reshape(-1, self.d_model), indices).view_as(x64)
        return ref_module, x64, out

    def given_weights(self, module: nn.Module, x: Tensor, indices: Tensor) -> Tensor:
        """The combine weights ``[N, k]`` of the experts ``indices [N, k]`` for tokens ``x [N, d]``, computed
        from the module's parameters without calling its ``route`` (e.g. ``router(x).softmax(-1)`` gathered at
        ``indices`` and renormalised): the reference of ``route(x, indices)``. Every MoE suite defines it."""
        raise AssertionError(
            f"{self.name}: define given_weights(module, x, indices) in the suite class: the weights of given experts "
            "computed independently of route(), the reference for routing given from outside"
        )

    def test_route_given_experts(self) -> None:
        """``route(x, indices)`` returns the weights of the given experts, not of the router's own choice."""
        module = self.build()
        x = self.inputs().reshape(-1, self.d_model)
        n, k, e = x.shape[0], module.top_k, module.n_experts
        scores = torch.rand(n, e, generator=torch.Generator().manual_seed(3))
        given = scores.topk(k, dim=-1).indices  # k distinct experts per token, mostly not the router's choice
        own, own_weights = module.route(x)
        assert not torch.equal(given.sort(-1).values, own.sort(-1).values), "the given experts are the router's own"
        with torch.no_grad():
            indices, weights = module.route(x, given)
            expected = self.given_weights(module, x, given)
        assert torch.equal(indices, given), "route(x, indices) must keep the given indices"
        assert_close(weights, expected.to(weights.dtype), self.tolerance, "route(x, given experts): weights vs given_weights")
        if k > 1:  # the module's own choice in another order: each weight follows its expert
            order = torch.arange(k).roll(1)
            _, permuted = module.route(x, own[:, order])
            assert_close(permuted, own_weights[:, order], self.tolerance, "route(x, own experts permuted): weights")

    def test_protocol(self) -> None:
        module = self.build()
        assert isinstance(module, MoE), f"{type(module).__name__} does not implement megaseq.contracts.MoE"
        assert 1 <= module.top_k <= module.n_experts
        x = self.inputs().reshape(-1, self.d_model)
        indices, weights = module.route(x)
        n = x.shape[0]
        assert indices.shape == (n, module.top_k) and weights.shape == (n, module.top_k)
        assert ((indices >= 0) & (indices < module.n_experts)).all()
        assert all(len(set(row)) == module.top_k for row in indices.tolist()), "a token chose an expert twice"
        given = torch.randint(
            0, module.n_experts, (n, module.top_k), generator=torch.Generator().manual_seed(3)
        )
        again, _ = module.route(x, given)
        assert torch.equal(again, given), "route(x, indices) must keep the given indices"

    def test_matches_dense_reference(self) -> None:
        module = self.build()
        x = self.inputs()
        out, routing = _record(module, x)
        (recorded,) = routing.indices.values()
        chosen, _ = module.route(x.reshape(-1, self.d_model))
        assert torch.equal(recorded.sort(-1).values, chosen.sort(-1).values), (
            "forward did not use route(x)'s experts"
        )
        assert out.shape == x.shape and out.dtype == x.dtype
        _, _, ref = self.reference(module, x, recorded)
        assert_close(out, ref, self.tolerance, "output vs dense reference")

    def test_dropless_under_skew(self) -> None:
        """Every token routed to the same k experts: nothing may be dropped or capped, forward or backward."""
        module = self.build()
        x = self.inputs().requires_grad_(True)
        _, routing = _record(module, x.detach())
        (key,) = routing.indices
        skewed = torch.arange(module.top_k).expand(x.shape[0] * x.shape[1], -1).contiguous()
        routing.indices[key] = skewed
        out = module(x, ForwardContext(routing=routing.replay()))
        self.assert_matches_reference(module, x, out, skewed, "all-to-the-same-experts routing")

    def test_gradients_match_reference(self) -> None:
        module = self.build()
        x = self.inputs().requires_grad_(True)
        out, routing = _record(module, x)
        (recorded,) = routing.indices.values()
        self.assert_matches_reference(module, x, out, recorded, "own routing")

    def assert_matches_reference(
        self, module: nn.Module, x: Tensor, out: Tensor, indices: Tensor, what: str
    ) -> None:
        """``out = module(x)`` routed by ``indices``: output, input and parameter gradients vs reference."""
        grad_out = self.inputs(seed=2)
        (out * grad_out).sum().backward()
        ref_module, x64, ref = self.reference(module, x, indices)
        (ref * grad_out.double()).sum().backward()
        assert_close(out, ref, self.tolerance, f"{what}: output")
        assert_close(x.grad, x64.grad, self.tolerance, f"{what}: input gradient")
        ref_params = dict(ref_module.named_parameters())
        for pname, p in module.named_parameters():
            assert_close(_grad(p), _grad(ref_params[pname]), self.tolerance, f"{what}: gradient of {pname}")

    def test_chunked_equals_unchunked(self) -> None:
        x = self.inputs()
        grad_out = self.inputs(seed=2)
        results = {}
        for chunk in (None, *self.chunk_sizes):
            module = self.build()
            module.chunk_tokens = chunk
            xr = x.clone().requires_grad_(True)
            out = module(xr, ForwardContext())
            (out * grad_out).sum().backward()
            results[chunk] = (out.detach(), xr.grad, {n: _grad(p) for n, p in module.named_parameters()})
        whole, whole_grad, whole_params = results.pop(None)
        for chunk, (out, x_grad, params) in results.items():
            assert_close(out, whole, self.tolerance, f"output with chunk_tokens={chunk}")
            assert_close(x_grad, whole_grad, self.tolerance, f"input gradient with chunk_tokens={chunk}")
            for pname, g in params.items():
                assert_close(
                    g, whole_params[pname], self.tolerance, f"gradient of {pname} with chunk_tokens={chunk}"
                )

    def test_routing_replay(self) -> None:
        """Replaying a record reproduces that forward exactly, and on new inputs uses the recorded experts."""
        module = self.build()
        x = self.inputs()
        out, routing = _record(module, x)
        replayed = module(x, ForwardContext(routing=routing.replay()))
        assert torch.equal(replayed, out), (
            "replaying the recorded routing on the same input changed the output"
        )
        (recorded,) = routing.indices.values()
        other = self.inputs(seed=5)
        own, _ = module.route(other.reshape(-1, self.d_model))
        assert not torch.equal(own.sort(-1).values, recorded.sort(-1).values), "test inputs route identically"
        out_other = module(other, ForwardContext(routing=routing.replay()))
        _, _, ref = self.reference(module, other, recorded)
        assert_close(out_other, ref, self.tolerance, "output on new input with replayed routing")

    def test_load_stats(self) -> None:
        module = self.build()
        x = self.inputs()
        n, k, e = x.shape[0] * x.shape[1], module.top_k, module.n_experts
        _, routing = _record(module, x)
        stats = _load_stats(module)
        missing = [key for key in LOAD_STAT_KEYS if key not in stats]
        assert not missing, f"load_stats() lacks {missing}"
        assert stats["tokens_per_expert_mean"] == pytest.approx(n * k / e)
        assert stats["tokens_per_expert_mean"] <= stats["tokens_per_expert_max"] <= n
        assert stats["tokens_per_rank_mean"] <= stats["tokens_per_rank_max"]
        assert 0 <= stats["routing_entropy"] <= math.log(e) + 1e-9
        # the same forward in chunks counts the same assignments (not the last chunk's)
        chunked = self.build()
        chunked.chunk_tokens = min(self.chunk_sizes)
        chunked(x, ForwardContext())
        chunked_stats = _load_stats(chunked)
        for key in LOAD_STAT_KEYS:
            assert chunked_stats[key] == pytest.approx(stats[key], rel=1e-9), (
                f"load_stats()[{key!r}] with chunk_tokens={chunked.chunk_tokens}: {chunked_stats[key]}, unchunked {stats[key]}"
            )
        # skewed routing: k experts take every token
        (key,) = routing.indices
        routing.indices[key] = torch.arange(k).expand(n, -1).contiguous()
        module(x, ForwardContext(routing=routing.replay()))
        skewed = _load_stats(module)
        assert skewed["tokens_per_expert_max"] == n
        assert skewed["routing_entropy"] == pytest.approx(math.log(k), abs=1e-6)
        # an eval forward is not training load
        module.eval()
        with torch.no_grad():
            module(self.inputs(seed=9), ForwardContext())
        assert _load_stats(module) == skewed, "an eval-mode forward changed the training load statistics"

    def test_local_experts_are_blocks_of_the_one_process_layer(self) -> None:
        """:func:`check_local_experts`, for the capabilities declared (none: nothing to check)."""
        check_local_experts(self.name, self.config, self.declared(), self.d_model, self.factory)

    def test_finite_at_large_inputs(self) -> None:
        """Inputs 50x the usual scale (saturated router and gates) give finite outputs and gradients."""
        module = self.build()
        x = (self.inputs() * 50).requires_grad_(True)
        out = module(x, ForwardContext())
        out.square().mean().backward()
        assert torch.isfinite(out).all(), "non-finite output at 50x inputs"
        assert torch.isfinite(x.grad).all(), "non-finite input gradient at 50x inputs"
        for pname, p in module.named_parameters():
            assert p.grad is None or torch.isfinite(p.grad).all(), f"non-finite gradient of {pname}"


__all__ = ["LOAD_STAT_KEYS", "MoEConformance", "check_local_experts", "dense_reference"]
