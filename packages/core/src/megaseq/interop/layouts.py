"""What a published model layout is, in the terms of core's walker (``megaseq.interop.convert``).

A plugin registers a layout (``megaseq.hookspecs.megaseq_hf_layout``, a ``megaseq.records.HFLayoutSpec``
whose target is a :class:`Layout`): where each model-level tensor lives, the model-level ``config.json``
fields, which component each layer's sub-modules are, how the components are placed back into
``config.json``, and the mappings of the components the layout uses that do not map themselves to it (a
component written for another model family: the layout's own softmax attention or gated MLP). Components
map their own sub-modules (``megaseq.interop.ComponentMapping``); a layout never converts a component's
tensors itself.

Core registers no layout: the package that owns a model family's layers provides its layout.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from megaseq.interop import ComponentMapping, InteropError, require


@dataclass(frozen=True)
class Layer:
    """One layer's components (the names a recipe uses) and the Hugging Face sub-module prefixes they read
    (relative to the layer). ``ffn_kind``: ``"ffn"`` or ``"moe"``."""

    attention: str
    attention_prefix: str
    ffn_kind: str
    ffn: str
    ffn_prefix: str
    ffn_prefix_aliases: tuple[str, ...] = ()  # other writers' names of the same sub-module; import reads them


@dataclass(frozen=True)
class Layout:
    """A published model layout, without its name and ``model_type`` (the record's, ``HFLayoutSpec``).

    ``architecture``: the class ``config.json``'s ``architectures`` names. ``embed``, ``final_norm``,
    ``head``: the model-level tensors' names; ``layer_prefix``: a layer's prefix, formatted with its index;
    ``attn_norm``, ``ffn_norm``: the block's two norms, relative to it. ``eps_key``: the ``config.json`` field
    of the norms' epsilon. ``hidden_act``: the values of ``hidden_act`` that mean the SiLU megaseq's MLPs
    compute (the first is written). ``ties_head``: whether the model class takes its head from the
    embedding when ``tie_word_embeddings`` is true (if not, a tied model is written with its head copied).

    ``layers(hf, source) -> list[Layer]``: each layer's components from ``config.json`` (refusing, in one
    line naming ``source``, what megaseq cannot compute). ``place(hf, attention, ffn)``: the inverse for
    export, writing into ``hf`` which layer is which (``attention``: each layer's attention name; ``ffn``:
    its ``(kind, name)``); the walker reads the result back with ``layers`` and refuses a model the layout
    cannot hold. ``mappings``: ``(kind, name) -> ComponentMapping`` of components this layout maps for
    them; the walker prefers these to the component's own ``mapping``.
    """

    architecture: str
    embed: str
    final_norm: str
    head: str
    layer_prefix: str
    attn_norm: str
    ffn_norm: str
    eps_key: str
    hidden_act: tuple[str, ...]
    ties_head: bool
    layers: Callable[[dict[str, Any], str], list[Layer]]
    place: Callable[[dict[str, Any], list[str], list[tuple[str, str]]], None]
    mappings: Mapping[tuple[str, str], ComponentMapping] = field(default_factory=dict)

    def model_fields(self, hf: dict[str, Any], source: str) -> dict[str, Any]:
        """``[model]`` fields (without the layer pattern) from ``config.json``."""
        missing = [k for k in ("hidden_size", "num_hidden_layers", "vocab_size") if not isinstance(hf.get(k), int)]
        if missing:
            raise InteropError(f"{source}: {missing[0]} is missing or not an integer")
        require(hf, "hidden_act", self.hidden_act, "the MLP activation", source)
        return {
            "d_model": hf["hidden_size"],
            "n_layers": hf["num_hidden_layers"],
            "vocab_size": hf["vocab_size"],
            "norm": "rmsnorm",
            "norm_eps": float(hf.get(self.eps_key, 1e-6)),
            "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
        }

    def model_to_hf(self, model: Any, model_type: str) -> dict[str, Any]:
        """The model-level ``config.json`` fields of ``[model]`` (``model``: a ``ModelConfig``)."""
        return {
            "model_type": model_type,
            "architectures": [self.architecture],
            "hidden_size": model.d_model,
            "num_hidden_layers": model.n_layers,
            "vocab_size": model.vocab_size,
            self.eps_key: model.norm_eps,
            "tie_word_embeddings": model.tie_embeddings,
            "hidden_act": self.hidden_act[0],
        }


__all__ = ["Layer", "Layout"]
