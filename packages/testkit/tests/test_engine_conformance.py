"""The engine conformance suite on core's ``cached`` engine (built-ins, and a toy MoE defined here for the
routing checks), and deliberately wrong engines, each shown to be caught by the check named beside it."""

from __future__ import annotations

import dataclasses
import sys
import types

import pytest
import torch
from torch import Tensor, nn

from megaseq.builtins.config import CachedEngineConfig
from megaseq.contracts import ForwardContext
from megaseq.hookspecs import hookimpl
from megaseq.inference import SamplingParams
from megaseq.inference.cached import CachedEngine
from megaseq.records import MoESpec, NoConfig
from megaseq_testkit import fresh_plugins
from megaseq_testkit.engine import EngineConformance

CONFIG = {"device": "cpu", "max_model_len": 64}


class TestCachedEngine(EngineConformance):
    name = "cached"
    config = CONFIG


def build_cached(config: dict, recipe, plugins) -> CachedEngine:
    return CachedEngine(CachedEngineConfig(**config), recipe, plugins)


class TestCachedEngineFromFactory(EngineConformance):
    """The same engine built by ``factory``, as an engine that is not yet packaged is tested."""

    name = "cached-factory"
    factory = f"{__file__}:build_cached"
    config = CONFIG
    test_logprobs_match_training_forward = test_top_p_keeps_to_the_nucleus = test_stop_token = None


# --- a toy MoE plugin, so that routing is checked with core alone ---------------------------------------
class ToyMoE(nn.Module):
    """Softmax top-2 of 4 linear experts; records/replays its choice through ctx.routing."""

    def __init__(self, d_model: int, layer_idx: int) -> None:
        super().__init__()
        self.n_experts, self.top_k, self.key = 4, 2, f"layer{layer_idx}"
        self.router = nn.Linear(d_model, 4, bias=False)
        self.experts = nn.Parameter(torch.randn(4, d_model, d_model) * d_model**-0.5)

    def forward(self, x: Tensor, ctx: ForwardContext) -> Tensor:
        flat = x.reshape(-1, x.shape[-1])
        probs = self.router(flat).softmax(-1)
        indices = probs.topk(2, dim=-1).indices
        if ctx.routing is not None:
            indices = ctx.routing.route(self.key, indices)
        weights = probs.gather(-1, indices)
        out = torch.einsum("nk,nkd->nd", weights, torch.einsum("nd,nkde->nke", flat, self.experts[indices]))
        return out.view_as(x)


toy_module = types.ModuleType("megaseq_engine_suite_toy")
toy_module.build = lambda config, dims, layer_idx: ToyMoE(dims.d_model, layer_idx)
sys.modules[toy_module.__name__] = toy_module


class ToyPlugin:
    @hookimpl
    def megaseq_moe(self):
        return [MoESpec(name="toy", target="megaseq_engine_suite_toy:build", config=NoConfig)]


def toy_plugins():
    plugins = fresh_plugins()
    plugins.register(ToyPlugin(), name="toy-moe")
    return plugins


MOE_RECIPE = {
    "model": {"d_model": 32, "n_layers": 3, "layer_pattern": ["sdpa"], "moe": "toy", "dense_layers": 1, "vocab_size": 7},
    "attention": {"sdpa": {"n_heads": 2}},
}


class TestCachedEngineWithMoE(EngineConformance):
    name = "cached"
    config = CONFIG
    recipe = MOE_RECIPE

    def plugins(self):
        return toy_plugins()


# --- wrong engines ---------------------------------------------------------------------------------------
class GlobalRNG(CachedEngine):
    def generate(self, prompts, params):  # draws its seed from torch's global generator
        return super().generate(prompts, dataclasses.replace(params, seed=int(torch.randint(0, 1 << 30, ()))))


class LogprobsAtT1(CachedEngine):
    def generate(self, prompts, params):  # reports the temperature-1 log-probabilities whatever the temperature
        out = super().generate(prompts, params)
        scores = self.score(torch.cat([prompts, out.tokens], 1))[:, prompts.shape[1] - 1 :]
        return dataclasses.replace(out, logprobs=scores)


class LogprobsShifted(CachedEngine):
    def generate(self, prompts, params):
        out = super().generate(prompts, params)
        return dataclasses.replace(out, logprobs=out.logprobs.roll(1, dims=1))


class SamplesWhenGreedy(CachedEngine):
    def generate(self, prompts, params):
        if params.temperature == 0:
            params = dataclasses.replace(params, temperature=1.0)
        return super().generate(prompts, params)


class IgnoresTopP(CachedEngine):
    def generate(self, prompts, params):
        return super().generate(prompts, dataclasses.replace(params, top_p=1.0))


class KeepsFirstWeights(CachedEngine):
    loaded = False

    def update_weights(self, weights):
        if not self.loaded:
            super().update_weights(weights)
            self.loaded = True


class PartialUpdate(CachedEngine):
    def update_weights(self, weights):  # copies what it can before complaining
        own = self.model.state_dict()
        with torch.no_grad():
            for name, value in weights.items():
                if name in own:
                    own[name].copy_(value)
        super().update_weights(weights)


class NoLengthCheck(CachedEngine):
    def generate(self, prompts, params):
        self.max_model_len = 1 << 20
        try:
            return super().generate(prompts, params)
        finally:
            self.max_model_len = CONFIG["max_model_len"]


class IgnoresStop(CachedEngine):
    def generate(self, prompts, params):
        return super().generate(prompts, dataclasses.replace(params, stop_token=None))


class BatchCoupled(CachedEngine):
    def generate(self, prompts, params):
        out = super().generate(prompts, params)
        return dataclasses.replace(out, logprobs=0.9 * out.logprobs + 0.1 * out.logprobs.mean(0))


class ScoreShifted(CachedEngine):
    def score(self, tokens, temperature=1.0):
        return super().score(tokens, temperature).roll(1, dims=1)


class Int32Tokens(CachedEngine):
    def generate(self, prompts, params):
        out = super().generate(prompts, params)
        return dataclasses.replace(out, tokens=out.tokens.to(torch.int32))


class NoRouting(CachedEngine):
    def generate(self, prompts, params):
        return dataclasses.replace(super().generate(prompts, params), routing={})


class PrefillRoutingOnly(CachedEngine):
    def generate(self, prompts, params):
        out = super().generate(prompts, params)
        return dataclasses.replace(out, routing={k: v[:, : prompts.shape[1]] for k, v in out.routing.items()})


@pytest.mark.parametrize(
    ("wrong", "check", "moe"),
    [
        (GlobalRNG, "test_seeded_and_independent_of_global_rng", False),
        (LogprobsAtT1, "test_logprobs_match_training_forward", False),
        (LogprobsShifted, "test_logprobs_match_training_forward", False),
        (SamplesWhenGreedy, "test_greedy_is_argmax", False),
        (IgnoresTopP, "test_low_temperature_and_tiny_top_p_are_greedy", False),
        (IgnoresTopP, "test_top_p_keeps_to_the_nucleus", False),
        (KeepsFirstWeights, "test_update_weights", False),
        (PartialUpdate, "test_update_weights", False),
        (NoLengthCheck, "test_too_long_prompt_is_refused", False),
        (IgnoresStop, "test_stop_token", False),
        (BatchCoupled, "test_rows_are_independent", False),
        (ScoreShifted, "test_score_matches_training_forward", False),
        (Int32Tokens, "test_generate_shapes_and_ranges", False),
        (NoRouting, "test_routing_replay_reproduces_logprobs", True),
        (PrefillRoutingOnly, "test_routing_replay_reproduces_logprobs", True),
    ],
    ids=lambda v: v.__name__ if isinstance(v, type) else str(v),
)
def test_suite_catches_wrong_engine(wrong: type, check: str, moe: bool) -> None:
    base = TestCachedEngineWithMoE if moe else TestCachedEngine

    class Suite(base):
        def build(self, weights=None):
            engine = wrong(CachedEngineConfig(**CONFIG), self.model_recipe(), self.plugins())
            engine.update_weights(weights if weights is not None else self.reference().state_dict())
            return engine

    suite = Suite()
    kwargs = {"temperature": 0.7, "top_p": 0.8} if check == "test_logprobs_match_training_forward" else {}
    with pytest.raises(AssertionError):
        getattr(suite, check)(**kwargs)


def test_sampling_params_are_validated() -> None:
    for bad in ({"max_new_tokens": 0}, {"max_new_tokens": 1, "temperature": -1.0}, {"max_new_tokens": 1, "top_p": 0.0}):
        with pytest.raises(ValueError, match="sampling"):
            SamplingParams(**bad)
