"""What memory policies build on: the layers of a built model, and how to change how a part of one runs.

A policy's ``apply(model)`` (see ``megaseq.contracts.MemoryPolicy``) finds the layers it acts on here, by
index and by component, without knowing how core assembles a model::

    from megaseq.memory import model_layers

    def apply(self, model):
        for layer in model_layers(model):
            if layer.ffn_kind == "ffn" and 2 <= layer.index < 6:
                layer.wrap("ffn", my_wrapper)        # my_wrapper(module, forward) -> new forward

A part is ``"block"`` (the whole residual block, called as ``block(x, ctx, cache=None)``), ``"attention"``
(``attention(x, ctx, cache=None)``) or ``"ffn"`` (the feed-forward or MoE, ``ffn(x, ctx)``). Wrapping
replaces how the module runs, not the module: parameter names, checkpoints and ``train.trainable`` patterns
stay the same, and wrappers of several policies compose (each receives the forward installed before it).

The memory planner (``megaseq plan``) is in :mod:`megaseq.memory.plan`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from torch import nn

Part = Literal["block", "attention", "ffn"]
PARTS: tuple[Part, ...] = ("block", "attention", "ffn")
Wrapper = Callable[[nn.Module, Callable[..., Any]], Callable[..., Any]]


@dataclass(frozen=True)
class Layer:
    """One layer of a built model: its index, its components' names, and its modules.

    ``attention``: the attention component's name in the recipe (e.g. ``"sdpa"``); ``ffn_kind``: ``"ffn"`` or
    ``"moe"``; ``ffn``: that component's name (e.g. ``"swiglu"``). ``block`` is the residual
    block; it also offers the block's halves for tiled execution: ``block.mix(x, ctx)`` (``x +
    attention(norm(x))``), ``block.mix_tile(x, ctx, tile, history)`` (the same on one tile, when
    :attr:`tiles` is true) and ``block.feed(h, ctx)`` (``h + ffn(norm(h))``).
    """

    index: int
    attention: str
    ffn_kind: str
    ffn: str
    block: nn.Module

    def module(self, part: Part) -> nn.Module:
        if part == "block":
            return self.block
        if part == "attention":
            return self.block.attention
        if part == "ffn":
            return self.block.ffn
        raise ValueError(f"unknown layer part {part!r}; parts: {', '.join(PARTS)}")

    def wrap(self, part: Part, wrapper: Wrapper) -> None:
        """Make ``part`` run as ``wrapper(module, forward)``, where ``forward`` is how it ran until now."""
        module = self.module(part)
        module.forward = wrapper(module, module.forward)

    @property
    def tiles(self) -> bool:
        """Whether the attention runs in sequence tiles: its record declares ``sequence_tiling``
        (``megaseq.records.CAPABILITIES``; it implements ``megaseq.contracts.SequenceTiling``)."""
        return self.block.tiles

    @property
    def ffn_tiles(self) -> bool:
        """Whether the feed-forward tiles over tokens from outside: dense feed-forwards do, MoE layers chunk
        their tokens themselves."""
        return self.ffn_kind == "ffn"


def model_layers(model: nn.Module) -> list[Layer]:
    """The layers of a model built by ``megaseq.model.build_model``, in order."""
    blocks = getattr(model, "blocks", None)
    if blocks is None:
        raise TypeError(f"{type(model).__name__} is not a megaseq model (no .blocks); build it with megaseq.model.build_model")
    return [Layer(i, *block.names, block=block) for i, block in enumerate(blocks)]


__all__ = ["PARTS", "Layer", "Part", "Wrapper", "model_layers"]
