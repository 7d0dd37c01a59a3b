"""The parts of the vLLM engine that can be checked without CUDA: the ``vllm.general_plugins`` registration,
config translation and weight-name mapping (a model rebuilt from the exported directory computes the same
logits). Serving through vLLM needs a CUDA build of vLLM: ``test_vllm_engine_conformance`` is marked cuda."""

from __future__ import annotations

import ast
import importlib.metadata as md
import importlib.util
import json
import sys
import types
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megaseq.cli import main
from megaseq.config import validate_recipe
from megaseq.contracts import ForwardContext
from megaseq.model import build_model
from megaseq.plugins import get_plugins
from megaseq_rl.vllm import register as register_module
from megaseq_rl.vllm.translate import ARCHITECTURE, export_model_dir, from_vllm_names, recipe_from_config, vllm_config
from megaseq_testkit.engine import EngineConformance

from .conftest import TINY_POLICY

HAS_VLLM = importlib.util.find_spec("vllm") is not None


def test_entry_point_metadata():
    (ep,) = [e for e in md.entry_points(group="vllm.general_plugins") if e.dist and e.dist.name == "megaseq-rl"]
    assert ep.value == "megaseq_rl.vllm.register:register"
    assert ep.load() is register_module.register


def test_register_names_the_model_class_lazily(monkeypatch):
    calls = []

    class Registry:  # vLLM's ModelRegistry API: get_supported_archs(), register_model(arch, "module:Class")
        @staticmethod
        def get_supported_archs():
            return [a for a, _ in calls]

        @staticmethod
        def register_model(arch, target):
            calls.append((arch, target))

    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(ModelRegistry=Registry))
    register_module.register()
    register_module.register()  # vLLM calls it in every process; a second call must not register twice
    assert calls == [(ARCHITECTURE, "megaseq_rl.vllm.model:MegaseqForCausalLM")]
    module, _, cls = register_module.MODEL_CLASS.partition(":")
    source = Path(importlib.util.find_spec("megaseq_rl").submodule_search_locations[0], *module.split(".")[1:]).with_suffix(".py")
    classes = {n.name for n in ast.walk(ast.parse(source.read_text())) if isinstance(n, ast.ClassDef)}
    assert cls in classes


def test_config_translation_and_weight_names_round_trip(tmp_path):
    plugins = get_plugins()
    recipe = validate_recipe(TINY_POLICY, plugins)
    torch.manual_seed(0)
    model = build_model(recipe, plugins).eval()
    out = export_model_dir(model.state_dict(), recipe.to_dict(), tmp_path / "m", "bf16", 4096)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [ARCHITECTURE] and config["torch_dtype"] == "bfloat16"
    assert (config["vocab_size"], config["hidden_size"], config["num_hidden_layers"]) == (5, 32, 2)
    assert config["max_position_embeddings"] == 4096
    weights = load_file(str(out / "model.safetensors"))
    assert all(name.startswith("model.") for name in weights)
    rebuilt = build_model(validate_recipe(recipe_from_config(config), plugins), plugins).eval()
    rebuilt.load_state_dict(dict(from_vllm_names(weights.items())), strict=True)
    tokens = torch.randint(0, 5, (2, 17))
    with torch.no_grad():
        expected = model.logits(model(tokens, ForwardContext()))
        assert torch.equal(rebuilt.logits(rebuilt(tokens, ForwardContext())), expected)
    with pytest.raises(ValueError, match="not a megaseq weight"):
        list(from_vllm_names([("lm_head.weight", torch.zeros(1))]))
    with pytest.raises(ValueError, match="not a megaseq model config"):
        recipe_from_config({"model_type": "llama"})
    assert vllm_config(recipe.to_dict(), "fp32", 8)["torch_dtype"] == "float32"


@pytest.mark.skipif(HAS_VLLM, reason="vLLM is installed here")
def test_engine_without_vllm_is_one_line(policy_checkpoint, capsys):
    assert main(["logprob-gap", str(policy_checkpoint), "--lengths", "32", "--engine", "vllm"]) == 2
    err = capsys.readouterr().err
    assert "engine 'vllm' needs vLLM" in err and "Traceback" not in err


@pytest.mark.cuda
@pytest.mark.skipif(not (HAS_VLLM and torch.cuda.is_available()), reason="needs vLLM (a CUDA build) and a CUDA device")
class TestVLLMEngineConformance(EngineConformance):
    name = "vllm"
    config = {"dtype": "fp32", "max_model_len": 64, "gpu_memory_utilization": 0.3}
