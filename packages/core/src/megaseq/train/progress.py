"""The progress display of training and evaluation: one line per loop, with rates over recent steps.

A line reads ``train 40/75 steps, 1:02 elapsed, 0:54 left: NOTE``, where NOTE is what the caller shows of
the step just done (the trainer's loss, throughput and memory). Rates and the time left come from a window of
the last :data:`WINDOW` steps (wall time between their ends), so one slow step (an evaluation, a checkpoint)
moves them a little, not all the way, and what a line shows is up to the step it names: :meth:`Progress.record`
takes a step's work, :meth:`Progress.show` prints the line of the steps recorded until then.

On a terminal the line is rewritten in place (a carriage return and spaces over a longer previous line; no
other control codes). Elsewhere (a log file, a pipe) every ``every``-th step and the last one print a plain
line, each step at most once, so a log reads as lines.
"""

from __future__ import annotations

import os
import sys
import time
from collections import deque
from collections.abc import Callable
from typing import TextIO

WINDOW = 20  # steps the rates are taken over


def _clock(seconds: float) -> str:
    hours, rest = divmod(round(seconds), 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


def is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def _columns(stream: TextIO) -> int:
    try:
        return os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, ValueError, OSError):  # not a real terminal (a test's stand-in)
        return 1000


class Progress:
    """A loop of ``total`` steps (``initial`` already done, e.g. before a resume), shown on ``stream``.

    ``every``: off a terminal, print every ``every``-th step (and the last); ``leave``: on a terminal, keep
    the last line when closed (else clear it). ``enabled=False`` shows nothing."""

    _live: Progress | None = None  # whose line the terminal's cursor is on

    def __init__(
        self,
        desc: str,
        total: int,
        *,
        unit: str = "steps",
        initial: int = 0,
        every: int = 1,
        leave: bool = True,
        enabled: bool = True,
        stream: TextIO | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.desc, self.total, self.unit, self.every, self.leave = desc, total, unit, max(1, every), leave
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stderr
        self.terminal = enabled and is_terminal(self.stream)
        self.clock = clock
        self.started = clock()
        self.initial = self.done = initial
        self.tokens = 0
        self.note = ""
        # (time, steps done, tokens seen) at the end of each of the last WINDOW steps, and where it began
        self._points: deque[tuple[float, int, int]] = deque([(self.started, initial, 0)], maxlen=WINDOW + 1)
        self._width = 0  # of the line on the terminal now
        self._shown = -1  # the step of the last plain line

    def record(self, steps: int = 1, tokens: int = 0) -> None:
        """``steps`` more steps done, which processed ``tokens`` tokens."""
        self.done += steps
        self.tokens += tokens
        self._points.append((self.clock(), self.done, self.tokens))

    def _span(self) -> tuple[float, int, int]:
        (t0, done0, tokens0), (t1, done1, tokens1) = self._points[0], self._points[-1]
        return t1 - t0, done1 - done0, tokens1 - tokens0

    @property
    def tokens_per_s(self) -> float | None:
        """Tokens per second over the recorded steps of the window (None before a step is recorded)."""
        seconds, steps, tokens = self._span()
        return tokens / seconds if steps and seconds > 0 else None

    def line(self) -> str:
        seconds, steps, _ = self._span()
        left = "?" if not steps else _clock(seconds / steps * max(0, self.total - self.done))
        text = f"{self.desc} {self.done}/{self.total} {self.unit}, {_clock(self.clock() - self.started)} elapsed, {left} left"
        return text + (f": {self.note}" if self.note else "")

    def show(self, note: str = "") -> None:
        """Print the line of the steps recorded until now, ``note`` after it."""
        if not self.enabled:
            return
        self.note = note
        if self.terminal:
            live = Progress._live
            if live is not None and live is not self and live._width:  # another loop's line (an evaluation
                live.stream.write("\n")  # inside training) stays above this one
                live._width = 0
            Progress._live = self
            text = self.line()[: _columns(self.stream) - 1]  # a wrapped line could not be rewritten in place
            self.stream.write("\r" + text + " " * max(0, self._width - len(text)))
            self._width = len(text)
            self.stream.flush()
        elif self.done != self._shown and (self.done % self.every == 0 or self.done >= self.total):
            self._print_plain()

    def advance(self, steps: int = 1, tokens: int = 0, note: str = "") -> None:
        self.record(steps, tokens)
        self.show(note)

    def _print_plain(self) -> None:
        self.stream.write(self.line() + "\n")
        self.stream.flush()
        self._shown = self.done

    def close(self) -> None:
        """End the display: on a terminal keep (``leave``) or clear the line; elsewhere print the last step
        recorded unless its line is already out."""
        if not self.enabled:
            return
        if self.terminal:
            if self._width:
                self.stream.write("\n" if self.leave else "\r" + " " * self._width + "\r")
                self.stream.flush()
            self._width = 0
            if Progress._live is self:
                Progress._live = None
        elif self.done != self._shown and self.done > self.initial:
            self._print_plain()
