"""Recipes: validation errors are one line naming the file, the key path and what is allowed."""

from __future__ import annotations

from pathlib import Path

import pytest

from megaseq.config import apply_overrides, load_recipe, parse_override, validate_recipe
from megaseq.errors import ConfigError, UserError
from megaseq_testkit import fresh_plugins

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def plugins():
    return fresh_plugins()


def check(raw, plugins, pattern):
    with pytest.raises(UserError) as err:
        validate_recipe(raw, plugins, source="r.toml")
    assert "\n" not in str(err.value)
    assert pattern in str(err.value), str(err.value)


def test_defaults_validate(plugins):
    recipe = validate_recipe({}, plugins)
    assert recipe.model.layer_pattern == ["sdpa"]
    assert recipe.component("attention", "sdpa").n_heads == 4


def test_shipped_recipes_validate(plugins):
    for path in (REPO / "recipes").glob("*.toml"):
        try:
            load_recipe(path, plugins)
        except UserError as exc:  # recipes for plugins that are not installed in this environment
            assert any(f"no {kind} named" in str(exc) for kind in ("attention", "moe", "baseline")), str(exc)


def test_unknown_key_lists_allowed(plugins):
    check({"train": {"stepz": 3}}, plugins, "r.toml: train.stepz: unknown key; allowed: steps, batch_size")


def test_unknown_section(plugins):
    check({"trian": {}}, plugins, "r.toml: [trian]: unknown section; allowed: run, data, model, train, eval")


def test_bad_value_names_key_and_input(plugins):
    check({"train": {"lr": "fast"}}, plugins, "r.toml: train.lr: Input should be a valid number")
    check({"model": {"norm": "batchnorm"}}, plugins, "r.toml: model.norm: Input should be 'rmsnorm' or 'layernorm'")
    check({"model": {"layer_pattern": []}}, plugins, "r.toml: model.layer_pattern:")


def test_component_schema_validates_its_section(plugins):
    check({"attention": {"sdpa": {"n_heads": 0}}}, plugins, "r.toml: attention.sdpa.n_heads: Input should be greater than or equal to 1")
    check({"attention": {"sdpa": {"heads": 2}}}, plugins, "r.toml: attention.sdpa.heads: unknown key; allowed: n_heads, head_dim, rope, rope_theta")


def test_unknown_component_lists_available(plugins):
    check({"model": {"layer_pattern": ["sdpa", "kda"]}}, plugins, "r.toml: model.layer_pattern[1]: no attention named 'kda'; available: sdpa")


def test_unused_component_section_is_an_error(plugins):
    check({"ffn": {"swiglu": {}, "other": {}}}, plugins, "[ffn.other] is configured but not used by model.ffn")


def test_dense_layers_need_moe(plugins):
    check({"model": {"dense_layers": 1}}, plugins, "dense_layers is only meaningful with moe set")


def test_bf16_residual_stream_needs_bf16_autocast(plugins):
    check({"model": {"residual_dtype": "bf16"}}, plugins,
          "r.toml: model.residual_dtype: 'bf16' needs train.bf16 = true (the forward in bf16 autocast); allowed without it: 'fp32'")
    check({"model": {"residual_dtype": "fp16"}}, plugins, "r.toml: model.residual_dtype: Input should be 'fp32' or 'bf16'")
    validate_recipe({"model": {"residual_dtype": "bf16"}, "train": {"bf16": True}}, plugins)


def test_overrides():
    assert parse_override("train.lr=1e-3") == (["train", "lr"], 0.001)
    assert parse_override("model.layer_pattern=['a','b']") == (["model", "layer_pattern"], ["a", "b"])
    assert parse_override("data.train=grch37-chr20") == (["data", "train"], "grch37-chr20")
    raw = apply_overrides({"train": {"lr": 1.0}}, ["train.lr=2", "attention.sdpa.n_heads=2"])
    assert raw == {"train": {"lr": 2}, "attention": {"sdpa": {"n_heads": 2}}}
    with pytest.raises(ConfigError, match="expected KEY.PATH=VALUE"):
        parse_override("novalue")


def test_a_set_that_deselects_a_component_drops_its_section(tmp_path, plugins):
    """--set eval.baselines=[] turns the recipe's baseline off, its [baseline.NAME] with it; a section no --set
    deselected, or one a --set configures, is still refused when unused."""
    recipe = tmp_path / "r.toml"
    recipe.write_text('[eval]\nbaselines = ["markov"]\nanalyses = ["retrieval"]\n\n[baseline.markov]\norder = 8\n\n'
                      "[eval_analysis.retrieval]\nk = 20\n")
    loaded = load_recipe(recipe, plugins, ["eval.baselines=[]", "eval.analyses=[]"])
    assert loaded.eval.baselines == [] and loaded.components["baseline"] == {} and "baseline" not in loaded.to_dict()
    with pytest.raises(ConfigError, match=r"r.toml: \[baseline.markov\] is configured but not used by eval.baselines"):
        load_recipe(recipe, plugins, ["eval.baselines=[]", "eval.analyses=[]", "baseline.markov.order=3"])
    stray = {"eval": {"baselines": ["markov"]}, "baseline": {"markov": {}, "markv": {}}}  # a misspelt section stays
    with pytest.raises(ConfigError, match=r"r.toml: \[baseline.markv\] is configured but not used by eval.baselines"):
        validate_recipe(apply_overrides(stray, ["eval.baselines=[]"]), plugins, "r.toml")
    assert apply_overrides({"attention": {"sdpa": {}, "kda": {}}}, ['model.layer_pattern=["kda"]']) == {
        "attention": {"kda": {}}, "model": {"layer_pattern": ["kda"]}}  # sdpa was selected by default
    assert apply_overrides({"baseline": {"markov": {}}}, ["train.lr=1"])["baseline"] == {"markov": {}}  # never selected


def test_load_recipe_errors(tmp_path, plugins):
    with pytest.raises(ConfigError, match="recipe not found"):
        load_recipe(tmp_path / "missing.toml", plugins)
    bad = tmp_path / "bad.toml"
    bad.write_text("[train\nsteps=1")
    with pytest.raises(ConfigError, match="bad.toml: not valid TOML"):
        load_recipe(bad, plugins)


def test_round_trip(plugins):
    recipe = validate_recipe({"attention": {"sdpa": {"n_heads": 2}}, "train": {"steps": 7}}, plugins)
    again = validate_recipe(recipe.to_dict(), plugins)
    assert again.to_dict() == recipe.to_dict()
