"""The feed-forward conformance suite passes core's ``swiglu`` and a small correct component, and catches a
wrong component for every check (``ffn_variants.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from megaseq.testing.ffn import FeedForwardConformance

VARIANTS = Path(__file__).with_name("ffn_variants.py")


class TestSwiGLU(FeedForwardConformance):
    name = "swiglu"
    config = {"hidden": 24}


class TestToyFFN(FeedForwardConformance):
    name = "toy"
    factory = f"{VARIANTS}:ToyFFN"
    d_model = 8


CAUGHT = [
    ("UpcastsOutput", "test_shape_and_dtype", "output dtype"),
    ("MixesTokens", "test_per_token", "tokens left unchanged"),
    ("DetachedWeight", "test_gradients", "w1.weight receives no gradient"),
    ("WrongBackward", "test_gradients", "gradient of the input"),
    ("GlobalNoise", "test_deterministic", "global random generator"),
    ("NormalisesWithoutEpsilon", "test_zero_input", "non-finite output"),
    ("ReadsBoundariesEveryLayer", "test_one_host_sync_per_batch", "2 times"),
]


@pytest.mark.parametrize(("variant", "test", "message"), CAUGHT, ids=[f"{v}-{t}" for v, t, _ in CAUGHT])
def test_suite_catches(variant: str, test: str, message: str) -> None:
    class Suite(FeedForwardConformance):
        name = variant
        factory = f"{VARIANTS}:{variant}"
        d_model = 8

    with pytest.raises(AssertionError, match=message):
        getattr(Suite(), test)()
