"""Discovering plugins and the components they provide.

Core loads entry points of the group ``megaseq`` itself (instead of pluggy's
``load_setuptools_entrypoints``) so that each plugin gets a status and a failing plugin is pinned on its
distribution instead of breaking start-up:

- ``active``: imported and registered;
- ``disabled``: not in ``MEGASEQ_PLUGINS`` (comma-separated distribution or entry-point names), or
  ``MEGASEQ_DISABLE_PLUGIN_AUTOLOAD=1``;
- ``incompatible``: its declared ``megaseq-core`` requirement excludes the installed core;
- ``broken``: importing it or one of its registration hooks raised.

A broken plugin produces a warning; using a component that is unavailable because of it is a one-line error
naming the distribution, its version and the cause.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import pluggy
from packaging.requirements import InvalidRequirement, Requirement
from packaging.version import Version

from megaseq import hookspecs
from megaseq.__about__ import __version__ as CORE_VERSION
from megaseq.errors import PluginError
from megaseq.records import SPEC_TYPES, Component

ENTRY_POINT_GROUP = "megaseq"
CORE_DIST = "megaseq-core"
Status = Literal["active", "disabled", "incompatible", "broken"]


@dataclass
class PluginInfo:
    """One registered plugin (a distribution's entry point, or an object registered in code)."""

    name: str
    dist: str
    version: str
    status: Status
    reason: str = ""
    components: dict[str, list[str]] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return f"{self.dist} {self.version}"


@dataclass(frozen=True)
class Provided:
    """A component together with the plugin that provided it."""

    spec: Component
    plugin: PluginInfo

    def load(self) -> Any:
        """Import the component's target; an import failure is a one-line error naming the distribution."""
        try:
            return self.spec.load()
        except Exception as exc:  # any import-time failure of third-party code
            raise PluginError(
                f"{self.spec.kind} {self.spec.name!r} from {self.plugin.label} failed to load: "
                f"{type(exc).__name__}: {exc}"
            ) from exc


def _core_requirement(dist: md.Distribution) -> Requirement | None:
    for raw in dist.requires or []:
        try:
            req = Requirement(raw)
        except InvalidRequirement:
            continue
        if req.name.lower().replace("_", "-") == CORE_DIST and req.marker is None:
            return req
    return None


def _allow_list() -> set[str] | None:
    raw = os.environ.get("MEGASEQ_PLUGINS")
    if raw is None:
        return None
    return {name.strip() for name in raw.split(",") if name.strip()}


class Plugins:
    """The plugin manager: registration, status per plugin, and the component registry.

    ``Plugins()`` registers core's built-ins; :meth:`load_entrypoints` adds installed plugins (what
    :func:`get_plugins` does for the CLI and trainer). Tests use ``megaseq.testing.fresh_plugins``.
    """

    def __init__(self) -> None:
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self.infos: dict[str, PluginInfo] = {}
        self._registry: dict[str, dict[str, Provided]] | None = None
        from megaseq import builtins

        self.register(builtins, name="megaseq.builtins", dist=CORE_DIST, version=CORE_VERSION)

    # -- registration -------------------------------------------------------------------------------
    def register(self, plugin: object, name: str | None = None, *, dist: str = "(local)", version: str = "") -> None:
        """Register a plugin object (a module or an instance with ``@hookimpl`` methods)."""
        name = name or getattr(plugin, "__name__", None) or type(plugin).__name__
        if name in self.infos:
            raise PluginError(f"plugin {name!r} is already registered (by {self.infos[name].label})")
        try:
            self.pm.register(plugin, name=name)
            self.pm.check_pending()  # a misspelt hook name fails here instead of being silently ignored
        except pluggy.PluginValidationError as exc:
            if self.pm.is_registered(plugin):
                self.pm.unregister(plugin)
            raise PluginError(f"plugin {name!r} ({dist} {version}): {exc}") from exc
        self.infos[name] = PluginInfo(name=name, dist=dist, version=version, status="active")
        self._registry = None

    def unregister(self, name: str) -> None:
        self.pm.unregister(name=name)
        del self.infos[name]
        self._registry = None

    def load_entrypoints(self) -> None:
        """Load every installed ``megaseq`` entry point, recording a status for each."""
        autoload = os.environ.get("MEGASEQ_DISABLE_PLUGIN_AUTOLOAD", "") not in ("1", "true", "yes")
        allow = _allow_list()
        core = Version(CORE_VERSION)
        for ep in sorted(md.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: (e.dist.name if e.dist else "", e.name)):
            dist_name = ep.dist.name if ep.dist else "(unknown)"
            version = ep.dist.version if ep.dist else ""
            info = PluginInfo(name=ep.name, dist=dist_name, version=version, status="active")
            if ep.name in self.infos:
                continue  # the same distribution seen twice on sys.path
            if not autoload:
                info.status, info.reason = "disabled", "MEGASEQ_DISABLE_PLUGIN_AUTOLOAD=1"
            elif allow is not None and ep.name not in allow and dist_name not in allow:
                info.status, info.reason = "disabled", "not in MEGASEQ_PLUGINS"
            else:
                req = _core_requirement(ep.dist) if ep.dist else None
                if req is not None and not req.specifier.contains(core, prereleases=True):
                    info.status = "incompatible"
                    info.reason = f"requires {req}, installed {CORE_DIST} {CORE_VERSION}"
            if info.status == "active":
                try:
                    module = ep.load()
                    self.pm.register(module, name=ep.name)
                    self.pm.check_pending()
                except Exception as exc:  # third-party import code can raise anything
                    if self.pm.has_plugin(ep.name):
                        self.pm.unregister(name=ep.name)
                    info.status, info.reason = "broken", f"{type(exc).__name__}: {exc}"
            self.infos[ep.name] = info
        self._registry = None

    # -- registry -----------------------------------------------------------------------------------
    def _collect(self) -> dict[str, dict[str, Provided]]:
        registry: dict[str, dict[str, Provided]] = {kind: {} for kind in SPEC_TYPES}
        for kind, spec_type in SPEC_TYPES.items():
            hook = getattr(self.pm.hook, f"megaseq_{kind}")
            for impl in hook.get_hookimpls():
                info = self.infos[impl.plugin_name]
                if info.status != "active":
                    continue
                try:
                    specs = impl.function()
                    specs = [] if specs is None else list(specs)
                    for spec in specs:
                        if not isinstance(spec, spec_type):
                            raise TypeError(f"megaseq_{kind} returned {type(spec).__name__}, expected {spec_type.__name__}")
                except Exception as exc:  # a plugin's registration hook failing must not stop the others
                    info.status, info.reason = "broken", f"megaseq_{kind}: {type(exc).__name__}: {exc}"
                    continue
                for spec in specs:
                    if spec.name in registry[kind]:
                        other = registry[kind][spec.name].plugin
                        raise PluginError(
                            f"{kind} {spec.name!r} is provided twice: by {other.label} ({other.name}) and by "
                            f"{info.label} ({info.name}); uninstall one or set MEGASEQ_PLUGINS"
                        )
                    registry[kind][spec.name] = Provided(spec, info)
                    info.components.setdefault(kind, []).append(spec.name)
        # a plugin that broke during collection must not keep the components it registered before breaking
        for kind in registry:
            registry[kind] = {n: p for n, p in registry[kind].items() if p.plugin.status == "active"}
        for info in self.infos.values():
            if info.status == "broken":
                info.components.clear()
                warnings.warn(f"megaseq plugin {info.name!r} ({info.label}) is broken: {info.reason}", stacklevel=3)
        return registry

    @property
    def registry(self) -> dict[str, dict[str, Provided]]:
        if self._registry is None:
            for info in self.infos.values():
                info.components.clear()
            self._registry = self._collect()
        return self._registry

    def names(self, kind: str) -> list[str]:
        return sorted(self.registry[kind])

    def get(self, kind: str, name: str, where: str = "") -> Provided:
        """The component ``name`` of ``kind``; unknown names are a one-line error listing the choices."""
        if kind not in SPEC_TYPES:
            raise PluginError(f"unknown component kind {kind!r}; kinds: {', '.join(SPEC_TYPES)}")
        found = self.registry[kind].get(name)
        if found is not None:
            return found
        prefix = f"{where}: " if where else ""
        available = ", ".join(self.names(kind)) or "none"
        msg = f"{prefix}no {kind} named {name!r}; available: {available}"
        trouble = [i for i in self.infos.values() if i.status in ("broken", "incompatible", "disabled")]
        if trouble:
            msg += "; unavailable plugins: " + ", ".join(f"{i.label} ({i.status}: {i.reason})" for i in trouble)
        else:
            msg += "; installed plugins: " + ", ".join(i.label for i in self.infos.values())
        raise PluginError(msg)

    def __iter__(self) -> Iterator[PluginInfo]:
        self.registry  # noqa: B018 - statuses are final only after collection
        return iter(self.infos.values())

    def active(self) -> list[dict[str, str]]:
        """Active plugins as ``{"name", "dist", "version"}``: for run headers and checkpoint metadata."""
        return [{"name": i.name, "dist": i.dist, "version": i.version} for i in self if i.status == "active"]

    # -- typed facade over the lifecycle hooks (pluggy's pm.hook is untyped) -------------------------
    @property
    def hooks(self) -> Hooks:
        return Hooks(self.pm)


class Hooks:
    """Typed calls of the lifecycle hooks."""

    def __init__(self, pm: pluggy.PluginManager) -> None:
        self._hook = pm.hook

    def step_start(self, step: Any, model: Any) -> None:
        self._hook.megaseq_step_start(step=step, model=model)

    def step_end(self, step: Any, model: Any, metrics: dict[str, float]) -> None:
        self._hook.megaseq_step_end(step=step, model=model, metrics=metrics)

    def checkpoint_save(self, model: Any) -> dict[str, Any]:
        state: dict[str, Any] = {}
        for part in self._hook.megaseq_checkpoint_save(model=model):
            if part:
                state.update(part)
        return state

    def checkpoint_load(self, model: Any, state: dict[str, Any]) -> None:
        self._hook.megaseq_checkpoint_load(model=model, state=state)


def get_plugins() -> Plugins:
    """A plugin manager with the built-ins and every installed plugin loaded."""
    plugins = Plugins()
    plugins.load_entrypoints()
    return plugins


__all__ = ["ENTRY_POINT_GROUP", "PluginInfo", "Plugins", "Provided", "get_plugins"]
