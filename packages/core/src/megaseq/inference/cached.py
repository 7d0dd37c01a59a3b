"""The ``cached`` inference engine: decoding with the components' own caches (recurrent states, key caches).

generate: one prefill forward over the prompts ``[B, P]`` with fresh caches (``LanguageModel.init_caches``),
then one forward per new token, each over the ``[B, 1]`` tokens just drawn; every forward records the MoE
routing it used (``RoutingReplay("record")``), and the records are concatenated along time. Only the last
position's hidden state goes through the LM head. The attention contract (decoding equals the full forward)
makes the log-probabilities equal the training forward's up to floating-point order; how close they are
is what an RL plugin measures before trusting the engine's log-probabilities.

Sharded: built inside a launched worker with its ``Parallel`` (the process groups of a layout, as training
creates them: ``megaseq.distributed.groups.init_process_groups``), the engine holds only this rank's shards
of the model (``megaseq.distributed.experts.build_local_model``: the same initial weights as one process, or
its blocks of a checkpoint of any layout, read by slices), never gathering experts or tensor-parallel blocks.
Tensor parallelism runs without sequence parallelism (a step of one token cannot be split along the sequence;
``megaseq.contracts.TensorParallel``): every tensor-parallel rank holds the whole short sequence, its heads'
caches, and computes its vocabulary block's logits of the last position, gathered over the group (``[B, V]``,
not the head). The rows of a batch are split over the data-parallel ranks (padded with copies of the last row
to a multiple of ``dp``); each step gathers the rows' logits, so that every rank samples the same tokens from
the whole batch with the same generator as one process does, and every rank runs the same number of steps
(``max_new_tokens``, whatever the stop tokens), as the MoE's expert-parallel dispatch needs. Context
parallelism is refused (one line): a decoding step holds one token per sequence.

Numerics: ``dtype = "fp32"`` keeps the model in fp32; ``"bf16"`` casts weights, activations and caches
to bf16 (as a serving engine would; components keep their own fp32 islands, e.g. a recurrent state), while
logits are taken to fp32 before the softmax. Memory: the caches (O(P + N) per layer that caches keys, O(1)
per recurrent layer) and one prefill forward.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from megaseq.builtins.config import CachedEngineConfig
from megaseq.capabilities import check_components
from megaseq.config import Recipe
from megaseq.contracts import ForwardContext, RoutingReplay
from megaseq.devices import pick_device
from megaseq.distributed.experts import (
    build_rank_model,
)
from megaseq.distributed.groups import Parallel
from megaseq.distributed.layout import Layout, LayoutError, check_expert_layout
from megaseq.errors import UserError
from megaseq.inference import Generation, SamplingParams, check_tokens, policy_logprobs, sample, sequence_logprobs
from megaseq.parallel import collectives
from megaseq.plugins import Plugins

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def check_decoding_layout(recipe: Recipe, plugins: Plugins, layout: Layout) -> None:
    """The layouts the engine runs (one-line errors, before any worker starts): no context parallelism, expert
    groups that the workers can form, and components that declare what the layout asks of them."""
    if layout.cp > 1:
        raise LayoutError(f"{recipe.source}: parallel ({layout}): the cached engine decodes without context "
                          f"parallelism (a decoding step holds one token per sequence); use cp=1")
    check_expert_layout(recipe, layout)
    check_components(recipe, plugins, layout, policies=[])


class CachedEngine:
    """Implements ``megaseq.inference.InferenceEngine`` on a private copy of the model, or (``parallel``: this
    worker's process groups, see :func:`sharded_engine`) on this rank's shards of it; then every rank is handed
    the same calls (prompts, params, weights) and returns the same whole results. ``checkpoint``: a run
    directory or checkpoint whose weights to decode with (of any layout), instead of the recipe's initial
    weights."""

    def __init__(
        self, config: CachedEngineConfig, recipe: Recipe, plugins: Plugins, parallel: Parallel | None = None,
        checkpoint: Path | None = None,
    ) -> None:
        from megaseq.distributed.sharded import read_local_weights
        from megaseq.train import checkpoint as checkpoints

        self.config = config
        self.device = pick_device(config.device)
        self.dtype = DTYPES[config.dtype]
        self.parallel = p = parallel or Parallel()
        layout = p.layout
        check_decoding_layout(recipe, plugins, layout)
        rank = build_rank_model(recipe, plugins, self.device, p)
        model = rank.model
        self.placement = rank.placement(p)
        if checkpoint is not None:
            found = checkpoints.resolve(checkpoint)
            checkpoints.load_weights(found, model, read_local_weights(found, checkpoints.read_meta(found), self.placement))
        self.model = model.to(self.device, self.dtype).eval()
        self.model.requires_grad_(False)
        self.vocab_size = recipe.model.vocab_size
        self.max_model_len = config.max_model_len
        groups = p.forward_context(0, sequence_parallel=False)
        self._groups: dict[str, Any] = {"ep_group": groups.ep_group, "tp": groups.tp, "etp_group": groups.etp_group}

    def _context(self, routing: RoutingReplay | None = None) -> ForwardContext:
        return ForwardContext(routing=routing, **self._groups)

    def _rows(self, batch: int) -> Tensor:
        """This rank's rows of a batch of ``batch``: its contiguous share over the data-parallel ranks of the batch
        padded to a multiple of ``dp`` (padding rows repeat the last row)."""
        dp, rank = self.parallel.layout.dp, self.parallel.dp_rank
        per = -(-batch // dp)
        return torch.arange(rank * per, (rank + 1) * per).clamp_max(batch - 1)

    def _all_rows(self, local: Tensor, batch: int) -> Tensor:
        """Every rank's rows of ``local`` (this rank's, :meth:`_rows`) in batch order, the padding dropped."""
        if self.parallel.layout.dp == 1:
            return local[:batch]
        return torch.cat(collectives.all_gather_tensor(local, self.parallel.tp_data_group))[:batch]

    def update_weights(self, weights: Mapping[str, Tensor]) -> None:
        """``weights``: the whole model's (its ``state_dict`` names); a sharded engine keeps its blocks of them."""
        own = self.model.state_dict()
        missing, unknown = sorted(set(own) - set(weights)), sorted(set(weights) - set(own))
        if missing or unknown:
            raise ValueError(f"cached engine: weights do not match the model (missing {missing[:3]}, unknown {unknown[:3]})")
        from megaseq.distributed.sharded import local_part

        try:
            weights = local_part(weights, self.placement)
        except ValueError as exc:
            raise ValueError(f"cached engine: {exc}") from None
        with torch.no_grad():
            for name, value in own.items():
                if value.shape != weights[name].shape:
                    raise ValueError(f"cached engine: {name} has shape {tuple(weights[name].shape)}, expected {tuple(value.shape)}")
            for name, value in own.items():
                value.copy_(weights[name])

    @torch.no_grad()
    def score(self, tokens: Tensor, temperature: float = 1.0) -> Tensor:
        check_tokens(tokens, self.vocab_size, "cached engine: score")
        batch = tokens.shape[0]
        local = tokens[self._rows(batch)].to(self.device)
        scored = sequence_logprobs(self.model, local, self._context(), temperature, self.config.loss_chunk)
        return self._all_rows(scored, batch)

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
        rows = self._rows(batch).to(self.device)
        caches = self.model.init_caches(len(rows), device=self.device, dtype=self.dtype)
        temperature = params.policy_temperature
        tokens, logprobs, records = [], [], []
        alive = torch.ones(batch, dtype=torch.bool, device=self.device)
        masks = []
        x = prompts.to(self.device)[rows]
        for step in range(params.max_new_tokens):  # every rank runs every step: the MoE dispatch needs them all
            routing = RoutingReplay("record")
            hidden = self.model(x, self._context(routing), caches)[:, -1]
            records.append({key: idx.view(len(rows), x.shape[1], -1) for key, idx in routing.indices.items()})
            logits = self._all_rows(self.model.logits(hidden, self._groups["tp"]).float(), batch)
            token = sample(logits, params, generator)  # the whole batch's, the same on every rank
            masks.append(alive.clone())
            tokens.append(torch.where(alive, token, 0))
            logprobs.append(torch.where(alive, policy_logprobs(logits, token, temperature), 0.0))
            if params.stop_token is not None:
                alive &= token != params.stop_token
            if step + 1 < params.max_new_tokens:  # the last token is returned, never fed back
                x = token[rows, None]
        routing_out = {key: self._all_rows(torch.cat([r[key] for r in records], dim=1), batch) for key in records[0]}
        return Generation(
            tokens=torch.stack(tokens, 1),
            logprobs=torch.stack(logprobs, 1),
            mask=torch.stack(masks, 1),
            truncated=alive if params.stop_token is not None else torch.zeros_like(alive),
            routing=routing_out,
        )


@contextmanager
def sharded_engine(
    config: CachedEngineConfig, recipe: Recipe, plugins: Plugins, layout: Layout, checkpoint: Path | None = None
) -> Iterator[CachedEngine]:
    """Inside a launched worker (``torch.distributed`` initialised by Ray Train, torchrun or
    ``megaseq_testkit.distributed.run_gloo``, as for training): ``layout``'s process groups, created as training
    creates them (``init_process_groups``), and this rank's engine on them; the groups end with the block."""
    from megaseq.distributed.groups import destroy_process_groups, init_process_groups

    check_decoding_layout(recipe, plugins, layout)
    parallel = init_process_groups(layout)
    try:
        yield CachedEngine(config, recipe, plugins, parallel, checkpoint)
    finally:
        destroy_process_groups()


def build(config: CachedEngineConfig, recipe: Recipe, plugins: Plugins) -> CachedEngine:
    return CachedEngine(config, recipe, plugins)
