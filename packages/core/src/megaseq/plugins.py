"""Discovering plugins and the components they provide.

Core loads entry points of the group ``megaseq`` itself (instead of pluggy's
``load_setuptools_entrypoints``) so that each plugin gets a status and a failing plugin is pinned on its
distribution instead of breaking start-up:

- ``active``: imported and registered;
- ``disabled``: not in ``MEGASEQ_PLUGINS`` (comma-separated distribution or entry-point names), or
  ``MEGASEQ_DISABLE_PLUGIN_AUTOLOAD=1``;
- ``incompatible``: its declared ``megaseq-core`` requirement excludes the installed core;
- ``broken``: importing it or one of its registration hooks raised, a hook returned something other than
  its record type, or one of its records points at a target (``target``, ``memory``) that does not exist.
  A broken plugin is blocked in the pluggy manager (``set_blocked``): none of its hooks runs again, its
  lifecycle hooks included.

Targets are checked without importing them (discovery must stay cheap and never touch CUDA): the target's
module must be found (``importlib.util.find_spec``, which imports only its parent packages) and its source
must define the attribute at top level. :meth:`Plugins.check` imports every target for real
(``megaseq plugins --check``).

A broken plugin produces a warning; using a component that is unavailable because of it is a one-line error
naming the distribution, its version and the cause. Two plugins providing the same name are a conflict: both
stay listed, a warning names them, and only using that name is an error.
"""

from __future__ import annotations

import ast
import importlib.metadata as md
import importlib.util
import os
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import pluggy
from packaging.requirements import InvalidRequirement, Requirement
from packaging.version import Version

from megaseq import hookspecs
from megaseq.__about__ import __version__ as CORE_VERSION
from megaseq.errors import PluginError
from megaseq.records import SPEC_TYPES, Record, load_target

if TYPE_CHECKING:
    from torch import nn

    from megaseq.train.state import StepInfo

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
    conflicts: list[str] = field(default_factory=list)

    @property
    def label(self) -> str:
        return f"{self.dist} {self.version}"


@dataclass(frozen=True)
class Provided:
    """A component together with the plugin that provided it."""

    spec: Any  # the kind's record type (megaseq.records.SPEC_TYPES), a Record
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


def _top_level_names(tree: ast.Module) -> set[str] | None:
    """Names a module's source binds at top level (also inside top-level if/try/with blocks); None when it
    cannot be told statically (a star import, or a module ``__getattr__``)."""
    names: set[str] = set()

    def visit(statements: list[ast.stmt]) -> bool:
        for node in statements:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                if node.name == "__getattr__":
                    return False
                names.add(node.name)
            elif isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
            elif isinstance(node, ast.Import | ast.ImportFrom):
                for alias in node.names:
                    if alias.name == "*":
                        return False
                    names.add(alias.asname or alias.name.split(".")[0])
            elif isinstance(node, ast.If | ast.Try | ast.With):
                blocks = [node.body, getattr(node, "orelse", []), getattr(node, "finalbody", [])]
                blocks += [h.body for h in getattr(node, "handlers", [])]
                if not all(visit(block) for block in blocks):
                    return False
        return True

    return names if visit(tree.body) else None


def target_problem(target: str) -> str | None:
    """Why ``"module:attr"`` cannot resolve, told without importing the module (its parent packages are
    imported to find it); ``None`` when it looks fine or cannot be told statically."""
    module_name, _, attr = target.partition(":")
    first = attr.split(".")[0]
    if module_name in sys.modules:
        return None if hasattr(sys.modules[module_name], first) else f"module {module_name} defines no {first!r}"
    try:
        spec = importlib.util.find_spec(module_name)
    except (ImportError, ValueError) as exc:  # a parent package is missing or failed to import
        return f"module {module_name!r} not found ({type(exc).__name__}: {exc})"
    if spec is None:
        return f"module {module_name!r} not found"
    if not spec.origin or not spec.origin.endswith(".py"):
        return None
    try:
        tree = ast.parse(Path(spec.origin).read_text(encoding="utf-8"), filename=spec.origin)
    except SyntaxError as exc:
        return f"module {module_name} does not parse: {exc}"
    except OSError:
        return None
    names = _top_level_names(tree)
    if names is None or first in names:
        return None
    return f"module {module_name} ({spec.origin}) defines no {first!r}"


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
    :func:`get_plugins` does for the CLI and trainer). Tests use ``megaseq_testkit.fresh_plugins``.
    """

    def __init__(self) -> None:
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self.infos: dict[str, PluginInfo] = {}
        self._registry: dict[str, dict[str, Provided]] | None = None
        self._conflicts: dict[tuple[str, str], list[PluginInfo]] = {}
        from megaseq import builtins, commands

        self.register(builtins, name="megaseq.builtins", dist=CORE_DIST, version=CORE_VERSION)
        self.register(commands, name="megaseq.commands", dist=CORE_DIST, version=CORE_VERSION)

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
        if self.pm.is_blocked(name):  # broken: already out of the manager
            self.pm.unblock(name)
        else:
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
        provided: dict[tuple[str, str], list[Provided]] = {}
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
                    self._block(info, f"megaseq_{kind}: {type(exc).__name__}: {exc}")
                    continue
                for spec in specs:
                    problem = self._record_problem(spec)
                    if problem:
                        self._block(info, problem)
                        break
                    provided.setdefault((kind, spec.name), []).append(Provided(spec, info))
                    info.components.setdefault(kind, []).append(spec.name)
        registry: dict[str, dict[str, Provided]] = {kind: {} for kind in SPEC_TYPES}
        self._conflicts = {}
        for (kind, name), providers in provided.items():
            # a plugin that broke during collection keeps none of the components it registered before breaking
            providers = [p for p in providers if p.plugin.status == "active"]
            core = [p for p in providers if p.plugin.dist == CORE_DIST]
            if kind == "command" and core and len(providers) > 1:  # core's own commands are always core's
                for p in providers:
                    if p is not core[0]:
                        warnings.warn(f"command {name!r} from {p.plugin.label} is ignored: core's own {name!r} runs",
                                      stacklevel=3)
                providers = core
            if len(providers) == 1:
                registry[kind][name] = providers[0]
            elif providers:
                self._conflicts[(kind, name)] = [p.plugin for p in providers]
                for p in providers:
                    others = ", ".join(o.plugin.label for o in providers if o is not p)
                    p.plugin.conflicts.append(f"{kind} {name!r} is also provided by {others}")
                warnings.warn(self._conflict_message(kind, name), stacklevel=3)
        for info in self.infos.values():
            if info.status == "broken":
                info.components.clear()
                warnings.warn(f"megaseq plugin {info.name!r} ({info.label}) is broken: {info.reason}", stacklevel=3)
        return registry

    def _block(self, info: PluginInfo, reason: str) -> None:
        """Mark a plugin broken and take it out of the hook calls, so none of its hooks runs again."""
        info.status, info.reason = "broken", reason
        if not self.pm.is_blocked(info.name):
            self.pm.set_blocked(info.name)

    @staticmethod
    def _record_problem(spec: Record) -> str | None:
        """Why a record's targets cannot resolve (see :func:`target_problem`), or None."""
        for field_name, target in spec.targets().items():
            problem = target_problem(target)
            if problem:
                return f"{spec.kind} {spec.name!r}: {field_name} {target!r}: {problem}"
        return None

    def _conflict_message(self, kind: str, name: str) -> str:
        providers = self._conflicts[(kind, name)]
        times = "twice" if len(providers) == 2 else f"{len(providers)} times"
        labels = " and by ".join(f"{i.label} ({i.name})" for i in providers)
        return f"{kind} {name!r} is provided {times}: by {labels}; uninstall all but one or set MEGASEQ_PLUGINS"

    @property
    def registry(self) -> dict[str, dict[str, Provided]]:
        if self._registry is None:
            for info in self.infos.values():
                info.components.clear()
                info.conflicts.clear()
            self._registry = self._collect()
        return self._registry

    @property
    def conflicts(self) -> dict[tuple[str, str], list[PluginInfo]]:
        """``(kind, name) -> providers`` for every name that more than one active plugin provides (such names
        are listed but unusable)."""
        self.registry  # noqa: B018 - conflicts are known only after collection
        return self._conflicts

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
        if (kind, name) in self.conflicts:
            raise PluginError(prefix + self._conflict_message(kind, name))
        available = ", ".join(self.names(kind)) or "none"
        msg = f"{prefix}no {kind} named {name!r}; available: {available}"
        trouble = [i for i in self.infos.values() if i.status in ("broken", "incompatible", "disabled")]
        if trouble:
            msg += "; unavailable plugins: " + ", ".join(f"{i.label} ({i.status}: {i.reason})" for i in trouble)
        else:
            msg += "; installed plugins: " + ", ".join(i.label for i in self.infos.values())
        msg += " (is the plugin that provides it installed? `megaseq plugins` lists what is)"
        raise PluginError(msg)

    def __iter__(self) -> Iterator[PluginInfo]:
        self.registry  # noqa: B018 - statuses are final only after collection
        return iter(self.infos.values())

    def check(self) -> list[str]:
        """Import every target (and memory target) of every active plugin, running nothing else; return one
        line per failure (``megaseq plugins --check``)."""
        failures = []
        for kind, components in self.registry.items():
            for name, found in sorted(components.items()):
                for field_name, target in found.spec.targets().items():
                    try:
                        obj = load_target(target)
                    except Exception as exc:  # third-party import code can raise anything
                        problem = f"{type(exc).__name__}: {exc}"
                    else:
                        problem = found.spec.loaded_problem(field_name, obj)
                    if problem:
                        failures.append(f"{kind} {name!r} from {found.plugin.label}: {field_name} {target!r}: {problem}")
        return failures

    def active(self) -> list[dict[str, str]]:
        """Active plugins as ``{"name", "dist", "version"}``: for run headers and checkpoint metadata."""
        return [{"name": i.name, "dist": i.dist, "version": i.version} for i in self if i.status == "active"]

    # -- typed facade over the lifecycle hooks (pluggy's pm.hook is untyped) -------------------------
    @property
    def hooks(self) -> Hooks:
        return Hooks(self.pm)


class Hooks:
    """Typed calls of the lifecycle hooks (``megaseq.hookspecs``) of every plugin that is not blocked."""

    def __init__(self, pm: pluggy.PluginManager) -> None:
        self._hook = pm.hook

    def step_start(self, step: StepInfo, model: nn.Module) -> None:
        self._hook.megaseq_step_start(step=step, model=model)

    def step_end(self, step: StepInfo, model: nn.Module, metrics: dict[str, float]) -> None:
        self._hook.megaseq_step_end(step=step, model=model, metrics=metrics)

    def checkpoint_save(self, model: nn.Module) -> dict[str, Any]:
        """Every plugin's state, merged; two plugins returning one key is an error naming both."""
        state: dict[str, Any] = {}
        owner: dict[str, str] = {}
        for impl in reversed(self._hook.megaseq_checkpoint_save.get_hookimpls()):  # pluggy's call order
            part = impl.function(**{arg: {"model": model}[arg] for arg in impl.argnames})
            for key in part or {}:
                if key in owner:
                    first, second = sorted((owner[key], impl.plugin_name))
                    raise PluginError(f"megaseq_checkpoint_save: plugins {first!r} and {second!r} both return the key "
                                      f"{key!r}; each plugin must save under its own key")
                owner[key] = impl.plugin_name
            state.update(part or {})
        return state

    def checkpoint_load(self, model: nn.Module, state: dict[str, Any]) -> None:
        self._hook.megaseq_checkpoint_load(model=model, state=state)


def get_plugins() -> Plugins:
    """A plugin manager with the built-ins and every installed plugin loaded."""
    plugins = Plugins()
    plugins.load_entrypoints()
    return plugins


__all__ = ["ENTRY_POINT_GROUP", "PluginInfo", "Plugins", "Provided", "get_plugins", "target_problem"]
