"""Config schema of the ``sliding-window`` attention: ``[attention.sliding-window]`` in a recipe."""

from __future__ import annotations

from pydantic import Field

from megaseq.records import ComponentConfig


class SlidingWindowConfig(ComponentConfig):
    n_heads: int = Field(4, ge=1, description="attention heads; d_model must be a multiple of it")
    window: int = Field(256, ge=1, description="keys each query sees, itself included")
    rope: bool = Field(True, description="rotary position embedding (positions counted from the document start)")
    rope_base: float = Field(10000.0, gt=0, description="RoPE frequency base")
    block_size: int | None = Field(
        None,
        ge=1,
        description="queries per block; default min(max(window, 64), 512). Memory is O(T * (window + block))",
    )
