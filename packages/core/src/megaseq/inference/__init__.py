"""Inference engines: the contract between a model served for generation and whoever drives it (RL).

An engine is a plugin kind (hook ``megaseq_inference_engine``, record ``InferenceEngineSpec``), built by
its record's target as ``build(config, recipe, plugins)`` for the model a recipe describes. It
generates continuations with per-token log-probabilities and the MoE routing it used, scores given tokens,
and takes new weights from the trainer. Core provides ``cached`` (``megaseq.inference.cached``), which
decodes with the components' own caches; ``megaseq_testkit.engine.EngineConformance`` is the executable
form of this contract.

Log-probabilities are those of the *policy at temperature T*: ``log softmax(logits / T)`` of the chosen
token, before top-p truncation (T = 1 when decoding greedily). The trainer's side computes the same
quantity with :func:`sequence_logprobs`, so the two can be compared token by token (the logprob gap).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

from megaseq.contracts import ForwardContext, RoutingReplay
from megaseq.model import LanguageModel, chunked_token_losses


@dataclass(frozen=True)
class SamplingParams:
    """How to continue a batch of prompts.

    ``temperature = 0`` decodes greedily (the first maximal token); otherwise tokens are drawn from
    ``softmax(logits / temperature)`` restricted to the smallest set of most likely tokens whose
    probability reaches ``top_p`` (the top token always stays). ``seed`` fixes every draw: the same prompts,
    weights and params give the same tokens, whatever the global RNG holds. With ``stop_token`` a row ends
    after emitting it; a row that never does is *truncated*.
    """

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0
    stop_token: int | None = None

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"sampling: max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not self.temperature >= 0 or self.temperature == float("inf"):
            raise ValueError(f"sampling: temperature must be finite and >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"sampling: top_p must be in (0, 1], got {self.top_p}")

    @property
    def policy_temperature(self) -> float:
        """The temperature of the distribution the log-probabilities refer to (1 for greedy decoding)."""
        return self.temperature if self.temperature > 0 else 1.0


@dataclass
class Generation:
    """What :meth:`InferenceEngine.generate` returns for prompts ``[B, P]`` and ``N = max_new_tokens``.

    ``tokens [B, N]`` int64 in ``[0, vocab)``; ``logprobs [B, N]`` fp32 policy log-probabilities of those
    tokens (see the module docstring); ``mask [B, N]`` bool, True for the tokens a row generated (up to
    and including its stop token; after it, ``tokens`` and ``logprobs`` are 0); ``truncated [B]`` bool.
    ``routing``: for each MoE layer (its ``RoutingReplay`` key) the experts ``[B, P + N - 1, k]`` chosen at
    every input position (the prompt and every generated token but the last, which is never fed back); empty
    for a model without MoE. Replaying it (:meth:`replay`) in the training forward over
    ``cat(prompts, tokens)[:, :-1]`` routes every token as the engine did (R3).
    """

    tokens: Tensor
    logprobs: Tensor
    mask: Tensor
    truncated: Tensor
    routing: dict[str, Tensor] = field(default_factory=dict)

    def replay(self, rows: slice | Tensor | None = None) -> RoutingReplay:
        """A replaying ``RoutingReplay`` of the recorded routing (of ``rows`` only, if given)."""
        out = RoutingReplay("replay")
        for key, indices in self.routing.items():
            picked = indices if rows is None else indices[rows]
            out.indices[key] = picked.reshape(-1, picked.shape[-1])
        return out


@runtime_checkable
class InferenceEngine(Protocol):
    """Generates from, and scores with, a copy of the policy's weights.

    - ``generate(prompts [B, P], params) -> Generation``: prompts of equal length (callers group prompts by
      length), token ids in ``[0, vocab_size)``. Rows are independent: a row's tokens and log-probabilities
      do not depend on the other rows. Seeded (see :class:`SamplingParams`). A prompt with
      ``P + max_new_tokens > max_model_len`` raises ``megaseq.errors.UserError`` (one line) before any work.
    - ``score(tokens [B, T], temperature) -> [B, T - 1]``: policy log-probability of ``tokens[:, t + 1]``
      given ``tokens[:, : t + 1]``, fp32. Generated log-probabilities equal the score of the same tokens up
      to the engine's numerics.
    - ``update_weights(weights)``: replace every parameter and persistent buffer with ``weights`` (names of
      the training model's ``state_dict()``, any dtype and device); a missing or unknown name raises
      ``ValueError`` and leaves the engine's weights unchanged. Later calls use the new weights.
    """

    vocab_size: int
    max_model_len: int

    def generate(self, prompts: Tensor, params: SamplingParams) -> Generation: ...

    def score(self, tokens: Tensor, temperature: float = 1.0) -> Tensor: ...

    def update_weights(self, weights: Mapping[str, Tensor]) -> None: ...


def sample(logits: Tensor, params: SamplingParams, generator: torch.Generator) -> Tensor:
    """Next tokens ``[B]`` from fp32 ``logits [B, V]`` (greedy, temperature, top-p; see SamplingParams)."""
    if params.temperature == 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits / params.temperature, dim=-1)
    if params.top_p < 1:
        sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)
        # keep a token if the mass of the tokens strictly more likely than it is still below top_p
        before = sorted_probs.cumsum(-1) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(before >= params.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def policy_logprobs(logits: Tensor, tokens: Tensor, temperature: float) -> Tensor:
    """``log softmax(logits / temperature)`` of ``tokens``: fp32, for logits ``[..., V]`` and tokens ``[...]``."""
    return torch.log_softmax(logits.float() / temperature, dim=-1).gather(-1, tokens[..., None]).squeeze(-1)


def sequence_logprobs(
    model: LanguageModel, tokens: Tensor, ctx: ForwardContext, temperature: float = 1.0, chunk: int = 4096
) -> Tensor:
    """The training forward's policy log-probabilities ``[B, T - 1]`` of ``tokens[:, 1:]`` (fp32).

    One forward over ``tokens[:, :-1]`` (with ``ctx``, e.g. replaying an engine's routing); the LM head
    runs ``chunk`` tokens at a time (recomputed in backward), so ``[T, vocab]`` logits never exist.
    Differentiable when gradients are enabled. Under tensor parallelism (``ctx.tp``) the head is this rank's
    vocabulary block (the vocabulary-parallel cross-entropy); with sequence parallelism the result is this
    rank's chunk of the positions, without it all of them.
    """
    hidden = model(tokens[:, :-1], ctx)
    if temperature != 1.0:
        hidden = hidden / temperature
    return -chunked_token_losses(hidden, model.head_weight, tokens[:, 1:], chunk, ctx.tp, model.dims.vocab_size)


def check_tokens(tokens: Tensor, vocab_size: int, what: str) -> None:
    """One-line ``ValueError`` unless ``tokens`` is an integer tensor of ids in ``[0, vocab_size)``."""
    if tokens.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"{what}: token ids must be int64, got {tokens.dtype}")
    if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab_size):
        raise ValueError(
            f"{what}: token ids must be in [0, {vocab_size}), got min {int(tokens.min())} max {int(tokens.max())}"
        )


__all__ = [
    "Generation",
    "InferenceEngine",
    "SamplingParams",
    "check_tokens",
    "policy_logprobs",
    "sample",
    "sequence_logprobs",
]
