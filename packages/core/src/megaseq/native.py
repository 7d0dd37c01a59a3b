"""C kernels that a plugin ships as source and builds on the user's machine: :class:`NativeLibrary`.

A plugin whose CPU path is bound by what PyTorch's operators cannot fuse (tiny per-query products, elementwise
chains over small blocks) may ship C files and load them with ``ctypes`` (which releases the GIL during each
call, so Python threads run them in parallel). The files are compiled on first use with the machine's C
compiler (``$CC``, else ``cc`` or ``gcc``) for this CPU (``-march=native``) into megaseq's cache
(``$MEGASEQ_CACHE/native``). The library's name carries a hash of the sources (with core's headers in
``include/``, on every build's include path), the flags, the compiler's version and the CPU's identity, so a
cache shared between machines (a network home) never loads a library built for another CPU, and a changed
source is rebuilt. A build writes a temporary file and renames it:
processes starting together never load a half-written library.

Flags: ``-O3 -march=native`` with reassociation allowed (the compiler vectorises sums), not ``-ffast-math``:
that would also assume no infinities or NaNs (kernels mark empty rows with -inf) and, with gcc 12, set
flush-to-zero for the whole process when the library loads.

Use it behind a backend (``megaseq.backends.Backend(unavailable=library.unavailable)``): where no compiler
builds the sources, ``auto`` passes the backend over and says why, and a requested one fails in one line.

Threads: a kernel call splits its work into contiguous :func:`ranges` and :func:`run_at_once` runs one call
per range, the first in the caller's thread and the others on one pool of threads that every plugin's
kernels share (grown to the most calls ever run at once).
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import functools
import hashlib
import itertools
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")

# Headers every build sees (`#include "megaseq_math.h"`: the kernels' shared vectorisable exp and log).
INCLUDE = Path(__file__).with_name("include")

FLAGS = (
    "-O3", "-march=native", "-fPIC", "-shared", "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros",
    "-fno-trapping-math", "-ffp-contract=fast",
)


def compiler() -> str | None:
    """The C compiler: ``$CC``, else ``cc`` or ``gcc`` on the path; None when there is none."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _cpu_identity() -> str:
    """The CPU model and instruction-set flags (what ``-march=native`` compiles for)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    fields = [line for line in info.splitlines() if line.startswith(("model name", "flags", "Features"))]
    return platform.machine() + "\n" + "\n".join(dict.fromkeys(fields))


class NativeLibrary:
    """The C files ``sources`` built into one shared library named after ``name``; ``declare(lib)`` sets its
    functions' ``argtypes`` and ``restype``."""

    def __init__(self, name: str, sources: Sequence[Path], declare: Callable[[ctypes.CDLL], None]) -> None:
        self.name, self.sources, self.declare = name, sorted(sources), declare

    def build(self) -> ctypes.CDLL:
        """Build into the cache unless there already, and load (RuntimeError, one line, when the build fails)."""
        from megaseq.data.sources import default_cache_dir

        cc = compiler()
        if cc is None:
            raise RuntimeError("no C compiler (set CC, or install gcc)")
        version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout.splitlines()[:1]
        texts = [source.read_text() for source in [*self.sources, *sorted(INCLUDE.glob("*.h"))]]
        digest = hashlib.sha256("\0".join([*texts, *FLAGS, *version, _cpu_identity()]).encode()).hexdigest()
        target = default_cache_dir() / "native" / f"{self.name}-{digest[:16]}.so"
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
                built = Path(scratch) / target.name
                command = [cc, *FLAGS, f"-I{INCLUDE}", *map(str, self.sources), "-o", str(built), "-lm"]
                run = subprocess.run(command, capture_output=True, text=True)
                if run.returncode:
                    last = (run.stderr.strip().splitlines() or [f"exit status {run.returncode}"])[-1]
                    names = ", ".join(source.name for source in self.sources)
                    raise RuntimeError(f"{cc} could not build {names}: {last}")
                os.replace(built, target)
        lib = ctypes.CDLL(str(target))
        self.declare(lib)
        return lib

    @functools.cached_property
    def _loaded(self) -> ctypes.CDLL:
        return self.build()

    def load(self) -> ctypes.CDLL:
        """The library, built on the first call of this process."""
        return self._loaded

    def unavailable(self) -> str | None:
        """Why the library cannot be used here (no compiler, a failed build), or None once it is loaded."""
        if "_loaded" not in self.__dict__ and compiler() is None:
            return "no C compiler (set CC, or install gcc)"
        try:
            self.load()
        except (OSError, RuntimeError) as error:
            return str(error)
        return None


def ranges(n: int, parts: int) -> list[tuple[int, int]]:
    """At most ``parts`` contiguous, non-empty ranges covering ``[0, n)``, as equal as they divide;
    ``[(0, 0)]`` for ``n = 0`` (one call, which has nothing to do)."""
    bounds = [n * i // max(parts, 1) for i in range(max(parts, 1) + 1)]
    return [(a, b) for a, b in itertools.pairwise(bounds) if b > a] or [(0, 0)]


_pool: concurrent.futures.ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def run_at_once(calls: Sequence[Callable[[], T]]) -> list[T]:
    """Run ``calls`` at once, the first in this thread, and return their results in order (a call's
    exception is raised here, after every call has ended). For calls into C through ``ctypes``, which
    releases the GIL while they run."""
    global _pool
    if len(calls) <= 1:
        return [call() for call in calls]
    with _pool_lock:
        if _pool is None or _pool._max_workers < len(calls) - 1:
            _pool = concurrent.futures.ThreadPoolExecutor(len(calls) - 1, thread_name_prefix="megaseq-native")
        others = [_pool.submit(call) for call in calls[1:]]
    try:
        first = calls[0]()
    finally:
        concurrent.futures.wait(others)
    return [first, *(future.result() for future in others)]


__all__ = ["FLAGS", "NativeLibrary", "compiler", "ranges", "run_at_once"]
