"""Which implementation runs DSA's two operations, top-k selection and sparse attention.

- ``torch``: ``megaseq_dsa.ops.select_topk`` and ``sparse_attention`` (anywhere; numpy's selection on CPU).
- ``triton``: ``megaseq_dsa.ops.triton`` (CUDA; on CPU only under ``TRITON_INTERPRET=1``, for tests); the
  same arguments and results, pooled selection included. Its kernel scores in fp32, so ``index_scores =
  "bf16"`` with ``backend = "triton"`` is refused in the recipe; under ``auto`` the selection runs torch's bf16
  path on the same device (logged once) and sparse attention runs the kernel.
- ``auto``: triton where it is installed and runs on the tensors' device, else torch (logged).

The rule is core's (``megaseq.backends``): a requested backend whose package is missing fails when the layer
is built, one that cannot run on the tensors' device fails at the call; nothing falls back silently.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor

from megaseq.backends import Backend, Backends


@dataclass(frozen=True)
class DSAOps:
    """``select_topk(q_idx, k_idx, weights, topk, cu_seqlens, pool, query_positions, query_chunk, scores)`` ->
    int32 indices (``scores``: the recipe's ``index_scores``); ``sparse_attention(q, key, value, indices, scale, query_chunk)`` -> outputs.
    ``query_chunk``: the layer's memory knob (``None``: by memory); a backend may ignore it.
    ``sparse_attention_with_indexer_kl(q, key, value, indices, scale, q_idx, k_idx, weights, query_chunk)`` ->
    (outputs, summed indexer KL) in one pass, where the backend has it (else the layer calls
    ``megaseq_dsa.indexer.indexer_kl`` after ``sparse_attention``)."""

    select_topk: Callable[..., Tensor]
    sparse_attention: Callable[..., Tensor]
    sparse_attention_with_indexer_kl: Callable[..., tuple[Tensor, Tensor]] | None = None


def _torch() -> DSAOps:
    from megaseq_dsa.ops import select_topk, sparse_attention, sparse_attention_with_indexer_kl

    def select(q_idx, k_idx, weights, topk, cu_seqlens, pool, query_positions, query_chunk, scores="fp32"):
        block = {"query_block": query_chunk} if query_chunk else {}
        return select_topk(q_idx, k_idx, weights, topk, cu_seqlens, pool, query_positions, **block, scores=scores)

    return DSAOps(select, sparse_attention, sparse_attention_with_indexer_kl)


def _triton() -> DSAOps:
    from megaseq_dsa.ops import select_topk
    from megaseq_dsa.ops.triton import select_topk_triton, sparse_attention_triton

    logged: set[str] = set()

    def select(q_idx, k_idx, weights, topk, cu_seqlens, pool, query_positions, query_chunk, scores="fp32"):
        # the kernel scores in fp32: bf16 scores are torch's (on the same device)
        if scores == "fp32":
            return select_topk_triton(q_idx, k_idx, weights, topk, cu_seqlens, pool, query_positions)
        if not logged:
            logged.add(scores)
            logging.getLogger("megaseq.backends").info(
                "attention.dsa: index_scores = 'bf16' (the triton kernel scores in fp32): selection runs torch's "
                "path; sparse attention runs the triton kernel")
        return select_topk(q_idx, k_idx, weights, topk, cu_seqlens, pool, query_positions, scores=scores)

    def attend(q, key, value, indices, scale, query_chunk):
        return sparse_attention_triton(q, key, value, indices, scale)

    return DSAOps(select, attend)


BACKENDS = Backends(
    "attention.dsa",
    [
        Backend("torch", load=_torch),
        Backend("triton", load=_triton, requires=("triton",), install="pip install 'megaseq-attn-dsa[triton]'",
                devices=("cuda",), interpretable=True),
    ],
    auto=("triton", "torch"),
)
