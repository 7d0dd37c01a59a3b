"""Hugging Face format in and out: the mapping contract components implement, and the walker that uses it.

A component declares its mapping on its record (``Component.mapping = "module:attr"``), or a layout carries
it (``megaseq.interop.layouts.Layout.mappings``, for a component written for another model family), an
object with:

``config_from_hf(hf, layout) -> dict``
    The component's recipe table (``[attention.NAME]``, ``[ffn.NAME]``, ...) from the model's ``config.json``
    (a dict). A field the component does not implement raises :class:`InteropError` naming it.
``config_to_hf(config, dims, layout) -> dict``
    The ``config.json`` fields that describe the component (the inverse).
``tensors_from_hf(tensors, config, dims, layout) -> dict[str, Tensor]``
    The component's state dict (its own parameter names) from its Hugging Face tensors: ``tensors`` is a
    :class:`Tensors` of one layer's sub-module (names relative to it, e.g. ``q_proj.weight``); the mapping
    ``take``s every tensor it reads, and whatever it leaves is an unknown tensor, refused by the walker.
    ``dims``: the model's ``megaseq.records.ModelDims``.
``tensors_to_hf(state, config, dims, layout) -> dict[str, Tensor]``
    The inverse: the Hugging Face tensors (relative names) from the component's state dict.

``layout`` names the published layout (a registered ``hf_layout``: ``megaseq.hookspecs.megaseq_hf_layout``); a
mapping that does not know it raises :class:`InteropError` (:func:`unknown_layout`). Core's walker
(``megaseq.interop.convert``) takes the layout's model-level names and fields and which component each
layer's sub-modules are (``megaseq.interop.layouts.Layout``), lets each component's mapping convert its own
part, prefixes the names, and checks the result against the model the recipe builds (every tensor present,
every shape as the config says). Import of export is the identity: ``megaseq_testkit.hf.assert_round_trip``
checks a mapping for it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

from torch import Tensor

from megaseq.errors import UserError


class InteropError(UserError):
    """A model directory, checkpoint or config that cannot be converted; the message is one line."""


class ComponentMapping(Protocol):
    def config_from_hf(self, hf: dict[str, Any], layout: str) -> dict[str, Any]: ...

    def config_to_hf(self, config: Any, dims: Any, layout: str) -> dict[str, Any]: ...

    def tensors_from_hf(self, tensors: Tensors, config: Any, dims: Any, layout: str) -> dict[str, Tensor]: ...

    def tensors_to_hf(self, state: dict[str, Tensor], config: Any, dims: Any, layout: str) -> dict[str, Tensor]: ...


class Tensors:
    """One sub-module's Hugging Face tensors (names relative to ``prefix``), handed out once each."""

    def __init__(self, tensors: dict[str, Tensor], prefix: str, source: str) -> None:
        self._tensors = dict(tensors)
        self.prefix = prefix
        self.source = source

    def take(self, name: str, shape: tuple[int, ...] | None = None) -> Tensor:
        """The tensor ``name`` (of ``shape``, when given); a missing one or one of another shape is an
        InteropError naming its full name."""
        try:
            tensor = self._tensors.pop(name)
        except KeyError:
            raise InteropError(f"{self.source}: tensor {self.prefix}{name} is missing") from None
        if shape is not None and tuple(tensor.shape) != tuple(shape):
            raise InteropError(
                f"{self.source}: tensor {self.prefix}{name} has shape {list(tensor.shape)}, the config says {list(shape)}"
            )
        return tensor

    def has(self, name: str) -> bool:
        return name in self._tensors

    def left(self) -> list[str]:
        """Full names of the tensors nobody took."""
        return sorted(self.prefix + n for n in self._tensors)

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._tensors))


def require(hf: dict[str, Any], key: str, allowed: Any, what: str, source: str = "config.json") -> None:
    """Refuse a config value megaseq does not implement: ``hf[key]`` must be one of ``allowed`` (a tuple)."""
    value = hf.get(key, allowed[0])
    if value not in allowed:
        shown = " or ".join(repr(a) for a in allowed)
        raise InteropError(f"{source}: {key} = {value!r} is not supported ({what}); megaseq needs {shown}")


def unknown_layout(who: str, layout: str, known: tuple[str, ...]) -> InteropError:
    return InteropError(f"{who}: no mapping for the layout {layout!r}; it maps {', '.join(known)}")


__all__ = ["ComponentMapping", "InteropError", "Tensors", "require", "unknown_layout"]
