"""Optional capabilities are declared once, on the record: a record declaring one its kind lacks is refused,
and a layout that needs a capability a used component does not declare is one line before anything runs
(the launch, the trainer and the planner read the same check)."""

from __future__ import annotations

import pytest
from torch import nn

from megaseq.capabilities import check_components, used_components
from megaseq.config import validate_recipe
from megaseq.distributed.layout import Layout
from megaseq.errors import UserError
from megaseq.hookspecs import hookimpl
from megaseq.memory.machine import GiB, Machine
from megaseq.memory.plan import plan
from megaseq.records import AttentionSpec, ComponentConfig, MemoryEstimate, MemoryPolicySpec, MoESpec
from megaseq_testkit import fresh_plugins, registered


class Config(ComponentConfig):
    n_experts: int = 4


def build(config, dims, layer_idx):
    return nn.Identity()


def estimate(config, dims, seq_len):
    return MemoryEstimate(parameters=0, saved_per_token=4 * dims.d_model)


class Plain:
    """An attention and an MoE that declare nothing."""

    @hookimpl
    def megaseq_attention(self):
        return [AttentionSpec(name="plain", target=f"{__name__}:build", config=Config, memory=f"{__name__}:estimate")]

    @hookimpl
    def megaseq_moe(self):
        return [MoESpec(name="plain-moe", target=f"{__name__}:build", config=Config, memory=f"{__name__}:estimate")]


def recipe(plugins, **model):
    raw = {"run": {"device": "cpu"}, "data": {"seq_len": 32},
           "model": {"d_model": 8, "n_layers": 2, "layer_pattern": ["plain"], **model}}
    return validate_recipe(raw, plugins, source="r.toml")


@pytest.fixture
def plugins():
    plugins = fresh_plugins()
    with registered(Plain(), plugins, name="plain-plugin"):
        yield plugins


def test_records_accept_only_their_kinds_capabilities():
    AttentionSpec(name="a", target="m:f", capabilities=frozenset({"context_parallel", "sequence_tiling"}))
    with pytest.raises(ValueError, match=r"capabilities \['expert_parallel'\] are not among those of kind 'attention'"):
        AttentionSpec(name="a", target="m:f", capabilities=frozenset({"expert_parallel"}))
    with pytest.raises(ValueError, match="declares pool_sizing but its config has no pool_bytes field"):
        MemoryPolicySpec(name="p", target="m:f", capabilities=frozenset({"pool_sizing"}))
    assert AttentionSpec(name="a", target="m:f", capabilities={"context_parallel"}).capabilities == frozenset({"context_parallel"})


def test_a_layout_needing_an_undeclared_capability_is_one_line(plugins):
    r = recipe(plugins)
    assert used_components(r) == [("attention", "plain"), ("ffn", "swiglu")]
    check_components(r, plugins, Layout(dp=2))  # nothing asked of them
    with pytest.raises(UserError, match=r"^r\.toml: parallel \(dp=1,cp=2,ep=1\): attention 'plain' \(.*\) "
                                        r"does not declare context_parallel; use cp=1 or another attention$"):
        check_components(r, plugins, Layout(cp=2))
    with pytest.raises(UserError, match="does not declare context_parallel"):  # the planner reads the same check
        plan(r, plugins, layout=Layout(cp=2), machine=Machine("cpu", 64 * GiB, None), policies="none")
    moe = recipe(plugins, moe="plain-moe", layer_pattern=["sdpa"])
    moe = validate_recipe({**moe.to_dict(), "attention": {"sdpa": {"n_heads": 2}}}, plugins, source="r.toml")
    check_components(moe, plugins, Layout(dp=2, cp=2))  # sdpa declares context_parallel
    with pytest.raises(UserError, match=r"moe 'plain-moe' \(.*\) does not declare expert_parallel"):
        check_components(moe, plugins, Layout(dp=2, ep=2))



def test_the_plugin_listing_shows_each_declaration(plugins):
    from megaseq.plugin_report import report

    lines = {line.split()[1]: line for line in report(plugins).splitlines() if line.startswith("  attention")}
    declared = sorted(plugins.get("attention", "sdpa").spec.capabilities)
    assert "context_parallel" in declared and lines["sdpa"].endswith(f"[{', '.join(declared)}]")
    assert not lines["plain"].endswith("]")
