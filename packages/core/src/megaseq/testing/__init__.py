"""Test kit for plugin authors: fresh plugin managers, temporary registration, conformance suites.

Typical plugin test::

    from megaseq.testing.attention import AttentionConformance

    class TestMyAttention(AttentionConformance):
        name = "my-attention"
        config = {"n_heads": 2}

The suites (``megaseq.testing.attention``, ``.ffn``, ``.moe``) are the executable definition of "a working
plugin"; they build components by name through the installed entry points, so they also check that
registration works. Their building blocks are in ``megaseq.testing.checks``.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from torch import nn

from megaseq.plugins import Plugins, get_plugins
from megaseq.records import MemoryEstimate, ModelDims, load_target
from megaseq.testing.checks import assert_close, check_deterministic, check_gradients, watch_host_syncs


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
    kind: str,
    name: str,
    config: dict[str, Any],
    dims: ModelDims,
    layer_idx: int = 0,
    plugins: Plugins | None = None,
    factory: str | None = None,
) -> nn.Module:
    """Build one component by name (from the installed plugins unless ``plugins`` is given), validating
    ``config`` with its schema. With ``factory`` (see :func:`load_factory`) the component is not looked up:
    ``factory(config, dims, layer_idx)`` builds it from the plain ``config`` dict."""
    if factory is not None:
        return load_factory(factory)(dict(config), dims, layer_idx)
    plugins = plugins or installed_plugins()
    provided = plugins.get(kind, name)
    return provided.load()(provided.spec.config(**config), dims, layer_idx)


def memory_estimator(
    kind: str,
    name: str,
    config: dict[str, Any],
    dims: ModelDims,
    factory: str | None = None,
    memory: str | None = None,
) -> Callable[[int], MemoryEstimate] | None:
    """``seq_len -> MemoryEstimate`` of a component: its record's ``memory`` target (installed plugins), or
    with ``factory`` the ``memory`` target ``estimate(config_dict, dims, seq_len)`` given beside it; ``None``
    when there is none (the planner then cannot plan the component)."""
    if factory is not None:
        if memory is None:
            return None
        estimate = load_factory(memory)
        return lambda seq_len: estimate(dict(config), dims, seq_len)
    provided = installed_plugins().get(kind, name)
    fn = provided.spec.load_memory()
    if fn is None:
        return None
    validated = provided.spec.config(**config)
    return lambda seq_len: fn(validated, dims, seq_len)


def declared_capabilities(
    kind: str, name: str, factory: str | None = None, knob: frozenset[str] | None = None, plugins: Plugins | None = None
) -> frozenset[str]:
    """The capabilities a suite verifies (``megaseq.records.CAPABILITIES``): the record's, from the installed
    plugins (or ``plugins``); with ``factory`` the component has no record, and the suite's ``capabilities``
    knob (``knob``, default none) says what it would declare."""
    if factory is not None:
        return frozenset(knob or ())
    return (plugins or installed_plugins()).get(kind, name).spec.capabilities


def load_factory(target: str) -> Any:
    """``"package.module:attr"`` or ``"/path/to/file.py:attr"``: a builder that is not a registered plugin.

    Conformance suites use it (their ``factory`` knob) to test a module before it is packaged, and core's
    own tests use it for deliberately wrong components. A file is imported once per process under a name
    derived from its path, so multi-process suites can rebuild the component in every rank."""
    path, _, attr = target.rpartition(":")
    if not path.endswith(".py"):
        return load_target(target)
    file = Path(path).resolve()
    module_name = "megaseq_factory_" + hashlib.sha1(str(file).encode()).hexdigest()[:12]
    if module_name not in sys.modules:
        spec = importlib.util.spec_from_file_location(module_name, file)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot import {file}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        spec.loader.exec_module(module)
    obj: Any = sys.modules[module_name]
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


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


__all__ = [
    "assert_close",
    "build_component",
    "check_deterministic",
    "check_gradients",
    "env",
    "fresh_plugins",
    "installed_plugins",
    "load_factory",
    "memory_estimator",
    "registered",
    "watch_host_syncs",
]
