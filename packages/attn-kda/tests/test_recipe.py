"""recipes/kda-cpu.toml needs nothing but megaseq-core and this package (the Makefile runs this package's
tests in an environment holding only those two)."""

from __future__ import annotations

from pathlib import Path

from megaseq.config import load_recipe
from megaseq.plugins import get_plugins

RECIPE = Path(__file__).resolve().parents[3] / "recipes" / "kda-cpu.toml"


def test_kda_recipe_uses_kda_and_builtins_only():
    plugins = get_plugins()
    recipe = load_recipe(RECIPE, plugins)
    used = {plugins.get("attention", name).plugin.dist for name in recipe.model.layer_pattern}
    used.add(plugins.get("ffn", recipe.model.ffn).plugin.dist)
    assert used <= {"megaseq-core", "megaseq-attn-kda"} and "megaseq-attn-kda" in used, used
    assert recipe.model.moe is None
