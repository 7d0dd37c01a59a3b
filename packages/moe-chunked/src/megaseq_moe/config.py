"""Config schema of the ``chunked`` MoE strategy (kept light: listing plugins imports it)."""

from __future__ import annotations

from pydantic import Field, model_validator

from megaseq.records import ComponentConfig


class ChunkedMoEConfig(ComponentConfig):
    """One MoE layer: sigmoid-routed SwiGLU experts, shared experts, tokens processed in chunks."""

    n_experts: int = Field(ge=1, description="routed experts in the layer")
    top_k: int = Field(ge=1, description="routed experts per token")
    expert_hidden: int = Field(ge=1, description="hidden width of each routed expert's SwiGLU")
    n_shared_experts: int = Field(1, ge=0, description="always-on experts, fused into one SwiGLU")
    shared_hidden: int | None = Field(
        None, ge=1, description="hidden width per shared expert (None: expert_hidden)"
    )
    routed_scaling_factor: float = Field(1.0, gt=0, description="multiplies the normalised routing weights")
    swiglu_limit: float | None = Field(None, gt=0, description="clamp of the SwiGLU gate/up pre-activations")
    bias_update_rate: float = Field(
        1e-3, ge=0, description="step of the load-balancing bias per step (0: frozen)"
    )
    aux_loss_coef: float = Field(0.0, ge=0, description="weight of the sequence-level balance loss (0: off)")
    chunk_tokens: int | None = Field(
        4096, ge=1, description="tokens per chunk, forward and backward (None: all)"
    )
    init_std: float = Field(0.02, gt=0, description="std of the normal init of every weight")

    @model_validator(mode="after")
    def _top_k_fits(self) -> ChunkedMoEConfig:
        if self.top_k > self.n_experts:
            raise ValueError(f"top_k ({self.top_k}) must be <= n_experts ({self.n_experts})")
        return self

    @property
    def shared_width(self) -> int:
        """Hidden width of the fused shared expert (0 when there is none)."""
        return self.n_shared_experts * (self.shared_hidden or self.expert_hidden)
