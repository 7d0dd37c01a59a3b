"""Conformance suite for inference engines (see ``megaseq.inference.InferenceEngine``).

Subclass :class:`EngineConformance` in a pytest module and set ``name``, ``config`` (the engine's own keys)
and, to serve another architecture, ``recipe`` (TOML-shaped ``[model]`` and component tables; the default is
a two-layer ``sdpa`` model built from core's built-ins). The reference is the training forward
(``megaseq.inference.sequence_logprobs``) of a model built from the same recipe with the same weights, in
fp32 on the CPU. The weights are random but scaled so that next-token distributions are far from uniform
(greedy choices have clear margins). Recipes with an MoE also check that the routing the engine reports,
replayed in the training forward, reproduces its log-probabilities. Every check has a deliberately wrong
engine in the kit's own tests (``packages/testkit/tests/test_engine_conformance.py``) that it catches.

The reference runs on a float64 copy of the weights the engine gets, so its own rounding is far below the bound
and ``tolerance`` measures the engine alone: the largest |engine - reference| log-probability accepted
(default 1e-4, for fp32 engines). ``factory`` (``"module:attr"`` or ``"/path/file.py:attr"`` of a
``build(config_dict, recipe, plugins)``) tests an engine that is not an installed plugin.
"""

from __future__ import annotations

import copy
from typing import Any, ClassVar

import pytest
import torch
from torch import Tensor

from megaseq.config import Recipe, validate_recipe
from megaseq.contracts import ForwardContext
from megaseq.errors import UserError
from megaseq.inference import InferenceEngine, SamplingParams, sequence_logprobs
from megaseq.model import LanguageModel, build_model
from megaseq.plugins import Plugins

DEFAULT_RECIPE: dict[str, Any] = {
    "model": {"d_model": 32, "n_layers": 2, "layer_pattern": ["sdpa"], "vocab_size": 7},
    "attention": {"sdpa": {"n_heads": 2}},
}


def refused(error: type[Exception], what: str, fn: Any, *args: Any) -> None:
    try:
        fn(*args)
    except error:
        return
    raise AssertionError(f"{what} was accepted; expected {error.__name__}")


class EngineConformance:
    """Base class of an inference engine's conformance tests."""

    name: ClassVar[str]
    config: ClassVar[dict[str, Any]] = {}
    factory: ClassVar[str | None] = None
    recipe: ClassVar[dict[str, Any]] = DEFAULT_RECIPE
    tolerance: ClassVar[float] = 1e-4
    batch: ClassVar[int] = 3
    prompt_len: ClassVar[int] = 11
    new_tokens: ClassVar[int] = 9

    # -- construction ---------------------------------------------------------------------------------
    def plugins(self) -> Plugins:
        from megaseq_testkit import installed_plugins

        return installed_plugins()

    def model_recipe(self) -> Recipe:
        return validate_recipe(self.recipe, self.plugins(), source="<engine suite recipe>")

    def reference(self, seed: int = 0) -> LanguageModel:
        """The training model with random weights, scaled so that its distributions are far from uniform."""
        torch.manual_seed(seed)
        model = build_model(self.model_recipe(), self.plugins()).eval()
        with torch.no_grad():
            model.embed.weight.mul_(3.0)  # mean top probability ~0.55 with the default recipe
        return model

    def build(self, weights: dict[str, Tensor] | None = None) -> Any:
        from megaseq_testkit import load_factory

        plugins = self.plugins()
        if self.factory is not None:
            engine = load_factory(self.factory)(dict(self.config), self.model_recipe(), plugins)
        else:
            provided = plugins.get("inference_engine", self.name)
            engine = provided.load()(provided.spec.config(**self.config), self.model_recipe(), plugins)
        engine.update_weights(weights if weights is not None else self.reference().state_dict())
        return engine

    def prompts(self, seed: int = 1, batch: int | None = None) -> Tensor:
        vocab = self.model_recipe().model.vocab_size
        return torch.randint(0, vocab, (batch or self.batch, self.prompt_len), generator=torch.Generator().manual_seed(seed))

    def reference_logprobs(self, model: LanguageModel, tokens: Tensor, temperature: float = 1.0, ctx=None) -> Tensor:
        with torch.no_grad():
            exact = copy.deepcopy(model).double()
            return sequence_logprobs(exact, tokens.cpu(), ctx or ForwardContext(), temperature).double()

    def reference_logits(self, model: LanguageModel, tokens: Tensor) -> Tensor:
        """Logits ``[B, T, V]`` at every position (small models only)."""
        with torch.no_grad():
            return model.logits(model(tokens.cpu(), ForwardContext())).float()

    def generated_part(self, prompts: Tensor, scores: Tensor) -> Tensor:
        return scores[:, prompts.shape[1] - 1 :]

    def close(self, actual: Tensor, expected: Tensor, what: str) -> None:
        actual = actual.detach().cpu().double()
        assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
        err = (actual - expected.double()).abs().max().item()
        assert err <= self.tolerance, f"{what}: max |delta logprob| {err:.3e} > {self.tolerance:.1e}"

    # -- the contract ---------------------------------------------------------------------------------
    def test_protocol(self) -> None:
        engine = self.build()
        assert isinstance(engine, InferenceEngine), f"{type(engine).__name__} does not implement InferenceEngine"
        assert engine.vocab_size == self.model_recipe().model.vocab_size

    def test_generate_shapes_and_ranges(self) -> None:
        engine = self.build()
        prompts = self.prompts()
        out = engine.generate(prompts, SamplingParams(self.new_tokens, seed=3))
        shape = (self.batch, self.new_tokens)
        for what, t in (("tokens", out.tokens), ("logprobs", out.logprobs), ("mask", out.mask)):
            assert tuple(t.shape) == shape, f"{what}: shape {tuple(t.shape)}, expected {shape}"
        assert out.tokens.dtype == torch.int64 and out.mask.dtype == torch.bool
        assert ((out.tokens >= 0) & (out.tokens < engine.vocab_size)).all(), "token outside the vocabulary"
        assert out.logprobs.dtype == torch.float32 and torch.isfinite(out.logprobs).all()
        assert (out.logprobs <= 0).all(), "a log-probability above 0"
        assert out.mask.all() and not out.truncated.any(), "without a stop token every token counts"

    @pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.7, 0.8), (0.0, 1.0)], ids=["t1", "t0.7-p0.8", "greedy"])
    def test_logprobs_match_training_forward(self, temperature: float, top_p: float) -> None:
        model = self.reference()
        engine = self.build(model.state_dict())
        prompts = self.prompts()
        params = SamplingParams(self.new_tokens, temperature=temperature, top_p=top_p, seed=4)
        out = engine.generate(prompts, params)
        tokens = torch.cat([prompts, out.tokens.cpu()], 1)
        ref = self.generated_part(prompts, self.reference_logprobs(model, tokens, params.policy_temperature))
        self.close(out.logprobs, ref, f"generated logprobs (temperature {temperature}, top_p {top_p})")

    def test_score_matches_training_forward(self) -> None:
        model = self.reference()
        engine = self.build(model.state_dict())
        tokens = self.prompts(seed=6)
        for temperature in (1.0, 0.5):
            self.close(engine.score(tokens, temperature), self.reference_logprobs(model, tokens, temperature), f"score at T={temperature}")

    def assert_argmax(self, model: LanguageModel, prompts: Tensor, generated: Tensor, what: str) -> None:
        """Each generated token is the reference's most likely one given the tokens before it (where the top
        two logits differ by more than 1e-3, so that numerics cannot flip the choice)."""
        tokens = torch.cat([prompts, generated.cpu()], 1)
        logits = self.reference_logits(model, tokens[:, :-1])[:, prompts.shape[1] - 1 :]
        top2 = logits.topk(2, dim=-1).values
        clear = (top2[..., 0] - top2[..., 1]) > 1e-3
        assert clear.float().mean() > 0.5, "test model too flat to check greedy decoding"
        assert torch.equal(generated.cpu()[clear], logits.argmax(-1)[clear]), f"{what}: not the most likely token"

    def test_greedy_is_argmax(self) -> None:
        model = self.reference()
        engine = self.build(model.state_dict())
        prompts = self.prompts()
        out = engine.generate(prompts, SamplingParams(self.new_tokens, temperature=0.0))
        self.assert_argmax(model, prompts, out.tokens, "greedy decoding")

    def test_seeded_and_independent_of_global_rng(self) -> None:
        engine = self.build()
        prompts = self.prompts()
        params = SamplingParams(self.new_tokens, temperature=1.0, seed=11)
        torch.manual_seed(123)
        a = engine.generate(prompts, params)
        torch.manual_seed(456)
        torch.rand(1000)
        b = engine.generate(prompts, params)
        assert torch.equal(a.tokens, b.tokens), "same seed, different tokens (does sampling use the global RNG?)"
        c = engine.generate(prompts, SamplingParams(self.new_tokens, temperature=1.0, seed=12))
        assert not torch.equal(a.tokens, c.tokens), "different seeds gave the same tokens"

    def test_rows_are_independent(self) -> None:
        engine = self.build()
        prompts = self.prompts()
        params = SamplingParams(self.new_tokens, temperature=0.0)
        together = engine.generate(prompts, params)
        for row in range(prompts.shape[0]):
            alone = engine.generate(prompts[row : row + 1], params)
            assert torch.equal(alone.tokens, together.tokens[row : row + 1]), f"row {row} depends on the batch"
            self.close(together.logprobs[row : row + 1], alone.logprobs.cpu(), f"row {row} logprobs alone vs batched")

    def test_low_temperature_and_tiny_top_p_are_greedy(self) -> None:
        model = self.reference()
        engine = self.build(model.state_dict())
        prompts = self.prompts()
        nucleus = engine.generate(prompts, SamplingParams(self.new_tokens, temperature=1.0, top_p=1e-6, seed=2))
        self.assert_argmax(model, prompts, nucleus.tokens, "top_p ~ 0 must keep only the most likely token")
        cold = engine.generate(prompts, SamplingParams(self.new_tokens, temperature=1e-5, seed=2))
        self.assert_argmax(model, prompts, cold.tokens, "temperature ~ 0 must sample the most likely token")

    def test_top_p_keeps_to_the_nucleus(self) -> None:
        model = self.reference()
        engine = self.build(model.state_dict())
        prompts = self.prompts(batch=8)
        top_p = 0.6
        out = engine.generate(prompts, SamplingParams(self.new_tokens, temperature=1.0, top_p=top_p, seed=5))
        tokens = torch.cat([prompts, out.tokens.cpu()], 1)
        probs = self.reference_logits(model, tokens[:, :-1])[:, prompts.shape[1] - 1 :].softmax(-1)
        chosen = probs.gather(-1, out.tokens.cpu()[..., None]).squeeze(-1)
        mass_above = (probs * (probs > chosen[..., None])).sum(-1)  # mass of the strictly more likely tokens
        assert (mass_above < top_p + 1e-4).all(), "sampled a token outside the top-p nucleus"

    def test_update_weights(self) -> None:
        a, b = self.reference(seed=0), self.reference(seed=1)
        engine = self.build(a.state_dict())
        tokens = self.prompts(seed=8)
        self.close(engine.score(tokens), self.reference_logprobs(a, tokens), "score with weights A")
        engine.update_weights(b.state_dict())
        self.close(engine.score(tokens), self.reference_logprobs(b, tokens), "score after taking weights B")
        broken = dict(a.state_dict())
        broken.pop(next(iter(broken)))
        refused(ValueError, "weights with a missing name", engine.update_weights, broken)
        self.close(engine.score(tokens), self.reference_logprobs(b, tokens), "score after a rejected update")
        refused(ValueError, "weights with an unknown name", engine.update_weights, {**b.state_dict(), "no.such.weight": torch.zeros(1)})

    def test_too_long_prompt_is_refused(self) -> None:
        engine = self.build()
        length = engine.max_model_len - self.new_tokens + 1
        assert length <= 1 << 16, f"set a small max_model_len in the suite's config (got {engine.max_model_len})"
        refused(UserError, "a prompt beyond max_model_len", engine.generate, torch.zeros(1, length, dtype=torch.int64), SamplingParams(self.new_tokens))
        ok = engine.generate(torch.zeros(1, length - 1, dtype=torch.int64), SamplingParams(self.new_tokens))
        assert ok.tokens.shape == (1, self.new_tokens)

    def test_stop_token(self) -> None:
        engine = self.build()
        prompts = self.prompts(batch=6)
        free = engine.generate(prompts, SamplingParams(self.new_tokens, seed=9))
        stop = int(free.tokens[0, 0])  # row 0 draws it first, so with the same seed it stops at once
        out = engine.generate(prompts, SamplingParams(self.new_tokens, seed=9, stop_token=stop))
        tokens, mask = out.tokens.cpu(), out.mask.cpu()
        for row in range(prompts.shape[0]):
            hits = (tokens[row] == stop) & mask[row]
            end = int(hits.nonzero()[0, 0]) + 1 if hits.any() else self.new_tokens
            expected = torch.arange(self.new_tokens) < end
            assert torch.equal(mask[row], expected), f"row {row}: mask {mask[row].tolist()} for a stop at {end - 1}"
            assert bool(out.truncated[row]) == (not hits.any()), f"row {row}: truncated flag wrong"
            assert (tokens[row][~expected] == 0).all() and (out.logprobs.cpu()[row][~expected] == 0).all()
        assert not mask[0, 1:].any(), "row 0 did not stop at its stop token"

    def test_routing_replay_reproduces_logprobs(self) -> None:
        model = self.reference()
        if not any(block.names[1] == "moe" for block in model.blocks):
            pytest.skip("the suite's recipe has no MoE layer; set `recipe` to one with [model] moe to check routing")
        engine = self.build(model.state_dict())
        prompts = self.prompts()
        out = engine.generate(prompts, SamplingParams(self.new_tokens, seed=2))
        tokens = torch.cat([prompts, out.tokens.cpu()], 1)
        n_moe = sum(1 for block in model.blocks if block.names[1] == "moe")
        assert len(out.routing) == n_moe, f"routing for {len(out.routing)} layers, the model has {n_moe} MoE layers"
        for key, idx in out.routing.items():
            expected = (self.batch, tokens.shape[1] - 1)
            assert tuple(idx.shape[:2]) == expected, f"routing {key}: shape {tuple(idx.shape)}, expected {expected} + (k,)"
        replayed = self.reference_logprobs(model, tokens, 1.0, ForwardContext(routing=out.replay()))
        self.close(out.logprobs, self.generated_part(prompts, replayed), "logprobs with the engine's routing replayed")


__all__ = ["DEFAULT_RECIPE", "EngineConformance"]
