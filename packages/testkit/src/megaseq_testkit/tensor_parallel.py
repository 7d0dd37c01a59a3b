"""Conformance check of a component's tensor parallelism (``megaseq.contracts.TensorParallel``).

:func:`check_tensor_parallel` builds the component once whole (``tp_size`` 1) and, on ``world`` gloo ranks,
as each rank's block (``ModelDims(tp_rank=r, tp_size=world)``, and for an MoE with expert tensor parallelism
over the same ranks, megatron-core's default: ``etp_rank=r, etp_size=world``, ``ctx.etp_group``) loaded with
the blocks of the same whole weights (the split is found from the shapes, as ``megaseq.distributed.experts.split_dims`` finds it for
training). Each rank runs its sequence chunk of a packed row (several documents, one empty, one crossing
the chunk boundary) forward and backward, and must give:

- outputs and input gradients equal to the whole component's on its chunk;
- for each split tensor, the gradient of the whole component's tensor cut to its block;
- for every other parameter, gradients that sum over ranks to the whole component's (the trainer sums them);
- auxiliary losses that sum over ranks to the whole component's, and metrics whose mean over ranks is its;
- decoding (tensor parallelism without sequence parallelism, ``TensorParallel.sequence_parallel = False``:
  every rank holds the whole row): an attention prefills all but the last ``DECODE_STEPS`` tokens of a plain
  row into its fresh cache (``init_cache``) and then takes them one at a time, any other component runs the
  whole row; every rank's outputs must equal the whole component's.

What it catches: a rank that leaves out the other ranks' heads (no reduce-scatter), a split region that sees
only its chunk of the sequence (no gather), heads split in a different order than the weights, and ranks that
run different collectives (gloo errors or times out); in decoding, a cache that holds every rank's heads and a
component that splits the sequence by itself. Error bound: ``tolerance`` relative to the largest
expected magnitude, as everywhere in ``megaseq_testkit``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from megaseq.contracts import ForwardContext, TensorParallel
from megaseq.parallel import tp_chunk
from megaseq.records import ModelDims
from megaseq_testkit import assert_close, build_component

COLLECTIVE_TIMEOUT = 60.0
DECODE_STEPS = 3


def _build(kind: str, name: str, config: dict[str, Any], d_model: int, rank: int, size: int,
           factory: str | None) -> nn.Module:
    torch.manual_seed(0)
    dims = ModelDims(d_model=d_model, n_layers=2, vocab_size=8, tp_rank=rank, tp_size=size, etp_rank=rank, etp_size=size)
    return build_component(kind, name, config, dims, factory=factory).float()


def _blocks(whole: nn.Module, local: nn.Module, world: int) -> dict[str, int]:
    """``{name: dim}`` of the local tensors that are one ``1/world`` block of the whole one's."""
    from megaseq.distributed.experts import split_dims

    return split_dims(whole.state_dict(), local.state_dict(), world, "tp")


def _rank_step(rank: int, world: int, kind: str, name: str, config: dict[str, Any], d_model: int, x: Tensor,
               grad_out: Tensor, cu: Tensor | None, factory: str | None) -> dict[str, Any]:
    import torch.distributed as dist

    whole = _build(kind, name, config, d_model, 0, 1, factory)
    local = _build(kind, name, config, d_model, rank, world, factory)
    dims = _blocks(whole, local, world)
    local.load_state_dict({n: t.chunk(world, dims[n])[rank] if n in dims else t for n, t in whole.state_dict().items()})
    tp = TensorParallel(group=dist.group.WORLD, rank=rank, world_size=world)
    x_local = tp_chunk(x, tp).clone().requires_grad_(True)
    ctx = ForwardContext(cu_seqlens=cu, tp=tp, etp_group=dist.group.WORLD)
    out = local(x_local, ctx)
    aux = sum(ctx.losses.values(), torch.zeros(()))
    ((out * tp_chunk(grad_out, tp)).sum() + aux).backward()
    grads = {n: p.grad if p.grad is not None else torch.zeros_like(p) for n, p in local.named_parameters()}
    decoding = TensorParallel(group=dist.group.WORLD, rank=rank, world_size=world, sequence_parallel=False)
    return {"out": out.detach(), "x_grad": x_local.grad, "grads": grads, "dims": dims, "aux": aux.detach(),
            "metrics": dict(ctx.metrics), "decoded": _decode(local, kind, x, decoding)}


@torch.no_grad()
def _decode(module: nn.Module, kind: str, x: Tensor, tp: TensorParallel | None) -> Tensor:
    """The module's outputs on the row ``x`` as decoding runs it (module docstring); ``tp``: without sequence
    parallelism."""
    import torch.distributed as dist

    def ctx() -> ForwardContext:
        return ForwardContext(tp=tp, etp_group=dist.group.WORLD if tp is not None else None)

    if kind != "attention":
        return module(x, ctx())
    prefill = x.shape[1] - DECODE_STEPS
    cache = module.init_cache(x.shape[0], device=x.device, dtype=x.dtype)
    outs = [module(x[:, :prefill], ctx(), cache)]
    outs += [module(x[:, t : t + 1], ctx(), cache) for t in range(prefill, x.shape[1])]
    return torch.cat(outs, 1)


def check_tensor_parallel(
    kind: str,
    name: str,
    config: dict[str, Any],
    d_model: int = 32,
    world: int = 2,
    seq_len: int = 48,
    doc_lengths: tuple[int, ...] = (5, 0, 22, 21),
    tolerance: float = 1e-5,
    factory: str | None = None,
) -> None:
    """Assert that ``world`` tensor-parallel gloo ranks equal the whole component (module docstring) on one
    packed row of ``seq_len`` tokens cut into ``doc_lengths`` (``None``-free: they must add up to ``seq_len``)."""
    from megaseq_testkit.distributed import run_gloo

    if sum(doc_lengths) != seq_len or seq_len % world:
        raise ValueError(f"doc_lengths {doc_lengths} must add up to seq_len {seq_len}, a multiple of {world}")
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, seq_len, d_model, generator=gen)
    grad_out = torch.randn(1, seq_len, d_model, generator=gen)
    cu = torch.tensor([0, *torch.tensor(doc_lengths).cumsum(0).tolist()], dtype=torch.int32)
    what = f"{kind} {name!r} under tp={world}"
    try:
        ranks = run_gloo(world, _rank_step, kind, name, config, d_model, x, grad_out, cu, factory,
                         collective_timeout=COLLECTIVE_TIMEOUT)
    except RuntimeError as exc:
        raise AssertionError(f"{what}: the ranks failed (a timeout in a collective means they did not run the "
                             f"same collectives): {exc}") from exc

    whole = _build(kind, name, config, d_model, 0, 1, factory)
    xr = x.clone().requires_grad_(True)
    ctx = ForwardContext(cu_seqlens=cu)
    ref = whole(xr, ctx)
    aux = sum(ctx.losses.values(), torch.zeros(()))
    ((ref * grad_out).sum() + aux).backward()
    dims = ranks[0]["dims"]
    if not dims:
        raise AssertionError(f"{what}: no tensor is split (a component that implements tensor parallelism holds "
                             f"1/tp of its heads or hidden width)")
    for rank, res in enumerate(ranks):
        tp = TensorParallel(group=None, rank=rank, world_size=world)
        assert_close(res["out"], tp_chunk(ref.detach(), tp), tolerance, f"{what} rank {rank} output")
        assert_close(res["x_grad"], tp_chunk(xr.grad, tp), tolerance, f"{what} rank {rank} input gradient")
        for pname, dim in dims.items():
            expected = whole.get_parameter(pname).grad
            if expected is not None:
                assert_close(res["grads"][pname], expected.chunk(world, dim)[rank], tolerance,
                             f"{what} rank {rank} gradient of {pname} (its block along dim {dim})")
    for pname, p in whole.named_parameters():
        if pname not in dims and p.grad is not None:
            summed = sum(r["grads"][pname] for r in ranks)
            assert_close(summed, p.grad, tolerance, f"{what} gradient of {pname} (summed over ranks)")
    assert_close(sum(r["aux"] for r in ranks), aux.detach(), tolerance, f"{what} auxiliary loss (summed over ranks)")
    for key, value in ctx.metrics.items():
        mean = sum(r["metrics"].get(key, float("nan")) for r in ranks) / world
        assert_close(torch.tensor(mean), torch.tensor(value), tolerance, f"{what} metric {key!r} (mean over ranks)")
    decoded = _decode(whole, kind, x, None)
    for rank, res in enumerate(ranks):
        assert_close(res["decoded"], decoded, tolerance,
                     f"{what} rank {rank} decoding output (tensor parallelism without sequence parallelism)")


__all__ = ["check_tensor_parallel"]
