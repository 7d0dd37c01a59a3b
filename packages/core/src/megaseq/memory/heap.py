"""The C library's heap on a CPU run: freed memory given back, so that resident memory follows live memory.

glibc serves allocations below its mmap threshold from the heap. The threshold is dynamic: it rises to the
size of any mapped block that is freed, up to 32 MiB, so after the first step nearly every activation-sized
buffer of a model of width 128 comes from the heap. Freed heap chunks stay resident until reused, and a
training step frees and allocates such buffers all along, in changing sizes, so resident memory grows well
above live memory.

Two remedies, both process-wide:

- :func:`trim_at_block_boundaries` (``run.trim_heap``; by default on CPU runs from ``TRIM_FROM_TOKENS``
  tokens per device): ``malloc_trim(0)`` after every residual block's forward and before every block's
  backward. Each call hands the heap's free pages back at once; the allocations that reuse them fault them
  in again. Below the threshold a step's activations are small and the page faults cost as large a share of
  the step, for little memory.
- :func:`map_large_allocations`: every allocation from ``min_bytes`` up gets its own map, which leaves at
  once when freed. Tighter, and what a policy that offloads to scratch files uses
  (``MemoryEffect.maps_allocations_from``), but every fresh page faults, which costs more
  CPU time than trimming.

``benchmarks/train_throughput.py`` measures both trades (``docs/results.md``, "The C library's heap").

Neither exists outside glibc (:func:`available`). :func:`apply_run_setting` applies ``run.trim_heap`` to a
built model and says what it did, for the run header.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle


def _glibc() -> Any:
    """The C library if it is glibc (it has ``malloc_trim`` and ``mallopt``), else ``None``."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "malloc_trim") and hasattr(libc, "mallopt") else None


_GLIBC = _glibc()
_M_MMAP_THRESHOLD = -3
# ``run.trim_heap = "auto"`` trims from this many tokens per device: below it the CPU recipes' activations
# are about a GiB or less, and the page faults cost as large a share of a step as at 64k.
TRIM_FROM_TOKENS = 32768


def available() -> bool:
    """Whether this process's C library is glibc, so that the functions below do something."""
    return _GLIBC is not None


def return_freed_memory() -> None:
    """Give the heap's free pages back to the system (glibc ``malloc_trim(0)``): tens of milliseconds for a
    heap of a few GiB, so call it at coarse boundaries."""
    if _GLIBC is not None:
        _GLIBC.malloc_trim(0)


def map_large_allocations(min_bytes: int) -> None:
    """Serve every allocation of ``min_bytes`` or more by its own memory map (glibc ``mallopt``; this also
    stops the threshold from rising). Permanent for the process."""
    if _GLIBC is not None:
        _GLIBC.mallopt(_M_MMAP_THRESHOLD, min_bytes)


def trim_at_block_boundaries(blocks: nn.ModuleList) -> list[RemovableHandle]:
    """Return freed heap memory after each block's forward and, in backward, when the gradient reaches the
    block's output (before the block's own backward runs). Only forwards that record a graph trim: evaluation
    and token-by-token decoding (a block call per token) keep little and would pay a call per block. The
    handles remove the forward hooks."""

    def after_forward(_module: nn.Module, _inputs: Any, output: Any) -> None:
        if not torch.is_grad_enabled():
            return
        return_freed_memory()
        out = output[0] if isinstance(output, tuple) else output
        if isinstance(out, Tensor) and out.requires_grad:
            out.register_hook(_trim_in_backward)

    return [block.register_forward_hook(after_forward) for block in blocks]


def _trim_in_backward(_grad: Tensor) -> None:
    return_freed_memory()


def apply_run_setting(trim_heap: bool | str, device: torch.device, tokens_per_device: int, blocks: nn.ModuleList) -> str:
    """Apply ``run.trim_heap`` to a model's blocks (:func:`trim_at_block_boundaries` where it acts) and
    return what the run header says about the heap."""
    if device.type != "cpu":
        return f"not trimmed (run.trim_heap acts on CPU runs; this one is on {device.type})"
    if not trim_heap:
        return "not trimmed (run.trim_heap = false)"
    if trim_heap == "auto" and tokens_per_device < TRIM_FROM_TOKENS:
        return f"not trimmed (run.trim_heap = 'auto' trims from {TRIM_FROM_TOKENS:,} tokens per device, this run has {tokens_per_device:,})"
    if not available():
        return "not trimmed (the C library is not glibc, which run.trim_heap needs)"
    trim_at_block_boundaries(blocks)
    return "trimmed at block boundaries"


__all__ = ["apply_run_setting", "available", "map_large_allocations", "return_freed_memory", "trim_at_block_boundaries"]
