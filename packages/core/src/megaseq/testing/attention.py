"""Conformance suite for attention components (see ``megaseq.contracts.Attention``).

Subclass :class:`AttentionConformance` in a pytest module, set ``name`` and ``config``; every test below
then runs against the component built through the installed plugins. Tolerances: outputs and gradients
must agree to ``rtol`` times the reference's largest magnitude (fp32 default 1e-5).
"""

from __future__ import annotations

import itertools
from typing import Any, ClassVar

import pytest
import torch
from torch import Tensor, nn

from megaseq.contracts import ContextParallel, ForwardContext
from megaseq.parallel import zigzag_shard
from megaseq.records import ModelDims
from megaseq.testing import assert_close, build_component


def _build(name: str, config: dict[str, Any], d_model: int, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    dims = ModelDims(d_model=d_model, n_layers=2, vocab_size=8)
    return build_component("attention", name, config, dims).float()


# A context-parallel case: (config, x [B, T, d_model], grad_out [B, T, d_model], cu_seqlens or None).
CPCase = tuple[dict[str, Any], Tensor, Tensor, Tensor | None]


def cp_rank_step(module: nn.Module, x: Tensor, grad_out: Tensor, cu_seqlens: Tensor | None, rank: int, world: int) -> dict[str, Any]:
    """One rank's forward and backward of ``(out * grad_out).sum() + auxiliary losses`` on its zig-zag share.

    Returns this rank's output and input gradient, and the parameter gradients and auxiliary loss summed over
    the group (each rank's auxiliary loss is its share: the shares add up to the single-rank loss).
    """
    import torch.distributed as dist

    x_local = zigzag_shard(x, rank, world).detach().requires_grad_(True)
    cp = ContextParallel(group=dist.group.WORLD, rank=rank, world_size=world, seq_len=x.shape[1])
    ctx = ForwardContext(cu_seqlens=cu_seqlens, cp=cp)
    out = module(x_local, ctx)
    aux = sum(ctx.losses.values(), torch.zeros(()))
    ((out * zigzag_shard(grad_out, rank, world)).sum() + aux).backward()
    grads = {}
    for pname, p in module.named_parameters():
        grads[pname] = p.grad if p.grad is not None else torch.zeros_like(p)
        dist.all_reduce(grads[pname])
    aux = aux.detach().clone()
    dist.all_reduce(aux)
    return {"out": out.detach(), "x_grad": x_local.grad, "param_grads": grads, "aux_loss": aux}


def _cp_cases_worker(rank: int, world: int, name: str, d_model: int, cases: list[CPCase]) -> list[dict[str, Any]]:
    return [cp_rank_step(_build(name, config, d_model, seed=0), x, g, cu, rank, world) for config, x, g, cu in cases]


def check_context_parallel(
    name: str, d_model: int, cases: list[CPCase], world: int, rtol: float = 1e-5,
    results: list[list[dict[str, Any]]] | None = None,
) -> list[list[dict[str, Any]]]:
    """Assert that ``world`` gloo ranks equal one rank for every case: outputs, input gradients, parameter
    gradients and auxiliary losses. All cases share one process group (spawning dominates a small case's
    cost). ``results`` (per rank, per case, from :func:`cp_rank_step`) may come from a plugin's own worker
    that records more; returns them for further checks."""
    from megaseq.testing.distributed import run_gloo

    results = results or run_gloo(world, _cp_cases_worker, name, d_model, cases)
    for i, (config, x, grad_out, cu) in enumerate(cases):
        module = _build(name, config, d_model, seed=0)
        xr = x.clone().requires_grad_(True)
        ctx = ForwardContext(cu_seqlens=cu)
        ref = module(xr, ctx)
        aux = sum(ctx.losses.values(), torch.zeros(()))
        ((ref * grad_out).sum() + aux).backward()
        what = f"{name} case {i}, cp{world}"
        for rank in range(world):
            res = results[rank][i]
            assert_close(res["out"], zigzag_shard(ref.detach(), rank, world), rtol, f"{what} rank {rank} output")
            assert_close(res["x_grad"], zigzag_shard(xr.grad, rank, world), rtol, f"{what} rank {rank} input grad")
        assert_close(results[0][i]["aux_loss"], aux.detach(), rtol, f"{what} auxiliary loss")
        for pname, p in module.named_parameters():
            if p.grad is not None:
                assert_close(results[0][i]["param_grads"][pname], p.grad, rtol, f"{what} gradient of {pname}")
    return results


class AttentionConformance:
    """Base class of an attention component's conformance tests."""

    name: ClassVar[str]
    config: ClassVar[dict[str, Any]] = {}
    d_model: ClassVar[int] = 32
    rtol: ClassVar[float] = 1e-5
    seq_len: ClassVar[int] = 48
    doc_lengths: ClassVar[tuple[int, ...]] = (5, 17, 1, 29)
    prefill: ClassVar[int] = 19
    cp_world_sizes: ClassVar[tuple[int, ...]] = (2,)
    cp_seq_len: ClassVar[int] = 32

    def build(self, seed: int = 0) -> nn.Module:
        return _build(self.name, self.config, self.d_model, seed)

    def inputs(self, batch: int, length: int, seed: int = 1) -> Tensor:
        gen = torch.Generator().manual_seed(seed)
        return torch.randn(batch, length, self.d_model, generator=gen)

    def test_shape_and_dtype(self) -> None:
        module = self.build()
        x = self.inputs(2, self.seq_len)
        out = module(x, ForwardContext())
        assert out.shape == x.shape and out.dtype == x.dtype
        assert torch.isfinite(out).all()

    def test_causal(self) -> None:
        module = self.build()
        x = self.inputs(2, self.seq_len)
        cut = self.seq_len // 2 + 1
        changed = x.clone()
        changed[:, cut:] = self.inputs(2, self.seq_len - cut, seed=7)
        a, b = module(x, ForwardContext()), module(changed, ForwardContext())
        assert_close(b[:, :cut], a[:, :cut], self.rtol, "outputs before the change")
        assert not torch.allclose(a[:, cut:], b[:, cut:]), "changing later tokens changed nothing at all"

    def test_packed_equals_separate(self) -> None:
        module = self.build()
        lengths = list(self.doc_lengths)
        x = self.inputs(1, sum(lengths)).requires_grad_(True)
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        grad_out = self.inputs(1, sum(lengths), seed=3)
        packed = module(x, ForwardContext(cu_seqlens=cu))
        (packed * grad_out).sum().backward()
        packed_grads = {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}
        module.zero_grad()
        xs = x.detach().clone().requires_grad_(True)
        parts = [module(xs[:, s:e], ForwardContext()) for s, e in itertools.pairwise(cu.tolist())]
        separate = torch.cat(parts, dim=1)
        (separate * grad_out).sum().backward()
        assert_close(packed, separate, self.rtol, "packed output")
        assert_close(x.grad, xs.grad, self.rtol, "packed input gradient")
        for n, p in module.named_parameters():
            if p.grad is not None:
                assert_close(packed_grads[n], p.grad, self.rtol, f"packed gradient of {n}")

    def test_decode_equals_forward(self) -> None:
        module = self.build()
        x = self.inputs(2, self.seq_len)
        with torch.no_grad():
            full = module(x, ForwardContext())
            cache = module.init_cache(2, device=x.device, dtype=x.dtype)
            outs = [module(x[:, : self.prefill], ForwardContext(), cache)]
            for t in range(self.prefill, self.seq_len):
                outs.append(module(x[:, t : t + 1], ForwardContext(), cache))
        assert_close(torch.cat(outs, dim=1), full, self.rtol, "prefill + step decode vs full forward")

    def test_finite_gradients(self) -> None:
        module = self.build()
        x = self.inputs(2, self.seq_len).requires_grad_(True)
        module(x, ForwardContext()).square().mean().backward()
        assert torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0
        for n, p in module.named_parameters():
            assert p.grad is None or torch.isfinite(p.grad).all(), f"non-finite gradient of {n}"

    def test_deterministic(self) -> None:
        x = self.inputs(2, self.seq_len)
        a = self.build(seed=5)(x, ForwardContext())
        b = self.build(seed=5)(x, ForwardContext())
        assert torch.equal(a, b), "same seed and input gave different outputs"

    @pytest.mark.parametrize("packed", [False, True], ids=["single-doc", "packed"])
    def test_context_parallel_equals_one_rank(self, packed: bool) -> None:
        if not self.cp_world_sizes:
            pytest.skip(f"{self.name} declares no context-parallel support (cp_world_sizes = ())")
        t = self.cp_seq_len
        cu = torch.tensor([0, 3, t // 2 + 1, t], dtype=torch.int32) if packed else None
        case = (self.config, self.inputs(1, t), self.inputs(1, t, seed=3), cu)
        for world in self.cp_world_sizes:
            check_context_parallel(self.name, self.d_model, [case], world, self.rtol)
