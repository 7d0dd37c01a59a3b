"""Every worker of a distributed run is bound to its own CUDA device before a process group forms, and the
trainer's device is that explicit ``cuda:i``: checked on a fake CUDA (torch.cuda's functions replaced)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist

from megaseq import devices
from megaseq.distributed import launch
from megaseq.errors import UserError
from megaseq.parallel import collectives

DEVICES = 8


class FakeCuda:
    """A machine with ``count`` CUDA devices: which one is current, and every ``set_device``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, count: int = DEVICES) -> None:
        self.current = 0
        self.bound: list[int] = []
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: self.current)
        monkeypatch.setattr(torch.cuda, "set_device", self.set_device)
        monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")

    def set_device(self, device: Any) -> None:
        self.current = device.index if isinstance(device, torch.device) else int(device)
        self.bound.append(self.current)


def _spy_worker(cuda: FakeCuda, seen: dict[str, Any]):
    """A stand-in for the worker's training: what the trainer and the collectives would use."""

    def run_worker(*args: Any, **kwargs: Any) -> SimpleNamespace:
        seen["current"] = cuda.current
        seen["trainer"] = devices.pick_device("cuda")
        seen["auto"] = devices.pick_device("auto")
        seen["collectives"] = collectives.group_device(object())
        return SimpleNamespace(eval=None)

    return run_worker


@pytest.mark.parametrize("local_rank", [0, 3, 7])
def test_torchrun_worker_takes_its_local_device_before_the_group_forms(monkeypatch, local_rank):
    cuda, seen = FakeCuda(monkeypatch), {}
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: seen.setdefault("at_group", cuda.current))
    monkeypatch.setattr(dist, "destroy_process_group", lambda *a, **k: None)
    monkeypatch.setattr(launch, "run_worker", _spy_worker(cuda, seen))
    launch.run_torchrun(SimpleNamespace(to_dict=dict, source="r.toml"), "overwrite", progress=False)
    assert seen["at_group"] == local_rank  # bound before init_process_group, not after
    assert seen["current"] == local_rank
    expected = torch.device("cuda", local_rank)
    assert seen["trainer"] == seen["auto"] == seen["collectives"] == expected


@pytest.mark.parametrize("local_rank", [0, 3, 7])
def test_ray_worker_takes_the_gpu_ray_assigned_it(monkeypatch, tmp_path, local_rank):
    ray_torch = pytest.importorskip("ray.train.torch", reason="needs the distributed extra: pip install 'megaseq-core[distributed]'")
    cuda, seen = FakeCuda(monkeypatch), {}
    # Ray Train shows a machine's workers all of its GPUs; each worker's own is its local rank's
    monkeypatch.setattr(ray_torch, "get_device", lambda: torch.device("cuda", local_rank))
    monkeypatch.setattr(dist, "get_rank", lambda group=None: local_rank)
    monkeypatch.setattr(launch, "run_worker", _spy_worker(cuda, seen))
    config = {"recipe": {"run": {"out_dir": str(tmp_path)}}, "source": "r.toml", "resume": False, "launch": "x"}
    launch._ray_worker(config)
    assert seen["current"] == local_rank  # bound before run_worker forms megatron-core's groups
    expected = torch.device("cuda", local_rank)
    assert seen["trainer"] == seen["auto"] == seen["collectives"] == expected


def test_more_workers_than_devices_is_one_line(monkeypatch):
    FakeCuda(monkeypatch, count=2)
    monkeypatch.setenv("LOCAL_RANK", "2")
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: pytest.fail("the group formed"))
    with pytest.raises(UserError, match=r"cuda:2 but the process sees 2 CUDA device\(s\)"):
        devices.join_torchrun()


def test_without_cuda_nothing_is_bound(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: pytest.fail("bound a device"))
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: None)
    devices.join_torchrun()
    assert devices.pick_device("auto") == torch.device("cpu")
