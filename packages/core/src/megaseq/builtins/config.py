"""Config schemas of the built-in components (kept free of torch so listing plugins stays cheap)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from megaseq.records import ComponentConfig


class SDPAConfig(ComponentConfig):
    n_heads: int = Field(4, ge=1)
    head_dim: int | None = Field(None, ge=2, description="default: d_model // n_heads")
    rope: bool = Field(True, description="rotary position embedding (off = NoPE, as GLM's global layers)")
    rope_theta: float = Field(10000.0, gt=0)


class SwiGLUConfig(ComponentConfig):
    hidden: int | None = Field(None, ge=1, description="default: 8/3 * d_model rounded up to a multiple of 64")


class CachedEngineConfig(ComponentConfig):
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto = cuda when available")
    dtype: Literal["fp32", "bf16"] = Field("fp32", description="weights, activations and caches (logits in fp32)")
    max_model_len: int = Field(1_048_576, ge=2, description="longest prompt + max_new_tokens accepted")
    loss_chunk: int = Field(4096, ge=1, description="tokens per chunk of the LM head when scoring")
