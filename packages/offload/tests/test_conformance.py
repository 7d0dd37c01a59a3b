"""The ``recompute`` and ``offload`` policies pass core's memory-policy suite.

Every recompute part keeps the order of operations, so its results are bitwise those without the policy;
tiles change the order (the feed-forward and the attention run per tile), so they are held to 1e-6 relative,
and tiles cannot run under context parallelism, which the suite checks raises. The context-parallel test
spawns two gloo processes, so it runs for whole-block recompute and for offload only.
"""

from typing import Any, ClassVar

from megaseq_testkit.memory_policy import MemoryPolicyConformance


class TestRecomputeBlocks(MemoryPolicyConformance):
    name = "recompute"
    config: ClassVar[dict[str, Any]] = {"part": "block"}


class TestRecomputeAttention(MemoryPolicyConformance):
    name = "recompute"
    config: ClassVar[dict[str, Any]] = {"part": "attention", "layers": [1, 3]}
    test_context_parallel = None  # the same mechanism as whole blocks, which run it


class TestRecomputeFeedForward(MemoryPolicyConformance):
    name = "recompute"
    config: ClassVar[dict[str, Any]] = {"part": "ffn", "layers": [0, 2]}
    test_context_parallel = None


class TestRecomputeTiles(MemoryPolicyConformance):
    name = "recompute"
    config: ClassVar[dict[str, Any]] = {"part": "block", "tile_tokens": 16}
    exact = False
    probe_noise = False  # a tiled block calls its feed-forward once per tile


class TestOffload(MemoryPolicyConformance):
    name = "offload"
    config: ClassVar[dict[str, Any]] = {"min_bytes": 1024}
