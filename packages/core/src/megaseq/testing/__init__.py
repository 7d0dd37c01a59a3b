"""Test kit for plugin authors: fresh plugin managers, temporary registration, conformance suites.

Typical plugin test::

    from megaseq.testing.attention import AttentionConformance

    class TestMyAttention(AttentionConformance):
        name = "my-attention"
        config = {"n_heads": 2}

The suites are the executable definition of "a working plugin"; they build components by name through the
installed entry points, so they also check that registration works.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from megaseq.plugins import Plugins, get_plugins
from megaseq.records import ModelDims


def assert_close(actual: Tensor, expected: Tensor, rtol: float, what: str) -> None:
    """``max |actual - expected| <= rtol * max(1, max |expected|)``, with a message naming ``what``."""
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert torch.isfinite(actual).all(), f"{what}: non-finite values"
    err = (actual.double() - expected.double()).abs().max().item() if actual.numel() else 0.0
    scale = max(1.0, expected.double().abs().max().item() if expected.numel() else 0.0)
    assert err <= rtol * scale, f"{what}: max abs error {err:.3e} > {rtol:.1e} x {scale:.3e}"


def fresh_plugins(autoload: bool = False) -> Plugins:
    """A new plugin manager: core's built-ins only, or (``autoload=True``) plus the installed entry points.

    Autoload honours ``MEGASEQ_PLUGINS`` and ``MEGASEQ_DISABLE_PLUGIN_AUTOLOAD`` like a real run.
    """
    plugins = Plugins()
    if autoload:
        plugins.load_entrypoints()
    return plugins


@contextmanager
def registered(plugin: object, plugins: Plugins, name: str | None = None) -> Iterator[Plugins]:
    """Register ``plugin`` (a module or an object with ``@hookimpl`` methods) for the duration of a block."""
    name = name or getattr(plugin, "__name__", None) or type(plugin).__name__
    plugins.register(plugin, name=name)
    try:
        yield plugins
    finally:
        plugins.unregister(name)


@functools.cache
def installed_plugins() -> Plugins:
    """The installed plugins, loaded once per process (conformance suites build many components)."""
    return get_plugins()


def build_component(
    kind: str, name: str, config: dict[str, Any], dims: ModelDims, layer_idx: int = 0, plugins: Plugins | None = None
) -> nn.Module:
    """Build one component by name (from the installed plugins unless ``plugins`` is given)."""
    plugins = plugins or installed_plugins()
    provided = plugins.get(kind, name)
    return provided.load()(provided.spec.config(**config), dims, layer_idx)


@contextmanager
def env(**values: str) -> Iterator[None]:
    """Set environment variables for a block (e.g. ``MEGASEQ_PLUGINS``)."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


__all__ = ["assert_close", "build_component", "env", "fresh_plugins", "installed_plugins", "registered"]
