"""Building and loading the C files beside this one (``sparse.c``, ``select.c``): the ``native`` backend's kernels.

The C sources ship with the package and are compiled into one library on first use with the machine's C compiler (``$CC``,
else ``cc`` or ``gcc``) for this CPU (``-march=native``), into megaseq's cache (``$MEGASEQ_CACHE/native``).
The file's name carries a hash of the sources, the flags, the compiler's version and the CPU's identity, so a
cache shared between machines (a network home) never loads a library built for another CPU, and a changed
source is rebuilt. A build writes a temporary file and renames it: processes starting together never load a
half-written library. The library is loaded with ``ctypes``, which releases the GIL during each call, so
Python threads run the kernels in parallel.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

SOURCES = sorted(Path(__file__).parent.glob("*.c"))
# Reassociation lets the compiler vectorise the dot products; -ffast-math is not used: it would also assume
# no infinities (-inf marks a query without keys) and, with gcc 12, set flush-to-zero for the whole process.
FLAGS = (
    "-O3", "-march=native", "-fPIC", "-shared", "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros",
    "-fno-trapping-math", "-ffp-contract=fast",
)


def compiler() -> str | None:
    """The C compiler: ``$CC``, else ``cc`` or ``gcc`` on the path; None when there is none."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def unavailable() -> str | None:
    """Why the kernels cannot run here (no compiler, a failed build), or None once they are built."""
    if compiler() is None:
        return "no C compiler (set CC, or install gcc)"
    try:
        library()
    except (OSError, RuntimeError) as error:
        return str(error)
    return None


def _cpu_identity() -> str:
    """The CPU model and instruction-set flags (what ``-march=native`` compiles for)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    fields = [line for line in info.splitlines() if line.startswith(("model name", "flags", "Features"))]
    return platform.machine() + "\n" + "\n".join(dict.fromkeys(fields))


@functools.cache
def library() -> ctypes.CDLL:
    """The compiled library (built into the cache on first use), its functions' signatures declared."""
    from megaseq.data.sources import default_cache_dir

    cc = compiler()
    if cc is None:
        raise RuntimeError("no C compiler (set CC, or install gcc)")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout.splitlines()[:1]
    texts = [source.read_text() for source in SOURCES]
    digest = hashlib.sha256("\0".join([*texts, *FLAGS, *version, _cpu_identity()]).encode()).hexdigest()
    target = default_cache_dir() / "native" / f"megaseq-dsa-{digest[:16]}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
            built = Path(scratch) / target.name
            command = [cc, *FLAGS, *map(str, SOURCES), "-o", str(built), "-lm"]
            run = subprocess.run(command, capture_output=True, text=True)
            if run.returncode:
                last = (run.stderr.strip().splitlines() or [f"exit status {run.returncode}"])[-1]
                raise RuntimeError(f"{cc} could not build {', '.join(s.name for s in SOURCES)}: {last}")
            os.replace(built, target)
    lib = ctypes.CDLL(str(target))
    size, pointer, real = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
    lib.dsa_sparse_forward.restype = ctypes.c_double
    lib.dsa_sparse_forward.argtypes = [size] * 8 + [pointer] * 3 + [real] + [pointer] * 4 + [size] * 2 + [pointer] * 6
    lib.dsa_sparse_backward.restype = None
    lib.dsa_sparse_backward.argtypes = [size] * 8 + [pointer] * 3 + [real] + [pointer] * 7
    lib.dsa_select.restype = None
    lib.dsa_select.argtypes = [size] * 4 + [pointer] * 3 + [size] + [pointer] * 2 + [size] + [pointer] * 4
    return lib
