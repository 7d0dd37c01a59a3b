"""Which KDA implementation runs the recurrence: every backend has the signature of ``ops.chunk_kda``.

- ``chunk``: the chunked PyTorch op (CPU fast path; also runs on CUDA, slowly).
- ``naive``: the token-loop oracle (tests only: a Python loop over tokens).
- ``triton``: this package's Triton kernels (CUDA; on CPU only under ``TRITON_INTERPRET=1``, for tests).
- ``fla``: fla-core's ``chunk_kda`` (CUDA only).
- ``native``: ``chunk`` with each chunk's gated Gram matrices and triangular solve by C kernels built on first
  use (``megaseq_kda.ops.native``; CPU, needs a C compiler).
- ``auto``: the first of triton, fla, native, chunk that is installed and runs on the tensors' device
  (logged, with why each one before it was passed over).

The rule is core's (``megaseq.backends``): a requested backend whose package is missing fails when the layer
is built, one that cannot run on the tensors' device fails at the call; nothing falls back silently.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from megaseq.backends import Backend, Backends
from megaseq.documents import Documents

KDAOp = Callable[..., tuple[Tensor, Tensor | None]]


def _chunk() -> KDAOp:
    from megaseq_kda.ops import chunk_kda

    return chunk_kda


def _naive() -> KDAOp:
    from megaseq_kda.ops import naive_recurrent_kda

    return naive_recurrent_kda


def _triton() -> KDAOp:
    from megaseq_kda.ops.triton import chunk_kda_triton

    return chunk_kda_triton


def _fla() -> KDAOp:
    return fla_chunk_kda


def _native() -> KDAOp:
    from megaseq_kda.ops.native import chunk_kda_native

    return chunk_kda_native


def _native_unavailable() -> str | None:
    from megaseq_kda.ops.native import unavailable

    return unavailable()


def plans_native(backend: str) -> bool:
    """Whether the memory plan counts the native Grams' working set for a layer with this ``backend`` setting:
    ``native``, or ``auto`` where the kernels build (a plan does not know the run's device)."""
    return backend == "native" or (backend == "auto" and _native_unavailable() is None)


BACKENDS = Backends(
    "attention.kda",
    [
        Backend("chunk", load=_chunk),
        Backend("naive", load=_naive),
        Backend("triton", load=_triton, requires=("triton",), install="pip install 'megaseq-attn-kda[triton]'",
                devices=("cuda",), interpretable=True),
        Backend("fla", load=_fla, requires=("fla",), install="pip install fla-core", devices=("cuda",)),
        Backend("native", load=_native, devices=("cpu",), unavailable=_native_unavailable),
    ],
    auto=("triton", "fla", "native", "chunk"),
)


def fla_chunk_kda(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: Tensor | Documents | None = None,
) -> tuple[Tensor, Tensor | None]:
    """fla-core's ``chunk_kda`` in this package's calling convention."""
    from fla.ops.kda import chunk_kda

    from megaseq_kda.ops.inputs import documents_of

    extra: dict[str, Any] = {}
    documents = documents_of(cu_seqlens, q.shape[0], q.shape[1])
    if documents is not None:
        # fla wants the offsets on the device (int64) and a CPU copy to plan its chunks (from the host offsets)
        extra = {
            "cu_seqlens": documents.on(q.device, torch.long),
            "cu_seqlens_cpu": torch.tensor(documents.offsets, dtype=torch.long),
        }
    return chunk_kda(
        q, k, v, g, beta, scale=scale, initial_state=initial_state, output_final_state=output_final_state, **extra
    )
