"""Registers the ``recompute`` and ``offload`` memory policies. Light on purpose: no torch, only the records."""

from __future__ import annotations

from megaseq.hookspecs import hookimpl
from megaseq.records import MemoryPolicySpec
from megaseq_offload.config import OffloadConfig, RecomputeConfig

# What `megaseq plan` / train.memory_policy = "auto" may choose from, cheapest first.
RECOMPUTE_PRESETS = (
    {"part": "ffn"},
    {"part": "attention"},
    {"part": "block"},
    *({"part": "block", "tile_tokens": 2**k} for k in (18, 16, 14, 12)),
)


@hookimpl
def megaseq_memory_policy() -> list[MemoryPolicySpec]:
    return [
        MemoryPolicySpec(
            name="recompute",
            target="megaseq_offload.policies:build_recompute",
            config=RecomputeConfig,
            summary="activation recomputation of whole blocks, attention or feed-forward, per layer range; "
            "blocks optionally in sequence tiles",
            memory="megaseq_offload.policies:recompute_effect",
            presets=RECOMPUTE_PRESETS,
            capabilities=frozenset({"context_parallel"}),
        ),
        MemoryPolicySpec(
            name="offload",
            target="megaseq_offload.policies:build_offload",
            config=OffloadConfig,
            summary="saved tensors leave device memory between forward and backward: pinned host pool (CUDA), "
            "scratch file on local disk (CPU)",
            memory="megaseq_offload.policies:offload_effect",
            presets=({},),
            capabilities=frozenset({"context_parallel", "pool_sizing"}),
        ),
    ]
