"""Stopping a run cleanly: the first SIGINT or SIGTERM asks for a stop at the next step boundary (the
trainer saves a checkpoint there and raises :class:`Interrupted`); a second one raises it at once.

Python runs signal handlers in the main thread between bytecodes, so "at once" means as soon as the
current torch operation returns. Outside the main thread (where handlers cannot be installed) the
default behaviour is kept.

Workers that get no signal (Ray's, started by ``megaseq train --workers N``) are asked to stop through a
stop file: the launcher catches the signal and writes its number into the file that every worker's
:class:`StopRequests` watches (``stop_file``), and they stop as after a first signal.
"""

from __future__ import annotations

import signal
import sys
import threading
from pathlib import Path
from types import FrameType

HANDLED = (signal.SIGINT, signal.SIGTERM)


class Interrupted(KeyboardInterrupt):
    """Training stopped by a signal. ``exit_status`` is the shell convention, 128 + the signal number."""

    def __init__(self, signum: int, message: str) -> None:
        super().__init__(message)
        self.signum = signum
        self.exit_status = 128 + signum


class StopRequests:
    """Context manager that turns the first SIGINT/SIGTERM, or the appearance of ``stop_file`` (holding a
    signal number), into :attr:`requested` (the signal number)."""

    def __init__(self, stop_file: Path | None = None) -> None:
        self.stop_file = stop_file
        self._requested: int | None = None
        self._previous: dict[int, object] = {}

    @property
    def requested(self) -> int | None:
        if self._requested is None and self.stop_file is not None and self.stop_file.exists():
            text = self.stop_file.read_text().strip()
            self._requested = int(text) if text.isdigit() else signal.SIGTERM
        return self._requested

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self._requested is not None:
            raise Interrupted(signum, f"{name} again: stopped at once, without saving")
        self._requested = signum
        print(f"\nmegaseq: {name}: saving a checkpoint after this step, then stopping "
              f"(send it again to stop at once)", file=sys.stderr, flush=True)

    def __enter__(self) -> StopRequests:
        if threading.current_thread() is threading.main_thread():
            for signum in HANDLED:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()


__all__ = ["Interrupted", "StopRequests"]
