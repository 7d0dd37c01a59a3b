"""Core's Hugging Face interop without a third-party model: the recipe writer, safetensors directories,
the bases' token ids, layout detection, mapping targets, and the ffn mapping's round trip."""

from __future__ import annotations

import json
import tomllib

import pytest
import torch
from safetensors.torch import save_file

from megaseq.builtins.config import SwiGLUConfig
from megaseq.config import ConfigError, validate_recipe
from megaseq.data.windows import Batch
from megaseq.hookspecs import hookimpl
from megaseq.interop import InteropError
from megaseq.interop.files import INDEX, read_tensors, same_tensors, write_model
from megaseq.interop.layouts import layout_of
from megaseq.interop.recipe_toml import dumps
from megaseq.interop.tokens import token_ids_for
from megaseq.records import FFNSpec
from megaseq_testkit import fresh_plugins, registered


def test_recipe_toml_reads_back_as_the_same_recipe():
    plugins = fresh_plugins()
    recipe = validate_recipe({"run": {"name": "x \"quoted\""}, "data": {"token_ids": [7, 3, 9, 4, 5]},
                              "model": {"vocab_size": 10, "layer_pattern": ["sdpa"], "norm_eps": 1e-5},
                              "attention": {"sdpa": {"n_heads": 2, "rope_theta": 500.0}}, "train": {"betas": [0.8, 0.9]}}, plugins)
    again = validate_recipe(tomllib.loads(dumps(recipe.to_dict())), plugins)
    assert again.to_dict() == recipe.to_dict()


def test_safetensors_directory_one_file_sharded_and_damaged(tmp_path):
    tensors = {f"t{i}": torch.randn(3, 5) for i in range(4)} | {"scalar": torch.tensor(2.0, dtype=torch.float64)}
    single, sharded = tmp_path / "single", tmp_path / "sharded"
    single.mkdir(), sharded.mkdir()
    assert write_model(single, {"a": 1}, tensors, 1 << 30) == ["config.json", "model.safetensors"]
    files = write_model(sharded, {"a": 1}, tensors, 100)
    assert INDEX in files and len(files) > 3
    assert same_tensors(read_tensors(single), tensors) and same_tensors(read_tensors(sharded), tensors)
    flipped = dict(tensors, t0=tensors["t0"].clone())
    flipped["t0"].view(torch.int32)[0, 0] ^= 1  # one bit
    assert not same_tensors(flipped, tensors) and not same_tensors(dict(tensors, t1=tensors["t1"].double()), tensors)

    index = json.loads((sharded / INDEX).read_text())
    shard = index["weight_map"]["t3"]
    (sharded / shard).write_bytes((sharded / shard).read_bytes()[:40])
    with pytest.raises(InteropError, match="not a readable safetensors file"):
        read_tensors(sharded)
    (sharded / shard).unlink()
    with pytest.raises(InteropError, match=f"names {shard}, which is missing"):
        read_tensors(sharded)
    save_file({"other": torch.zeros(1)}, str(sharded / shard))
    with pytest.raises(InteropError, match="is listed in .* but not in this shard"):
        read_tensors(sharded)
    with pytest.raises(InteropError, match="no model.safetensors"):
        read_tensors(tmp_path)


def test_token_ids_of_the_bases(tmp_path):
    pytest.importorskip("tokenizers", reason="needs the hf extra: pip install 'megaseq-core[hf]'")
    assert token_ids_for(tmp_path, 5) is None  # megaseq's own vocabulary
    with pytest.raises(InteropError, match="no tokenizer.json, and vocab_size 9"):
        token_ids_for(tmp_path, 9)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(InteropError, match="not a readable tokenizer"):
        token_ids_for(tmp_path, 9)

    batch = Batch(torch.tensor([[0, 1, 2, 3, 4]]), torch.tensor([[1, 2, 3, 4, 0]]), torch.ones(1, 5))
    mapped = batch.to_vocab([7, 3, 9, 4, 5])
    assert mapped.inputs.tolist() == [[7, 3, 9, 4, 5]] and mapped.targets.tolist() == [[3, 9, 4, 5, 7]]
    assert batch.to_vocab(None) is batch
    plugins = fresh_plugins()
    with pytest.raises(ConfigError, match="data.token_ids: id 9 is beyond model.vocab_size 8"):
        validate_recipe({"data": {"token_ids": [7, 3, 9, 4, 5]}, "model": {"vocab_size": 8}}, plugins)
    with pytest.raises(ConfigError, match="5 distinct ids"):
        validate_recipe({"data": {"token_ids": [1, 1, 2, 3, 4]}, "model": {"vocab_size": 8}}, plugins)


def test_layout_by_model_type():
    assert layout_of({"model_type": "kda"}, "c").name == "kda"
    assert layout_of({"model_type": "kimi_linear"}, "c").name == "kimi_linear"
    with pytest.raises(InteropError, match="c: model_type 'llama' is not supported; megaseq imports 'kda'"):
        layout_of({"model_type": "llama"}, "c")


class HalfMapping:
    def config_from_hf(self, hf, layout):
        return {}


HALF = HalfMapping()


class ProvidesBadMapping:
    @hookimpl
    def megaseq_ffn(self):
        return [FFNSpec(name="mapped", target="megaseq.builtins.swiglu:build", config=SwiGLUConfig, mapping=f"{__name__}:HALF")]


def test_a_mapping_target_without_the_contract_is_reported():
    plugins = fresh_plugins()
    with registered(ProvidesBadMapping(), plugins, name="bad-mapping"):
        (failure,) = plugins.check()
    assert "ffn 'mapped'" in failure and "mapping" in failure and "lacks config_to_hf, tensors_from_hf, tensors_to_hf" in failure


def test_swiglu_and_sdpa_round_trip_and_a_component_without_mapping_is_refused():
    from megaseq.interop.convert import model_to_hf
    from megaseq.model import build_model
    from megaseq_testkit.hf import assert_round_trip

    plugins = fresh_plugins()
    # core alone has no kda: fla's layout holds an all-sdpa model (every layer in config.attn)
    recipe = validate_recipe({"model": {"d_model": 16, "n_layers": 2, "vocab_size": 5},
                              "attention": {"sdpa": {"n_heads": 2, "rope_theta": 100.0}}, "ffn": {"swiglu": {"hidden": 24}}}, plugins)
    assert_round_trip(recipe, plugins, "kda")
    with registered(ProvidesBadMapping(), plugins, name="bad-mapping"):
        unmapped = validate_recipe({"model": {"d_model": 16, "n_layers": 1, "ffn": "mapped"}}, plugins)
        with pytest.raises(InteropError, match="ffn 'mapped': its mapping lacks config_to_hf, tensors_from_hf"):
            model_to_hf(build_model(unmapped, plugins), unmapped, "kda", plugins)


def test_import_and_export_leave_a_users_directories_beside_out_alone(tmp_path):
    from megaseq.cli import main
    from megaseq.interop.convert import model_to_hf
    from megaseq.model import build_model

    plugins = fresh_plugins()
    recipe = validate_recipe({"model": {"d_model": 16, "n_layers": 1, "vocab_size": 5},
                              "attention": {"sdpa": {"n_heads": 2}}, "ffn": {"swiglu": {"hidden": 24}}}, plugins)
    src = tmp_path / "src"
    src.mkdir()
    write_model(src, *model_to_hf(build_model(recipe, plugins), recipe, "kda", plugins), 1 << 30)
    for name in ("imported", "back"):  # the name the staging directory once had
        (tmp_path / f".tmp-{name}").mkdir()
        (tmp_path / f".tmp-{name}" / "notes.txt").write_text("mine")
    before = sorted(p.name for p in tmp_path.iterdir())

    assert main(["import", str(src), "--out", str(tmp_path / "imported")]) == 0
    assert main(["export", str(tmp_path / "imported"), "--out", str(tmp_path / "back"), "--layout", "kda"]) == 0
    for name in ("imported", "back"):
        assert (tmp_path / f".tmp-{name}" / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*before, "imported", "back"])  # no staging left
    assert main(["import", str(src), "--out", str(tmp_path / "imported")]) == 2  # exists: refused, nothing left
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*before, "imported", "back"])
