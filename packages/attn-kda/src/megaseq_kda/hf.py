"""The ``kda`` component's Hugging Face mapping (``megaseq.interop.ComponentMapping``).

Layouts: ``kda``, fla's ``KimiDeltaAttention`` (``fla.models.KDAConfig``: q/k/v projections with one short
convolution each, ``f_proj`` and ``g_proj`` as two-layer sequences, a bias on the output gate), and
``kimi_linear``, Kimi-Linear's published names for the same layer (``f_a_proj``/``f_b_proj``,
``g_a_proj``/``g_b_proj`` without a bias, ``A_log`` stored as ``[1, 1, H, 1]``, sizes in
``linear_attn_config``). megaseq keeps q, k and v in one projection and one convolution weight, stacked
``[3, H * D, ...]``: import stacks, export splits, so export of an import gives back the same tensors.

Refused in one line, since megaseq's layer cannot compute them: grouped value heads (``num_v_heads`` other
than ``num_heads``), ``expand_v`` other than 1, no short convolution, negative eigenvalues
(``allow_neg_eigval``), and on export a gate rank other than ``head_dim`` (fla fixes it there).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from megaseq.interop import InteropError, Tensors, require, unknown_layout
from megaseq.records import ModelDims
from megaseq_kda.config import KDAConfig

LAYOUTS = ("kda", "kimi_linear")
# (ours, fla's, Kimi-Linear's) names of the tensors that map one to one
_SAME = (
    ("beta_proj.weight", "b_proj.weight", "b_proj.weight"),
    ("gate_down.weight", "f_proj.0.weight", "f_a_proj.weight"),
    ("gate_up.weight", "f_proj.1.weight", "f_b_proj.weight"),
    ("dt_bias", "dt_bias", "dt_bias"),
    ("norm_weight", "o_norm.weight", "o_norm.weight"),
    ("out_gate_down.weight", "g_proj.0.weight", "g_a_proj.weight"),
    ("out_gate_up.weight", "g_proj.1.weight", "g_b_proj.weight"),
    ("out_proj.weight", "o_proj.weight", "o_proj.weight"),
)


def _shapes(config: KDAConfig, d_model: int) -> dict[str, tuple[int, ...]]:
    h, k = config.n_heads, config.head_dim
    width, rank = h * k, config.gate_rank or k
    return {
        "beta_proj.weight": (h, d_model), "gate_down.weight": (rank, d_model), "gate_up.weight": (width, rank),
        "dt_bias": (width,), "norm_weight": (k,), "out_gate_down.weight": (rank, d_model),
        "out_gate_up.weight": (width, rank), "out_proj.weight": (d_model, width),
    }


class KDAMapping:
    def config_from_hf(self, hf: dict[str, Any], layout: str) -> dict[str, Any]:
        if layout == "kda":
            for key, allowed, what in (
                ("expand_v", (1, 1.0), "value heads wider than key heads"),
                ("num_v_heads", (None, hf.get("num_heads", 16)), "grouped value heads"),
                ("use_short_conv", (True,), "KDA without its short convolution"),
                ("allow_neg_eigval", (False,), "negative eigenvalues"),
            ):
                require(hf, key, allowed, what)
            head_dim, lower_bound = hf.get("head_dim", 128), hf.get("lower_bound")
            return {
                "n_heads": hf.get("num_heads", 16), "head_dim": head_dim, "conv_size": hf.get("conv_size", 4),
                "gate": "softplus" if lower_bound is None else "bounded", "gate_lower_bound": lower_bound,
                "gate_rank": head_dim, "norm_eps": hf.get("norm_eps", 1e-6), "out_gate_bias": True,
            }
        if layout == "kimi_linear":
            linear = hf.get("linear_attn_config") or {}
            missing = [k for k in ("num_heads", "head_dim", "short_conv_kernel_size") if k not in linear]
            if missing:
                raise InteropError(f"config.json: linear_attn_config.{missing[0]} is missing")
            return {
                "n_heads": linear["num_heads"], "head_dim": linear["head_dim"], "conv_size": linear["short_conv_kernel_size"],
                "gate": "softplus", "gate_rank": linear["head_dim"], "norm_eps": hf.get("rms_norm_eps", 1e-6),
                "out_gate_bias": False,
            }
        raise unknown_layout("attention 'kda'", layout, LAYOUTS)

    def config_to_hf(self, config: KDAConfig, dims: ModelDims, layout: str) -> dict[str, Any]:
        if config.gate_rank not in (None, config.head_dim):
            raise InteropError(f"attention.kda.gate_rank = {config.gate_rank}: the {layout} layout fixes the gate rank at head_dim ({config.head_dim})")
        if layout == "kda":
            return {
                "num_heads": config.n_heads, "head_dim": config.head_dim, "conv_size": config.conv_size,
                "expand_v": 1.0, "num_v_heads": None, "use_short_conv": True, "allow_neg_eigval": False,
                "lower_bound": config.gate_lower_bound if config.gate == "bounded" else None, "norm_eps": config.norm_eps,
            }
        if layout == "kimi_linear":
            if config.gate != "softplus":
                raise InteropError("attention.kda.gate = 'bounded': the kimi_linear layout has only the softplus gate")
            if config.out_gate_bias:
                raise InteropError("attention.kda.out_gate_bias = true: the kimi_linear layout's output gate has no bias")
            return {
                "linear_attn_config": {"num_heads": config.n_heads, "head_dim": config.head_dim, "short_conv_kernel_size": config.conv_size},
                "rms_norm_eps": config.norm_eps,
            }
        raise unknown_layout("attention 'kda'", layout, LAYOUTS)

    def tensors_from_hf(self, tensors: Tensors, config: KDAConfig, dims: ModelDims, layout: str) -> dict[str, Tensor]:
        if layout not in LAYOUTS:
            raise unknown_layout("attention 'kda'", layout, LAYOUTS)
        d, width, h = dims.d_model, config.n_heads * config.head_dim, config.n_heads
        theirs = 1 if layout == "kda" else 2
        shapes = _shapes(config, d)
        state = {names[0]: tensors.take(names[theirs], shapes[names[0]]) for names in _SAME}
        state["qkv_weight"] = torch.stack([tensors.take(f"{p}_proj.weight", (width, d)) for p in "qkv"])
        conv = [tensors.take(f"{p}_conv1d.weight", (width, 1, config.conv_size)) for p in "qkv"]
        state["conv_weight"] = torch.stack(conv).squeeze(2)
        state["A_log"] = tensors.take("A_log", (h,) if layout == "kda" else (1, 1, h, 1)).reshape(h)
        if layout == "kda":
            state["out_gate_up.bias"] = tensors.take("g_proj.1.bias", (width,))
        return state

    def tensors_to_hf(self, state: dict[str, Tensor], config: KDAConfig, dims: ModelDims, layout: str) -> dict[str, Tensor]:
        if layout not in LAYOUTS:
            raise unknown_layout("attention 'kda'", layout, LAYOUTS)
        h, theirs = config.n_heads, 1 if layout == "kda" else 2
        out = {names[theirs]: state[names[0]] for names in _SAME}
        out.update({f"{p}_proj.weight": w for p, w in zip("qkv", state["qkv_weight"].unbind(0), strict=True)})
        out.update({f"{p}_conv1d.weight": w.unsqueeze(1) for p, w in zip("qkv", state["conv_weight"].unbind(0), strict=True)})
        out["A_log"] = state["A_log"] if layout == "kda" else state["A_log"].reshape(1, 1, h, 1)
        if layout == "kda":  # fla's output gate always has a bias: zeros stand for none
            out["g_proj.1.bias"] = state.get("out_gate_up.bias", torch.zeros(h * config.head_dim))
        return out


MAPPING = KDAMapping()
