"""Run a function on several CPU processes joined by a gloo process group, for multi-rank tests (or, with
``backend="nccl"``, on one GPU per process).

Processes start from a fork server that has already imported torch and core's test kit, so a launch costs a
fraction of a second instead of a fresh interpreter importing torch per rank (seconds each on a busy
machine). Each worker runs with the caller's environment as it is at the call.
"""

from __future__ import annotations

import datetime
import io
import os
import queue as queue_module
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Imported once by the fork server, so that every rank starts with them loaded. torch._dynamo is what the
# first activation checkpoint imports, megatron-core's parallel_state (megaseq_testkit.rank_preload) what the
# first process group imports: seconds each, otherwise paid again by every rank.
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "megaseq_testkit.attention", "megaseq_testkit.rank_preload"]


def _worker(
    rank: int, world_size: int, port: int, fn: Callable[..., Any], args: tuple, queue: Any,
    environ: dict[str, str], timeout: float, backend: str = "gloo",
) -> None:
    os.environ.clear()
    os.environ.update(environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # several ranks share the machine's cores: intra-op threads would oversubscribe
    if backend == "nccl":
        torch.cuda.set_device(rank)
    # a rank stuck in a collective that another rank never entered fails after ``timeout`` instead of hanging
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=timeout))
    try:
        # results travel as bytes: tensors sent through a queue would share memory with a process about to exit
        buffer = io.BytesIO()
        torch.save(fn(rank, world_size, *args), buffer)
        queue.put((rank, "ok", buffer.getvalue()))
    except BaseException:  # report any failure to the parent instead of hanging it
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        dist.destroy_process_group()


def run_gloo(
    world_size: int, fn: Callable[..., Any], *args: Any, timeout: float = 300.0, collective_timeout: float = 60.0,
    backend: str = "gloo",
) -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` in ``world_size`` processes with a gloo group initialised
    (``backend="nccl"``: an NCCL group, rank ``r`` on CUDA device ``r``).

    ``fn`` must be importable (a module-level function) and its return value picklable (e.g. tensors).
    Returns the results in rank order; raises ``RuntimeError`` with the worker's traceback if any rank fails.
    A collective that some rank never enters fails after ``collective_timeout`` seconds; ``timeout`` bounds
    the wait for each rank's answer.
    """
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    queue = ctx.Queue()
    port = _free_port()
    worker_args = (queue, dict(os.environ), min(timeout, collective_timeout), backend)
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, port, fn, args, *worker_args)) for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    deadline = time.monotonic() + timeout
    while len(results) < world_size and not errors:
        try:
            rank, status, payload = queue.get(timeout=1.0)
        except queue_module.Empty:
            dead = [r for r, p in enumerate(procs) if p.exitcode is not None and r not in results]
            if dead:  # died without reporting (killed, or failed while starting)
                errors.append(f"rank {dead[0]} exited with code {procs[dead[0]].exitcode} without an answer")
            elif time.monotonic() > deadline:
                errors.append(f"no answer from some rank within {timeout:.0f} s")
            continue
        if status == "ok":
            results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
        else:
            errors.append(f"rank {rank}:\n{payload}")
    for p in procs:
        p.join(timeout=timeout if not errors else 5)
        if p.is_alive():
            p.terminate()
    if errors:
        raise RuntimeError("\n".join(errors))
    return [results[r] for r in range(world_size)]
