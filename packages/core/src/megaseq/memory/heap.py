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

Huge pages. A fresh page costs a page fault, and a step whose large allocations have their own maps
(:func:`map_large_allocations`) faults in every page of each one: at 1M tokens hundreds of millions of 4 KiB
faults, over a quarter of the step. Torch's CPU allocator asks the kernel for transparent huge pages for its
allocations of 2 MiB and more when ``THP_MEM_ALLOC_ENABLE=1`` (a 2 MiB page per fault); it reads the variable
once, at the process's first CPU allocation. A run whose large allocations will be mapped calls
:func:`ask_for_huge_pages` before its first tensor. Where they stay in the heap the variable costs memory
(torch then aligns them to pages, and the heap keeps more of what they free: the default recipe's `megaseq
train` at 8k peaked at 1.58 GiB with it against 1.21 without, for a plan of 1.13) and, trimmed, time (a trim
splits huge pages: +6-8% CPU at 64k), so it is left unset there. :func:`huge_pages` says what the process got.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from pathlib import Path
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
HUGE_PAGES = "THP_MEM_ALLOC_ENABLE"  # torch's CPU allocator's switch
HUGE_PAGE_BYTES = 2 * 2**20  # x86-64's and arm64's (4 KiB base pages) transparent huge page
KERNEL_HUGE_PAGES = Path("/sys/kernel/mm/transparent_hugepage/enabled")


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


def ask_for_huge_pages() -> bool:
    """Have torch's CPU allocator ask for huge pages (``THP_MEM_ALLOC_ENABLE=1``, module docstring) where the
    user left the variable unset, and say whether it does. Only before the process's first CPU tensor:
    after it, torch has read the variable, and it is taken back so that child processes (whose runs may keep
    their large allocations in the heap) do not inherit it."""
    if HUGE_PAGES in os.environ:
        return os.environ[HUGE_PAGES] == "1"
    os.environ[HUGE_PAGES] = "1"
    if _torch_asks():
        return True
    del os.environ[HUGE_PAGES]
    return False


def _torch_asks() -> bool:
    """Whether torch's allocator read ``THP_MEM_ALLOC_ENABLE=1``: then it aligns a large tensor to a page
    (else to 64 bytes, which a mapped chunk's header keeps off the page) and the kernel marks its mapping."""
    probe = torch.empty(2 * HUGE_PAGE_BYTES, dtype=torch.uint8)
    address = probe.data_ptr()
    return address % 4096 == 0 and (kernel_huge_pages() == "always" or bool(_huge_page_eligible(address)))


def kernel_huge_pages() -> str | None:
    """The kernel's transparent huge page mode (``always``, ``madvise`` or ``never``), ``None`` without one."""
    try:
        words = KERNEL_HUGE_PAGES.read_text().split()
    except OSError:
        return None
    return next((word.strip("[]") for word in words if word.startswith("[")), None)


def huge_pages() -> str:
    """Whether this process's large CPU tensors get huge pages, for the run header: what the kernel says of
    a fresh 4 MiB tensor's mapping (``THPeligible`` in ``/proc/self/smaps``), which covers both torch's
    request and the kernel's mode."""
    probe = torch.empty(2 * HUGE_PAGE_BYTES, dtype=torch.uint8)
    eligible = _huge_page_eligible(probe.data_ptr())
    if eligible is None:
        return "huge pages unknown (no /proc/self/smaps)"
    if eligible:
        return f"huge pages from {HUGE_PAGE_BYTES // 2**20} MiB (kernel: {kernel_huge_pages()})"
    if kernel_huge_pages() in (None, "never"):
        return f"no huge pages (the kernel's transparent huge pages are {kernel_huge_pages() or 'absent'})"
    return "no huge pages"


def _huge_page_eligible(address: int) -> bool | None:
    """The kernel's ``THPeligible`` for the mapping holding ``address``; ``None`` where it does not say."""
    try:
        lines = Path("/proc/self/smaps").read_text().splitlines()
    except OSError:
        return None
    inside = False
    for line in lines:
        head = line.split(" ", 1)[0]
        if "-" in head and ":" not in head:  # a mapping's first line: "start-end perms ..."
            start, end = (int(bound, 16) for bound in head.split("-"))
            inside = start <= address < end
        elif inside and line.startswith("THPeligible:"):
            return line.split()[1] == "1"
    return None


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


__all__ = [
    "HUGE_PAGES",
    "apply_run_setting",
    "ask_for_huge_pages",
    "available",
    "huge_pages",
    "kernel_huge_pages",
    "map_large_allocations",
    "return_freed_memory",
    "trim_at_block_boundaries",
]
