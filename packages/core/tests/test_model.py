"""Model assembly and the chunked LM loss."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megaseq.config import validate_recipe
from megaseq.contracts import ForwardContext
from megaseq.model import build_model, chunked_token_losses
from megaseq.testing import fresh_plugins


def tiny_model(**model):
    plugins = fresh_plugins()
    recipe = validate_recipe({"model": {"d_model": 16, "n_layers": 2, **model}, "attention": {"sdpa": {"n_heads": 2}}}, plugins)
    torch.manual_seed(0)
    return build_model(recipe, plugins)


def test_chunked_loss_equals_full_loss_and_gradients():
    torch.manual_seed(0)
    hidden = torch.randn(2, 37, 16, requires_grad=True)
    weight = torch.randn(5, 16, requires_grad=True)
    targets = torch.randint(0, 5, (2, 37))
    full = F.cross_entropy((hidden @ weight.t()).flatten(0, 1), targets.flatten(), reduction="none").view(2, 37)
    gh, gw = torch.autograd.grad(full.sum(), (hidden, weight))
    for chunk in (1, 7, 74, 1000):
        losses = chunked_token_losses(hidden, weight, targets, chunk)
        ch, cw = torch.autograd.grad(losses.sum(), (hidden, weight))
        torch.testing.assert_close(losses, full, rtol=0, atol=1e-6)
        torch.testing.assert_close(ch, gh, rtol=0, atol=1e-6)
        torch.testing.assert_close(cw, gw, rtol=1e-5, atol=1e-5)  # summed over 74 tokens: |gw| ~ 5


def test_model_shapes_tied_head_and_decode():
    model = tiny_model()
    assert model.head is None and model.head_weight is model.embed.weight
    tokens = torch.randint(0, 5, (2, 11))
    hidden = model(tokens)
    assert hidden.shape == (2, 11, 16)
    with torch.no_grad():
        caches = model.init_caches(2)
        steps = [model(tokens[:, :4], ForwardContext(), caches)]
        steps += [model(tokens[:, t : t + 1], ForwardContext(), caches) for t in range(4, 11)]
    torch.testing.assert_close(torch.cat(steps, 1), hidden.detach(), rtol=0, atol=1e-5)


def test_untied_head_and_layernorm():
    model = tiny_model(tie_embeddings=False, norm="layernorm")
    assert model.head is not None and isinstance(model.final_norm, torch.nn.LayerNorm)
    assert model.logits(model(torch.randint(0, 5, (1, 3)))).shape == (1, 3, 5)
