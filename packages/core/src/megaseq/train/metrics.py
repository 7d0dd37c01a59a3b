"""Metrics sinks: a JSONL file (one object per logged step) and TensorBoard scalars.

Both append. A resumed run first cuts ``metrics.jsonl`` back to its checkpoint's step
(``megaseq.train.rundir.truncate_metrics``) and passes ``purge_step`` = that step + 1, which TensorBoard
records so that readers drop the older events from that step on: each step is shown once.
"""

from __future__ import annotations

import json
import resource
from pathlib import Path

import torch


def peak_memory_gib(device: torch.device) -> float:
    """Peak device memory for CUDA, else the process's peak resident set size."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB


class MetricsLogger:
    def __init__(self, out_dir: Path, tensorboard: bool = True, purge_step: int | None = None) -> None:
        out_dir.mkdir(parents=True, exist_ok=True)
        self._jsonl = (out_dir / "metrics.jsonl").open("a")
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(out_dir / "tensorboard"), purge_step=purge_step)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self._jsonl.write(json.dumps({"step": step, **metrics}) + "\n")
        self._jsonl.flush()
        if self._tb is not None:
            for key, value in metrics.items():
                self._tb.add_scalar(key, value, step)

    def close(self) -> None:
        self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
