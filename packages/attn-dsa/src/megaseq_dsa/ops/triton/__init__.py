"""Triton kernels for DeepSeek Sparse Attention: indexer top-k selection and sparse MQA attention.

Importing this subpackage imports triton; nothing else in megaseq_dsa does. The kernels run on CUDA
tensors, or on CPU tensors under ``TRITON_INTERPRET=1`` (set before triton is first imported), which is
how they are tested against the dense torch references.
"""

from megaseq_dsa.ops.triton.indexer import select_topk_triton
from megaseq_dsa.ops.triton.sparse import SparseAttentionTriton, sparse_attention_triton

__all__ = ["SparseAttentionTriton", "select_topk_triton", "sparse_attention_triton"]
