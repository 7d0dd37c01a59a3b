"""The ``cached`` inference engine: decoding with the components' own caches (KDA state, DSA and sdpa caches).

generate: one prefill forward over the prompts ``[B, P]`` with fresh caches (``LanguageModel.init_caches``),
then one forward per new token, each over the ``[B, 1]`` tokens just drawn; every forward records the MoE
routing it used (``RoutingReplay("record")``), and the records are concatenated along time. Only the last
position's hidden state goes through the LM head. The attention contract (decoding equals the full forward)
makes the log-probabilities equal the training forward's up to floating-point order; how close they are
is what ``megaseq logprob-gap`` measures.

Numerics: ``dtype = "fp32"`` keeps the model in fp32; ``"bf16"`` casts weights, activations and caches
to bf16 (as a serving engine would; components keep their own fp32 islands, e.g. KDA's state), while
logits are taken to fp32 before the softmax. Memory: the caches (O(P + N) per DSA/sdpa layer, O(1) per
KDA layer) and one prefill forward.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from megaseq.builtins.config import CachedEngineConfig
from megaseq.config import Recipe
from megaseq.contracts import ForwardContext, RoutingReplay
from megaseq.devices import pick_device
from megaseq.errors import UserError
from megaseq.inference import Generation, SamplingParams, check_tokens, policy_logprobs, sample, sequence_logprobs
from megaseq.model import build_model
from megaseq.plugins import Plugins

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class CachedEngine:
    """Implements ``megaseq.inference.InferenceEngine`` on a private copy of the model."""

    def __init__(self, config: CachedEngineConfig, recipe: Recipe, plugins: Plugins) -> None:
        self.config = config
        self.device = pick_device(config.device)
        self.dtype = DTYPES[config.dtype]
        self.model = build_model(recipe, plugins).to(self.device, self.dtype).eval()
        self.model.requires_grad_(False)
        self.vocab_size = recipe.model.vocab_size
        self.max_model_len = config.max_model_len

    def update_weights(self, weights: Mapping[str, Tensor]) -> None:
        own = self.model.state_dict()
        missing, unknown = sorted(set(own) - set(weights)), sorted(set(weights) - set(own))
        if missing or unknown:
            raise ValueError(f"cached engine: weights do not match the model (missing {missing[:3]}, unknown {unknown[:3]})")
        with torch.no_grad():
            for name, value in own.items():
                if value.shape != weights[name].shape:
                    raise ValueError(f"cached engine: {name} has shape {tuple(weights[name].shape)}, expected {tuple(value.shape)}")
            for name, value in own.items():
                value.copy_(weights[name])

    @torch.no_grad()
    def score(self, tokens: Tensor, temperature: float = 1.0) -> Tensor:
        check_tokens(tokens, self.vocab_size, "cached engine: score")
        tokens = tokens.to(self.device)
        return sequence_logprobs(self.model, tokens, ForwardContext(), temperature, self.config.loss_chunk)

    @torch.no_grad()
    def generate(self, prompts: Tensor, params: SamplingParams) -> Generation:
        if prompts.dim() != 2 or prompts.shape[1] < 1:
            raise ValueError(f"cached engine: prompts must be [batch, length >= 1], got shape {tuple(prompts.shape)}")
        check_tokens(prompts, self.vocab_size, "cached engine: prompts")
        batch, prompt_len = prompts.shape
        if prompt_len + params.max_new_tokens > self.max_model_len:
            raise UserError(
                f"cached engine: prompt of {prompt_len} tokens + max_new_tokens {params.max_new_tokens} exceeds "
                f"max_model_len {self.max_model_len} (engine config key max_model_len)"
            )
        generator = torch.Generator(self.device).manual_seed(params.seed)
        caches = self.model.init_caches(batch, device=self.device, dtype=self.dtype)
        temperature = params.policy_temperature
        tokens, logprobs, records = [], [], []
        alive = torch.ones(batch, dtype=torch.bool, device=self.device)
        masks = []
        x = prompts.to(self.device)
        for step in range(params.max_new_tokens):
            routing = RoutingReplay("record")
            hidden = self.model(x, ForwardContext(routing=routing), caches)[:, -1]
            records.append({key: idx.view(batch, x.shape[1], -1) for key, idx in routing.indices.items()})
            logits = self.model.logits(hidden).float()
            token = sample(logits, params, generator)
            masks.append(alive.clone())
            tokens.append(torch.where(alive, token, 0))
            logprobs.append(torch.where(alive, policy_logprobs(logits, token, temperature), 0.0))
            if params.stop_token is not None:
                alive &= token != params.stop_token
            if step + 1 < params.max_new_tokens:  # the last token is returned, never fed back
                x = token[:, None]
        routing_out = {key: torch.cat([r[key] for r in records], dim=1) for key in records[0]}
        return Generation(
            tokens=torch.stack(tokens, 1),
            logprobs=torch.stack(logprobs, 1),
            mask=torch.stack(masks, 1),
            truncated=alive if params.stop_token is not None else torch.zeros_like(alive),
            routing=routing_out,
        )


def build(config: CachedEngineConfig, recipe: Recipe, plugins: Plugins) -> CachedEngine:
    return CachedEngine(config, recipe, plugins)
