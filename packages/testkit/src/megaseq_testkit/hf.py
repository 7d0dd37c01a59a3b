"""Conformance of a component's Hugging Face mapping: import(export(m)) == m.

:func:`assert_round_trip` exports a model built from a recipe, with every parameter and persistent buffer
drawn at random (so a
mapping that swaps two tensors of one shape, or leaves a norm weight at its initial ones, cannot pass), into
a published layout, imports the result, and requires the same tensors bitwise and the same logits: a
mapping that loses a config field (an epsilon, a bias, a gate) changes the logits. The recipe must describe
a model the layout holds exactly (fla's layout always has the KDA output gate's bias: a recipe without it
comes back with a zero bias, the same logits but another parameter set).
"""

from __future__ import annotations

import torch

from megaseq.config import Recipe
from megaseq.contracts import ForwardContext
from megaseq.interop.convert import model_from_hf, model_to_hf, recipe_from_hf
from megaseq.model import build_model
from megaseq.plugins import Plugins


def assert_round_trip(recipe: Recipe, plugins: Plugins, layout: str, seq_len: int = 19, seed: int = 0) -> None:
    torch.manual_seed(seed)
    model = build_model(recipe, plugins)
    with torch.no_grad():  # every parameter and persistent buffer (a router's bias), vectors around 1
        for t in model.state_dict().values():
            if t.is_floating_point():
                t.copy_(torch.randn_like(t) * 0.3 + (1.0 if t.dim() == 1 else 0.0))
    hf, tensors = model_to_hf(model, recipe, layout, plugins)
    back_recipe, back_layout, layers = recipe_from_hf(hf, plugins, f"export to {layout}")
    back = model_from_hf(tensors, back_recipe, back_layout, layers, plugins, f"export to {layout}")
    ours, theirs = model.state_dict(), back.state_dict()
    assert ours.keys() == theirs.keys(), f"tensors differ: {sorted(set(ours) ^ set(theirs))}"
    changed = [n for n in ours if not torch.equal(ours[n], theirs[n])]
    assert not changed, f"import(export(m)) changed {changed}"
    tokens = torch.randint(0, recipe.model.vocab_size, (2, seq_len))
    with torch.no_grad():
        a, b = model.logits(model(tokens, ForwardContext())), back.logits(back(tokens, ForwardContext()))
    scale = a.abs().max().clamp_min(1e-30)
    error = ((a - b).abs().max() / scale).item()
    assert error <= 1e-6, f"import(export(m)) computes other logits: max error {error:.2e} of the largest logit"


__all__ = ["assert_round_trip"]
