"""Config schema of the ``dsa`` attention component (kept free of torch so listing plugins stays cheap).

Defaults are small enough for CPU experiments; GLM-5.3-Flash's values are given in each description.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from megaseq.records import ComponentConfig


class DSAConfig(ComponentConfig):
    n_heads: int = Field(4, ge=1, description="query heads (all share one latent key/value per token)")
    head_dim: int = Field(
        32, ge=1, description="per-head width of the query and value up-projections (GLM 256)"
    )
    q_lora_rank: int = Field(64, ge=1, description="width of the compressed query (GLM 1536)")
    kv_lora_rank: int = Field(32, ge=1, description="width of the shared latent key/value (GLM 512)")
    rope: bool = Field(False, description="decoupled RoPE key/query part as in MLA (GLM: false = NoPE)")
    rope_dim: int = Field(16, ge=2, description="width of the rotary part shared by all heads (with rope)")
    rope_theta: float = Field(10000.0, gt=0)
    index_heads: int = Field(4, ge=1, description="lightning-indexer heads (GLM 32)")
    index_dim: int = Field(64, ge=1, description="lightning-indexer width (GLM 128)")
    topk: int = Field(2048, ge=1, description="keys each query attends to (GLM 2048)")
    index_pool: int = Field(1, ge=1, description="score keys in pooled blocks of this many tokens (GLM 4)")
    index_scores: Literal["fp32", "bf16"] = Field(
        "fp32",
        description="top-k selection's scores: fp32, or bf16 operands then an exact fp32 pass over the best "
        "candidates (faster only where bf16 products are: GPUs, AVX512-BF16/AMX CPUs; megaseq_dsa/ops/indexer.py)",
    )
    mode: Literal["dense_warmup", "sparse"] = Field(
        "sparse",
        description="dense_warmup: dense main attention, indexer learns it by KL; sparse: attend to the top-k only",
    )
    indexer_loss_coef: float = Field(1.0, ge=0, description="weight of the indexer KL loss 'dsa_indexer'")
    freeze_main_in_warmup: bool = Field(
        True, description="dense_warmup: build this layer's non-indexer parameters with requires_grad=False"
    )
    backend: Literal["auto", "torch", "triton", "native"] = Field(
        "auto",
        description="auto: triton on CUDA when importable, native (C kernels built on first use) on CPU where a C "
        "compiler builds them, else torch (megaseq_dsa/backends.py)",
    )
    query_chunk: int | None = Field(
        None,
        ge=1,
        description="queries per chunk in selection, attention and the indexer loss; default: by memory",
    )

    @model_validator(mode="after")
    def _consistent(self) -> DSAConfig:
        if self.index_pool > self.topk:
            raise ValueError(f"index_pool ({self.index_pool}) must not exceed topk ({self.topk})")
        if self.rope and self.rope_dim % 2:
            raise ValueError(f"rope_dim must be even with rope = true, got {self.rope_dim}")
        if self.backend == "triton" and self.index_scores == "bf16":  # a requested backend is what runs
            raise ValueError("index_scores = 'bf16' has no triton kernel (it scores in fp32): use backend = 'auto' "
                             "or 'torch', or index_scores = 'fp32'")
        return self
