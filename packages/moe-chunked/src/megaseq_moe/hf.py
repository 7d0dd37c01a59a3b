"""The ``chunked`` MoE's Hugging Face mapping (``megaseq.interop.ComponentMapping``): Kimi-Linear's layout.

Kimi-Linear's MoE layers (``block_sparse_moe``): a sigmoid router ``gate.weight`` whose choice adds the bias
``gate.e_score_correction_bias`` and whose weights are the chosen affinities renormalised and scaled by
``routed_scaling_factor`` (megaseq's router, with the bias in ``router.expert_bias``); routed experts
``experts.{j}.w1`` (gate), ``w3`` (up), ``w2`` (down); one fused shared expert ``shared_experts.gate_proj``,
``up_proj``, ``down_proj`` of width ``moe_intermediate_size * num_shared_experts``. megaseq stores every
routed expert in one ``[E, d, 2, h]`` / ``[E, h, d]`` pair (inputs on the left): import transposes and stacks,
export splits. Refused: another router activation, no renormalisation, grouped top-k that drops a group
(``num_expert_group`` > 1 with ``topk_group`` < ``num_expert_group``, whatever ``use_grouped_topk`` says).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from megaseq.interop import InteropError, Tensors, require, unknown_layout
from megaseq.records import ModelDims
from megaseq_moe.config import ChunkedMoEConfig

LAYOUTS = ("kimi_linear",)
_SHARED = ("shared_experts.gate_proj.weight", "shared_experts.up_proj.weight", "shared_experts.down_proj.weight")


def _check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise unknown_layout("moe 'chunked'", layout, LAYOUTS)


class ChunkedMoEMapping:
    def config_from_hf(self, hf: dict[str, Any], layout: str) -> dict[str, Any]:
        _check_layout(layout)
        require(hf, "moe_router_activation_func", ("sigmoid",), "the router's activation")
        require(hf, "moe_renormalize", (True,), "routing weights that are not renormalised")
        # transformers' KimiLinearForCausalLM groups whenever num_expert_group > 1, whatever use_grouped_topk
        # says; keeping every group (topk_group = num_expert_group) is the only grouping that chooses as megaseq
        groups, kept = hf.get("num_expert_group") or 1, hf.get("topk_group", 1)
        if groups != 1 and kept != groups:
            raise InteropError(
                f"config.json: num_expert_group = {groups} with topk_group = {kept} is not supported (grouped top-k "
                "routing, applied by transformers' model whatever use_grouped_topk says); megaseq needs "
                f"num_expert_group = 1, or topk_group = num_expert_group ({groups}, every group kept)"
            )
        missing = [k for k in ("num_experts", "num_experts_per_token", "moe_intermediate_size") if not hf.get(k)]
        if missing:
            raise InteropError(f"config.json: {missing[0]} is missing")
        return {
            "n_experts": hf["num_experts"], "top_k": hf["num_experts_per_token"],
            "expert_hidden": hf["moe_intermediate_size"], "n_shared_experts": hf.get("num_shared_experts", 0),
            "routed_scaling_factor": float(hf.get("routed_scaling_factor", 1.0)),
        }

    def config_to_hf(self, config: ChunkedMoEConfig, dims: ModelDims, layout: str) -> dict[str, Any]:
        _check_layout(layout)
        if config.shared_hidden not in (None, config.expert_hidden) or config.swiglu_limit is not None:
            raise InteropError(
                "moe.chunked: the kimi_linear layout has shared experts as wide as the routed ones and no SwiGLU "
                f"limit (shared_hidden = {config.shared_hidden}, swiglu_limit = {config.swiglu_limit})"
            )
        return {
            "num_experts": config.n_experts, "num_experts_per_token": config.top_k,
            "moe_intermediate_size": config.expert_hidden, "num_shared_experts": config.n_shared_experts,
            "routed_scaling_factor": config.routed_scaling_factor, "moe_router_activation_func": "sigmoid",
            "moe_renormalize": True, "use_grouped_topk": True, "num_expert_group": 1, "topk_group": 1,
        }

    def tensors_from_hf(self, tensors: Tensors, config: ChunkedMoEConfig, dims: ModelDims, layout: str) -> dict[str, Tensor]:
        _check_layout(layout)
        d, h, e = dims.d_model, config.expert_hidden, config.n_experts
        state = {"router.weight": tensors.take("gate.weight", (e, d)),
                 "router.expert_bias": tensors.take("gate.e_score_correction_bias", (e,))}
        gate_up, down = [], []
        for j in range(e):
            gate, up = (tensors.take(f"experts.{j}.{w}.weight", (h, d)) for w in ("w1", "w3"))
            gate_up.append(torch.stack([gate.t(), up.t()], 1))
            down.append(tensors.take(f"experts.{j}.w2.weight", (d, h)).t())
        state["experts.w_gate_up"], state["experts.w_down"] = torch.stack(gate_up), torch.stack(down)
        if config.shared_width:
            s = config.shared_width
            gate, up, shared_down = (tensors.take(n, shape) for n, shape in zip(_SHARED, ((s, d), (s, d), (d, s)), strict=True))
            state["shared.w_gate_up"], state["shared.w_down"] = torch.cat([gate.t(), up.t()], 1), shared_down.t()
        return {k: v.contiguous() for k, v in state.items()}

    def tensors_to_hf(self, state: dict[str, Tensor], config: ChunkedMoEConfig, dims: ModelDims, layout: str) -> dict[str, Tensor]:
        _check_layout(layout)
        out = {"gate.weight": state["router.weight"], "gate.e_score_correction_bias": state["router.expert_bias"]}
        for j, (gate_up, down) in enumerate(zip(state["experts.w_gate_up"], state["experts.w_down"], strict=True)):
            gate, up = gate_up.unbind(1)
            out.update({f"experts.{j}.w1.weight": gate.t(), f"experts.{j}.w3.weight": up.t(), f"experts.{j}.w2.weight": down.t()})
        if "shared.w_gate_up" in state:
            gate, up = state["shared.w_gate_up"].chunk(2, 1)
            out.update(dict(zip(_SHARED, (gate.t(), up.t(), state["shared.w_down"].t()), strict=True)))
        return {k: v.contiguous() for k, v in out.items()}


MAPPING = ChunkedMoEMapping()
