"""The ``vllm.general_plugins`` entry point: vLLM calls :func:`register` in every process it starts.

Registration is by import path, so vLLM imports ``megaseq_rl.vllm.model`` (and CUDA) only when it serves a
megaseq model directory.
"""

from __future__ import annotations

from megaseq_rl.vllm.translate import ARCHITECTURE

MODEL_CLASS = "megaseq_rl.vllm.model:MegaseqForCausalLM"


def register() -> None:
    from vllm import ModelRegistry

    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, MODEL_CLASS)
