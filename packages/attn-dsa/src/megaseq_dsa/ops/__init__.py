"""DeepSeek Sparse Attention operations in PyTorch: indexer top-k selection and sparse MQA attention.

Each fast path has a dense oracle beside it in `reference.py`; `tests/test_ops.py` compares them. On CPU the
selection's per-row k-th value and nonzero run in numpy (much faster there than torch's).
"""

from megaseq_dsa.ops.indexer import select_topk, selected_slots, selection_recall
from megaseq_dsa.ops.reference import (
    indexer_scores_reference,
    select_topk_reference,
    sparse_attention_reference,
)
from megaseq_dsa.ops.sparse import sparse_attention, sparse_attention_with_indexer_kl, sparse_attention_with_lse

__all__ = [
    "indexer_scores_reference",
    "select_topk",
    "select_topk_reference",
    "selected_slots",
    "selection_recall",
    "sparse_attention",
    "sparse_attention_reference",
    "sparse_attention_with_indexer_kl",
    "sparse_attention_with_lse",
]
