"""Test helper: a KDA layer built from a config dict with a fixed seed."""

from __future__ import annotations

from typing import Any

import torch

from megaseq.records import ModelDims
from megaseq_kda.config import KDAConfig
from megaseq_kda.layer import KimiDeltaAttention, build


def build_layer(config: dict[str, Any], d_model: int, seed: int = 0) -> KimiDeltaAttention:
    torch.manual_seed(seed)
    return build(KDAConfig(**config), ModelDims(d_model=d_model, n_layers=2, vocab_size=8), 0)
