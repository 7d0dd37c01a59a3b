"""A megaseq plugin that records where a rank of ``megaseq train`` runs, for ``benchmarks/device_check.py``.

The device check starts ``megaseq train`` under Ray and under torchrun with this module on the path and
registered as an entry point (``device_check.write_distributions``), so every rank loads it as it loads any
installed plugin. At the end of its first optimizer step, a rank whose environment names a directory in
``MEGASEQ_DEVICE_PROBE`` writes ``rank{r}.json`` there: its rank, the CUDA device current in the process
(``torch.cuda.current_device()``, None without CUDA) and the devices the trainer's parameters are on. Without
that variable it does nothing.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

from megaseq.hookspecs import hookimpl

PROBE_ENV = "MEGASEQ_DEVICE_PROBE"


@hookimpl
def megaseq_step_end(step, model: torch.nn.Module, metrics: dict[str, float]) -> None:
    where = os.environ.get(PROBE_ENV)
    if not where or step.step != 1:
        return
    grouped = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if grouped else 0
    record = {
        "rank": rank,
        "world_size": dist.get_world_size() if grouped else 1,
        "local_rank": os.environ.get("LOCAL_RANK"),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "current_device": torch.cuda.current_device() if torch.cuda.is_available() else None,
        "parameter_devices": sorted({str(p.device) for p in model.parameters()}),
        "pid": os.getpid(),
    }
    path = Path(where) / f"rank{rank}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record))
