"""Core's Hugging Face interop without any plugin: the recipe writer, safetensors directories, the bases'
token ids, and the walker, through a small layout this module defines and registers itself (core registers
no layout: the packages that own model families do)."""

from __future__ import annotations

import json
import re
import tomllib

import pytest
import torch
from safetensors.torch import save_file

from megaseq.builtins.config import SDPAConfig, SwiGLUConfig
from megaseq.builtins.swiglu import hidden_size
from megaseq.config import ConfigError, validate_recipe
from megaseq.data.windows import Batch
from megaseq.hookspecs import hookimpl
from megaseq.interop import InteropError, Tensors
from megaseq.interop.convert import layout_for, layout_named, model_to_hf
from megaseq.interop.files import INDEX, read_tensors, same_tensors, write_model
from megaseq.interop.layouts import Layer, Layout
from megaseq.interop.recipe_toml import dumps
from megaseq.interop.tokens import token_ids_for
from megaseq.model import build_model
from megaseq.records import FFNSpec, HFLayoutSpec
from megaseq_testkit import fresh_plugins, registered
from megaseq_testkit.hf import assert_round_trip


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


# -- a layout of the test's own: core's sdpa and swiglu under other names ----------------------------------------
class TinyAttention:
    """core's ``sdpa`` as ``mixer.qkv`` / ``mixer.o``, rotary from ``rope_theta`` (null: none)."""

    def config_from_hf(self, hf, layout):
        theta = hf.get("rope_theta")
        return {"n_heads": hf["heads"], "rope": theta is not None, "rope_theta": theta or 10000.0}

    def config_to_hf(self, config: SDPAConfig, dims, layout):
        if (config.head_dim or dims.d_model // config.n_heads) * config.n_heads != dims.d_model:
            raise InteropError("attention.sdpa: the tiny layout has n_heads x head_dim = d_model")
        return {"heads": config.n_heads, "rope_theta": config.rope_theta if config.rope else None}

    def tensors_from_hf(self, tensors: Tensors, config, dims, layout):
        return {"qkv.weight": tensors.take("qkv.weight", (3 * dims.d_model, dims.d_model)),
                "out.weight": tensors.take("o.weight", (dims.d_model, dims.d_model))}

    def tensors_to_hf(self, state, config, dims, layout):
        return {"qkv.weight": state["qkv.weight"], "o.weight": state["out.weight"]}


class TinyMLP:
    NAMES = (("w1.weight", "gate.weight"), ("w3.weight", "up.weight"), ("w2.weight", "down.weight"))

    def config_from_hf(self, hf, layout):
        return {"hidden": hf["mlp_width"]}

    def config_to_hf(self, config: SwiGLUConfig, dims, layout):
        return {"mlp_width": hidden_size(config, dims)}

    def tensors_from_hf(self, tensors, config, dims, layout):
        h, d = hidden_size(config, dims), dims.d_model
        shapes = {"w1.weight": (h, d), "w3.weight": (h, d), "w2.weight": (d, h)}
        return {ours: tensors.take(theirs, shapes[ours]) for ours, theirs in self.NAMES}

    def tensors_to_hf(self, state, config, dims, layout):
        return {theirs: state[ours] for ours, theirs in self.NAMES}


def tiny_layers(hf, source):
    kinds = hf.get("mixers", [])
    if len(kinds) != hf["num_hidden_layers"] or set(kinds) - {"softmax"}:
        raise InteropError(f"{source}: mixers = {kinds}; megaseq reads one 'softmax' per layer")
    return [Layer("sdpa", "mixer.", "ffn", "swiglu", "mlp.", ("feed_forward.",)) for _ in kinds]


def tiny_place(hf, attention, ffn):
    hf["mixers"] = ["softmax" if name == "sdpa" else name for name in attention]


def tiny_layout(**changes):
    fields = dict(architecture="TinyForCausalLM", embed="embed.weight", final_norm="norm.weight", head="head.weight",
                  layer_prefix="layers.{}.", attn_norm="norm1.weight", ffn_norm="norm2.weight", eps_key="eps",
                  hidden_act=("silu",), ties_head=False, layers=tiny_layers, place=tiny_place,
                  mappings={("attention", "sdpa"): TinyAttention(), ("ffn", "swiglu"): TinyMLP()})
    return Layout(**{**fields, **changes})


TINY = tiny_layout()
NOT_A_LAYOUT = {"architecture": "TinyForCausalLM"}
HALF_MAPPED = tiny_layout(mappings={("attention", "sdpa"): TinyAttention(), ("ffn", "swiglu"): HALF})
ONLY_ATTENTION = tiny_layout(mappings={("attention", "sdpa"): TinyAttention()})
MAPS_MAPPED = tiny_layout(layers=lambda hf, source: [Layer("sdpa", "mixer.", "ffn", "mapped", "mlp.") for _ in hf["mixers"]],
                          mappings={("attention", "sdpa"): TinyAttention(), ("ffn", "mapped"): TinyMLP()})


class ProvidesLayouts:
    """Registers ``(name, target attribute, model_type, default)`` layouts of this module."""

    def __init__(self, *layouts):
        self.layouts = layouts or (("tiny", "TINY", "tiny", True),)

    @hookimpl
    def megaseq_hf_layout(self):
        return [HFLayoutSpec(name=name, target=f"{__name__}:{attr}", model_type=model_type, default=default)
                for name, attr, model_type, default in self.layouts]


def _recipe(plugins, **model):
    return validate_recipe({"model": {"d_model": 16, "n_layers": 2, "vocab_size": 5, **model},
                            "attention": {"sdpa": {"n_heads": 2, "rope_theta": 100.0}}, "ffn": {"swiglu": {"hidden": 24}}}, plugins)


@pytest.mark.parametrize("tie", [True, False])
def test_the_walker_round_trips_a_layout_the_plugin_defines(tie):
    plugins = fresh_plugins()
    with registered(ProvidesLayouts(), plugins, name="tiny-layout"):
        recipe = _recipe(plugins, tie_embeddings=tie)
        assert_round_trip(recipe, plugins, "tiny")
        hf, tensors = model_to_hf(build_model(recipe, plugins), recipe, None, plugins)  # tiny is the default
    assert (hf["model_type"], hf["architectures"], hf["mixers"], hf["heads"], hf["mlp_width"]) == (
        "tiny", ["TinyForCausalLM"], ["softmax", "softmax"], 2, 24)
    assert hf["eps"] == recipe.model.norm_eps and hf["hidden_act"] == "silu" and hf["tie_word_embeddings"] is tie
    layer = {"norm1.weight", "norm2.weight", "mixer.qkv.weight", "mixer.o.weight", "mlp.gate.weight", "mlp.up.weight",
             "mlp.down.weight"}
    # the layout's class never ties: a tied model is written with its head
    assert set(tensors) == {"embed.weight", "norm.weight", "head.weight"} | {f"layers.{i}.{n}" for i in range(2) for n in layer}


def test_import_reads_a_layouts_aliases_and_refuses_what_the_layout_refuses():
    from megaseq.interop.convert import model_from_hf, recipe_from_hf

    plugins = fresh_plugins()
    with registered(ProvidesLayouts(), plugins, name="tiny-layout"):
        recipe = _recipe(plugins, tie_embeddings=False)
        model = build_model(recipe, plugins)
        hf, tensors = model_to_hf(model, recipe, "tiny", plugins)
        aliased = {n.replace("layers.1.mlp.", "layers.1.feed_forward."): t for n, t in tensors.items()}
        again, layout, layers = recipe_from_hf(hf, plugins, "c")
        back = model_from_hf(aliased, again, layout, layers, plugins, "c")
        assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), back.state_dict().values(), strict=True))
        both = dict(tensors, **{"layers.0.feed_forward.gate.weight": tensors["layers.0.mlp.gate.weight"]})
        with pytest.raises(InteropError, match="c: the MLP of one layer has tensors under both layers.0.mlp. and "
                                               "layers.0.feed_forward."):
            model_from_hf(both, again, layout, layers, plugins, "c")
        with pytest.raises(InteropError, match=r"c: mixers = \['softmax', 'linear'\]; megaseq reads one 'softmax'"):
            recipe_from_hf({**hf, "mixers": ["softmax", "linear"]}, plugins, "c")
        with pytest.raises(InteropError, match="c: hidden_act = 'gelu' is not supported"):
            recipe_from_hf({**hf, "hidden_act": "gelu"}, plugins, "c")
        with pytest.raises(InteropError, match="c: unknown tensor layers.0.mixer.bias"):
            model_from_hf(dict(tensors, **{"layers.0.mixer.bias": torch.zeros(2)}), again, layout, layers, plugins, "c")


def test_layouts_are_found_by_model_type_and_by_name_or_refused_in_one_line():
    plugins = fresh_plugins()
    with pytest.raises(InteropError, match=r"^c: model_type 'tiny' is not supported; Hugging Face layouts none is installed"):
        layout_for({"model_type": "tiny"}, plugins, "c")
    with pytest.raises(InteropError, match=r"^--layout: choose a layout \(no installed layout declares itself the default\); none is"):
        layout_named(plugins, None)
    with registered(ProvidesLayouts(("tiny", "TINY", "tiny", True), ("other", "TINY", "other", False)), plugins, name="two"):
        assert layout_for({"model_type": "tiny"}, plugins, "c").name == "tiny"
        assert layout_named(plugins, None).name == "tiny" and layout_named(plugins, "other").model_type == "other"
        installed = "installed: other (model_type 'other', from (local)), tiny (model_type 'tiny', from (local))"
        with pytest.raises(InteropError, match=rf"^c: model_type 'llama' is not supported; Hugging Face layouts {re.escape(installed)}$"):
            layout_for({"model_type": "llama"}, plugins, "c")
        with pytest.raises(InteropError, match=rf"^--layout 'nope': no such Hugging Face layout; {re.escape(installed)}$"):
            layout_named(plugins, "nope")
    with registered(ProvidesLayouts(("a", "TINY", "tiny", True), ("b", "TINY", "tiny", True)), plugins, name="clash"):
        with pytest.raises(InteropError, match=r"^--layout: choose a layout \(a and b each declare themselves the default\)"):
            layout_named(plugins, None)
        with pytest.raises(InteropError, match=r"^c: model_type 'tiny' is read by several layouts, a \(from \(local\)\) and b"):
            layout_for({"model_type": "tiny"}, plugins, "c")
    with pytest.raises(ValueError, match="model_type"):
        HFLayoutSpec(name="x", target="m:X")


def test_a_layouts_mapping_comes_first_and_a_component_mapped_by_neither_is_refused():
    plugins = fresh_plugins()
    with registered(ProvidesLayouts(("tiny", "ONLY_ATTENTION", "tiny", True), ("maps-mapped", "MAPS_MAPPED", "m", False),
                                    ("half", "HALF_MAPPED", "h", False)), plugins, name="layouts"):
        recipe = _recipe(plugins)
        with pytest.raises(InteropError, match="ffn 'swiglu' has no Hugging Face mapping for the layout 'tiny'"):
            model_to_hf(build_model(recipe, plugins), recipe, "tiny", plugins)
        with pytest.raises(InteropError, match=r"hf_layout 'half' from \(local\): target '.*:HALF_MAPPED': its mapping of "
                                               "ffn 'swiglu' lacks config_to_hf, tensors_from_hf, tensors_to_hf"):
            model_to_hf(build_model(recipe, plugins), recipe, "half", plugins)
        with registered(ProvidesBadMapping(), plugins, name="bad-mapping"):
            mapped = validate_recipe({"model": {"d_model": 16, "n_layers": 1, "ffn": "mapped"},
                                      "attention": {"sdpa": {"n_heads": 2}}, "ffn": {"mapped": {"hidden": 24}}}, plugins)
            with pytest.raises(InteropError, match="ffn 'mapped': its mapping lacks config_to_hf, tensors_from_hf"):
                model_to_hf(build_model(mapped, plugins), mapped, "tiny", plugins)  # the record's own
            assert_round_trip(mapped, plugins, "maps-mapped")  # the layout's, in place of the record's


def test_plugins_check_holds_a_layout_target_to_the_layout_contract():
    plugins = fresh_plugins()
    with registered(ProvidesLayouts(("not-one", "NOT_A_LAYOUT", "x", False), ("half", "HALF_MAPPED", "h", False)), plugins,
                    name="layouts"):
        failures = sorted(plugins.check())
    assert len(failures) == 2
    assert "hf_layout 'half'" in failures[0] and "its mapping of ffn 'swiglu' lacks config_to_hf" in failures[0]
    assert "hf_layout 'not-one'" in failures[1] and "dict is not a megaseq.interop.layouts.Layout" in failures[1]
    with registered(ProvidesLayouts(("not-one", "NOT_A_LAYOUT", "x", True)), plugins, name="layouts"):
        with pytest.raises(InteropError, match="hf_layout 'not-one' from .*: dict is not a megaseq.interop.layouts.Layout"):
            layout_named(plugins, None)


@pytest.fixture
def cli_plugins(monkeypatch):
    """The command line's plugins: core's and this module's layout, whatever else is installed."""
    plugins = fresh_plugins()
    plugins.register(ProvidesLayouts(), name="tiny-layout")
    monkeypatch.setattr("megaseq.plugins.get_plugins", lambda: plugins)
    return plugins


def test_import_and_export_leave_a_users_directories_beside_out_alone(tmp_path, cli_plugins):
    from megaseq.cli import main

    recipe = _recipe(cli_plugins, n_layers=1)
    src = tmp_path / "src"
    src.mkdir()
    write_model(src, *model_to_hf(build_model(recipe, cli_plugins), recipe, "tiny", cli_plugins), 1 << 30)
    for name in ("imported", "back"):  # the name the staging directory once had
        (tmp_path / f".tmp-{name}").mkdir()
        (tmp_path / f".tmp-{name}" / "notes.txt").write_text("mine")
    before = sorted(p.name for p in tmp_path.iterdir())

    assert main(["import", str(src), "--out", str(tmp_path / "imported")]) == 0
    assert main(["export", str(tmp_path / "imported"), "--out", str(tmp_path / "back"), "--layout", "tiny"]) == 0
    assert same_tensors(read_tensors(tmp_path / "back"), read_tensors(src))
    for name in ("imported", "back"):
        assert (tmp_path / f".tmp-{name}" / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*before, "imported", "back"])  # no staging left
    assert main(["import", str(src), "--out", str(tmp_path / "imported")]) == 2  # exists: refused, nothing left
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*before, "imported", "back"])


def test_export_to_an_unknown_layout_is_one_line_listing_the_installed_ones(tmp_path, cli_plugins, capsys):
    from megaseq.cli import main

    recipe = _recipe(cli_plugins, n_layers=1)
    src = tmp_path / "src"
    src.mkdir()
    write_model(src, *model_to_hf(build_model(recipe, cli_plugins), recipe, "tiny", cli_plugins), 1 << 30)
    assert main(["import", str(src), "--out", str(tmp_path / "imported")]) == 0
    capsys.readouterr()
    assert main(["export", str(tmp_path / "imported"), "--out", str(tmp_path / "x"), "--layout", "nope"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "megaseq: error: --layout 'nope': no such Hugging Face layout; installed: tiny (model_type 'tiny', from (local))"
    assert not (tmp_path / "x").exists()
