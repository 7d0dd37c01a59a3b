"""Config schemas of the built-in components (kept free of torch so listing plugins stays cheap)."""

from __future__ import annotations

from pydantic import Field

from megaseq.records import ComponentConfig


class SDPAConfig(ComponentConfig):
    n_heads: int = Field(4, ge=1)
    head_dim: int | None = Field(None, ge=2, description="default: d_model // n_heads")
    rope: bool = Field(True, description="rotary position embedding (off = NoPE, as GLM's global layers)")
    rope_theta: float = Field(10000.0, gt=0)


class SwiGLUConfig(ComponentConfig):
    hidden: int | None = Field(None, ge=1, description="default: 8/3 * d_model rounded up to a multiple of 64")
