"""The pytest plugin megaseq-testkit ships (entry point ``pytest11``): the markers that the conformance
suites and the project's tests use, registered wherever megaseq-testkit is installed, so a plugin package's
own test run (``--strict-markers`` included) knows them. Light on purpose: pytest loads it at start-up.

- ``slow``: a test that starts processes (gloo ranks, Ray, torchrun) or trains for more than a few
  seconds. ``pytest -m "not slow"`` is the fast lane (``make test-fast``); ``make test`` runs everything.
- ``cuda``: needs a CUDA device.
"""

from __future__ import annotations

from typing import Any

MARKERS = {
    "slow": "starts processes or trains for more than a few seconds; deselect with -m 'not slow' (the fast lane)",
    "cuda": "needs a CUDA device",
}


def pytest_configure(config: Any) -> None:
    for name, meaning in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {meaning}")
