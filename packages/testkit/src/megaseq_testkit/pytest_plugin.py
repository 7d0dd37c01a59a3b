"""The pytest plugin megaseq-testkit ships (entry point ``pytest11``): the markers that the conformance
suites and the project's tests use, registered wherever megaseq-testkit is installed, so a plugin package's
own test run (``--strict-markers`` included) knows them. Light on purpose: pytest loads it at start-up.

- ``slow``: a test that starts processes (gloo ranks, Ray, torchrun) or trains for more than a few
  seconds. ``pytest -m "not slow"`` is the fast lane (``make test-fast``); ``make test`` runs everything.
- ``cuda``: needs a CUDA device.

The fixture ``intra_op_threads`` runs a test once with one and once with two intra-op threads
(``torch.set_num_threads``), what CPU kernels split their work by (``megaseq.native.run_at_once``).

A test run never writes into the user's megaseq cache (``$MEGASEQ_CACHE``, else ``~/.cache/megaseq``): it
holds token caches and the registry of live trainers, which decides a user's running trainers' thread counts.
The run gets a cache of its own in a temporary directory, removed at its end; the data sources the user has
already fetched are linked into it, read-only in use, so that tests of fetched data still find them.
``MEGASEQ_CACHE`` set before the run for a test run (``MEGASEQ_TEST_CACHE=keep``) is left as it is.

``MEGASEQ_TEST_EVERY_MODULE=1`` (``make test`` sets it: it installs every extra) turns a test module skipped
whole at collection (a module-level ``importorskip`` or ``pytest.skip``) into a failure: there a skipped module
is a dependency that went missing, not an extra the user chose not to install.

``MEGASEQ_TEST_PROGRESS=NAME`` with ``MEGASEQ_TEST_PROGRESS_FD=N`` (``make test`` sets them for each test set,
whose report it prints whole when the set ends) writes one line per finished test file to file descriptor
``N``: ``NAME: FILE: P passed, F failed (S s)``, each line one write, so that two sets' lines never mix.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

MARKERS = {
    "slow": "starts processes or trains for more than a few seconds; deselect with -m 'not slow' (the fast lane)",
    "cuda": "needs a CUDA device",
}


@pytest.fixture(params=[1, 2], ids=["one-thread", "two-threads"])
def intra_op_threads(request: Any) -> Any:
    """The test's intra-op threads, 1 then 2; the count before is restored after."""
    import torch  # here, not at start-up

    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


# what a run writes into its cache, never linked from the user's
WRITTEN = {"tokens", "trainers", "scratch"}


def pytest_configure(config: Any) -> None:
    for name, meaning in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {meaning}")
    if os.environ.get("MEGASEQ_TEST_CACHE") != "keep" and not hasattr(config, "_megaseq_cache"):
        config._megaseq_cache = own_cache()


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: Any) -> Any:
    outcome = yield
    report = outcome.get_result()
    if report.skipped and isinstance(collector, pytest.Module) and os.environ.get("MEGASEQ_TEST_EVERY_MODULE") == "1":
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = (f"{collector.nodeid} was skipped whole ({reason}), but MEGASEQ_TEST_EVERY_MODULE=1 says every "
                           "extra is installed here: a dependency is missing")


class _Progress:
    """Per test file: how many tests it holds, how many finished, failed, and when its first one started."""

    def __init__(self, name: str, fd: int) -> None:
        self.name, self.fd = name, fd
        self.total: dict[str, int] = {}
        self.done: dict[str, int] = {}
        self.failed: dict[str, int] = {}
        self.started: dict[str, float] = {}

    @pytest.hookimpl
    def pytest_collection_finish(self, session: Any) -> None:
        for item in session.items:
            path = item.nodeid.split("::")[0]
            self.total[path] = self.total.get(path, 0) + 1

    @pytest.hookimpl
    def pytest_runtest_logstart(self, nodeid: str, location: Any) -> None:
        self.started.setdefault(nodeid.split("::")[0], time.monotonic())

    @pytest.hookimpl
    def pytest_runtest_logreport(self, report: Any) -> None:
        if report.failed:
            path = report.nodeid.split("::")[0]
            self.failed[path] = self.failed.get(path, 0) + 1

    @pytest.hookimpl
    def pytest_runtest_logfinish(self, nodeid: str, location: Any) -> None:
        path = nodeid.split("::")[0]
        self.done[path] = self.done.get(path, 0) + 1
        if self.done[path] == self.total.get(path):
            failed = self.failed.get(path, 0)
            seconds = time.monotonic() - self.started.get(path, time.monotonic())
            line = f"{self.name}: {path}: {self.done[path] - failed} passed or skipped, {failed} failed ({seconds:.0f} s)\n"
            with contextlib.suppress(OSError):
                os.write(self.fd, line.encode())


@pytest.hookimpl(trylast=True)
def pytest_sessionstart(session: Any) -> None:
    name, fd = os.environ.get("MEGASEQ_TEST_PROGRESS"), os.environ.get("MEGASEQ_TEST_PROGRESS_FD")
    if name and fd and fd.isdigit():
        session.config.pluginmanager.register(_Progress(name, int(fd)), "megaseq-test-progress")


def pytest_unconfigure(config: Any) -> None:
    cache = getattr(config, "_megaseq_cache", None)
    if cache is not None:
        shutil.rmtree(cache, ignore_errors=True)  # removes the links, never what they point at


def own_cache() -> Path:
    """A fresh cache for this test run, with links to the user's fetched data sources; ``MEGASEQ_CACHE`` names it
    (the run's subprocesses and gloo ranks inherit it)."""
    user = Path(os.environ.get("MEGASEQ_CACHE") or Path.home() / ".cache" / "megaseq")
    cache = Path(tempfile.mkdtemp(prefix="megaseq-test-cache-"))
    if user.is_dir():
        for entry in user.iterdir():
            if entry.is_dir() and entry.name not in WRITTEN:
                (cache / entry.name).symlink_to(entry.resolve(), target_is_directory=True)
    os.environ["MEGASEQ_CACHE"] = str(cache)
    return cache
