"""megaseq plugin registration of the ``chunked`` MoE strategy and its step hook.

Listing plugins imports this module, so it imports nothing heavy: the layer (torch) is loaded lazily from
the record's target, and the step hook imports it only when it runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from megaseq.hookspecs import hookimpl
from megaseq.records import MoESpec
from megaseq_moe.config import ChunkedMoEConfig

if TYPE_CHECKING:
    import torch

    from megaseq.train.state import StepInfo


@hookimpl
def megaseq_moe() -> list[MoESpec]:
    return [
        MoESpec(
            name="chunked",
            target="megaseq_moe.layer:build",
            config=ChunkedMoEConfig,
            summary="dropless sigmoid-routed SwiGLU experts, processed in token chunks, expert- and tensor-parallel",
            memory="megaseq_moe.layer:memory_estimate",
            capabilities=frozenset({"expert_parallel", "tensor_parallel"}),
            mapping="megaseq_moe.hf:MAPPING",
        )
    ]


@hookimpl
def megaseq_step_end(step: StepInfo, model: torch.nn.Module, metrics: dict[str, float]) -> None:
    """Move each chunked layer's balancing bias by the step's load; add ``moe/...`` load metrics."""
    from megaseq_moe.layer import end_step

    end_step(model, metrics)
