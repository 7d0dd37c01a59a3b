"""Hugging Face mappings of core's ``sdpa`` and ``swiglu`` in this package's layouts (``megaseq_kda.hf_layouts``),
which carry them: core's components know no published layout, these layouts' softmax attention and MLP
are theirs (``megaseq.interop.ComponentMapping``).

``sdpa``: fla's softmax attention layers of the ``kda`` layout (``config.attn``, fla's ``Attention``:
``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``, head width ``hidden_size / num_heads``, rotary embedding on
the whole head). fla rotates channel i with channel i + D/2 (the two halves of a head); megaseq's ``rotary``
rotates neighbours (2i, 2i + 1): import permutes the query and key rows of each head so that megaseq's pairs
are fla's, export permutes them back (the scores are unchanged: q and k move alike). megaseq's ``qkv`` holds
each head's q, k and v rows together (``[head, 3, head_dim]``), fla's three projections hold all heads each.
Refused: grouped key/value heads, a bias on q/k/v, a sliding window, several attention specs that differ.

``swiglu``: the gated MLP of fla's models and of Kimi-Linear's dense layers, ``down(silu(gate x) * up x)``
(``gate_proj``, ``up_proj``, ``down_proj``; megaseq's ``w1``, ``w3``, ``w2``). fla sizes it from
``hidden_ratio`` when ``intermediate_size`` is null: 2/3 of ``hidden_size * hidden_ratio`` rounded up to a
multiple of 256.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from megaseq.builtins.config import SDPAConfig, SwiGLUConfig
from megaseq.builtins.swiglu import hidden_size
from megaseq.interop import InteropError, Tensors, require, unknown_layout
from megaseq.records import ModelDims

LAYOUTS = ("kda", "kimi_linear")
_NAMES = (("w1.weight", "gate_proj.weight"), ("w3.weight", "up_proj.weight"), ("w2.weight", "down_proj.weight"))


def fla_intermediate_size(hidden: int, ratio: int | None) -> int:
    """fla's ``GatedMLP`` width when ``intermediate_size`` is not given."""
    width = int(hidden * (4 if ratio is None else ratio) * 2 / 3)
    return 256 * ((width + 255) // 256)


class SwiGLUMapping:
    def config_from_hf(self, hf: dict[str, Any], layout: str) -> dict[str, Any]:
        if layout not in LAYOUTS:
            raise unknown_layout("ffn 'swiglu'", layout, LAYOUTS)
        width = hf.get("intermediate_size")
        if width is None:
            if layout != "kda":
                raise InteropError("config.json: intermediate_size is missing")
            width = fla_intermediate_size(hf["hidden_size"], hf.get("hidden_ratio"))
        return {"hidden": width}

    def config_to_hf(self, config: SwiGLUConfig, dims: ModelDims, layout: str) -> dict[str, Any]:
        if layout not in LAYOUTS:
            raise unknown_layout("ffn 'swiglu'", layout, LAYOUTS)
        return {"intermediate_size": hidden_size(config, dims)}

    def tensors_from_hf(self, tensors: Tensors, config: SwiGLUConfig, dims: ModelDims, layout: str) -> dict[str, Tensor]:
        h, d = hidden_size(config, dims), dims.d_model
        shapes = {"w1.weight": (h, d), "w3.weight": (h, d), "w2.weight": (d, h)}
        return {ours: tensors.take(theirs, shapes[ours]) for ours, theirs in _NAMES}

    def tensors_to_hf(self, state: dict[str, Tensor], config: SwiGLUConfig, dims: ModelDims, layout: str) -> dict[str, Tensor]:
        return {theirs: state[ours] for ours, theirs in _NAMES}


SWIGLU = SwiGLUMapping()


def _halves_to_pairs(head_dim: int) -> Tensor:
    """Row order that puts channel i + D/2 of a head right after channel i: fla's rotary pairs as megaseq's."""
    half = torch.arange(head_dim // 2)
    return torch.stack([half, half + head_dim // 2], 1).flatten()


class SDPAMapping:
    def config_from_hf(self, hf: dict[str, Any], layout: str) -> dict[str, Any]:
        if layout != "kda":
            raise unknown_layout("attention 'sdpa'", layout, ("kda",))
        specs = hf.get("attn")
        specs = [specs] if isinstance(specs, dict) else list(specs or [])
        settings = [{k: v for k, v in spec.items() if k != "layers"} for spec in specs]
        if any(s != settings[0] for s in settings[1:]):
            raise InteropError("config.json: attn has several specs with different settings; megaseq's sdpa has one config")
        spec = settings[0]
        heads = spec.get("num_heads", 32)
        for key, allowed, what in (
            ("num_kv_heads", (None, heads), "grouped key/value heads"),
            ("qkv_bias", (False,), "a bias on q, k, v"),
            ("window_size", (None,), "a sliding window"),
            ("qk_norm", (False,), "q/k normalisation"),
        ):
            require(spec, key, allowed, what, "config.json: attn")
        if spec.get("rope_theta", 10000.0) is None:
            raise InteropError("config.json: attn.rope_theta = None is not supported; fla's attention always rotates")
        if hf["hidden_size"] % heads:
            raise InteropError(f"config.json: attn.num_heads = {heads} does not divide hidden_size {hf['hidden_size']}")
        return {"n_heads": heads, "head_dim": hf["hidden_size"] // heads, "rope": True,
                "rope_theta": float(spec.get("rope_theta", 10000.0))}

    def config_to_hf(self, config: SDPAConfig, dims: ModelDims, layout: str) -> dict[str, Any]:
        if layout != "kda":
            raise unknown_layout("attention 'sdpa'", layout, ("kda",))
        head_dim = config.head_dim or dims.d_model // config.n_heads
        if head_dim * config.n_heads != dims.d_model or not config.rope:
            raise InteropError(
                "attention.sdpa: fla's attention has n_heads x head_dim = d_model and rotary embedding; this recipe's "
                f"has {config.n_heads} x {head_dim} for d_model {dims.d_model}, rope = {str(config.rope).lower()}"
            )
        return {"attn": {"num_heads": config.n_heads, "num_kv_heads": config.n_heads, "qkv_bias": False,
                         "window_size": None, "rope_theta": config.rope_theta}}

    def tensors_from_hf(self, tensors: Tensors, config: SDPAConfig, dims: ModelDims, layout: str) -> dict[str, Tensor]:
        d, h = dims.d_model, config.n_heads
        head_dim = config.head_dim or d // h
        order = _halves_to_pairs(head_dim)
        q, k, v = (tensors.take(f"{p}_proj.weight", (h * head_dim, d)).view(h, head_dim, d) for p in "qkv")
        qkv = torch.stack([q[:, order], k[:, order], v], 1)  # megaseq keeps each head's q, k, v rows together
        return {"qkv.weight": qkv.reshape(3 * h * head_dim, d), "out.weight": tensors.take("o_proj.weight", (d, h * head_dim))}

    def tensors_to_hf(self, state: dict[str, Tensor], config: SDPAConfig, dims: ModelDims, layout: str) -> dict[str, Tensor]:
        d, h = dims.d_model, config.n_heads
        head_dim = config.head_dim or d // h
        back = torch.argsort(_halves_to_pairs(head_dim))
        q, k, v = state["qkv.weight"].view(h, 3, head_dim, d).unbind(1)
        q, k = q[:, back], k[:, back]
        flat = (w.reshape(h * head_dim, d) for w in (q, k, v))
        return {**dict(zip(("q_proj.weight", "k_proj.weight", "v_proj.weight"), flat, strict=True)), "o_proj.weight": state["out.weight"]}


SDPA = SDPAMapping()

