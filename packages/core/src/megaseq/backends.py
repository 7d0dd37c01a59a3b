"""Choosing which implementation of an operation a component runs: one rule for core and every plugin.

A component often has several implementations of its core operation (a PyTorch path, Triton kernels, a
third-party library's kernels), chosen by a ``backend`` key in its config that also accepts ``"auto"``.
:class:`Backends` holds a component's implementations and applies the same rule everywhere:

- A **requested** backend runs, or fails with a one-line :class:`BackendError`, never falls back to
  another one: a missing package fails when the component is built (:meth:`Backends.check`, call it from
  the module's ``__init__``); a device the backend cannot run on fails at the call (:meth:`Backends.select`:
  a module can be moved between devices after it is built).
- ``"auto"`` takes the first backend of the component's preference order that is installed, passes its own
  ``unavailable`` check and runs on the tensors' device (never an interpreted one: the Triton interpreter is
  for tests), and logs that choice (logger ``megaseq.backends``, level INFO, once per component, device
  type and choice) together with why each backend before it was passed over.

Deciding reads only ``importlib.util.find_spec``: nothing is imported until a backend is loaded, so building
a model never imports Triton or touches CUDA. Triton kernels also run on CPU tensors under the Triton
interpreter (``TRITON_INTERPRET=1``, set before triton is imported; tests use it): declare them with
``devices=("cuda",), interpretable=True``.

Example, in a plugin's layer module::

    from megaseq.backends import Backend, Backends

    MY_BACKENDS = Backends(
        "attention.mything",
        [
            Backend("torch", load=lambda: my_op_torch),
            Backend("triton", load=load_triton_op, requires=("triton",),
                    install="pip install 'megaseq-mything[triton]'", devices=("cuda",), interpretable=True),
        ],
        auto=("triton", "torch"),
    )

    class MyThing(nn.Module):
        def __init__(self, config):
            MY_BACKENDS.check(config.backend)           # unknown name or missing package: error now
            self.backend = config.backend

        def forward(self, x, ctx, cache=None):
            op = MY_BACKENDS.load(self.backend, x.device)  # wrong device: error; auto: logged choice
            ...
"""

from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from megaseq.errors import UserError

logger = logging.getLogger("megaseq.backends")

AUTO = "auto"


class BackendError(UserError, ValueError):
    """A backend that does not exist, is not installed, or cannot run on the tensors' device."""


def is_installed(module: str) -> bool:
    """Whether ``module`` can be imported (found on the path; not imported)."""
    return importlib.util.find_spec(module) is not None


def triton_interpreter_on() -> bool:
    """Whether Triton kernels run in the CPU interpreter in this process."""
    return os.environ.get("TRITON_INTERPRET") == "1"


@dataclass(frozen=True)
class Backend:
    """One implementation: ``load()`` returns it (importing what it needs).

    ``requires``: top-level modules it imports (``install`` says how to get them); ``devices``: the device
    types it runs on (``None``: any); ``interpretable``: Triton kernels, which also run on CPU tensors under
    the Triton interpreter; ``unavailable``: a check beyond imports (a compiler that builds its kernels on
    this machine, say), returning why the backend cannot run here or None; called when a backend is requested
    or considered by ``auto``, so keep it cheap after its first call.
    """

    name: str
    load: Callable[[], Any]
    requires: tuple[str, ...] = ()
    install: str = ""
    devices: tuple[str, ...] | None = None
    interpretable: bool = False
    unavailable: Callable[[], str | None] | None = None

    def missing(self) -> list[str]:
        return [module for module in self.requires if not is_installed(module)]

    def why_not(self) -> str | None:
        """Why it cannot run on this machine (a missing package or what ``unavailable`` says), or None."""
        missing = self.missing()
        if missing:
            return f"{', '.join(missing)} not installed"
        return self.unavailable() if self.unavailable is not None else None

    def runs_on(self, device: torch.device, *, interpreted: bool = True) -> bool:
        """Whether it runs on tensors on ``device`` (``interpreted``: counting the Triton interpreter)."""
        if self.devices is None or device.type in self.devices:
            return True
        return interpreted and self.interpretable and device.type == "cpu" and triton_interpreter_on()


class Backends:
    """The backends of one component (``component`` names it in errors, e.g. ``"attention.NAME"``) and its
    ``auto`` preference order (names of ``backends``, most preferred first)."""

    def __init__(self, component: str, backends: Sequence[Backend], auto: Sequence[str]) -> None:
        self.component = component
        self.backends = {b.name: b for b in backends}
        if AUTO in self.backends or len(self.backends) != len(backends):
            raise ValueError(f"{component}: backend names must be unique and not {AUTO!r}")
        unknown = [name for name in auto if name not in self.backends]
        if unknown or not auto:
            raise ValueError(f"{component}: auto order {list(auto)} must name some of {list(self.backends)}")
        self.auto = tuple(auto)
        self._logged: set[tuple[str, str]] = set()

    @property
    def names(self) -> tuple[str, ...]:
        """Every value the ``backend`` key accepts."""
        return (AUTO, *self.backends)

    def check(self, requested: str) -> None:
        """Fail now if ``requested`` is unknown or a package it needs is not installed (``auto`` always passes)."""
        if requested == AUTO:
            return
        backend = self._get(requested)
        missing = backend.missing()
        if missing:
            hint = f" ({backend.install})" if backend.install else ""
            raise BackendError(
                f"{self.component}: backend {requested!r} needs {', '.join(missing)}, which is not installed{hint}"
            )
        reason = backend.unavailable() if backend.unavailable is not None else None
        if reason:
            raise BackendError(f"{self.component}: backend {requested!r} cannot run here: {reason}")

    def select(self, requested: str, device: torch.device | str) -> Backend:
        """The backend that runs on tensors on ``device``: ``requested`` itself, or an error; for ``auto`` the
        first of the preference order that is installed and runs there (logged)."""
        device = torch.device(device)
        if requested != AUTO:
            self.check(requested)
            backend = self.backends[requested]
            if not backend.runs_on(device):
                runnable = [b.name for b in self.backends.values() if b.runs_on(device) and not b.why_not()]
                extra = " (or set TRITON_INTERPRET=1 before importing triton, for tests)" if backend.interpretable else ""
                raise BackendError(
                    f"{self.component}: backend {requested!r} needs {' or '.join(backend.devices or ())} tensors, "
                    f"got {device.type}; backends that run there: {', '.join(runnable)}{extra}"
                )
            return backend
        passed_over = []
        for name in self.auto:
            backend = self.backends[name]
            if not backend.runs_on(device, interpreted=False):
                passed_over.append(f"{name}: does not run on {device.type}")
            elif reason := backend.why_not():
                passed_over.append(f"{name}: {reason}")
            else:
                self._log_choice(device, name, passed_over)
                return backend
        raise BackendError(f"{self.component}: no backend runs on {device.type} ({'; '.join(passed_over)})")

    def load(self, requested: str, device: torch.device | str) -> Any:
        """The implementation of :meth:`select`'s backend."""
        return self.select(requested, device).load()

    def _get(self, name: str) -> Backend:
        if name not in self.backends:
            raise BackendError(f"{self.component}: unknown backend {name!r}; allowed: {', '.join(self.names)}")
        return self.backends[name]

    def _log_choice(self, device: torch.device, name: str, passed_over: list[str]) -> None:
        if (device.type, name) in self._logged:
            return
        self._logged.add((device.type, name))
        reasons = f" (passed over: {'; '.join(passed_over)})" if passed_over else ""
        logger.info("%s: backend 'auto' chose %r on %s%s", self.component, name, device.type, reasons)


__all__ = ["AUTO", "Backend", "BackendError", "Backends", "is_installed", "triton_interpreter_on"]
