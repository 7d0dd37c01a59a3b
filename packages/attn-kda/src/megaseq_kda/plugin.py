"""Registers the ``kda`` attention component and the Hugging Face layouts of the KDA model families (``kda``:
fla's, ``kimi_linear``: Kimi-Linear's). Light on purpose: no torch, no kernels, only the records."""

from __future__ import annotations

from megaseq.hookspecs import hookimpl
from megaseq.records import AttentionSpec, HFLayoutSpec
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


@hookimpl
def megaseq_hf_layout() -> list[HFLayoutSpec]:
    return [
        HFLayoutSpec(
            name="kda", target="megaseq_kda.hf_layouts:FLA", model_type="kda", default=True,
            summary="flash-linear-attention's KDAForCausalLM: kda layers, softmax layers (sdpa), SwiGLU MLPs",
        ),
        HFLayoutSpec(
            name="kimi_linear", target="megaseq_kda.hf_layouts:KIMI_LINEAR", model_type="kimi_linear",
            summary="Kimi-Linear's KimiLinearForCausalLM: kda layers, dense SwiGLU MLPs, then the chunked MoE",
        ),
    ]
