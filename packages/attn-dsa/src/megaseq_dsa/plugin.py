"""Registers the ``dsa`` attention component. Light on purpose: no torch, no kernels, only the record."""

from __future__ import annotations

from megaseq.hookspecs import hookimpl
from megaseq.records import AttentionSpec
from megaseq_dsa.config import DSAConfig


@hookimpl
def megaseq_attention() -> list[AttentionSpec]:
    return [
        AttentionSpec(
            name="dsa",
            target="megaseq_dsa.layer:build",
            config=DSAConfig,
            summary="DeepSeek Sparse Attention: MLA (MQA over one latent per token) attending to the lightning "
            "indexer's top-k keys; dense warm-up and sparse training, packing, decoding, context and tensor parallelism",
            memory="megaseq_dsa.layer:memory_estimate",
            capabilities=frozenset({"context_parallel", "sequence_tiling", "tensor_parallel"}),
        )
    ]
