"""The ``native`` backend's library: the C files beside this one (``select.c``, ``sparse.c``), built on first use
by core's ``megaseq.native.NativeLibrary`` (which says where, with which flags and why)."""

from __future__ import annotations

import ctypes
from pathlib import Path

from megaseq.native import NativeLibrary


def _declare(lib: ctypes.CDLL) -> None:
    size, pointer, real = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
    lib.dsa_sparse_forward.restype = ctypes.c_double
    lib.dsa_sparse_forward.argtypes = [size] * 8 + [pointer] * 3 + [real] + [pointer] * 4 + [size] * 2 + [pointer] * 6
    lib.dsa_sparse_backward.restype = None
    lib.dsa_sparse_backward.argtypes = [size] * 8 + [pointer] * 3 + [real] + [pointer] * 7
    lib.dsa_select.restype = None
    lib.dsa_select.argtypes = [size] * 4 + [pointer] * 3 + [size] + [pointer] * 2 + [size] * 2 + [pointer] * 4


LIBRARY = NativeLibrary("megaseq-dsa", list(Path(__file__).parent.glob("*.c")), _declare)
library = LIBRARY.load
unavailable = LIBRARY.unavailable
