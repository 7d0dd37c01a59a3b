"""The machine a memory plan must fit: one device's memory, and the host memory and scratch disk offloading
may use; read from this machine, or given (``megaseq plan --device-mem/--host-mem``)."""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass

from megaseq.errors import UserError

GiB = 2**30
# Resident memory of a CPU training process before any tensor of the model: the interpreter, torch and its
# libraries, the plugins and the held-out data (measured on the 2-core CPU machine, torch 2.13: VmRSS after
# Trainer.__init__ with the 300 kb shipped excerpt as training data was 0.378 GiB). The training data adds
# one byte per base: the windows scan the whole token file once (with chr20: 0.437 GiB in all).
CPU_RUNTIME_BYTES = int(0.378 * GiB)
# A CPU worker of a multi-process layout also holds torch.distributed's process groups and megatron-core, and a
# Ray worker Ray's core worker and Ray Train besides (recipes/tiny.toml, 2 steps, dp=2: peak RSS 0.44 GiB in one
# process, 0.50 per worker under torchrun, 0.65 under `megaseq train --workers 2`).
DISTRIBUTED_WORKER_BYTES = int(0.06 * GiB)
RAY_WORKER_BYTES = int(0.15 * GiB)
# The CUDA context, cuBLAS workspaces and allocator slack of one GPU process (an assumption, not measured here).
CUDA_RUNTIME_BYTES = int(2.0 * GiB)


@dataclass(frozen=True)
class Machine:
    """The memory the plan must fit in: one device, and the host memory it may use (``None``: unlimited)."""

    kind: str  # "cpu" or "cuda"
    device_bytes: int
    host_bytes: int | None
    disk_bytes: int | None = None  # CPU: free space for scratch files (None: unlimited)

    @classmethod
    def detect(cls, kind: str, device_gib: float | None = None, host_gib: float | None = None) -> Machine:
        for flag, value in (("--device-mem", device_gib), ("--host-mem", host_gib)):
            if value is not None and not (math.isfinite(value) and value > 0):
                raise UserError(f"{flag} {value}: must be a positive number of GiB")
        if kind == "cpu":
            device = int(device_gib * GiB) if device_gib else total_ram()
            if device <= CPU_RUNTIME_BYTES:
                raise UserError(f"--device-mem {device / GiB:g}: impossible, a CPU process alone needs {CPU_RUNTIME_BYTES / GiB:.2f} GiB")
            return cls("cpu", device, None, scratch_free())
        if device_gib is None:
            import torch

            if not torch.cuda.is_available():
                raise UserError("the recipe runs on cuda but no CUDA device is visible: give --device-mem GiB (e.g. 178 for a B200)")
            device = torch.cuda.get_device_properties(0).total_memory
        else:
            device = int(device_gib * GiB)
        if device <= CUDA_RUNTIME_BYTES:
            raise UserError(f"--device-mem {device / GiB:g}: impossible, a CUDA process alone needs about {CUDA_RUNTIME_BYTES / GiB:.0f} GiB")
        return cls("cuda", device, int(host_gib * GiB) if host_gib else None)

    @property
    def runtime_bytes(self) -> int:
        return CPU_RUNTIME_BYTES if self.kind == "cpu" else CUDA_RUNTIME_BYTES


def in_ray_worker() -> bool:
    """Whether this process is connected to a Ray cluster (a Ray Train worker: the driver does not train)."""
    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized()


def scratch_free() -> int | None:
    """Free bytes in the directory where CPU offloading writes by default ($MEGASEQ_SCRATCH, else the system
    temporary directory)."""
    import tempfile

    try:
        stat = os.statvfs(os.environ.get("MEGASEQ_SCRATCH") or tempfile.gettempdir())
    except OSError:
        return None
    return stat.f_bavail * stat.f_frsize


def total_ram() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def gib(n: float) -> str:
    return f"{n / GiB:.2f}G"


__all__ = [
    "CPU_RUNTIME_BYTES", "CUDA_RUNTIME_BYTES", "DISTRIBUTED_WORKER_BYTES", "RAY_WORKER_BYTES", "GiB", "Machine", "gib",
    "in_ray_worker", "scratch_free", "total_ram",
]
