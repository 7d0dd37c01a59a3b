"""Kimi-Linear's layout with its MoE layers (``kda`` + ``swiglu`` + ``chunked``, three packages): the
published tensor names and shapes, import(export(m)) == m, a wrong MoE mapping caught, export of an import
bitwise, and, where transformers ships ``models/kimi_linear``, an export's logits in transformers' model."""

from __future__ import annotations

import importlib.util
import inspect
import json

import pytest
import torch
from tokenizers import Tokenizer, models

from megaseq.cli import main
from megaseq.config import validate_recipe
from megaseq.contracts import ForwardContext
from megaseq.interop.convert import model_to_hf
from megaseq.interop.files import read_tensors, same_tensors, write_model
from megaseq.model import build_model
from megaseq.plugins import get_plugins
from megaseq_testkit.hf import assert_round_trip

RAW = {
    "model": {"d_model": 32, "n_layers": 3, "layer_pattern": ["kda"], "moe": "chunked", "dense_layers": 1,
              "vocab_size": 5, "tie_embeddings": False},
    "attention": {"kda": {"n_heads": 2, "head_dim": 8, "norm_eps": 1e-6, "gate": "softplus"}},
    "ffn": {"swiglu": {"hidden": 48}},
    "moe": {"chunked": {"n_experts": 4, "top_k": 2, "expert_hidden": 16, "n_shared_experts": 1, "routed_scaling_factor": 2.5}},
}
# Kimi-Linear's published names of one MoE layer's tensors (model.layers.N.block_sparse_moe.*) for 4 experts
MOE_NAMES = {"gate.weight", "gate.e_score_correction_bias", "shared_experts.gate_proj.weight",
             "shared_experts.up_proj.weight", "shared_experts.down_proj.weight"} | {
    f"experts.{j}.{w}.weight" for j in range(4) for w in ("w1", "w2", "w3")}


def recipe(**model):
    return validate_recipe({**RAW, "model": {**RAW["model"], **model}}, get_plugins())


def random_model(r, seed=0):
    """The recipe's model with every tensor drawn at random (vectors around 1), in eval mode."""
    torch.manual_seed(seed)
    model = build_model(r, get_plugins())
    with torch.no_grad():
        for t in model.state_dict().values():
            if t.is_floating_point():
                t.copy_(torch.randn_like(t) * 0.3 + (1.0 if t.dim() == 1 else 0.0))
    return model.eval()


HAS_TRANSFORMERS_KIMI = importlib.util.find_spec("transformers.models.kimi_linear") is not None
needs_transformers_kimi = pytest.mark.skipif(not HAS_TRANSFORMERS_KIMI, reason="transformers has no models/kimi_linear")


def transformers_kimi(monkeypatch):
    """transformers' ``KimiLinearForCausalLM`` computing with its own PyTorch ops: with fla installed it picks
    fla's Triton kernels, which cannot run on a CPU-only machine."""
    import transformers.models.kimi_linear.modeling_kimi_linear as kimi

    for name in ("chunk_kimi_delta_attention", "recurrent_kimi_delta_attention", "causal_conv1d_fn", "causal_conv1d_update"):
        monkeypatch.setattr(kimi, name, inspect.unwrap(getattr(kimi, name)))
    return kimi.KimiLinearForCausalLM


def logits_of_transformers(cls, directory, tokens):
    model = cls.from_pretrained(str(directory)).eval()
    with torch.no_grad():
        return model(tokens, use_cache=False).logits


def test_round_trip_with_moe():
    assert_round_trip(recipe(), get_plugins(), "kimi_linear")


def test_round_trip_catches_a_dropped_router_bias(monkeypatch):
    import megaseq_moe.hf as moe_hf

    class DropsBias(moe_hf.ChunkedMoEMapping):
        def tensors_to_hf(self, state, config, dims, layout):
            out = super().tensors_to_hf(state, config, dims, layout)
            return {**out, "gate.e_score_correction_bias": torch.zeros_like(out["gate.e_score_correction_bias"])}

    monkeypatch.setattr(moe_hf, "MAPPING", DropsBias())
    with pytest.raises(AssertionError, match="router.expert_bias"):
        assert_round_trip(recipe(), get_plugins(), "kimi_linear")


def test_published_names_and_config_then_import_export_bitwise(tmp_path):
    plugins = get_plugins()
    r = recipe()
    torch.manual_seed(1)
    model = build_model(r, plugins)
    with torch.no_grad():
        for t in model.state_dict().values():
            t.copy_(torch.randn_like(t))
    hf, tensors = model_to_hf(model, r, "kimi_linear", plugins)
    assert {n.removeprefix("model.layers.2.block_sparse_moe.") for n in tensors if ".block_sparse_moe." in n and n.startswith("model.layers.2.")} == MOE_NAMES
    assert tensors["model.layers.1.block_sparse_moe.experts.3.w1.weight"].shape == (16, 32)
    assert tensors["model.layers.1.block_sparse_moe.shared_experts.down_proj.weight"].shape == (32, 16)
    assert "model.layers.0.mlp.gate_proj.weight" in tensors and tensors["model.layers.0.self_attn.A_log"].shape == (1, 1, 2, 1)
    assert (hf["first_k_dense_replace"], hf["num_experts"], hf["num_experts_per_token"], hf["moe_intermediate_size"]) == (1, 4, 2, 16)
    assert hf["linear_attn_config"]["kda_layers"] == [1, 2, 3] and hf["moe_router_activation_func"] == "sigmoid"

    src = tmp_path / "kimi"
    src.mkdir()
    write_model(src, hf, tensors, 1 << 30)
    Tokenizer(models.WordLevel({b: i for i, b in enumerate("ACGTN")}, unk_token="N")).save(str(src / "tokenizer.json"))
    assert main(["import", str(src), "--out", str(tmp_path / "imported")]) == 0
    assert main(["export", str(tmp_path / "imported"), "--out", str(tmp_path / "back"), "--layout", "kimi_linear"]) == 0
    assert same_tensors(read_tensors(tmp_path / "back"), read_tensors(src))
    assert json.loads((tmp_path / "back" / "config.json").read_text()) == json.loads((src / "config.json").read_text())

    # grouped top-k over several groups is not megaseq's router: one line, exit 2
    (src / "config.json").write_text(json.dumps({**hf, "num_expert_group": 8}))
    assert main(["import", str(src), "--out", str(tmp_path / "grouped")]) == 2 and not (tmp_path / "grouped").exists()


def test_a_tied_model_exported_to_kimi_linear_keeps_its_head(tmp_path, monkeypatch):
    """KimiLinearForCausalLM never ties: the head is written out, and the export computes the model's logits."""
    r = recipe(tie_embeddings=True)
    model = random_model(r)
    hf, tensors = model_to_hf(model, r, "kimi_linear", get_plugins())
    assert torch.equal(tensors["lm_head.weight"], tensors["model.embed_tokens.weight"]) and hf["tie_word_embeddings"]
    out = tmp_path / "tied"
    out.mkdir()
    write_model(out, hf, tensors, 1 << 30)
    assert same_tensors(read_tensors(out), tensors)
    assert_round_trip(r, get_plugins(), "kimi_linear")  # import gives the tied model back

    if HAS_TRANSFORMERS_KIMI:
        tokens = torch.randint(0, 5, (2, 19))
        with torch.no_grad():
            ours = model.logits(model(tokens, ForwardContext()))
        theirs = logits_of_transformers(transformers_kimi(monkeypatch), out, tokens)
        assert ((ours - theirs).abs().max() / ours.abs().max()).item() < 1e-5


def test_exported_special_token_ids_lie_in_the_vocabulary(monkeypatch):
    """pad_token_id is N's id, bos/eos are null: Kimi-Linear's defaults (163839, ...) fail a small vocabulary."""
    plugins = get_plugins()
    for extra, vocab, n_id in (({}, 5, 4), ({"data": {"token_ids": [3, 4, 5, 6, 7]}}, 9, 7)):
        r = validate_recipe({**RAW, **extra, "model": {**RAW["model"], "vocab_size": vocab}}, plugins)
        hf, _ = model_to_hf(random_model(r), r, "kimi_linear", plugins)
        assert (hf["pad_token_id"], hf["bos_token_id"], hf["eos_token_id"]) == (n_id, None, None)
    if HAS_TRANSFORMERS_KIMI:
        from transformers import KimiLinearConfig

        config = KimiLinearConfig(**hf)
        assert (config.pad_token_id, config.bos_token_id, config.eos_token_id) == (7, None, None)
        transformers_kimi(monkeypatch)(config)  # builds: the embedding's padding index is within the vocabulary


@needs_transformers_kimi
@pytest.mark.parametrize("groups", [1, 2])
def test_transformers_save_pretrained_of_kimi_linear_imports(tmp_path, monkeypatch, groups):
    """transformers writes a dense layer's MLP as block_sparse_moe.*; the import computes transformers' logits,
    also with expert groups that are all kept (topk_group = num_expert_group: no grouping)."""
    from transformers import KimiLinearConfig

    cls = transformers_kimi(monkeypatch)
    torch.manual_seed(0)
    config = KimiLinearConfig(
        vocab_size=5, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
        num_experts=4, num_experts_per_token=2, num_shared_experts=1, routed_scaling_factor=2.5, rms_norm_eps=1e-6,
        first_k_dense_replace=1, num_expert_group=groups, topk_group=groups, pad_token_id=4, bos_token_id=None, eos_token_id=None,
        linear_attn_config={"num_heads": 2, "head_dim": 8, "short_conv_kernel_size": 4, "kda_layers": [1, 2, 3],
                            "full_attn_layers": []})
    theirs = cls(config).eval()
    with torch.no_grad():
        for t in theirs.state_dict().values():
            t.copy_(torch.randn_like(t) * 0.3 + (1.0 if t.dim() == 1 else 0.0))
    theirs.save_pretrained(str(tmp_path / "hf"))
    assert "model.layers.0.block_sparse_moe.gate_proj.weight" in read_tensors(tmp_path / "hf")

    assert main(["import", str(tmp_path / "hf"), "--out", str(tmp_path / "imported")]) == 0
    from megaseq.train.checkpoint import load_weights, read_meta

    path = tmp_path / "imported" / "checkpoints" / "step_0000000"
    ours = build_model(validate_recipe(read_meta(path)["recipe"], get_plugins()), get_plugins()).eval()
    load_weights(path, ours)
    tokens = torch.randint(0, 5, (2, 19))
    with torch.no_grad():
        a, b = ours.logits(ours(tokens, ForwardContext())), theirs(tokens, use_cache=False).logits
    assert ((a - b).abs().max() / b.abs().max()).item() < 1e-5

    # layer kinds written out that disagree with first_k_dense_replace: transformers follows them, so refused
    hf = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**hf, "mlp_layer_types": ["dense", "dense", "sparse"]}))
    assert main(["import", str(tmp_path / "hf"), "--out", str(tmp_path / "mixed")]) == 2
