"""Config schemas of the ``recompute`` and ``offload`` memory policies (kept free of torch: listing plugins
imports them)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from megaseq.records import ComponentConfig


class RecomputeConfig(ComponentConfig):
    part: Literal["block", "attention", "ffn"] = Field(
        "block",
        description="what keeps only its input and is re-run in backward: the whole residual block, the "
        "attention only, or the feed-forward / MoE only",
    )
    layers: tuple[int, int] | None = Field(
        None, description="[first, stop) of the layers to act on, e.g. [0, 2]; default: every layer"
    )
    tile_tokens: int | None = Field(
        None,
        ge=1,
        description="with part = 'block': re-run each block in sequence tiles of this many tokens (its attention "
        "must declare sequence_tiling); default: whole blocks",
    )
    reuse_kept: bool = Field(
        True,
        description="a re-run takes back what a component kept from its forward (ForwardContext.keep: dsa's top-k "
        "selection) instead of computing it again, for those bytes held from forward to backward "
        "(MemoryEstimate.kept_per_token); false: it computes them again",
    )

    @model_validator(mode="after")
    def _consistent(self) -> RecomputeConfig:
        if self.tile_tokens is not None and self.part != "block":
            raise ValueError(f"tile_tokens needs part = 'block' (got part = {self.part!r})")
        if self.layers is not None and not 0 <= self.layers[0] < self.layers[1]:
            raise ValueError(f"layers must be [first, stop) with 0 <= first < stop, got {list(self.layers)}")
        return self


class OffloadConfig(ComponentConfig):
    min_bytes: int = Field(
        2**20, ge=1, description="saved tensors at least this large leave device memory between forward and backward"
    )
    scratch_dir: str | None = Field(
        None,
        description="CPU: directory on a local disk for the scratch file (default: $MEGASEQ_SCRATCH, else the "
        "system temporary directory); not a tmpfs, whose files are memory",
    )
    pool_bytes: int | None = Field(
        None,
        ge=0,
        description="bytes reserved up front (CUDA: the pinned host pool, once, kept across steps; CPU: each step's "
        "scratch file); the planner sets it from its prediction; default: CUDA pins what the first step needed, "
        "CPU grows the file in exact-size pieces",
    )
