"""Core's built-in components, registered like any plugin: ``sdpa`` attention and the ``swiglu`` FFN."""

from __future__ import annotations

from megaseq.hookspecs import hookimpl
from megaseq.records import AttentionSpec, FFNSpec

from .config import SDPAConfig, SwiGLUConfig


@hookimpl
def megaseq_attention() -> list[AttentionSpec]:
    return [
        AttentionSpec(
            name="sdpa",
            target="megaseq.builtins.sdpa:build",
            config=SDPAConfig,
            summary="causal softmax attention (torch SDPA; flash-attn varlen on CUDA when installed), RoPE optional",
            memory="megaseq.builtins.sdpa:memory_estimate",
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
        )
    ]
