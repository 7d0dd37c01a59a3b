"""The ``recompute`` policy's mechanics: what it keeps, what it refuses, and that it changes nothing else.

Its results are checked against no policy by core's memory-policy suite (test_conformance.py); here: the
bytes autograd saves in forward (counted by saved-tensor hooks) shrink to the recomputed parts' inputs, a
tiled block whose feed-forward runs whole (the MoE path) equals the untiled block, what a unit keeps for its
re-run (``ForwardContext.keep``) is computed once, saved beside its inputs and freed after its backward,
decoding and forwards without gradients run as before, and configurations that cannot apply are one-line errors.
"""

from __future__ import annotations

import weakref
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
from megaseq_offload.config import OffloadConfig, RecomputeConfig
from megaseq_offload.plugin import RECOMPUTE_PRESETS
from megaseq_offload.policies import RecomputePolicy, offload_effect, recompute_effect
from megaseq_offload.recompute import run_unit, tiled_block_forward
from megaseq_testkit import fresh_plugins

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


def _sorting_unit(calls: list[bool], keep_in_rerun: bool = True, name_in_rerun: str = "order"):
    """A unit that gathers its input in an order it chooses (an integer choice, like DSA's top-k) and keeps
    that choice; ``keep_in_rerun=False`` or another ``name_in_rerun``: a wrong component whose re-run does not
    ask for what its forward kept."""

    def fn(inputs, ctx):
        (x,) = inputs

        def choose():
            calls.append(ctx.recomputing)
            return x.detach().argsort(dim=-1)

        if ctx.recomputing and not keep_in_rerun:
            order = choose()
        else:
            order = ctx.keep(name_in_rerun if ctx.recomputing else "order", choose)
        return (x.gather(-1, order).cumsum(-1),)

    return fn


def test_kept_values_are_computed_once_saved_beside_the_inputs_and_freed():
    x = torch.randn(3, 7, requires_grad=True)
    ref = x.gather(-1, x.detach().argsort(dim=-1)).cumsum(-1)
    ref.square().sum().backward()
    ref_grad, x.grad = x.grad.clone(), None
    calls, saved = [], []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        (out,) = run_unit(_sorting_unit(calls), (x,), ForwardContext(), [])
    assert [t.dtype for t in saved] == [torch.float32, torch.int64]  # the input and the kept choice
    kept = weakref.ref(saved.pop())
    saved.clear()
    out.square().sum().backward()
    assert calls == [False]  # chosen in the forward only: the re-run took it back
    assert torch.equal(out, ref) and torch.equal(x.grad, ref_grad)
    assert kept() is None  # freed when the unit's backward ended


def test_keep_without_a_recompute_unit_computes_and_keeps_nothing():
    calls = []
    x = torch.randn(2, 5, requires_grad=True)
    ctx = ForwardContext()
    for _ in range(2):
        _sorting_unit(calls)([x], ctx)[0].sum().backward()
    with torch.no_grad():
        run_unit(_sorting_unit(calls), (x,), ctx, [])
    assert calls == [False, False, False] and ctx._kept is None


@pytest.mark.parametrize(("keep_in_rerun", "name", "error"), [
    (False, "order", r"took 0 of the 1 values its forward kept \['order'\]"),
    (True, "other", r"keep\('other'\): the re-run .* asks for value 0 as 'other', its forward kept \['order'\]"),
])
def test_a_rerun_that_does_not_take_back_what_it_kept_is_an_error(keep_in_rerun, name, error):
    x = torch.randn(2, 5, requires_grad=True)
    (out,) = run_unit(_sorting_unit([], keep_in_rerun, name), (x,), ForwardContext(), [])
    with pytest.raises(RuntimeError, match=error):
        out.sum().backward()


def test_only_values_without_gradient_can_be_kept():
    x = torch.randn(2, 5, requires_grad=True)

    def fn(inputs, ctx):
        return (ctx.keep("scaled", lambda: inputs[0] * 2),)

    with pytest.raises(TypeError, match=r"keep\('scaled'\): only a tensor without gradient .* requires grad"):
        run_unit(fn, (x,), ForwardContext(), [])
