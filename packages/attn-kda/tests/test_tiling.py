"""The ``kda`` component runs in sequence tiles (core's tiling suite): the carry is the recurrent state and
the convolution's last inputs, so tile lengths below the convolution width (1) and below a chunk (7) are
covered, as are documents that start at or run across tile boundaries."""

from typing import Any, ClassVar

from megaseq_testkit.tiling import SequenceTilingConformance


class TestKDATiling(SequenceTilingConformance):
    name = "kda"
    config: ClassVar[dict[str, Any]] = {"n_heads": 2, "head_dim": 8, "gate": "bounded"}
    seq_len = 45
    tile_sizes = (1, 7, 16, 45)


class TestKDATilingSoftplus(SequenceTilingConformance):
    name = "kda"
    config: ClassVar[dict[str, Any]] = {"n_heads": 2, "head_dim": 8, "gate": "softplus", "gate_rank": 4}
    tile_sizes = (20,)
