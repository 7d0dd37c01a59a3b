"""Recomputation units: run part of a model so that autograd keeps only the part's inputs, re-run it in backward.

A unit is ``fn(inputs, ctx) -> outputs`` (tuples of tensors) over some parameters. :func:`run_unit` runs it
inside one autograd Function:

- forward: ``fn`` runs as it would without the unit (gradients enabled, so a component sees the same
  ``torch.is_grad_enabled()`` and adds the same auxiliary losses), under saved-tensor hooks that drop
  every tensor the graph would save, so the graph costs nothing and dies with the unit. The Function
  saves the unit's inputs (``save_for_backward``, so an offloading policy's hooks see them) and returns
  the outputs and the auxiliary losses ``fn`` added, which are then added to the caller's context
  connected to the Function: their gradients reach the unit's parameters like the outputs' do.
- backward: the RNG state and autocast state of the forward are restored, ``fn`` runs again with
  gradients on a context from ``ForwardContext.for_recomputation`` (it records that re-run's losses, which
  are differentiated here; everything else treats the re-run as recomputation: ``ctx.recomputing`` is
  true, so components skip their own counters), and ``torch.autograd.grad`` takes the gradients of
  outputs and losses with respect to the inputs and the parameters, which the Function returns.
- kept values (``reuse_kept``): what ``fn`` keeps with ``ForwardContext.keep`` in the forward (e.g. DSA's
  top-k indices) is saved beside the inputs (so an offloading policy moves it too) and handed back to the
  re-run, which does not compute it again; it is freed with the inputs when the unit's backward ends.

Numerics: the re-run does the same operations in the same order on the same values, so outputs and
gradients are bitwise those of a run without the unit, as long as the components are deterministic.

Sequence tiling (:func:`tiled_block_forward`): a block whose attention implements
``megaseq.contracts.SequenceTiling`` runs as one unit per tile; each unit's inputs are the tile's block
input and what earlier tiles carry (``history``), its outputs the tile's block output (or, for an MoE
block, the attention half) and its own carry. A dense feed-forward tiles over tokens inside the unit; an
MoE layer runs whole afterwards as one more unit (it chunks tokens itself, and its balance loss and
routing record are per sequence). So the most that exists at once in backward is one tile's activations.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from megaseq.contracts import ForwardContext, KeptValues, Tile

UnitFn = Callable[[Sequence[Tensor], ForwardContext], Sequence[Tensor]]


def _drop(_: Tensor) -> None:
    return None


def _dropped(_: None) -> Tensor:
    raise RuntimeError("megaseq_offload: a recomputation unit's forward graph was differentiated; this is a bug")


@dataclass
class _Unit:
    fn: UnitFn
    ctx: ForwardContext
    n_inputs: int
    params: list[nn.Parameter]
    reuse_kept: bool = True
    device_type: str = "cpu"
    cpu_rng: Tensor | None = None
    cuda_rng: list[tuple[int, Tensor]] = field(default_factory=list)
    autocast: tuple[bool, torch.dtype] = (False, torch.float32)
    n_outputs: int = 0
    loss_names: list[str] = field(default_factory=list)
    kept_names: list[str] = field(default_factory=list)  # what the forward kept (ForwardContext.keep), in order
    metrics: dict[str, float] = field(default_factory=dict)


class _UnitFunction(torch.autograd.Function):
    @staticmethod
    def forward(fctx: Any, unit: _Unit, *tensors: Tensor) -> tuple[Tensor, ...]:  # type: ignore[override]
        inputs = tensors[: unit.n_inputs]
        unit.cpu_rng = torch.get_rng_state()
        devices = sorted({t.device.index or 0 for t in inputs if t.is_cuda})
        unit.cuda_rng = [(d, torch.cuda.get_rng_state(d)) for d in devices]
        unit.device_type = "cuda" if devices else "cpu"
        unit.autocast = (torch.is_autocast_enabled(unit.device_type), torch.get_autocast_dtype(unit.device_type))
        detached = [t.detach().requires_grad_(t.requires_grad) for t in inputs]
        kept = KeptValues()
        sub = unit.ctx.fork(kept if unit.reuse_kept else None)
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(_drop, _dropped):
            outputs = tuple(unit.fn(detached, sub))
        unit.n_outputs = len(outputs)
        unit.loss_names = list(sub.losses)
        unit.metrics = dict(sub.metrics)
        unit.kept_names = [name for name, _ in kept.items]
        fctx.unit = unit
        fctx.save_for_backward(*inputs, *(value for _, value in kept.items))
        return (*(o.detach() for o in outputs), *(v.detach() for v in sub.losses.values()))

    @staticmethod
    def backward(fctx: Any, *grads: Tensor | None) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        unit: _Unit = fctx.unit
        saved = fctx.saved_tensors
        inputs = saved[: unit.n_inputs]
        kept = KeptValues(list(zip(unit.kept_names, saved[unit.n_inputs :], strict=True)))
        needs = fctx.needs_input_grad[1:]
        detached = [t.detach().requires_grad_(need) for t, need in zip(inputs, needs, strict=False)]
        sub = unit.ctx.for_recomputation(kept if unit.reuse_kept else None)
        with torch.random.fork_rng(devices=[d for d, _ in unit.cuda_rng]):
            torch.set_rng_state(unit.cpu_rng)
            for device, state in unit.cuda_rng:
                torch.cuda.set_rng_state(state, device)
            enabled, dtype = unit.autocast
            with torch.enable_grad(), torch.autocast(unit.device_type, dtype=dtype, enabled=enabled):
                outputs = tuple(unit.fn(detached, sub))
        if list(sub.losses) != unit.loss_names:
            raise RuntimeError(
                f"megaseq_offload: the re-run of a recomputed part added losses {list(sub.losses)}, the forward "
                f"{unit.loss_names}: a component's forward is not deterministic"
            )
        if not kept.exhausted:
            raise RuntimeError(
                f"megaseq_offload: the re-run of a recomputed part took {kept.used} of the {len(kept.items)} values "
                f"its forward kept {unit.kept_names}: a component's forward is not deterministic"
            )
        produced = [*outputs, *sub.losses.values()]
        pairs = [(o, g) for o, g in zip(produced, grads, strict=True) if g is not None and o.requires_grad]
        wanted = [t for t, need in zip([*detached, *unit.params], needs, strict=True) if need]
        got = iter(
            torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True)
            if pairs and wanted
            else [None] * len(wanted)
        )
        return (None, *(next(got) if need else None for need in needs))


def run_unit(
    fn: UnitFn, inputs: Sequence[Tensor], ctx: ForwardContext, params: Sequence[nn.Parameter], reuse_kept: bool = True
) -> tuple[Tensor, ...]:
    """``fn(inputs, ctx)``'s outputs, with only ``inputs`` (and, with ``reuse_kept``, what ``fn`` keeps for its
    re-run) kept for backward (module docstring).

    ``params``: every trainable parameter ``fn`` uses. Losses ``fn`` adds to its context reach ``ctx``
    connected to the unit, metrics as logged. Without gradients ``fn`` simply runs.
    """
    if not torch.is_grad_enabled():
        return tuple(fn(list(inputs), ctx))
    trainable = [p for p in params if p.requires_grad]
    # a fork: the unit must not hold the caller's losses, whose graph holds the unit (a cycle gc cannot break)
    unit = _Unit(fn, ctx.fork(), len(inputs), trainable, reuse_kept)
    flat = _UnitFunction.apply(unit, *inputs, *trainable)
    if isinstance(flat, Tensor):
        flat = (flat,)
    outputs, losses = flat[: unit.n_outputs], flat[unit.n_outputs :]
    for name, value in zip(unit.loss_names, losses, strict=True):
        ctx.add_loss(name, value)
    for name, value in unit.metrics.items():
        ctx.log(name, value)
    return tuple(outputs)


def recomputed(module: nn.Module, forward: Callable[..., Tensor], reuse_kept: bool = True) -> Callable[..., Tensor]:
    """A forward for ``module`` (a block, an attention or a feed-forward: ``forward(x, ctx, *rest)``) that
    keeps only ``x`` (and what it keeps for its re-run, with ``reuse_kept``) for backward. Decoding (a cache
    argument) and forwards without gradients run as before."""
    params = list(module.parameters())

    def run(x: Tensor, ctx: ForwardContext, *rest: Any) -> Tensor:
        if any(r is not None for r in rest) or not torch.is_grad_enabled():
            return forward(x, ctx, *rest)
        (out,) = run_unit(lambda inputs, c: (forward(inputs[0], c, *rest),), (x,), ctx, params, reuse_kept)
        return out

    return run


def tiled_block_forward(
    block: nn.Module, forward: Callable[..., Tensor], tile_tokens: int, ffn_tiles: bool, reuse_kept: bool = True
) -> Callable[..., Tensor]:
    """A forward for a residual block (``megaseq.memory.Layer.block``) that recomputes it in sequence tiles of
    ``tile_tokens`` tokens (module docstring). The attention must implement ``SequenceTiling``; ``ffn_tiles``:
    whether the feed-forward runs inside each tile (dense) or whole afterwards (MoE); ``reuse_kept``: as
    :func:`run_unit`'s."""
    params = list(block.parameters())

    def run(x: Tensor, ctx: ForwardContext, cache: Any | None = None) -> Tensor:
        if cache is not None or not torch.is_grad_enabled():
            return forward(x, ctx, cache)
        if ctx.cp is not None:
            raise ValueError(
                "memory_policy.recompute: tile_tokens cannot run under context parallelism (each rank already "
                "holds a share of the sequence); remove tile_tokens or context parallelism"
            )
        length = x.shape[1]
        history: list[tuple[Tensor, ...]] = []
        outputs: list[Tensor] = []
        metric_sums: dict[str, float] = {}
        # split, not a slice per tile: a slice's backward writes its gradient into a zero tensor of the whole
        # input's size, once per tile (17.9 CPU s for 64 tiles at 1M tokens of width 128; split's 0.37)
        pieces = x.split(tile_tokens, dim=1)
        for start, piece in zip(range(0, length, tile_tokens), pieces, strict=True):
            tile = Tile(start, min(start + tile_tokens, length), length)
            sizes = [len(carry) for carry in history]

            def tile_fn(inputs: Sequence[Tensor], c: ForwardContext, tile: Tile = tile, sizes: list[int] = sizes) -> tuple[Tensor, ...]:
                earlier, flat = [], list(inputs[1:])
                for n in sizes:
                    earlier.append(tuple(flat[:n]))
                    flat = flat[n:]
                h, carry = block.mix_tile(inputs[0], c, tile, earlier)
                return (block.feed(h, c) if ffn_tiles else h, *carry)

            sub = ctx.fork()
            out, *carry = run_unit(
                tile_fn, (piece, *(t for c in history for t in c)), sub, params, reuse_kept
            )
            outputs.append(out)
            history.append(tuple(carry))
            for name, value in sub.losses.items():
                ctx.add_loss(name, value)
            for name, value in sub.metrics.items():  # per-token means over tiles -> over the sequence
                metric_sums[name] = metric_sums.get(name, 0.0) + value * tile.length
        for name, total in metric_sums.items():
            ctx.log(name, total / length)
        y = torch.cat(outputs, dim=1)
        if not ffn_tiles:
            (y,) = run_unit(lambda inputs, c: (block.feed(inputs[0], c),), (y,), ctx, params, reuse_kept)
        return y

    return run


__all__ = ["recomputed", "run_unit", "tiled_block_forward"]
