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
    """The device a run on this machine uses; ``cuda`` without a visible CUDA device is a one-line error.
    On CUDA it is the explicit ``cuda:i`` this process is bound to (:func:`bind_local_device`), so that every
    tensor, memory counter and stream of a worker names its own device rather than whichever is current."""
    kind = device_type(name)
    if kind == "cuda" and not torch.cuda.is_available():
        raise UserError("run.device = 'cuda' but no CUDA device is available; use 'cpu' or 'auto'")
    if kind == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(kind)


def bind_local_device(index: int) -> None:
    """Make CUDA device ``index`` (as this process sees them) the current one, where CUDA is available. A
    worker does this before any process group forms: NCCL builds its communicators on the current device,
    and without it every worker of a machine lands on device 0."""
    if not torch.cuda.is_available():
        return
    count = torch.cuda.device_count()
    if not 0 <= index < count:
        raise UserError(f"this worker's local device is cuda:{index} but the process sees {count} CUDA device(s); "
                        f"start at most {count} workers per machine, or check CUDA_VISIBLE_DEVICES")
    torch.cuda.set_device(index)


def bind_ray_device() -> None:
    """Inside a Ray Train worker: bind the GPU Ray assigned it. Ray Train shows a machine's workers all of
    the machine's assigned GPUs and tells each which one is its own (``ray.train.torch.get_device``)."""
    if not torch.cuda.is_available():
        return
    from ray.train.torch import get_device

    device = get_device()
    if device.type == "cuda":
        bind_local_device(device.index or 0)


def process_group_backend() -> str:
    """``nccl`` where the workers run on CUDA devices, ``gloo`` on CPU."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def join_torchrun() -> None:
    """Inside a torchrun worker: on CUDA take this worker's local device (``LOCAL_RANK``), then join the
    process group torchrun's environment describes."""
    import torch.distributed as dist

    bind_local_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(process_group_backend())


__all__ = ["bind_local_device", "bind_ray_device", "device_type", "join_torchrun", "pick_device", "process_group_backend"]
