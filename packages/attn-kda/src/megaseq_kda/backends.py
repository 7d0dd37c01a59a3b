"""Which KDA implementation runs the recurrence: every backend has the signature of ``ops.chunk_kda``.

- ``chunk``: the chunked PyTorch op (CPU fast path; also runs on CUDA, slowly).
- ``naive``: the token-loop oracle (tests only: a Python loop over tokens).
- ``triton``: this package's Triton kernels (CUDA; on CPU only under ``TRITON_INTERPRET=1``, for tests).
- ``fla``: fla-core's ``chunk_kda`` (CUDA only).
- ``auto``: triton on CUDA when triton is installed, else fla on CUDA when fla-core is installed, else chunk.

Availability of an explicitly requested backend is checked when the layer is built (a missing package); the
device is checked at each call, because a module can move between devices after it is built.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from megaseq_kda.ops import chunk_kda, naive_recurrent_kda

KDAOp = Callable[..., tuple[Tensor, Tensor | None]]

# backend -> (importable module it needs, what to install)
_REQUIREMENTS = {
    "triton": ("triton", "pip install 'megaseq-attn-kda[triton]'"),
    "fla": ("fla", "pip install fla-core"),
}


def is_installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def check_available(backend: str) -> None:
    """Raise a one-line ValueError if ``backend`` needs a package that is not installed."""
    if backend in _REQUIREMENTS:
        module, install = _REQUIREMENTS[backend]
        if not is_installed(module):
            raise ValueError(
                f"attention.kda: backend {backend!r} needs {module}, which is not installed ({install})"
            )


def resolve(backend: str, device: torch.device) -> str:
    """The concrete backend for tensors on ``device``."""
    if backend != "auto":
        return backend
    if device.type == "cuda":
        for candidate in ("triton", "fla"):
            if is_installed(_REQUIREMENTS[candidate][0]):
                return candidate
    return "chunk"


def kda_op(backend: str, device: torch.device) -> KDAOp:
    """The KDA function of ``backend`` (after ``resolve``) for tensors on ``device``."""
    name = resolve(backend, device)
    if name == "chunk":
        return chunk_kda
    if name == "naive":
        return naive_recurrent_kda
    check_available(name)
    if name == "triton":
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(
                f"attention.kda: backend 'triton' needs CUDA tensors (got {device.type}); on CPU use backend "
                "'chunk' (or set TRITON_INTERPRET=1 before importing triton, for tests)"
            )
        from megaseq_kda.ops.triton import chunk_kda_triton

        return chunk_kda_triton
    if name == "fla":
        if device.type != "cuda":
            raise ValueError(
                f"attention.kda: backend 'fla' needs CUDA tensors (got {device.type}); use 'chunk'"
            )
        return _fla_chunk_kda
    raise ValueError(f"attention.kda: unknown backend {backend!r}; allowed: auto, chunk, naive, triton, fla")


def _fla_chunk_kda(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    from fla.ops.kda import chunk_kda as fla_chunk_kda

    extra: dict[str, Any] = {}
    if cu_seqlens is not None:
        # fla wants the offsets on the device (int64) and reads a CPU copy to plan its chunks
        extra = {"cu_seqlens": cu_seqlens.to(q.device, torch.long), "cu_seqlens_cpu": cu_seqlens.cpu().long()}
    o, final_state = fla_chunk_kda(
        q,
        k,
        v,
        g,
        beta,
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        **extra,
    )
    return o, final_state
