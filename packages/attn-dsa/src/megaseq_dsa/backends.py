"""Which implementation runs DSA's two operations, top-k selection and sparse attention.

- ``torch``: ``megaseq_dsa.ops.select_topk`` and ``sparse_attention`` (anywhere; numpy's selection on CPU).
- ``triton``: ``megaseq_dsa.ops.triton`` (CUDA; on CPU only under ``TRITON_INTERPRET=1``, for tests); the
  same arguments and results, pooled selection included. Its kernel scores in fp32, so ``index_scores =
  "bf16"`` with ``backend = "triton"`` is refused in the recipe; under ``auto`` the selection runs torch's bf16
  path on the same device (logged once) and sparse attention runs the kernel.
- ``native``: CPU only; selection (fp32 scores; bf16 scores run torch's path), sparse attention and the
  indexer loss by C kernels compiled on this machine on first use (``megaseq_dsa.ops.native``: needs a C
  compiler).
- ``auto``: triton where it is installed and runs on the tensors' device, else native where the tensors are
  on the CPU and the kernels build, else torch (logged).

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


def _native() -> DSAOps:
    from megaseq_dsa.ops import native

    def select(q_idx, k_idx, weights, topk, cu_seqlens, pool, query_positions, query_chunk, scores="fp32"):
        return native.select_topk(q_idx, k_idx, weights, topk, cu_seqlens, pool, query_positions, scores=scores)

    return DSAOps(select, native.sparse_attention, native.sparse_attention_with_indexer_kl)


def _native_unavailable() -> str | None:
    from megaseq_dsa.ops.native.build import unavailable

    return unavailable()


def plans_native(backend: str) -> bool:
    """Whether the memory plan counts the native kernels' buffers for a layer with this ``backend`` setting:
    ``native``, or ``auto`` where the kernels build (a plan does not know the run's device: on CUDA ``auto``
    runs triton, whose working set is the native kernels' size, not the PyTorch path's chunk buffers)."""
    return backend == "native" or (backend == "auto" and _native_unavailable() is None)


BACKENDS = Backends(
    "attention.dsa",
    [
        Backend("torch", load=_torch),
        Backend("triton", load=_triton, requires=("triton",), install="pip install 'megaseq-attn-dsa[triton]'",
                devices=("cuda",), interpretable=True),
        Backend("native", load=_native, devices=("cpu",), unavailable=_native_unavailable),
    ],
    auto=("triton", "native", "torch"),
)
