"""Core's built-in components, registered like any plugin: ``sdpa`` attention, the ``swiglu`` FFN, the
``cached`` inference engine and the two DNA excerpts shipped for tests and demos (core's own commands are
the built-in plugin ``megaseq.commands``)."""

from __future__ import annotations

from megaseq.hookspecs import hookimpl
from megaseq.records import AttentionSpec, DataSourceSpec, FFNSpec, InferenceEngineSpec

from .config import CachedEngineConfig, SDPAConfig, SwiGLUConfig


@hookimpl
def megaseq_attention() -> list[AttentionSpec]:
    return [
        AttentionSpec(
            name="sdpa",
            target="megaseq.builtins.sdpa:build",
            config=SDPAConfig,
            summary="causal softmax attention (torch SDPA; flash-attn varlen on CUDA when installed), RoPE optional",
            memory="megaseq.builtins.sdpa:memory_estimate",
            capabilities=frozenset({"context_parallel", "sequence_tiling", "tensor_parallel"}),
        )
    ]


@hookimpl
def megaseq_ffn() -> list[FFNSpec]:
    return [
        FFNSpec(
            name="swiglu",
            target="megaseq.builtins.swiglu:build",
            config=SwiGLUConfig,
            summary="dense SwiGLU feed-forward",
            memory="megaseq.builtins.swiglu:memory_estimate",
            capabilities=frozenset({"tensor_parallel"}),
        )
    ]


@hookimpl
def megaseq_inference_engine() -> list[InferenceEngineSpec]:
    return [
        InferenceEngineSpec(
            name="cached",
            target="megaseq.inference.cached:build",
            config=CachedEngineConfig,
            summary="decodes with the components' own caches (recurrent states, key caches); CPU and CUDA, fp32/bf16",
        )
    ]


@hookimpl
def megaseq_data_source() -> list[DataSourceSpec]:
    return [
        DataSourceSpec(
            name="excerpt-chr20",
            target="megaseq.data.sources:excerpt_chr20",
            summary="300 kb of GRCh37 chr20 (40,000,001-40,300,000) from vt-examples, shipped with megaseq",
            bases=300_000,
            n_bases=0,
        ),
        DataSourceSpec(
            name="excerpt-chrX",
            target="megaseq.data.sources:excerpt_chrx",
            summary="200 kb of GRCh37 chrX (40,000,001-40,200,000) from smalt-examples, shipped with megaseq",
            bases=200_000,
            n_bases=0,
        ),
    ]

