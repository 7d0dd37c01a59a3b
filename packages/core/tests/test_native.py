"""megaseq.native: C sources built on first use into the cache, keyed by their text; failures in one line; the
ranges and the pool of threads the kernels share."""

from __future__ import annotations

import ctypes
import functools
import threading
import time
from pathlib import Path

import pytest

from megaseq import native
from megaseq.native import NativeLibrary

pytestmark = pytest.mark.skipif(native.compiler() is None, reason="no C compiler on this machine")


def library(tmp_path: Path, body: str) -> NativeLibrary:
    source = tmp_path / "src" / "twice.c"
    source.parent.mkdir(exist_ok=True)
    source.write_text(f"#include <stdint.h>\nint64_t twice(int64_t x) {{ {body} }}\n")

    def declare(lib: ctypes.CDLL) -> None:
        lib.twice.restype, lib.twice.argtypes = ctypes.c_int64, [ctypes.c_int64]

    return NativeLibrary("test-twice", [source], declare)


def test_built_once_into_the_cache_and_rebuilt_when_the_source_changes(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("MEGASEQ_CACHE", str(tmp_path / "cache"))
    assert library(tmp_path, "return 2 * x;").load().twice(21) == 42
    built = list((tmp_path / "cache" / "native").glob("test-twice-*.so"))
    assert len(built) == 1
    mtime = built[0].stat().st_mtime_ns
    assert library(tmp_path, "return 2 * x;").unavailable() is None  # a second process: loaded, not rebuilt
    assert built[0].stat().st_mtime_ns == mtime
    assert library(tmp_path, "return x + x + 1;").load().twice(21) == 43  # a changed source: its own build
    assert len(list((tmp_path / "cache" / "native").glob("test-twice-*.so"))) == 2


def test_a_failed_build_or_no_compiler_says_why_in_one_line(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("MEGASEQ_CACHE", str(tmp_path / "cache"))
    reason = library(tmp_path, "return 2 * x").unavailable()  # a missing semicolon
    assert reason is not None and reason.startswith(f"{native.compiler()} could not build twice.c: ") and "\n" not in reason
    assert not list((tmp_path / "cache").rglob("*.so"))
    monkeypatch.setattr(native, "compiler", lambda: None)
    assert library(tmp_path, "return 2 * x;").unavailable() == "no C compiler (set CC, or install gcc)"


@pytest.mark.parametrize(("n", "parts"), [(0, 3), (1, 4), (7, 3), (10, 10), (5, 1), (3, 0)])
def test_ranges_cover_the_work_once_in_order(n: int, parts: int):
    got = native.ranges(n, parts)
    assert [i for a, b in got for i in range(a, b)] == list(range(n))  # every item once, in order
    assert len(got) <= max(parts, 1) and ((n == 0 and got == [(0, 0)]) or all(b > a for a, b in got))
    sizes = [b - a for a, b in got]
    assert max(sizes) - min(sizes) <= 1  # as equal as they divide


def test_run_at_once_runs_together_and_keeps_order():
    # the calls wait for each other: run one after another they would never pass the barrier
    barrier = threading.Barrier(3, timeout=30)
    main = threading.get_ident()

    def call(i: int):
        barrier.wait()
        return i, threading.get_ident() == main

    results = native.run_at_once([functools.partial(call, i) for i in range(3)])
    assert [i for i, _ in results] == [0, 1, 2]
    assert [here for _, here in results] == [True, False, False]  # the first in the caller's thread


def test_run_at_once_raises_a_calls_error_after_all_have_ended():
    ended = []

    def fails():
        raise ValueError("kernel failed")

    def slow():
        time.sleep(0.2)
        ended.append(True)

    with pytest.raises(ValueError, match="kernel failed"):
        native.run_at_once([fails, slow])
    assert ended == [True]
