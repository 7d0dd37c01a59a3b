"""Config schema of the ``kda`` attention component (kept free of torch so listing plugins stays cheap)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from megaseq.records import ComponentConfig


class KDAConfig(ComponentConfig):
    n_heads: int = Field(4, ge=1)
    head_dim: int = Field(64, ge=1, description="key and value width per head (K = V)")
    conv_size: int = Field(4, ge=2, description="kernel of the causal depthwise convolution on q, k, v")
    gate: Literal["bounded", "softplus"] = Field(
        "bounded",
        description="forget gate: lower_bound * sigmoid(exp(A) (f + b)) (GLM-5.3-Flash) "
        "or -exp(A) softplus(f + b)",
    )
    gate_lower_bound: float = Field(-5.0, lt=0, description="smallest log-decay of the bounded gate")
    gate_rank: int | None = Field(None, ge=1, description="rank of the gate projections; default: head_dim")
    norm_eps: float = Field(1e-5, gt=0, description="epsilon of the per-head output RMSNorm")
    out_gate_bias: bool = Field(False, description="a bias on the output gate's up-projection (fla's layout has one)")
    backend: Literal["auto", "chunk", "naive", "triton", "fla", "native"] = Field(
        "auto",
        description="auto: triton on CUDA if installed, else fla on CUDA if installed, else native (chunk with C "
        "kernels built on first use) on CPU where a C compiler builds them, else chunk (PyTorch)",
    )
