"""The MoE conformance suite run on a tiny loop-over-experts MoE (``moe_variants.py``), and failing wrong ones:
one per MoE-specific check, and one per feed-forward check whose class matters for an MoE (the feed-forward
suite's own wrong components are in ``test_ffn_suite.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from megaseq_testkit import load_factory
from megaseq_testkit.moe import MoEConformance

VARIANTS = Path(__file__).with_name("moe_variants.py")


class LoopSuite(MoEConformance):
    def given_weights(self, module, x, indices):
        return load_factory(f"{VARIANTS}:softmax_given_weights")(module, x, indices)


class TestLoopMoEConformance(LoopSuite):
    name = "loop-reference"
    factory = f"{VARIANTS}:LoopMoE"


CAUGHT = [
    ("IgnoresGivenIndices", "test_protocol", "must keep the given indices"),
    ("UnnormalisedForward", "test_matches_dense_reference", "output vs dense reference"),
    ("WrongBackwardMoE", "test_gradients_match_reference", "own routing: input gradient"),
    ("ChunkCappedMoE", "test_chunked_equals_unchunked", "chunk_tokens"),
    ("EvalCountsAsLoad", "test_load_stats", "eval-mode forward changed"),
    ("OverflowingRouter", "test_finite_at_large_inputs", "50x"),
    ("CappedMoE", "test_dropless_under_skew", "all-to-the-same-experts routing"),
    ("ReplayIgnoringMoE", "test_routing_replay", "replay"),
    ("DetachedExpertMoE", "test_gradients", "receives no gradient"),
    ("NoisyRouterMoE", "test_deterministic", "global random generator"),
    ("NormalisedRouterMoE", "test_zero_input", "non-finite output"),
    ("OwnWeightsForGiven", "test_route_given_experts", "weights vs given_weights"),
    ("LastChunkLoad", "test_load_stats", "with chunk_tokens=1"),
]


@pytest.mark.parametrize(("variant", "test", "message"), CAUGHT, ids=[f"{v}-{t}" for v, t, _ in CAUGHT])
def test_suite_catches(variant: str, test: str, message: str) -> None:
    class Suite(LoopSuite):
        name = variant
        factory = f"{VARIANTS}:{variant}"

    with pytest.raises(AssertionError, match=message):
        getattr(Suite(), test)()


def test_dense_reference_misses_a_detached_expert() -> None:
    """The reason for the finite-difference check: the dense reference shares the module's mistake."""

    class Suite(LoopSuite):
        name = "DetachedExpertMoE"
        factory = f"{VARIANTS}:DetachedExpertMoE"

    Suite().test_gradients_match_reference()
