"""Run directories: one run per directory, never overwritten or mixed silently.

A run directory (``run.out_dir``) holds what training writes: ``metrics.jsonl``, ``tensorboard/``,
``checkpoints/`` and ``eval/``. Every evaluation of the checkpoint of step N, by the trainer at the end of
a run or by ``megaseq eval``, goes to ``eval/step_N/`` (:func:`eval_dir`). How a run starts in it is always explicit:

- ``new`` (the default): the directory must not hold run output yet; if it does, a one-line error says
  to continue it with ``--resume`` or start over with ``--overwrite``.
- ``resume``: continue from the newest verified checkpoint. The logs are cut back to that checkpoint's
  step (:func:`truncate_metrics`; TensorBoard through ``purge_step``), so the steps replayed after it are
  logged once. Everything the trainer logs for a step is logged before that step's checkpoint is saved,
  which is what makes "keep every row up to the checkpoint's step" exact.
- ``overwrite``: delete the run output listed above (nothing else in the directory) and start at step 0.

One process at a time writes a run directory: :class:`RunLock` holds an advisory lock (``flock``) on
``RUN/.megaseq.lock`` for the run's whole life, taken by ``megaseq train`` before anything is built, so a second trainer
(or an ``--overwrite`` that would delete the live run) stops with one line naming the holder's PID and
host. The kernel drops the lock when its process dies however it dies; a lock file still naming a holder
then shows the holder did not exit cleanly, and the next run takes it over with a line saying so.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import socket
import sys
from pathlib import Path
from typing import Any, Literal

from megaseq.errors import UserError

StartMode = Literal["new", "resume", "overwrite"]
START_MODES: tuple[StartMode, ...] = ("new", "resume", "overwrite")
RUN_OUTPUTS = ("metrics.jsonl", "metrics.unreadable.txt", "tensorboard", "checkpoints", "eval")
LOCK_NAME = ".megaseq.lock"
UNREADABLE_METRICS = "metrics.unreadable.txt"


class RunLock:
    """The lock of one run directory, held between ``__enter__`` and ``__exit__`` (see the module docstring).
    ``what`` names the holder in the error a second process gets (e.g. "training", "evaluation")."""

    def __init__(self, out_dir: Path, what: str = "a run") -> None:
        self.path = Path(out_dir) / LOCK_NAME
        self.what = what
        self._file: Any = None
        self._created: list[Path] = []

    def __enter__(self) -> RunLock:
        # the directories this lock creates, deepest first: a run that stops before writing anything (a refused
        # layout, a bad recipe value) leaves no directory behind
        self._created = [p for p in (self.path.parent, *self.path.parent.parents) if not p.exists()]
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            file = self.path.open("a+")
        except OSError as exc:
            raise UserError(f"run.out_dir {self.path.parent}: cannot write there ({exc.strerror})") from None
        try:
            fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(file)
            file.close()
            raise UserError(
                f"{self.path.parent} is in use by {holder} ({self.path}); wait for it to finish or stop it first"
            ) from None
        except OSError as exc:  # e.g. a file system without locks
            file.close()
            raise UserError(f"run.out_dir {self.path.parent}: cannot lock {self.path} ({exc.strerror})") from None
        previous = _read_holder(file)
        if previous != "an unnamed process":
            print(f"megaseq: taking over {self.path}: its holder {previous} is no longer running", file=sys.stderr)
        file.seek(0)
        file.truncate()
        file.write(f"{os.getpid()}@{socket.gethostname()} {self.what}\n")
        file.flush()
        self._file = file
        return self

    def __exit__(self, *exc: object) -> None:
        if self._file is not None:
            self._file.truncate(0)  # an empty lock file: its holder finished cleanly
            self._file.close()  # closing releases the flock
            self._file = None
            if self._created and [p.name for p in self.path.parent.iterdir()] == [LOCK_NAME]:
                self.path.unlink()
                for directory in self._created:
                    with contextlib.suppress(OSError):  # another process may have written there meanwhile
                        directory.rmdir()


def _read_holder(file: Any) -> str:
    """'PID N on HOST (what)' from a lock file's content, or 'an unnamed process' when it is empty."""
    file.seek(0)
    pid_host, _, what = file.read().strip().partition(" ")
    pid, _, host = pid_host.partition("@")
    if not pid:
        return "an unnamed process"
    return f"PID {pid} on {host}" + (f" ({what})" if what else "")


def run_outputs(out_dir: Path) -> list[str]:
    """The run output already present in ``out_dir``."""
    return [name for name in RUN_OUTPUTS if (out_dir / name).exists()]


def eval_dir(out_dir: Path, step: int) -> Path:
    """Where the evaluation of step ``step``'s checkpoint goes: ``RUN/eval/step_N`` (named as the checkpoint)."""
    return out_dir / "eval" / f"step_{step:07d}"


def check_writable(directory: Path, what: str) -> None:
    """Create ``directory`` if needed and write a probe file there: a one-line error (naming ``what``, e.g.
    "run.out_dir") instead of a traceback after the work is done."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / ".megaseq-write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise UserError(f"{what} {directory}: cannot write there ({exc.strerror})") from None


def prepare(
    out_dir: Path, mode: StartMode, outputs: tuple[str, ...] = RUN_OUTPUTS, holds: str = "a run", option: str = "run.out_dir"
) -> None:
    """Make ``out_dir`` ready for a run started as ``mode`` (see the module docstring). Something else that
    keeps this rule (an experiment of several runs) names its own ``outputs``, what the directory ``holds``
    and the ``option`` that chose the directory, for the messages."""
    if mode not in START_MODES:
        raise ValueError(f"start mode must be one of {START_MODES}, got {mode!r}")
    present = [name for name in outputs if (out_dir / name).exists()]
    if mode == "new" and present:
        raise UserError(
            f"{out_dir} already holds {holds} ({', '.join(present)}); continue it with --resume or start over "
            f"with --overwrite (deletes its {', '.join(outputs)})"
        )
    if mode == "overwrite":
        for name in present:
            path = out_dir / name
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    check_writable(out_dir, option)


def truncate_metrics(out_dir: Path, step: int) -> str | None:
    """Keep the rows of ``metrics.jsonl`` up to ``step``; returns a note for the run header when lines were
    unreadable, else None.

    A line that is not a JSON row with a step (a row cut short by a kill, or anything else) is never
    dropped silently: it is appended to ``metrics.unreadable.txt`` beside it. The file is rewritten atomically.
    """
    path = out_dir / "metrics.jsonl"
    if not path.exists():
        return None
    kept, unreadable, dropped = [], [], 0
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
            row_step = row["step"]
            keep = row_step <= step
        except (ValueError, KeyError, TypeError):
            unreadable.append(line + "\n")
            continue
        if keep:
            kept.append(line + "\n")
        else:
            dropped += 1
    if unreadable:
        with (out_dir / UNREADABLE_METRICS).open("a") as f:
            f.writelines(unreadable)
    if dropped or unreadable:
        tmp = path.with_name(".metrics.jsonl.tmp")
        tmp.write_text("".join(kept))
        os.replace(tmp, path)
    if not unreadable:
        return None
    return f"moved {len(unreadable)} unreadable line(s) of metrics.jsonl to {out_dir / UNREADABLE_METRICS}"


__all__ = [
    "LOCK_NAME", "RUN_OUTPUTS", "START_MODES", "UNREADABLE_METRICS", "RunLock", "StartMode", "check_writable", "eval_dir",
    "prepare", "run_outputs", "truncate_metrics",
]
