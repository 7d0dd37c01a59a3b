"""Conformance suite for the optional sequence-tiling capability (see ``megaseq.contracts.SequenceTiling``).

Subclass :class:`SequenceTilingConformance` in a pytest module and set ``name`` and ``config`` (an attention
component that implements ``forward_tile``). Each test runs the component over a sequence tile by tile
(:func:`run_tiled`: a plain loop handing each tile the earlier tiles' carries, gradients flowing through
them) and compares with one untiled forward: outputs, the input gradient, every parameter gradient and
the auxiliary losses within ``tolerance`` (``megaseq_testkit.assert_close``; fp32 default 1e-5), metrics as
tile-length-weighted means; for tile lengths that do not divide the sequence (one token, a prime, the
whole sequence), rows of a batch, and packed documents that cross tile boundaries, one of which starts
exactly at a boundary; and the component must refuse context parallelism in a tile with one line. Its
record must declare ``sequence_tiling`` (``megaseq.records.CAPABILITIES``: what memory policies and the
planner read) and what it carries (``MemoryEstimate.tiling``). ``factory``, ``memory`` and
``capabilities`` build, estimate and declare a component that is not an installed plugin (``"module:attr"``
or ``"/path/file.py:attr"`` of ``build(config_dict, dims, layer_idx)`` and of ``estimate(config_dict,
dims, seq_len)``; the capabilities it would declare). What the tiles carry (the distinct storages of every carry,
a view of a larger tensor counting as all of it) must be within ``memory_tolerance`` (25%) of the declared
``per_token x tokens + per_tile x tiles``, at each of ``memory_lengths`` in four tiles.
"""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch
from torch import Tensor, nn

from megaseq.contracts import ForwardContext, SequenceTiling, Tile
from megaseq.records import MemoryEstimate
from megaseq_testkit import ComponentSuite, assert_close, build_component, declared_capabilities
from megaseq_testkit.checks import check_saved_estimate


def run_tiled(module: nn.Module, x: Tensor, ctx: ForwardContext, tile_tokens: int) -> Tensor:
    """``module`` over ``x [B, T, d]`` in tiles of ``tile_tokens``, as a memory policy runs it; losses go to
    ``ctx``, metrics to ``ctx`` as tile-length-weighted means of the tiles' values."""
    length = x.shape[1]
    history: list[tuple[Tensor, ...]] = []
    outputs, sums = [], {}
    for start in range(0, length, tile_tokens):
        tile = Tile(start, min(start + tile_tokens, length), length)
        sub = ctx.fork()
        out, carry = module.forward_tile(x[:, tile.start : tile.stop], sub, tile, history)
        assert isinstance(carry, tuple) and all(isinstance(c, Tensor) for c in carry), "carry must be a tuple of tensors"
        outputs.append(out)
        history.append(carry)
        for name, value in sub.losses.items():
            ctx.add_loss(name, value)
        for name, value in sub.metrics.items():
            sums[name] = sums.get(name, 0.0) + value * tile.length
    for name, total in sums.items():
        ctx.log(name, total / length)
    return torch.cat(outputs, dim=1)


class SequenceTilingConformance(ComponentSuite):
    """Base class of a tiling attention component's conformance tests."""

    kind: ClassVar[str] = "attention"
    seq_len: ClassVar[int] = 45
    tile_sizes: ClassVar[tuple[int, ...]] = (1, 7, 16, 45)
    # packed documents, one empty: with tiles of 16 one starts exactly at a tile boundary (16) and one
    # crosses a boundary (29..45 over 32); tiles of 5 cut most of them
    doc_lengths: ClassVar[tuple[int, ...]] = (12, 4, 13, 0, 16)
    packed_tile_sizes: ClassVar[tuple[int, ...]] = (5, 16)

    def build(self, seed: int = 0) -> nn.Module:
        torch.manual_seed(seed)
        return build_component("attention", self.name, self.config, self.dims(), factory=self.factory).float()

    def memory_estimate(self, seq_len: int | None = None) -> MemoryEstimate | None:
        estimate = self.estimator()
        return None if estimate is None else estimate(seq_len or self.seq_len)

    def inputs(self, batch: int, length: int, seed: int = 1) -> Tensor:
        gen = torch.Generator().manual_seed(seed)
        return torch.randn(batch, length, self.d_model, generator=gen)

    def _compare(self, batch: int, cu_seqlens: Tensor | None, tile_tokens: int) -> None:
        module = self.build()
        x = self.inputs(batch, self.seq_len).requires_grad_(True)
        grad_out = self.inputs(batch, self.seq_len, seed=3)

        def objective(out: Tensor, ctx: ForwardContext) -> Tensor:
            return (out * grad_out).sum() + sum(ctx.losses.values(), torch.zeros(()))

        ctx = ForwardContext(cu_seqlens=cu_seqlens)
        ref = module(x, ctx)
        objective(ref, ctx).backward()
        ref_x, ref_grads = x.grad.clone(), {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}
        ref_losses = {k: v.detach() for k, v in ctx.losses.items()}
        ref_metrics = dict(ctx.metrics)
        module.zero_grad(set_to_none=True)
        x.grad = None

        tiled_ctx = ForwardContext(cu_seqlens=cu_seqlens)
        out = run_tiled(module, x, tiled_ctx, tile_tokens)
        objective(out, tiled_ctx).backward()
        what = f"{self.name} in tiles of {tile_tokens}" + (" (packed)" if cu_seqlens is not None else f" (batch {batch})")
        assert_close(out, ref, self.tolerance, f"{what}: output")
        assert set(tiled_ctx.losses) == set(ref_losses), f"{what}: auxiliary losses {sorted(tiled_ctx.losses)} != {sorted(ref_losses)}"
        for name, value in ref_losses.items():
            assert_close(tiled_ctx.losses[name].detach(), value, self.tolerance, f"{what}: auxiliary loss {name!r} (tile shares add up)")
        assert set(tiled_ctx.metrics) == set(ref_metrics), f"{what}: metrics {sorted(tiled_ctx.metrics)} != {sorted(ref_metrics)}"
        for name, value in ref_metrics.items():
            assert_close(torch.tensor(tiled_ctx.metrics[name]), torch.tensor(value), self.tolerance, f"{what}: metric {name!r}")
        assert_close(x.grad, ref_x, self.tolerance, f"{what}: input gradient")
        for n, p in module.named_parameters():
            if n in ref_grads:
                assert p.grad is not None, f"{what}: no gradient reached {n}"
                assert_close(p.grad, ref_grads[n], self.tolerance, f"{what}: gradient of {n}")
            else:
                assert p.grad is None or not p.grad.any(), f"{what}: {n} got a gradient the untiled forward gives it not"

    def test_implements_forward_tile(self) -> None:
        assert isinstance(self.build(), SequenceTiling), f"{self.name} has no forward_tile"

    def test_record_declares_tiling(self) -> None:
        declared = declared_capabilities("attention", self.name, self.factory, self.capabilities)
        assert "sequence_tiling" in declared, f"{self.name} tiles but its record does not declare sequence_tiling"
        estimate = self.memory_estimate()
        assert estimate is not None, f"{self.name}: the record has no memory target, so the planner cannot tile it"
        assert estimate.tiling is not None, f"{self.name}: MemoryEstimate.tiling is None but the component tiles"
        assert estimate.tiling.per_token >= 0 and estimate.tiling.per_tile >= 0

    def test_carry_matches_estimate(self) -> None:
        """The planner holds ``per_token`` bytes for every token of the earlier tiles and ``per_tile`` per tile:
        what the carries keep alive must be that (a carry that is a view of the tile's whole projection keeps
        the whole projection)."""
        module = self.build()

        def measure(length: int) -> int:
            x, history, ctx = self.inputs(1, length), [], ForwardContext()
            with torch.no_grad():
                for start in range(0, length, length // 4):
                    tile = Tile(start, min(start + length // 4, length), length)
                    history.append(module.forward_tile(x[:, tile.start : tile.stop], ctx.fork(), tile, history)[1])
            storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for carry in history for t in carry}
            return sum(storages.values())

        def estimate(length: int) -> float:
            tiling = self.memory_estimate(length).tiling
            assert tiling is not None, f"{self.name}: MemoryEstimate.tiling is None but the component tiles"
            return tiling.per_token * length + tiling.per_tile * 4

        check_saved_estimate(measure, estimate, self.memory_lengths, self.memory_tolerance, f"{self.name} tile carry")

    @pytest.mark.parametrize("batch", [1, 2])
    def test_tiled_equals_untiled(self, batch: int) -> None:
        for tile_tokens in self.tile_sizes:
            self._compare(batch, None, tile_tokens)

    def test_tiled_packed_equals_untiled(self) -> None:
        assert sum(self.doc_lengths) == self.seq_len, "doc_lengths must add up to seq_len"
        bounds = torch.tensor([0, *torch.tensor(self.doc_lengths).cumsum(0).tolist()], dtype=torch.int32)
        for tile_tokens in self.packed_tile_sizes:
            self._compare(1, bounds, tile_tokens)

    def test_rejects_context_parallel(self) -> None:
        from megaseq.contracts import ContextParallel

        module = self.build()
        cp = ContextParallel(group=None, rank=0, world_size=2, seq_len=self.seq_len - self.seq_len % 4)
        x = self.inputs(1, 4)
        with pytest.raises(ValueError, match="context parallel"):
            module.forward_tile(x, ForwardContext(cp=cp), Tile(0, 4, self.seq_len), [])
