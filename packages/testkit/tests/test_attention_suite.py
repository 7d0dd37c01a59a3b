"""The attention conformance suite passes a small correct component and catches a wrong one for every check.

``attention_variants.py`` holds the components; each wrong variant differs from ``ToyAttention`` in one
thing. Every case runs one suite test on one variant and expects it to fail with an AssertionError (the
suite turns errors of the gloo ranks into assertion failures too).
"""

from __future__ import annotations

from pathlib import Path

import pytest

import megaseq_testkit.attention
from megaseq_testkit.attention import AttentionConformance

VARIANTS = Path(__file__).with_name("attention_variants.py")


def factory(cls: str) -> str:
    return f"{VARIANTS}:{cls}"


class TestToyAttention(AttentionConformance):
    """The correct component passes every check (context parallelism at 2 and 4 ranks included)."""

    name = "toy"
    factory = factory("ToyAttention")
    capabilities = frozenset({"context_parallel"})
    d_model = 8


class TestOptOut(AttentionConformance):
    """A component that declares no context parallelism and raises on ``ctx.cp`` passes."""

    name = "toy-no-cp"
    factory = factory("OptOutRaises")
    d_model = 8

    # only the opt-out check differs from TestToyAttention
    test_shape_and_dtype = test_causal = test_packed_equals_separate = test_decode_equals_forward = None
    test_gradients = test_deterministic = test_zero_input = test_padding_document = None
    test_one_host_sync_per_batch = test_two_forwards_one_backward = test_memory_estimate = None
    test_temporary_estimate = None


CAUGHT = [
    ("UpcastsOutput", "test_shape_and_dtype", "output dtype"),
    ("PeeksAhead", "test_causal", "outputs before the change"),
    ("CrossesDocuments", "test_packed_equals_separate", "packed output"),
    ("ForgetfulCache", "test_decode_equals_forward", "decode"),
    ("OneTokenSteps", "test_decode_equals_forward", "decode in steps of 3, 1, 5, 2 tokens"),
    ("StashesOutputInput", "test_two_forwards_one_backward", "two forwards before one backward, gradient of out.weight"),
    ("SumsMetric", "test_context_parallel", "metric 'toy/out_abs' \\(mean over ranks\\)"),
    ("DetachedProjection", "test_gradients", "gradient of qkv.weight"),
    ("FrozenByData", "test_gradients", "out.weight receives no gradient"),
    ("WrongBackward", "test_gradients", "gradient of the input"),
    ("GlobalNoise", "test_deterministic", "global random generator"),
    ("NormalisesWithoutEpsilon", "test_zero_input", "zeros: non-finite output"),
    ("NormalisesDocumentsWithoutEpsilon", "test_padding_document", "non-finite output"),
    ("ReadsBoundariesEveryLayer", "test_one_host_sync_per_batch", "2 times"),
    ("IgnoresContextParallel", "test_context_parallel", "cp2 rank 0 output"),
    ("TwoRanksOnly", "test_context_parallel", "cp4 rank 0 output"),
    ("SkipsGatherWhenUnneeded", "test_context_parallel", "context parallelism over 2 gloo ranks failed"),
    ("ToyAttention", "opt-out", "tried to communicate|DID NOT RAISE"),
]


# the context-parallel checks start gloo processes: outside the fast lane
CAUGHT_MARKED = [pytest.param(*c, marks=pytest.mark.slow) if c[1] == "test_context_parallel" else c for c in CAUGHT]


@pytest.mark.parametrize(("variant", "test", "message"), CAUGHT_MARKED, ids=[f"{v}-{t}" for v, t, _ in CAUGHT])
def test_suite_catches(variant: str, test: str, message: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # the toy's collectives take milliseconds: a rank left waiting in one was abandoned by its peers
    monkeypatch.setattr(megaseq_testkit.attention, "COLLECTIVE_TIMEOUT", 5.0)
    class Suite(AttentionConformance):
        name = variant
        factory = globals()["factory"](variant)
        d_model = 8
        capabilities = frozenset() if test == "opt-out" else frozenset({"context_parallel"})

    with pytest.raises((AssertionError, pytest.fail.Exception), match=message):
        getattr(Suite(), "test_context_parallel" if test == "opt-out" else test)()



def _suite(component: str, memory: str, d_model: int) -> AttentionConformance:
    """The suite on one of the kit's variants (or sdpa, with two heads) with a memory estimate of this file's."""
    knobs = {"name": component, "config": {"n_heads": 2} if component == "sdpa" else {}, "d_model": d_model,
             "factory": factory(component), "memory": factory(memory)}
    return type(f"Suite{component}", (AttentionConformance,), knobs)()

@pytest.mark.parametrize(
    ("factory_name", "memory", "message"),
    [
        ("sdpa", "sdpa_memory_third", r"at 64 tokens .* \(0.33x"),
        ("ToyAttention", "toy_memory_at_64", r"at 256 tokens .* \(0\.5\dx"),
    ],
)
def test_suite_holds_the_memory_estimate(factory_name: str, memory: str, message: str) -> None:
    """A 3x underestimate, and a per-token estimate right at one length of a component whose saved bytes grow
    as the square of the tokens (caught at the second length)."""

    with pytest.raises(AssertionError, match=message):
        _suite(factory_name, memory, d_model=32).test_memory_estimate()


@pytest.mark.parametrize(
    ("factory_name", "memory", "message"),
    [
        ("sdpa", "sdpa_memory", None),
        ("WideScratch", "no_temporary",
         r"WideScratch temporary: at 64 tokens the estimate is 0 bytes, the largest transient working set measured "
         r"\(forward\) is \d+ \(0.00x; bound 0.75x to 4x\): fix temporary"),
        ("sdpa", "sdpa_temporary_tenfold", r"sdpa temporary: at 64 tokens .* \(backward\) .* \(10.00x; bound 0.75x to 4x\)"),
    ],
)
def test_suite_holds_the_temporary_estimate(factory_name: str, memory: str, message: str | None) -> None:
    """sdpa with its own estimate passes; a component with a wide scratch buffer that its estimate does not
    declare is caught, and so is an estimate ten times the working set."""

    suite = _suite(factory_name, memory, d_model=32 if factory_name == "sdpa" else 8)
    if message is None:
        suite.test_temporary_estimate()
        return
    with pytest.raises(AssertionError, match=message):
        suite.test_temporary_estimate()


@pytest.mark.parametrize(
    ("variant", "memory", "message"),
    [
        ("KeepsOrder", "keeps_order_memory", None),
        ("KeepsOrder", "keeps_order_undeclared", r"at 64 tokens the estimate says it keeps 0 bytes for a re-run, it keeps 512"),
        ("ChangesKeptValue", "keeps_order_memory", r"a re-run with the kept values, output: differs"),
        ("ChangesKeptValueWhenPacked", "keeps_order_memory", r"\(packed documents\): a re-run with the kept values, output: differs"),
    ],
)
def test_suite_holds_what_is_kept_for_a_rerun(variant: str, memory: str, message: str | None) -> None:
    """A component that keeps a choice for recomputation's re-run passes with its bytes declared; it is caught
    when its estimate omits them, or when it changes the kept value after using it (also when only packed
    documents do)."""

    suite = _suite(variant, memory, d_model=8)
    if message is None:
        suite.test_kept_for_rerun()
        return
    with pytest.raises(AssertionError, match=message):
        suite.test_kept_for_rerun()
