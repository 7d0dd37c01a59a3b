"""``MegaseqConfig``: the Hugging Face config class of a megaseq model directory (``model_type = "megaseq"``).

vLLM reads every model directory's ``config.json`` through transformers' ``AutoConfig``, which knows a
``model_type`` only once a config class is registered for it (:func:`megaseq_rl.vllm.register.register`
does so in every process vLLM starts). The class holds the sizes vLLM reads itself and the megaseq recipe
(``megaseq_recipe``) from which ``MegaseqForCausalLM`` builds the model; it has no weights of its own.
"""

from __future__ import annotations

from typing import Any

from transformers import PretrainedConfig

from megaseq_rl.vllm.translate import MODEL_TYPE


class MegaseqConfig(PretrainedConfig):
    model_type = MODEL_TYPE

    def __init__(
        self,
        vocab_size: int = 5,
        hidden_size: int = 32,
        num_hidden_layers: int = 1,
        max_position_embeddings: int = 2048,
        megaseq_recipe: dict[str, Any] | None = None,
        tie_word_embeddings: bool = False,
        **kwargs: Any,
    ) -> None:
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.max_position_embeddings = max_position_embeddings
        self.megaseq_recipe = megaseq_recipe or {}
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)
