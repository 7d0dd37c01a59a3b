"""The chunked MoE's Kimi-Linear config mapping: which expert groupings import."""

from __future__ import annotations

import pytest

from megaseq.interop import InteropError
from megaseq_moe.hf import MAPPING

KIMI = {"num_experts": 4, "num_experts_per_token": 2, "moe_intermediate_size": 16, "moe_router_activation_func": "sigmoid",
        "moe_renormalize": True}


@pytest.mark.parametrize("grouping", [
    {"use_grouped_topk": False, "num_expert_group": 2},  # transformers' model groups all the same
    {"use_grouped_topk": True, "num_expert_group": 2, "topk_group": 1},
    {"num_expert_group": 4, "topk_group": 2},
])
def test_a_grouping_that_drops_groups_is_refused(grouping):
    groups = grouping["num_expert_group"]
    with pytest.raises(InteropError, match=f"num_expert_group = {groups} with topk_group = .*megaseq needs "
                                           rf"num_expert_group = 1, or topk_group = num_expert_group \({groups}"):
        MAPPING.config_from_hf({**KIMI, **grouping}, "kimi_linear")


@pytest.mark.parametrize("grouping", [
    {}, {"num_expert_group": 1, "topk_group": 1}, {"use_grouped_topk": False, "num_expert_group": None},
    {"use_grouped_topk": True, "num_expert_group": 2, "topk_group": 2},  # every group kept: no grouping
])
def test_a_grouping_that_keeps_every_group_imports(grouping):
    assert MAPPING.config_from_hf({**KIMI, **grouping}, "kimi_linear")["n_experts"] == 4
