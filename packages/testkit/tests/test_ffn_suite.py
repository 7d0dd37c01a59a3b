"""The feed-forward conformance suite passes core's ``swiglu`` and a small correct component, and catches a
wrong component for every check (``ffn_variants.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from megaseq_testkit.ffn import FeedForwardConformance

VARIANTS = Path(__file__).with_name("ffn_variants.py")


class TestSwiGLU(FeedForwardConformance):
    name = "swiglu"
    config = {"hidden": 24}


class TestToyFFN(FeedForwardConformance):
    name = "toy"
    factory = f"{VARIANTS}:ToyFFN"
    memory = f"{VARIANTS}:toy_memory"
    d_model = 8


CAUGHT = [
    ("UpcastsOutput", "test_shape_and_dtype", "output dtype"),
    ("MixesTokens", "test_per_token", "tokens left unchanged"),
    ("DetachedWeight", "test_gradients", "w1.weight receives no gradient"),
    ("WrongBackward", "test_gradients", "gradient of the input"),
    ("GlobalNoise", "test_deterministic", "global random generator"),
    ("NormalisesWithoutEpsilon", "test_zero_input", "non-finite output"),
    ("ReadsBoundariesEveryLayer", "test_one_host_sync_per_batch", "2 times"),
    ("StashesInput", "test_two_forwards_one_backward", "two forwards before one backward, gradient of w2.weight"),
    ("ToyFFN:toy_memory_third", "test_memory_estimate", r"saved_per_token: at 64 tokens .* \(0.33x"),
    ("ToyFFN:toy_memory_temporary_tenth", "test_temporary_estimate",
     r"ToyFFN temporary: at 64 tokens the estimate is 1638 bytes, .* \(backward\) is 16384 \(0.10x; bound 0.75x to 4x\)"),
]


@pytest.mark.parametrize(("variant", "test", "message"), CAUGHT, ids=[f"{v}-{t}" for v, t, _ in CAUGHT])
def test_suite_catches(variant: str, test: str, message: str) -> None:
    variant, _, memory = variant.partition(":")

    class Suite(FeedForwardConformance):
        name = variant
        factory = f"{VARIANTS}:{variant}"
        d_model = 8

    Suite.memory = f"{VARIANTS}:{memory or 'toy_memory'}"

    with pytest.raises(AssertionError, match=message):
        getattr(Suite(), test)()
