"""Where the packed documents of a row lie: read once per batch, shared by every layer.

A packed row (batch size 1) holds several documents back to back; ``cu_seqlens`` (int32/int64 ``[N + 1]``,
non-decreasing from 0 to the row's length, empty documents allowed) are their boundaries. Every component
needs the same few derived facts: the boundaries on the host (to plan loops and kernel grids), the
document of every position and where it starts (masks, rotary positions, convolution restarts), and the
documents seen by a window of the sequence (a context-parallel segment).

:class:`Documents` computes them once per batch. Building it reads ``cu_seqlens`` to the host: that is the
batch's only host synchronisation (``.tolist()`` of a CUDA tensor waits for the device). Everything else is
derived from the host copy or computed on the device from the tensor, and memoized, so a model with 40
layers pays for it once. ``ForwardContext.documents`` builds it on first use; a component's own derived
layout (e.g. a kernel's chunk plan) is memoized with :meth:`Documents.derive`, so it too is built once per
forward instead of once per layer.

Ops that take ``cu_seqlens`` accept either a tensor or a :class:`Documents` and call :func:`as_documents`:
a layer passes ``ctx.documents`` (no synchronisation), a direct caller may pass a tensor (one).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Hashable
from typing import Any, TypeVar

import torch
from torch import Tensor

T = TypeVar("T")


def check_offsets(offsets: list[int] | tuple[int, ...], length: int | None = None, *, who: str = "cu_seqlens") -> None:
    """Raise a one-line ValueError unless ``offsets`` rise from 0 (to ``length``) without decreasing."""
    if len(offsets) < 2 or offsets[0] != 0 or any(b < a for a, b in itertools.pairwise(offsets)):
        raise ValueError(f"{who} must rise from 0 without decreasing ([N + 1], N >= 1), got {list(offsets)}")
    if length is not None and offsets[-1] != length:
        raise ValueError(f"{who} must end at the sequence length {length}, got {list(offsets)}")


class Documents:
    """The document layout of one packed row (see the module docstring).

    ``offsets``: the boundaries on the host, a tuple of ints. ``tensor``: the ``cu_seqlens`` tensor given
    (on its own device). Device tensors (``doc_ids``, ``starts``, ...) are computed from ``tensor`` on the
    device, without a host synchronisation, once per device.
    """

    def __init__(self, cu_seqlens: Tensor, offsets: tuple[int, ...] | None = None) -> None:
        if not isinstance(cu_seqlens, Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.dtype not in (
            torch.int32,
            torch.int64,
        ):
            what = f"{cu_seqlens.dtype} tensor of shape {tuple(cu_seqlens.shape)}" if isinstance(
                cu_seqlens, Tensor
            ) else type(cu_seqlens).__name__
            raise ValueError(f"cu_seqlens must be a 1-D int32/int64 tensor [N + 1], got a {what}")
        if offsets is None:
            offsets = tuple(cu_seqlens.tolist())  # the one host synchronisation
        check_offsets(offsets)
        self.tensor = cu_seqlens
        self.offsets: tuple[int, ...] = offsets
        self._memo: dict[Hashable, Any] = {}

    @classmethod
    def from_offsets(cls, offsets: list[int] | tuple[int, ...], device: torch.device | str | None = None) -> Documents:
        """Documents from host boundaries (no synchronisation at all)."""
        offsets = tuple(int(b) for b in offsets)
        check_offsets(offsets)
        return cls(torch.tensor(offsets, dtype=torch.int32, device=device), offsets)

    # -- host facts -----------------------------------------------------------------------------------
    @property
    def length(self) -> int:
        """Tokens in the row."""
        return self.offsets[-1]

    @property
    def n_docs(self) -> int:
        return len(self.offsets) - 1

    @property
    def bounds(self) -> list[tuple[int, int]]:
        """``[start, end)`` of every document, empty ones included."""
        return list(itertools.pairwise(self.offsets))

    @property
    def lengths(self) -> list[int]:
        return [end - start for start, end in self.bounds]

    def window(self, start: int, end: int) -> tuple[Documents, bool]:
        """The documents seen by the positions ``[start, end)``, as offsets relative to ``start``, and whether
        the first of them continues a document begun before ``start``. Memoized."""

        def build() -> tuple[Documents, bool]:
            if not 0 <= start <= end <= self.length:
                raise ValueError(f"window [{start}, {end}) is outside the row of {self.length} tokens")
            inside = sorted({b for b in self.offsets if start < b < end})
            relative = (0, *(b - start for b in inside), end - start)
            # a document starting exactly at ``start`` (a start offset, not only the row's end) owes nothing
            return Documents.from_offsets(relative, self.tensor.device), start not in self.offsets[:-1]

        return self.derive(("megaseq.window", start, end), build)

    # -- device facts (computed on the device, memoized per device) ---------------------------------------
    def on(self, device: torch.device | str, dtype: torch.dtype = torch.int64) -> Tensor:
        """``cu_seqlens`` on ``device`` as ``dtype``."""
        device = torch.device(device)
        return self.derive(("megaseq.cu_seqlens", device, dtype), lambda: self.tensor.to(device=device, dtype=dtype))

    def doc_ids(self, device: torch.device | str) -> Tensor:
        """Document index of every position, int64 ``[length]``."""
        device = torch.device(device)

        def build() -> Tensor:
            positions = torch.arange(self.length, device=device)
            return torch.searchsorted(self.on(device)[1:], positions, right=True)

        return self.derive(("megaseq.doc_ids", device), build)

    def starts(self, device: torch.device | str) -> Tensor:
        """First position of every position's document, int64 ``[length]``."""
        device = torch.device(device)
        return self.derive(("megaseq.starts", device), lambda: self.on(device)[self.doc_ids(device)])

    def ends(self, device: torch.device | str) -> Tensor:
        """End (exclusive) of every position's document, int64 ``[length]``."""
        device = torch.device(device)
        return self.derive(("megaseq.ends", device), lambda: self.on(device)[self.doc_ids(device) + 1])

    def positions_in_doc(self, device: torch.device | str) -> Tensor:
        """Offset of every position in its document, int64 ``[length]`` (rotary positions, conv restarts)."""
        device = torch.device(device)

        def build() -> Tensor:
            return torch.arange(self.length, device=device) - self.starts(device)

        return self.derive(("megaseq.positions_in_doc", device), build)

    # -- component-derived layouts ----------------------------------------------------------------------
    def derive(self, key: Hashable, build: Callable[[], T]) -> T:
        """``build()`` once per batch for ``key``, then the memoized result: for a layout derived from these
        documents (a kernel's chunk plan, index tensors). Put the device and every parameter the result
        depends on in ``key``, and prefix it with your package name. Results must not require gradients."""
        if key not in self._memo:
            self._memo[key] = build()
        return self._memo[key]

    def __repr__(self) -> str:
        return f"Documents(offsets={list(self.offsets)})"


def as_documents(
    cu_seqlens: Tensor | Documents, *, batch: int | None = None, length: int | None = None, who: str = "cu_seqlens"
) -> Documents:
    """``cu_seqlens`` as :class:`Documents` (a tensor is read to the host once; :class:`Documents` pass as
    they are), checked against the batch size (must be 1: documents are packed along the sequence) and the
    sequence length. Errors are one-line ValueErrors."""
    if batch is not None and batch != 1:
        raise ValueError(f"{who} needs packed documents in a batch of 1 (documents lie along T), got batch size {batch}")
    documents = cu_seqlens if isinstance(cu_seqlens, Documents) else Documents(cu_seqlens)
    if length is not None:
        check_offsets(documents.offsets, length, who=who)
    return documents


__all__ = ["Documents", "as_documents", "check_offsets"]
