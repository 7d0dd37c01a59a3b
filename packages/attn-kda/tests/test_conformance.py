"""The ``kda`` component passes core's attention conformance suite, with both forget-gate forms.

Small heads (2 x 8) keep the suite fast; the backend is ``auto``, which is the chunked op on CPU. The suite's
context-parallel test runs 2 gloo ranks, packed and not; 4 ranks are in test_parallel.py.
"""

from typing import Any, ClassVar

from megaseq_testkit.attention import AttentionConformance


class TestKDABounded(AttentionConformance):
    name = "kda"
    config: ClassVar[dict[str, Any]] = {"n_heads": 2, "head_dim": 8, "gate": "bounded"}


class TestKDASoftplus(AttentionConformance):
    name = "kda"
    config: ClassVar[dict[str, Any]] = {"n_heads": 2, "head_dim": 8, "gate": "softplus", "gate_rank": 4}
