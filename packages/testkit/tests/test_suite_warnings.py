"""A conformance-suite run prints no warning from core's own code: a plugin author's test output shows only
what their component causes."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path

import pytest

import megaseq
from megaseq_testkit.attention import AttentionConformance
from megaseq_testkit.ffn import FeedForwardConformance
from megaseq_testkit.memory_policy import MemoryPolicyConformance

CORE = Path(megaseq.__file__).parent


def core_warnings(run: Callable[[], None]) -> list[str]:
    """Warnings raised from a file of core's package while ``run()`` runs."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run()
    return [f"{w.filename}:{w.lineno}: {w.message}" for w in caught if Path(w.filename).is_relative_to(CORE)]


class _Attention(AttentionConformance):
    name = "sdpa"
    config = {"n_heads": 2}


class _FeedForward(FeedForwardConformance):
    name = "swiglu"


class _Policy(MemoryPolicyConformance):
    name = "checkpoint-blocks"
    factory = f"{Path(__file__).with_name('test_memory_policy_conformance.py')}:CheckpointBlocks"


@pytest.mark.parametrize(
    "check",
    [_Attention().test_packed_equals_separate, _Attention().test_memory_estimate, _FeedForward().test_gradients,
     _Policy().test_same_loss_gradients_losses_and_metrics],
    ids=["attention-packed", "attention-memory", "ffn-gradients", "memory-policy-probe"],
)
def test_suite_runs_warn_nothing_from_core(check: Callable[[], None]) -> None:
    assert core_warnings(check) == []


def test_a_warning_from_core_is_seen() -> None:
    def warns() -> None:
        warnings.warn_explicit("planted", UserWarning, str(CORE / "contracts.py"), 1)

    assert core_warnings(warns) == [f"{CORE / 'contracts.py'}:1: planted"]
