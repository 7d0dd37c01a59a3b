"""The ``vllm.general_plugins`` entry point: vLLM calls :func:`register` in every process it starts (the engine
core, each worker), before it reads a model directory.

Two registrations, both needed to serve a megaseq model directory: transformers' ``AutoConfig`` learns the
``model_type`` ``"megaseq"`` (``MegaseqConfig``), without which vLLM cannot parse ``config.json``; vLLM's
``ModelRegistry`` learns the architecture ``MegaseqForCausalLM``, by its import path, so that vLLM imports
``megaseq_rl.vllm.model`` only when it serves such a directory.
"""

from __future__ import annotations

from megaseq_rl.vllm.translate import ARCHITECTURE, MODEL_TYPE

MODEL_CLASS = "megaseq_rl.vllm.model:MegaseqForCausalLM"


def register() -> None:
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from vllm import ModelRegistry

    from megaseq_rl.vllm.hf_config import MegaseqConfig

    if MODEL_TYPE not in CONFIG_MAPPING:
        AutoConfig.register(MODEL_TYPE, MegaseqConfig)
    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, MODEL_CLASS)
