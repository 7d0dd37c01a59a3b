"""The ``dsa`` component runs in sequence tiles (core's tiling suite): a tile's queries select among and
attend to the keys of all earlier tiles, which are its carry, in sparse training (with pooled keys and a
rotary part) and in the dense warm-up; the indexer loss of the tiles adds up to the untiled one."""

from typing import Any, ClassVar

from megaseq_testkit.tiling import SequenceTilingConformance

SMALL = {"n_heads": 3, "head_dim": 8, "q_lora_rank": 12, "kv_lora_rank": 8, "index_heads": 2, "index_dim": 8}


class TestSparseTiling(SequenceTilingConformance):
    name = "dsa"
    config: ClassVar[dict[str, Any]] = {**SMALL, "topk": 8}


class TestSparsePooledRopeTiling(SequenceTilingConformance):
    name = "dsa"
    config: ClassVar[dict[str, Any]] = {**SMALL, "topk": 8, "index_pool": 4, "rope": True, "rope_dim": 4}
    tile_sizes = (7, 45)


class TestDenseWarmupTiling(SequenceTilingConformance):
    name = "dsa"
    config: ClassVar[dict[str, Any]] = {**SMALL, "mode": "dense_warmup", "rope": True, "rope_dim": 4, "freeze_main_in_warmup": False}
    tile_sizes = (7, 45)
