"""Where offloaded tensors wait for backward: a scratch file on local disk (CPU) or a pinned host pool (CUDA).

Both allocate by bumping an offset, rounded to 4 KiB, in storage reserved up front (``reserve``: the
planner's prediction), and start again from the beginning once every tensor put has been read back.

**ScratchFile (CPU).** Made at the start of a step and closed at its end (also when the step raises): an
unnamed file (``O_TMPFILE`` where the file system has it, else created and unlinked at once), so no path ever
exists that a killed process could leave behind: the kernel frees the space when the last descriptor closes,
however the process ends. Tensors are written with ``pwrite`` and read back with ``preadv`` into fresh
tensors. The file's pages live in the kernel's page cache, outside the process's resident set, and are
written back to disk and dropped under memory pressure. Writing through a shared memory map instead puts every
written page into the process's resident set until it is unmapped or advised away, and first-touch faults on a
preallocated file made it 12x slower here (512 MiB: 2.5 s by mmap, 0.15 s by pwrite). Space is reserved with
``posix_fallocate``, so a full disk is a clean error at the start of a step rather than a failed write (or a
SIGBUS through a map) in the middle of one; a step that needs more extends it in exact-size pieces.

**PinnedPool (CUDA).** Host memory allocated pageable at the exact size and page-locked with
``cudaHostRegister``, never from PyTorch's caching host allocator (``pin_memory=True``), which rounds
blocks up to powers of two (a 2.25 GiB tensor takes a 4 GiB block) and keeps them after use. Page-locking
is slow (the driver pins every page) and may stall the device, so the pool is made once, at the first step,
and kept from step to step (:meth:`PinnedPool.begin`); it is never registered inside a forward or backward. A
tensor that finds no room goes to pageable memory (correct, but its copies hold the host until done), and the
pool grows by what that step could not place, once, before the next step. Copies run on one side stream:
device-to-host copies overlap the forward; in backward, loading a tensor also starts loading the one packed
before it (backward unpacks in reverse order), so the copy overlaps the compute of the layer in between. A
tensor's device memory is not reused before its copy ends (``record_stream``). Because every copy into and
out of the pool runs in order on that stream, reusing the pool from the start needs no host synchronisation.
"""

from __future__ import annotations

import errno
import os
import tempfile
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from megaseq.errors import UserError
from megaseq.memory import heap

ALIGN = 4096
GROWTH = 256 * 2**20  # the least a store grows by when its reservation is used up
TRIM_EVERY = 256 * 2**20  # bytes moved between two returns of freed heap memory to the system (CPU)
MAP_LARGER_THAN = 2**20


def map_large_allocations() -> None:
    """Serve allocations of ``MAP_LARGER_THAN`` bytes or more by their own memory maps (core's
    ``megaseq.memory.heap``): a tensor moved to disk, or a recomputed layer's activations after its backward,
    would otherwise stay resident in glibc's heap. The price is a page fault per fresh page
    (``docs/results.md``, "The C library's heap"). Process-wide and permanent: called when an offloading
    policy is applied to a CPU model."""
    heap.map_large_allocations(MAP_LARGER_THAN)


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _layout(t: Tensor) -> tuple[int, ...]:
    """The strides ``t`` comes back with: its own where they describe a dense block of memory (e.g. a
    transposed matrix), so that backward's kernels see the layout they would have seen (and round the same
    way), else the contiguous ones."""
    if t.is_contiguous():
        return t.stride()
    probe = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
    return t.stride() if probe.untyped_storage().nbytes() == t.numel() * t.element_size() else torch.empty(t.shape, device="meta").stride()


def _as_bytes(t: Tensor, stride: tuple[int, ...]) -> Tensor:
    """The bytes of ``t`` laid out with ``stride`` (dense), as a 1-D uint8 tensor (a copy unless contiguous)."""
    t = t.detach()
    if not t.is_contiguous() or t.stride() != stride:
        dense = torch.empty_strided(t.shape, stride, dtype=t.dtype, device=t.device)
        dense.copy_(t)
        t = dense.as_strided((t.numel(),), (1,))  # the same memory, in storage order
    return t.reshape(-1).view(torch.uint8)


def _empty(shape: torch.Size, stride: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu") -> tuple[Tensor, Tensor]:
    """A tensor with this layout and a 1-D uint8 view of its memory (to fill it)."""
    out = torch.empty_strided(shape, stride, dtype=dtype, device=device)
    return out, out.as_strided((out.numel(),), (1,)).view(torch.uint8)


def default_scratch_dir() -> str:
    return os.environ.get("MEGASEQ_SCRATCH") or tempfile.gettempdir()


def filesystem_type(path: Path) -> str:
    """The type of the file system holding ``path`` (the longest matching mount point in /proc/mounts)."""
    best, kind = "", "unknown"
    try:
        with open("/proc/mounts") as f:
            for line in f:
                fields = line.split()
                mount = fields[1].replace("\\040", " ")
                if (str(path) == mount or str(path).startswith(mount.rstrip("/") + "/")) and len(mount) >= len(best):
                    best, kind = mount, fields[2]
    except OSError:
        pass
    return kind


# File systems whose files live on another machine: every offloaded byte would cross the network twice a step.
NETWORK_FILESYSTEMS = frozenset({
    "nfs", "nfs4", "cifs", "smb3", "smbfs", "ncpfs", "9p", "afs", "ceph", "glusterfs", "fuse.glusterfs", "lustre",
    "gpfs", "beegfs", "fuse.sshfs", "fuse.s3fs", "fuse.gcsfuse", "fuse.rclone",
})


def check_scratch_dir(directory: str, need: int = 0) -> Path:
    """Raise a one-line UserError unless ``directory`` is an existing, writable directory on a local disk with
    at least ``need`` bytes free."""
    path = Path(directory).expanduser().resolve()
    where = f"memory_policy.offload.scratch_dir {str(path)!r}"
    if not path.exists():
        raise UserError(f"{where} does not exist; create it or set scratch_dir to a directory on a local disk")
    if not path.is_dir():
        raise UserError(f"{where} is not a directory")
    kind = filesystem_type(path)
    if kind in ("tmpfs", "ramfs"):
        raise UserError(f"{where} is on {kind}, whose files are held in memory; choose a directory on a local disk")
    if kind in NETWORK_FILESYSTEMS:
        raise UserError(f"{where} is on a network file system ({kind}); choose a directory on a local disk")
    stat = os.statvfs(path)
    free = stat.f_bavail * stat.f_frsize
    if free == 0 or free < need:
        raise UserError(f"{where} is full: a step needs {need / 2**30:.2f} GiB of scratch space, "
                        f"{free / 2**30:.2f} GiB are free; free space or choose another directory")
    try:  # the real test of writability (permissions, a read-only mount, no inodes left)
        tempfile.TemporaryFile(dir=path, prefix="megaseq-offload-").close()
    except OSError as exc:
        raise UserError(f"{where} is not writable: {exc.strerror}") from None
    return path


@dataclass
class FileHandle:
    offset: int
    nbytes: int
    shape: torch.Size
    stride: tuple[int, ...]
    dtype: torch.dtype


class ScratchFile:
    """Offloaded tensors of one step in an unnamed scratch file (module docstring)."""

    def __init__(self, directory: Path, reserve: int = 0) -> None:
        self.directory = directory
        try:
            self._file = tempfile.TemporaryFile(dir=directory, prefix="megaseq-offload-")
        except OSError as exc:
            raise UserError(f"memory_policy.offload.scratch_dir {str(directory)!r}: cannot create a scratch file: {exc.strerror}") from None
        self.fd = self._file.fileno()
        self.reserved = 0
        self.end = 0
        self.written = 0  # bytes written this step, for reports
        self.untrimmed = 0  # bytes moved since freed memory was last given back
        self._reserve(reserve)

    def _reserve(self, size: int) -> None:
        if size <= self.reserved:
            return
        stat = os.statvfs(self.directory)
        free = stat.f_bavail * stat.f_frsize
        full = UserError(
            f"memory_policy.offload.scratch_dir {str(self.directory)!r} is full: this step needs "
            f"{size / 2**30:.2f} GiB of scratch space, {(free + self.reserved) / 2**30:.2f} GiB are free"
        )
        if size - self.reserved > free:  # checked first: a failing fallocate may take the disk's last blocks
            raise full
        try:
            os.posix_fallocate(self.fd, self.reserved, size - self.reserved)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                raise full from None
            raise UserError(f"memory_policy.offload.scratch_dir {str(self.directory)!r}: cannot reserve space: {exc.strerror}") from None
        self.reserved = size

    def put(self, t: Tensor) -> FileHandle:
        stride = _layout(t)
        data = _as_bytes(t, stride)
        offset = _align(self.end)
        if offset + data.numel() > self.reserved:
            self._reserve(max(offset + data.numel(), self.reserved + GROWTH))
        view = memoryview(data.numpy())
        done = 0
        while done < len(view):  # pwrite may write less than asked (at most ~2 GiB per call on Linux)
            done += os.pwrite(self.fd, view[done:], offset + done)
        self.end = offset + data.numel()
        self.written += data.numel()
        self._moved(data.numel())
        return FileHandle(offset, data.numel(), t.shape, stride, t.dtype)

    def _moved(self, nbytes: int) -> None:
        self.untrimmed += nbytes
        if self.untrimmed >= TRIM_EVERY:
            self.untrimmed = 0
            heap.return_freed_memory()

    def get(self, handle: FileHandle) -> Tensor:
        out, raw = _empty(handle.shape, handle.stride, handle.dtype)
        view = memoryview(raw.numpy())
        done = 0
        while done < handle.nbytes:
            n = os.preadv(self.fd, [view[done:]], handle.offset + done)
            if n == 0:
                raise RuntimeError("megaseq_offload: the scratch file ended early; was it truncated?")
            done += n
        self._moved(handle.nbytes)  # backward frees what it used while it reads the next tensors back
        return out

    def reset(self) -> None:
        """Reuse the space from the start: every tensor put before has been read back and dropped."""
        self.end = 0

    def close(self) -> None:
        self._file.close()


@dataclass
class HostHandle:
    host: Tensor  # uint8 view into the pool
    written: Any  # torch.cuda.Event: the device-to-host copy is done
    shape: torch.Size
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    index: int
    loaded: tuple[Tensor, Any] | None = None  # a prefetched device copy and its event
    used: bool = False


class PinnedPool:
    """Offloaded tensors in page-locked host memory kept from step to step, copied on a side stream (module
    docstring). Call :meth:`begin` at the start of every step."""

    def __init__(self, device: torch.device, reserve: int = 0) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.segments: list[Tensor] = []
        self.segment = 0  # the segment being filled
        self.segment_end = 0
        self.handles: list[weakref.ref[HostHandle]] = []
        self.written = 0
        self.short = 0  # bytes put in pageable memory since the pool was last reused from the start
        self.needed = 0  # the most bytes one fill could not place: what the pool grows by before the next step
        # unpinned when the pool is dropped (or at exit), after the side stream's copies are done
        self._unpin = weakref.finalize(self, _unpin, self.stream, self.segments)
        if reserve:
            self._add_segment(reserve)

    def begin(self) -> None:
        """The start of a step: grow by what the last step could not place (between steps, never inside a
        forward or backward), then reuse the pool from the start."""
        self.reset()
        if self.needed:
            self._add_segment(max(self.needed, GROWTH))
            self.needed = 0

    def _add_segment(self, size: int) -> None:
        size = _align(size)
        buffer = torch.empty(size, dtype=torch.uint8)  # pageable, exactly this size
        code = torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), size, 0)
        if int(code) != 0:
            raise RuntimeError(f"megaseq_offload: cudaHostRegister of {size / 2**30:.2f} GiB failed (error {int(code)})")
        self.segments.append(buffer)

    def _take(self, nbytes: int) -> Tensor:
        offset = _align(self.segment_end)
        while self.segment < len(self.segments) and offset + nbytes > self.segments[self.segment].numel():
            self.segment, offset = self.segment + 1, 0
        if self.segment == len(self.segments):
            self.short += _align(nbytes)
            return torch.empty(nbytes, dtype=torch.uint8)
        self.segment_end = offset + nbytes
        return self.segments[self.segment][offset : offset + nbytes]

    def put(self, t: Tensor) -> HostHandle:
        current = torch.cuda.current_stream(t.device)
        stride = _layout(t)
        src = _as_bytes(t, stride)
        host = self._take(src.numel())
        self.stream.wait_stream(current)  # the tensor is complete before it is copied
        with torch.cuda.stream(self.stream):
            host.copy_(src, non_blocking=True)
            written = torch.cuda.Event()
            written.record(self.stream)
        src.record_stream(self.stream)  # its memory is not reused before the copy has read it
        handle = HostHandle(host, written, t.shape, stride, t.dtype, t.device, len(self.handles))
        self.handles.append(weakref.ref(handle))
        self.written += src.numel()
        return handle

    def _load(self, handle: HostHandle) -> tuple[Tensor, Any]:
        current = torch.cuda.current_stream(handle.device)
        out, raw = _empty(handle.shape, handle.stride, handle.dtype, handle.device)
        self.stream.wait_stream(current)  # the new allocation is free on the stream that made it
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(handle.written)
            raw.copy_(handle.host, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        out.record_stream(self.stream)
        return out, done

    def get(self, handle: HostHandle) -> Tensor:
        out, done = handle.loaded or self._load(handle)
        handle.loaded, handle.used = None, True
        torch.cuda.current_stream(handle.device).wait_event(done)
        for ref in reversed(self.handles[: handle.index]):  # the next one backward will want
            earlier = ref()
            if earlier is not None and not earlier.used:
                if earlier.loaded is None:
                    earlier.loaded = self._load(earlier)
                break
        return out

    def reset(self) -> None:
        """Reuse the pool from the start: every tensor put before has been read back and dropped. No host
        synchronisation: a later copy into the pool runs on the side stream after every earlier one."""
        self.needed = max(self.needed, self.short)
        self.segment, self.segment_end, self.short = 0, 0, 0
        self.handles.clear()

    def close(self) -> None:
        """Unpin and free the pool (waits for the side stream's copies)."""
        self.handles.clear()
        self._unpin()


def _unpin(stream: Any, segments: list[Tensor]) -> None:
    stream.synchronize()
    for buffer in segments:
        torch.cuda.cudart().cudaHostUnregister(buffer.data_ptr())
    segments.clear()
