"""Tensor parallelism of the KDA layer (the conformance suite checks tp=2 against one rank, test_conformance.py):
heads that tp does not divide are refused when the layer is built, in one line; a rank's block of the q, k, v
projection and convolution holds its heads' rows of each of q, k and v; the memory estimate's parameters are
what a rank builds."""

from __future__ import annotations

import pytest
import torch

from megaseq.records import ModelDims
from megaseq_kda.config import KDAConfig
from megaseq_kda.layer import build, memory_estimate
from megaseq_testkit import assert_close

CONFIG = KDAConfig(n_heads=4, head_dim=8)


def test_heads_that_tp_does_not_divide_are_refused():
    with pytest.raises(ValueError, match=r"^attention.kda: n_heads 3 is not a multiple of tp 2$"):
        build(KDAConfig(n_heads=3, head_dim=8), ModelDims(d_model=16, n_layers=2, vocab_size=8, tp_size=2), 0)


def test_a_rank_projects_its_heads_q_k_and_v():
    whole = build(CONFIG, ModelDims(d_model=16, n_layers=2, vocab_size=8), 0)
    rank = build(CONFIG, ModelDims(d_model=16, n_layers=2, vocab_size=8, tp_rank=1, tp_size=2), 0)
    rank.load_state_dict({n: t.chunk(2, 1)[1] if n in ("qkv_weight", "conv_weight") else rank.state_dict()[n]
                          for n, t in whole.state_dict().items()})
    x = torch.randn(1, 5, 16)
    q, k, v = whole.project(x).unflatten(-1, (3, 4, 8)).unbind(2)  # heads 2 and 3 are rank 1's
    expected = torch.cat([q[:, :, 2:], k[:, :, 2:], v[:, :, 2:]], 2).flatten(2)
    assert_close(rank.project(x), expected, 1e-6, "rank 1's q, k, v projection")


@pytest.mark.parametrize("config", [CONFIG, KDAConfig(n_heads=4, head_dim=8, gate_rank=4, out_gate_bias=True)])
def test_the_estimate_gives_a_ranks_parameters(config):
    """The estimate at ``tp_size`` gives the bytes rank 0 builds at tp = 1, 2 and 4 (the gates' down-projections
    are whole on each rank, so halving the one-process count would be short of them)."""
    for tp in (1, 2, 4):
        dims = ModelDims(d_model=16, n_layers=2, vocab_size=8, tp_size=tp)
        built = sum(p.numel() * p.element_size() for p in build(config, dims, 0).parameters())
        assert built == memory_estimate(config, dims, 64).parameters
        assert tp == 1 or built > memory_estimate(config, ModelDims(16, 2, 8), 64).parameters // tp


def test_the_estimates_chunk_group_does_not_shrink_with_the_heads():
    """Backward's intra-chunk graph runs at most ``GROUP_HEAD_TOKENS`` (token, head) pairs at once: with one
    head per rank at 16k tokens that is as many as with two, so a rank's temporary is more than half of it."""
    whole = memory_estimate(KDAConfig(n_heads=2, head_dim=64), ModelDims(128, 2, 8), 16384)
    rank = memory_estimate(KDAConfig(n_heads=2, head_dim=64), ModelDims(128, 2, 8, tp_size=2), 16384)
    assert rank.temporary > whole.temporary / 2
