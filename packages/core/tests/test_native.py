"""megaseq.native: C sources built on first use into the cache, keyed by their text; failures in one line."""

from __future__ import annotations

import ctypes
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
