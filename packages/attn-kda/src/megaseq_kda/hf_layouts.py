"""The published model layouts of the KDA model families (``megaseq.interop.layouts.Layout``), registered by
this package's plugin (``megaseq_hf_layout``): ``megaseq import`` reads them, ``megaseq export --layout NAME``
writes them.

``kda``: flash-linear-attention's KDA model family (``fla.models.KDAConfig``, ``KDAForCausalLM``): KDA layers
with a SwiGLU MLP, and optional softmax attention layers (``config.attn.layers``), which map to core's
``sdpa``. The default layout of ``megaseq export``.

``kimi_linear``: Kimi-Linear's published checkpoints (``KimiLinearForCausalLM``): KDA layers
(``linear_attn_config.kda_layers``, numbered from 1), MLA layers (the others), a dense SwiGLU MLP in the first
``first_k_dense_replace`` layers and a mixture of experts with a shared expert after them, which maps to the
MoE component ``chunked`` (a recipe name: that component and its mapping are its own package's). These names
and shapes follow its published config and tensor names. ``KimiLinearForCausalLM`` never ties its head to
the embedding, whatever ``tie_word_embeddings`` says: a tied model is exported with ``lm_head.weight`` written
out (a copy of the embedding), and ``tie_word_embeddings`` stays true so that import gives the tied model back.

Both layouts carry the mappings of core's ``sdpa`` and ``swiglu`` in them (``megaseq_kda.hf_sdpa_swiglu``);
``kda`` maps itself (``megaseq_kda.hf``, its record's ``mapping``).
"""

from __future__ import annotations

from typing import Any

from megaseq.interop import InteropError, require
from megaseq.interop.layouts import Layer, Layout
from megaseq_kda.hf_sdpa_swiglu import SDPA, SWIGLU

MOE = "chunked"  # the MoE component Kimi-Linear's expert layers are, by its recipe name


def _fla_layers(hf: dict[str, Any], source: str) -> list[Layer]:
    for key, allowed, what in (
        ("attnres_block_size", (None,), "attention residuals"),
        ("use_l2warp", (False,), "the L2-warp loss"),
    ):
        require(hf, key, allowed, what, source)
    specs = hf.get("attn") or []
    softmax = {i for spec in ([specs] if isinstance(specs, dict) else specs) for i in spec.get("layers", [])}
    out_of_range = sorted(i for i in softmax if not 0 <= i < hf["num_hidden_layers"])
    if out_of_range:
        raise InteropError(f"{source}: attn.layers names layer {out_of_range[0]}, the model has {hf['num_hidden_layers']}")
    return [
        Layer("sdpa" if i in softmax else "kda", "attn.", "ffn", "swiglu", "mlp.") for i in range(hf["num_hidden_layers"])
    ]


def _kimi_layers(hf: dict[str, Any], source: str) -> list[Layer]:
    linear = hf.get("linear_attn_config") or {}
    kda_layers = set(linear.get("kda_layers", []))  # numbered from 1 in Kimi-Linear's config
    require(hf, "moe_layer_freq", (1,), "MoE in every layer after the dense ones", source)
    dense = int(hf.get("first_k_dense_replace", 0))
    experts = hf.get("num_experts")
    layers = []
    for i in range(hf["num_hidden_layers"]):
        if i + 1 not in kda_layers:
            raise InteropError(
                f"{source}: layer {i} is an MLA layer (not in linear_attn_config.kda_layers): megaseq's dsa cannot "
                "express Kimi-Linear's MLA exactly (its query is not compressed, q_lora_rank = null, and its key "
                "has a separate rotary part) and megaseq has no MLA attention; only all-KDA models import"
            )
        moe = bool(experts) and i >= dense
        # transformers' save_pretrained names every layer's MLP block_sparse_moe, the dense ones too
        layers.append(Layer("kda", "self_attn.", "moe" if moe else "ffn", MOE if moe else "swiglu",
                            "block_sparse_moe." if moe else "mlp.", () if moe else ("block_sparse_moe.",)))
    # transformers' KimiLinearConfig writes the layer kinds out too, and its model follows them
    for key, ours in (
        ("layer_types", ["linear_attention"] * len(layers)),
        ("mlp_layer_types", ["sparse" if layer.ffn_kind == "moe" else "dense" for layer in layers]),
    ):
        theirs = hf.get(key)
        if theirs is not None and list(theirs) != ours:
            raise InteropError(
                f"{source}: {key} = {theirs} disagrees with linear_attn_config.kda_layers, first_k_dense_replace "
                f"and num_experts, which describe {ours}"
            )
    return layers


def _fla_place(hf: dict[str, Any], attention: list[str], ffn: list[tuple[str, str]]) -> None:
    """Which layers are softmax attention (``attn.layers``); everything else ``layers`` checks."""
    softmax = [i for i, name in enumerate(attention) if name == "sdpa"]
    if softmax:
        hf["attn"] = {**hf.get("attn", {}), "layers": softmax}


def _kimi_place(hf: dict[str, Any], attention: list[str], ffn: list[tuple[str, str]]) -> None:
    linear = hf.setdefault("linear_attn_config", {})
    linear["kda_layers"] = [i + 1 for i, name in enumerate(attention) if name == "kda"]
    linear["full_attn_layers"] = [i + 1 for i, name in enumerate(attention) if name != "kda"]
    moe = [i for i, (kind, _) in enumerate(ffn) if kind == "moe"]
    hf["first_k_dense_replace"] = moe[0] if moe else len(ffn)
    hf["moe_layer_freq"] = 1


FLA = Layout(
    architecture="KDAForCausalLM", embed="model.embeddings.weight", final_norm="model.norm.weight",
    head="lm_head.weight", layer_prefix="model.layers.{}.", attn_norm="attn_norm.weight", ffn_norm="mlp_norm.weight",
    eps_key="norm_eps", hidden_act=("swish", "silu"), ties_head=True, layers=_fla_layers, place=_fla_place,
    mappings={("attention", "sdpa"): SDPA, ("ffn", "swiglu"): SWIGLU},
)

KIMI_LINEAR = Layout(
    architecture="KimiLinearForCausalLM", embed="model.embed_tokens.weight", final_norm="model.norm.weight",
    head="lm_head.weight", layer_prefix="model.layers.{}.", attn_norm="input_layernorm.weight",
    ffn_norm="post_attention_layernorm.weight", eps_key="rms_norm_eps", hidden_act=("silu", "swish"), ties_head=False,
    layers=_kimi_layers, place=_kimi_place, mappings={("ffn", "swiglu"): SWIGLU},
)
