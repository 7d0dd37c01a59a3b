"""A megaseq model as a vLLM model directory: config translation and weight-name mapping.

vLLM builds ``MegaseqForCausalLM`` (``megaseq_rl.vllm.model``) from ``config.json``: ``architectures``,
``model_type = "megaseq"``, the sizes vLLM reads itself (``vocab_size``, ``hidden_size``,
``num_hidden_layers``, ``max_position_embeddings``, ``torch_dtype``, ``tie_word_embeddings``) and the
megaseq recipe (``megaseq_recipe``), from which the model class builds megaseq's own components through the
installed plugins. Weights: the vLLM model holds the megaseq ``LanguageModel`` as ``model``, so a megaseq
name ``n`` is ``model.n`` in vLLM; a tied LM head has no weight of its own.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from torch import Tensor

ARCHITECTURE = "MegaseqForCausalLM"
MODEL_TYPE = "megaseq"
PREFIX = "model."
TORCH_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


def vllm_config(recipe: dict[str, Any], dtype: str, max_model_len: int) -> dict[str, Any]:
    """``config.json`` of the vLLM model directory for a megaseq recipe (``Recipe.to_dict()``)."""
    model = recipe["model"]
    return {
        "architectures": [ARCHITECTURE],
        "model_type": MODEL_TYPE,
        "vocab_size": model["vocab_size"],
        "hidden_size": model["d_model"],
        "num_hidden_layers": model["n_layers"],
        "max_position_embeddings": max_model_len,
        "tie_word_embeddings": model["tie_embeddings"],
        "torch_dtype": TORCH_DTYPES[dtype],
        "megaseq_recipe": recipe,
    }


def recipe_from_config(config: Mapping[str, Any]) -> dict[str, Any]:
    if config.get("model_type") != MODEL_TYPE or "megaseq_recipe" not in config:
        raise ValueError(f"not a megaseq model config (model_type {config.get('model_type')!r}, expected {MODEL_TYPE!r})")
    return dict(config["megaseq_recipe"])


def to_vllm_names(weights: Mapping[str, Tensor]) -> Iterator[tuple[str, Tensor]]:
    for name, value in weights.items():
        yield PREFIX + name, value


def from_vllm_names(weights: Iterable[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
    for name, value in weights:
        if not name.startswith(PREFIX):
            raise ValueError(f"weight {name!r} is not a megaseq weight (expected the prefix {PREFIX!r})")
        yield name[len(PREFIX) :], value


def export_model_dir(weights: Mapping[str, Tensor], recipe: dict[str, Any], path: Path, dtype: str, max_model_len: int) -> Path:
    """Write ``config.json`` and ``model.safetensors`` (vLLM names, contiguous CPU tensors) into ``path``."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(vllm_config(recipe, dtype, max_model_len), indent=2))
    tensors = {name: value.detach().cpu().contiguous() for name, value in to_vllm_names(weights)}
    save_file(tensors, str(path / "model.safetensors"))
    return path
