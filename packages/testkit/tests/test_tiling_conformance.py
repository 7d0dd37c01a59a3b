"""Core's sdpa passes the sequence-tiling suite, and the suite catches a wrong component of each kind.

The wrong components are variants of a small correct one, ``PrefixMean``: each token's output is a linear
map of the mean of the projected inputs of its document up to itself, so a tile carries the running sum and
count of the document open at its end. It adds an auxiliary loss (a per-token sum divided by the whole
sequence's token count) and logs a per-token mean, as a real component would.
"""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
import torch
from torch import Tensor, nn

from megaseq.contracts import ForwardContext, Tile
from megaseq.records import MemoryEstimate, TileCarry
from megaseq_testkit.tiling import SequenceTilingConformance


class TestSDPATiling(SequenceTilingConformance):
    name = "sdpa"
    config: ClassVar[dict[str, Any]] = {"n_heads": 2}


class TestSDPATilingNoRope(SequenceTilingConformance):
    name = "sdpa"
    config: ClassVar[dict[str, Any]] = {"n_heads": 2, "rope": False}
    tile_sizes = (11,)


class PrefixMean(nn.Module):
    """Correct reference for the suite's own tests (module docstring)."""

    detach_carry = False
    ignore_history = False
    local_positions = False
    tile_normalised_loss = False
    view_carry = False

    def __init__(self, d: int) -> None:
        super().__init__()
        self.inp = nn.Linear(d, d, bias=False)
        self.outp = nn.Linear(d, d, bias=False)

    def _doc_start(self, positions: Tensor, ctx: ForwardContext) -> Tensor:
        if ctx.cu_seqlens is None:
            return torch.zeros_like(positions)
        starts = ctx.cu_seqlens.long()
        return starts[torch.searchsorted(starts, positions, right=True) - 1]

    def _run(self, x: Tensor, ctx: ForwardContext, start: int, seq_len: int, carry: tuple[Tensor, Tensor] | None) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        b, t, d = x.shape
        v = self.inp(x)
        positions = torch.arange(start, start + t)
        doc_start = self._doc_start(positions - start if self.local_positions else positions, ctx)
        running = carry[0] if carry is not None else v.new_zeros(b, d)
        outs, sums, all_sums = [], running, []
        for i in range(t):
            pos = int(positions[i])
            if pos == int(doc_start[i]) + (start if self.local_positions else 0):
                sums = v.new_zeros(b, d)
            sums = sums + v[:, i]
            all_sums.append(sums)
            count = pos - int(doc_start[i]) - (start if self.local_positions else 0) + 1
            outs.append(sums / count)
        out = self.outp(torch.stack(outs, 1))
        norm = b * (t if self.tile_normalised_loss else seq_len)
        ctx.add_loss("prefix_mean_aux", 0.1 * out.square().sum() / norm)
        ctx.log("prefix_mean_abs", out.abs().mean())
        if self.view_carry:  # the last running sum as a view of all of the tile's running sums
            sums = torch.stack(all_sums, 1)[:, -1]
        return out, (sums,)

    def forward(self, x: Tensor, ctx: ForwardContext, cache: Any = None) -> Tensor:
        return self._run(x, ctx, 0, x.shape[1], None)[0]

    def forward_tile(self, x: Tensor, ctx: ForwardContext, tile: Tile, history: list[tuple[Tensor, ...]]) -> tuple[Tensor, tuple[Tensor, ...]]:
        if ctx.cp is not None:
            raise ValueError("prefix-mean: no context parallelism in tiles")
        carry = None if not history or self.ignore_history else history[-1]
        out, (sums,) = self._run(x, ctx, tile.start, tile.seq_len, carry)
        return out, (sums.detach() if self.detach_carry else sums,)

    def init_cache(self, batch_size: int, *, device: torch.device, dtype: torch.dtype) -> None:
        return None


class DetachedCarry(PrefixMean):
    detach_carry = True


class IgnoresHistory(PrefixMean):
    ignore_history = True


class TileLocalPositions(PrefixMean):
    local_positions = True


class TileNormalisedLoss(PrefixMean):
    tile_normalised_loss = True


class CarriesView(PrefixMean):
    view_carry = True


def build_prefix_mean(config: dict, dims: Any, layer_idx: int) -> nn.Module:
    return {cls.__name__: cls for cls in (PrefixMean, DetachedCarry, IgnoresHistory, TileLocalPositions,
                                          TileNormalisedLoss, CarriesView)}[config["variant"]](dims.d_model)


def prefix_mean_memory(config: dict, dims: Any, seq_len: int) -> MemoryEstimate:
    return MemoryEstimate(parameters=8 * dims.d_model**2, saved_per_token=12 * dims.d_model,
                          tiling=None if config.get("undeclared") else TileCarry(per_tile=4 * dims.d_model))


def _suite(cls: type, declares_tiling: bool = True, carry_estimated: bool = True) -> SequenceTilingConformance:
    class Suite(SequenceTilingConformance):
        name = "prefix-mean"
        config: ClassVar[dict[str, Any]] = {"variant": cls.__name__, "undeclared": not carry_estimated}
        capabilities = frozenset({"sequence_tiling"} if declares_tiling else ())
        factory = f"{__file__}:build_prefix_mean"
        memory = f"{__file__}:prefix_mean_memory"
        d_model = 8
        seq_len = 45
        tile_sizes = (7, 16)

    return Suite()


def test_reference_component_passes():
    suite = _suite(PrefixMean)
    suite.test_implements_forward_tile()
    suite.test_record_declares_tiling()
    suite.test_tiled_equals_untiled(2)
    suite.test_tiled_packed_equals_untiled()
    suite.test_rejects_context_parallel()
    suite.test_carry_matches_estimate()


@pytest.mark.parametrize(
    ("cls", "check", "message"),
    [
        (DetachedCarry, "test_tiled_equals_untiled", "input gradient"),
        (IgnoresHistory, "test_tiled_equals_untiled", "output"),
        (TileLocalPositions, "test_tiled_packed_equals_untiled", "output"),
        (TileNormalisedLoss, "test_tiled_equals_untiled", "auxiliary loss"),
        (CarriesView, "test_carry_matches_estimate", r"tile carry: at 64 tokens .* \(0\.06x"),
    ],
    ids=["carry-detached", "history-ignored", "tile-local-positions", "loss-not-shared", "carry-a-view"],
)
def test_wrong_components_are_caught(cls, check, message):
    suite = _suite(cls)
    args = (1,) if check == "test_tiled_equals_untiled" else ()
    with pytest.raises(AssertionError, match=message):
        getattr(suite, check)(*args)


def test_undeclared_tiling_is_caught():
    with pytest.raises(AssertionError, match="does not declare sequence_tiling"):
        _suite(PrefixMean, declares_tiling=False).test_record_declares_tiling()
    with pytest.raises(AssertionError, match="MemoryEstimate.tiling is None"):
        _suite(PrefixMean, carry_estimated=False).test_record_declares_tiling()
