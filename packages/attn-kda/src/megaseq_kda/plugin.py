"""Registers the ``kda`` attention component. Light on purpose: no torch, no kernels, only the record."""

from __future__ import annotations

from megaseq.hookspecs import hookimpl
from megaseq.records import AttentionSpec
from megaseq_kda.config import KDAConfig


@hookimpl
def megaseq_attention() -> list[AttentionSpec]:
    return [
        AttentionSpec(
            name="kda",
            target="megaseq_kda.layer:build",
            config=KDAConfig,
            summary="Kimi Delta Attention: gated delta-rule linear attention, O(T) memory; packing, "
            "decoding, exact context parallelism and tensor parallelism over heads",
            memory="megaseq_kda.layer:memory_estimate",
            capabilities=frozenset({"context_parallel", "sequence_tiling", "tensor_parallel"}),
            mapping="megaseq_kda.hf:MAPPING",
        )
    ]
