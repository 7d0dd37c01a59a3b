"""Rollout engines: one engine in this process, or several as Ray actors when the run is distributed.

``sampling.rollout_workers = 1`` (the default) builds the recipe's engine here. With ``N > 1`` each of N Ray
actors builds the same engine in its own process (from the policy's recipe, through its installed plugins);
:class:`RayEngines` then implements ``megaseq.inference.InferenceEngine`` by splitting prompts by rows over
the actors (actor i samples with ``seed + i``, so tokens depend on N), and weights reach every actor through
one object-store copy. Ray is an optional extra (``megaseq-rl[ray]``); the actors run on the machine of the
rank that draws the rollouts (rank 0; ``megaseq_rl.loop``).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from megaseq.config import Recipe, validate_recipe
from megaseq.errors import UserError
from megaseq.inference import Generation, InferenceEngine, SamplingParams
from megaseq.plugins import Plugins, get_plugins
from megaseq.records import ComponentConfig


def cat_generations(parts: list[Generation]) -> Generation:
    """Rows of several generations (same ``max_new_tokens`` and prompt length), in order."""
    return Generation(
        tokens=torch.cat([p.tokens for p in parts]),
        logprobs=torch.cat([p.logprobs for p in parts]),
        mask=torch.cat([p.mask for p in parts]),
        truncated=torch.cat([p.truncated for p in parts]),
        routing={key: torch.cat([p.routing[key] for p in parts]) for key in parts[0].routing},
    )


def select_rows(gen: Generation, rows: Tensor) -> Generation:
    return Generation(
        tokens=gen.tokens[rows],
        logprobs=gen.logprobs[rows],
        mask=gen.mask[rows],
        truncated=gen.truncated[rows],
        routing={key: value[rows] for key, value in gen.routing.items()},
    )


def build_engine(name: str, config: ComponentConfig, recipe: Recipe, plugins: Plugins, workers: int = 1) -> InferenceEngine:
    if workers == 1:
        return plugins.get("inference_engine", name).load()(config, recipe, plugins)
    return RayEngines(name, config, recipe, workers)


class EngineActor:
    """One engine in a Ray worker process, built from plain data (names, dicts)."""

    def __init__(self, name: str, config: dict[str, Any], recipe: dict[str, Any]) -> None:
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        plugins = get_plugins()
        provided = plugins.get("inference_engine", name)
        self.engine = provided.load()(provided.spec.config(**config), validate_recipe(recipe, plugins), plugins)

    def limits(self) -> tuple[int, int]:
        return self.engine.vocab_size, self.engine.max_model_len

    def generate(self, prompts: Tensor, params: SamplingParams) -> Generation:
        out = self.engine.generate(prompts, params)
        routing = {key: value.cpu() for key, value in out.routing.items()}
        return Generation(out.tokens.cpu(), out.logprobs.cpu(), out.mask.cpu(), out.truncated.cpu(), routing)

    def score(self, tokens: Tensor, temperature: float) -> Tensor:
        return self.engine.score(tokens, temperature).cpu()

    def update_weights(self, weights: Mapping[str, Tensor]) -> None:
        self.engine.update_weights(weights)


class RayEngines:
    """``InferenceEngine`` over ``workers`` Ray actors (see the module docstring)."""

    def __init__(self, name: str, config: ComponentConfig, recipe: Recipe, workers: int) -> None:
        try:
            import ray
        except ImportError:
            raise UserError(
                f"sampling.rollout_workers = {workers} runs engines as Ray actors, but Ray is not installed: "
                "pip install 'megaseq-rl[ray]' (or set rollout_workers = 1)"
            ) from None
        self.ray = ray
        if not ray.is_initialized():
            # declare at least one logical CPU per actor: more actors than CPUs would otherwise wait forever
            ray.init(num_cpus=max(workers, os.cpu_count() or 1), include_dashboard=False, log_to_driver=False)
        actor = ray.remote(num_cpus=1, runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})(EngineActor)
        self.actors = [actor.remote(name, config.model_dump(), recipe.to_dict()) for _ in range(workers)]
        self.vocab_size, self.max_model_len = ray.get(self.actors[0].limits.remote())

    def _split(self, rows: Tensor) -> list[tuple[Any, Tensor, int]]:
        parts = rows.tensor_split(len(self.actors))
        return [(actor, part, i) for i, (actor, part) in enumerate(zip(self.actors, parts, strict=True)) if len(part)]

    def generate(self, prompts: Tensor, params: SamplingParams) -> Generation:
        futures = [a.generate.remote(p, dataclasses.replace(params, seed=params.seed + i)) for a, p, i in self._split(prompts)]
        return cat_generations(self.ray.get(futures))

    def score(self, tokens: Tensor, temperature: float = 1.0) -> Tensor:
        return torch.cat(self.ray.get([a.score.remote(p, temperature) for a, p, _ in self._split(tokens)]))

    def update_weights(self, weights: Mapping[str, Tensor]) -> None:
        ref = self.ray.put({name: value.detach().cpu() for name, value in weights.items()})
        self.ray.get([a.update_weights.remote(ref) for a in self.actors])
