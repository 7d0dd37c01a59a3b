"""The ``recompute`` policy's mechanics: what it keeps, what it refuses, and that it changes nothing else.

Its results are checked against no policy by core's memory-policy suite (test_conformance.py); here: the
bytes autograd saves in forward (counted by saved-tensor hooks) shrink to the recomputed parts' inputs, a
tiled block whose feed-forward runs whole (the MoE path) equals the untiled block, decoding and forwards
without gradients run as before, and configurations that cannot apply are one-line errors.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from pydantic import ValidationError

from megaseq.config import validate_recipe
from megaseq.contracts import ForwardContext, recomputing
from megaseq.errors import UserError
from megaseq.hookspecs import hookimpl
from megaseq.model import build_model
from megaseq.records import AttentionSpec, ComponentConfig
from megaseq.testing import fresh_plugins
from megaseq_offload.config import OffloadConfig, RecomputeConfig
from megaseq_offload.plugin import RECOMPUTE_PRESETS
from megaseq_offload.policies import RecomputePolicy, offload_effect, recompute_effect
from megaseq_offload.recompute import tiled_block_forward

D, LAYERS, T = 16, 4, 90


def _model(pattern=("sdpa",), plugins=None, **attention: Any):
    plugins = plugins or fresh_plugins()
    raw = {"model": {"d_model": D, "n_layers": LAYERS, "layer_pattern": list(pattern)},
           "attention": {name: {"n_heads": 2} for name in set(pattern) if name == "sdpa"} | attention}
    torch.manual_seed(0)
    return build_model(validate_recipe(raw, plugins), plugins)


def _saved_bytes(model, tokens) -> int:
    """Bytes autograd keeps from the forward for the backward (parameters excepted)."""
    total = 0

    def pack(t):
        nonlocal total
        if not isinstance(t, torch.nn.Parameter) and not recomputing():  # kept from forward to backward
            total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(tokens, ForwardContext()).sum().backward()
    return total


def test_recompute_keeps_only_inputs():
    tokens = torch.randint(0, 5, (1, T))
    plain = _saved_bytes(_model(), tokens)
    model = _model()
    RecomputePolicy(RecomputeConfig(part="block")).apply(model)
    blocks = _saved_bytes(model, tokens)
    assert blocks == LAYERS * T * D * 4 + (plain - _saved_bytes_of_blocks(tokens)), (plain, blocks)
    model = _model()
    RecomputePolicy(RecomputeConfig(part="block", tile_tokens=32)).apply(model)
    tiled = _saved_bytes(model, tokens)
    # per layer: the block input (in tiles) and the rotated keys and values of every earlier tile, per tile
    assert blocks < tiled < plain


def _saved_bytes_of_blocks(tokens) -> int:
    """What the blocks alone save without a policy (the whole model's minus the model without blocks)."""
    model = _model()
    full = _saved_bytes(model, tokens)
    model.blocks = torch.nn.ModuleList()
    return full - _saved_bytes(model, tokens)


def test_tiled_block_with_whole_feed_forward_equals_untiled():
    """The MoE path: attention in tiles, then the feed-forward over the whole sequence as one more unit."""
    model = _model()
    block = model.blocks[1]
    x = torch.randn(2, T, D, requires_grad=True)
    ref = block(x, ForwardContext())
    ref.square().sum().backward()
    ref_grads = [p.grad.clone() for p in block.parameters()]
    ref_x = x.grad.clone()
    block.zero_grad()
    x.grad = None
    out = tiled_block_forward(block, block.forward, 25, ffn_tiles=False)(x, ForwardContext())
    out.square().sum().backward()
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(x.grad, ref_x, rtol=1e-5, atol=1e-6)
    for p, g in zip(block.parameters(), ref_grads, strict=True):
        torch.testing.assert_close(p.grad, g, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("config", [{"part": "block"}, {"part": "attention"}, {"part": "block", "tile_tokens": 7}])
def test_decoding_and_no_grad_run_as_before(config):
    tokens = torch.randint(0, 5, (1, 20))
    ref_model, model = _model(), _model()
    RecomputePolicy(RecomputeConfig(**config)).apply(model)
    with torch.no_grad():
        assert torch.equal(model(tokens), ref_model(tokens))
        caches, ref_caches = model.init_caches(1), ref_model.init_caches(1)
        assert torch.equal(model(tokens[:, :5], caches=caches), ref_model(tokens[:, :5], caches=ref_caches))
        assert torch.equal(model(tokens[:, 5:6], caches=caches), ref_model(tokens[:, 5:6], caches=ref_caches))


def test_parameter_names_do_not_change():
    model, ref = _model(), _model()
    RecomputePolicy(RecomputeConfig(part="block", tile_tokens=8)).apply(model)
    assert list(model.state_dict()) == list(ref.state_dict())


def test_layers_selecting_nothing_is_an_error():
    with pytest.raises(UserError, match=r"layers \[4, 6\) selects no layer of this 4-layer model"):
        RecomputePolicy(RecomputeConfig(layers=(4, 6))).apply(_model())


class NoOptions(ComponentConfig):
    pass


class Untiled(torch.nn.Module):
    def forward(self, x, ctx, cache=None):
        return x

    def init_cache(self, batch_size, *, device, dtype):
        return None


def _build_untiled(config, dims, layer_idx):
    return Untiled()


class UntiledPlugin:
    @hookimpl
    def megaseq_attention(self):
        return [AttentionSpec(name="untiled", target=f"{__name__}:_build_untiled", config=NoOptions)]


def test_tiles_need_attention_that_tiles():
    plugins = fresh_plugins()
    plugins.register(UntiledPlugin(), name="untiled-plugin")
    model = _model(("sdpa", "untiled"), plugins)
    with pytest.raises(UserError, match=r"layer 1 \(untiled\), 3 \(untiled\) cannot run in sequence tiles"):
        RecomputePolicy(RecomputeConfig(tile_tokens=8)).apply(model)
    RecomputePolicy(RecomputeConfig(tile_tokens=8, layers=(0, 1))).apply(model)  # the sdpa layer alone tiles


def test_config_errors():
    with pytest.raises(ValidationError, match="tile_tokens needs part = 'block'"):
        RecomputeConfig(part="ffn", tile_tokens=8)
    with pytest.raises(ValidationError, match="first < stop"):
        RecomputeConfig(layers=(3, 3))


def test_presets_are_valid_and_effects_rank_them():
    configs = [RecomputeConfig(**preset) for preset in RECOMPUTE_PRESETS]
    costs = [recompute_effect(c).time_cost for c in configs]
    assert costs == sorted(costs), "presets are listed cheapest first"
    assert recompute_effect(RecomputeConfig(part="attention", layers=(1, 3))).acts_on(2)
    assert not recompute_effect(RecomputeConfig(part="attention", layers=(1, 3))).acts_on(3)
    assert offload_effect(OffloadConfig(min_bytes=5)).offload_min_bytes == 5
