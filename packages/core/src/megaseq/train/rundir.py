"""Run directories: one run per directory, never overwritten or mixed silently.

A run directory (``run.out_dir``) holds what training writes: ``metrics.jsonl``, ``tensorboard/``,
``checkpoints/`` and ``eval/``. How a run starts in it is always explicit:

- ``new`` (the default): the directory must not hold run output yet; if it does, a one-line error says
  to continue it with ``--resume`` or start over with ``--overwrite``.
- ``resume``: continue from the newest verified checkpoint. The logs are cut back to that checkpoint's
  step (:func:`truncate_metrics`; TensorBoard through ``purge_step``), so the steps replayed after it are
  logged once. Everything the trainer logs for a step is logged before that step's checkpoint is saved,
  which is what makes "keep every row up to the checkpoint's step" exact.
- ``overwrite``: delete the run output listed above (nothing else in the directory) and start at step 0.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Literal

from megaseq.errors import UserError

StartMode = Literal["new", "resume", "overwrite"]
START_MODES: tuple[StartMode, ...] = ("new", "resume", "overwrite")
RUN_OUTPUTS = ("metrics.jsonl", "tensorboard", "checkpoints", "eval")


def run_outputs(out_dir: Path) -> list[str]:
    """The run output already present in ``out_dir``."""
    return [name for name in RUN_OUTPUTS if (out_dir / name).exists()]


def prepare(out_dir: Path, mode: StartMode) -> None:
    """Make ``out_dir`` ready for a run started as ``mode`` (see the module docstring)."""
    if mode not in START_MODES:
        raise ValueError(f"start mode must be one of {START_MODES}, got {mode!r}")
    present = run_outputs(out_dir)
    if mode == "new" and present:
        raise UserError(
            f"{out_dir} already holds a run ({', '.join(present)}); continue it with --resume or start over "
            f"with --overwrite (deletes its {', '.join(RUN_OUTPUTS)})"
        )
    if mode == "overwrite":
        for name in present:
            path = out_dir / name
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        probe = out_dir / ".megaseq-write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise UserError(f"run.out_dir {out_dir}: cannot write there ({exc.strerror})") from None


def truncate_metrics(out_dir: Path, step: int) -> int:
    """Keep the rows of ``metrics.jsonl`` up to ``step``; returns how many rows were dropped.

    A row cut short by a kill (not valid JSON) is dropped too. The file is rewritten atomically.
    """
    path = out_dir / "metrics.jsonl"
    if not path.exists():
        return 0
    kept, dropped = [], 0
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
            keep = row["step"] <= step
        except (ValueError, KeyError, TypeError):
            keep = False
        if keep:
            kept.append(line + "\n")
        else:
            dropped += 1
    if dropped:
        tmp = path.with_name(".metrics.jsonl.tmp")
        tmp.write_text("".join(kept))
        os.replace(tmp, path)
    return dropped


__all__ = ["RUN_OUTPUTS", "START_MODES", "StartMode", "prepare", "run_outputs", "truncate_metrics"]
