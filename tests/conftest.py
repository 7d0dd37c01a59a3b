"""Shared recipes of the cross-package tests."""

from __future__ import annotations

import json
from typing import Any

import pytest

# The GLM-5.3-Flash layer structure (kda, kda, kda, dsa; dense first layer, then chunked MoE) at tiny
# width, on the DNA excerpts shipped inside megaseq-core: seconds per step on one core.
HYBRID: dict[str, Any] = {
    "run": {"name": "hybrid", "device": "cpu"},
    "data": {"train": "excerpt-chr20", "heldout": "excerpt-chrX", "seq_len": 96},
    "model": {"d_model": 32, "n_layers": 4, "layer_pattern": ["kda", "kda", "kda", "dsa"], "moe": "chunked", "dense_layers": 1},
    "attention": {
        "kda": {"n_heads": 2, "head_dim": 16},
        "dsa": {"n_heads": 2, "head_dim": 8, "q_lora_rank": 16, "kv_lora_rank": 16, "index_heads": 2, "index_dim": 8, "topk": 16, "index_pool": 4},
    },
    "moe": {"chunked": {"n_experts": 4, "top_k": 2, "expert_hidden": 32, "chunk_tokens": 40}},
    "train": {"steps": 3, "batch_size": 2, "warmup_steps": 1, "log_every": 1, "loss_chunk": 64},
    "eval": {"windows": 2, "batch_size": 2},
}


def to_toml(raw: dict[str, Any]) -> str:
    """A recipe dict (tables of tables of plain values) as TOML; JSON scalars and arrays are valid TOML."""
    lines: list[str] = []

    def table(name: str, values: dict[str, Any]) -> None:
        plain = {k: v for k, v in values.items() if not isinstance(v, dict)}
        lines.append(f"[{name}]")
        lines.extend(f"{k} = {json.dumps(v)}" for k, v in plain.items())
        for k, v in values.items():
            if isinstance(v, dict):
                table(f"{name}.{k}", v)

    for name, values in raw.items():
        table(name, values)
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="session")
def hybrid() -> dict[str, Any]:
    return HYBRID


@pytest.fixture(scope="session")
def layouts_recipe() -> dict[str, Any]:
    """The hybrid recipe as the layout-equivalence tests run it: the MoE balance loss on, as in the default
    recipe (under cp and tp its per-rank shares must add up), and the default recipe's learning rate (1e-3).

    AdamW's first steps move a weight by about ``lr x g / (|g| + eps)``: where a gradient element is within a
    few ``eps`` of zero, its fp32 rounding (which other layouts' reductions order differently) moves the weight
    by a visible part of ``lr``. At 3e-3 that reached 1.5e-5 in one KDA projection element (|g| ~ 7e-8), above
    the 1e-5 bound, while the loss and the gradient norm agreed to 1e-7."""
    return {**HYBRID, "moe": {"chunked": {**HYBRID["moe"]["chunked"], "aux_loss_coef": 0.01}},
            "train": {**HYBRID["train"], "lr": 1e-3}}


@pytest.fixture(scope="session")
def single(tmp_path_factory, layouts_recipe):
    """One process on ``layouts_recipe``: its first two steps, then its third (what every layout must equal).
    Trained once for every module that compares with it (the tests only read it), with a cache of its own: a
    session's fixture is set up before a module's ``module_cache``."""
    from megaseq_testkit.layouts import single_trainer, train_single

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MEGASEQ_CACHE", str(tmp_path_factory.mktemp("cache")))
        trainer = single_trainer(layouts_recipe, tmp_path_factory.mktemp("single"))
        return train_single(trainer, 2), train_single(trainer, 1)


@pytest.fixture(scope="session")
def recipe_toml():
    """``recipe_toml(raw) -> str``: a recipe dict as TOML text, for tests that run the CLI."""
    return to_toml


@pytest.fixture(scope="module")
def module_cache(tmp_path_factory):
    """MEGASEQ_CACHE in a fresh directory for a whole module: its gloo ranks inherit it."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MEGASEQ_CACHE", str(tmp_path_factory.mktemp("cache")))
        yield
