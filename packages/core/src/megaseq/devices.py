"""The one rule for ``run.device`` (``auto``, ``cpu``, ``cuda``) and for what a distributed run builds on it."""

from __future__ import annotations

import os

import torch

from megaseq.errors import UserError


def device_type(name: str) -> str:
    """``"cuda"`` or ``"cpu"``: ``auto`` is CUDA where a CUDA device is visible. Not a check that the device
    exists (the planner plans for devices this machine lacks); :func:`pick_device` checks."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


def pick_device(name: str) -> torch.device:
    """The device a run on this machine uses; ``cuda`` without a visible CUDA device is a one-line error."""
    kind = device_type(name)
    if kind == "cuda" and not torch.cuda.is_available():
        raise UserError("run.device = 'cuda' but no CUDA device is available; use 'cpu' or 'auto'")
    return torch.device(kind)


def process_group_backend() -> str:
    """``nccl`` where the workers run on CUDA devices, ``gloo`` on CPU."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def join_torchrun() -> None:
    """Inside a torchrun worker: join the process group torchrun's environment describes, and on CUDA take
    this worker's local device."""
    import torch.distributed as dist

    dist.init_process_group(process_group_backend())
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))


__all__ = ["device_type", "join_torchrun", "pick_device", "process_group_backend"]
