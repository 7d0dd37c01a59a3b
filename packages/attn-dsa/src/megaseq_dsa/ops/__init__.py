"""DeepSeek Sparse Attention operations in pure PyTorch: indexer top-k selection and sparse MQA attention.

Each fast path has a dense oracle beside it in `reference.py`; `tests/test_ops.py` compares them.
"""

from megaseq_dsa.ops.indexer import select_topk, selected_slots
from megaseq_dsa.ops.reference import (
    indexer_scores_reference,
    select_topk_reference,
    sparse_attention_reference,
)
from megaseq_dsa.ops.sparse import sparse_attention, sparse_attention_with_lse

__all__ = [
    "indexer_scores_reference",
    "select_topk",
    "select_topk_reference",
    "selected_slots",
    "sparse_attention",
    "sparse_attention_reference",
    "sparse_attention_with_lse",
]
