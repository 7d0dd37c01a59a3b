"""Starting the workers of a distributed run: Ray Train, or torchrun.

Ray (``--workers N``, optionally ``--address`` of a running cluster): a ``TorchTrainer`` starts N workers
(gloo on CPU, nccl on CUDA; Ray initialises ``torch.distributed``), restarts the whole group when a
worker dies (``--max-failures``), and the restarted workers resume from the newest checkpoint of the run
directory that this launch wrote (each checkpoint's ``meta.json`` names its launch, so an older run's
checkpoints are never mistaken for this one's). Locally, Ray is told that the machine has at least N
logical CPUs: a worker needs one, and Ray waits forever for workers it cannot place.

The launcher holds the run directory's lock for the whole launch (``megaseq.train.rundir``). SIGINT or
SIGTERM to it asks the workers to save at their next step and stop (through a stop file, see
``megaseq.train.interrupt``); a second signal stops at once. Either way the workers and the local Ray
cluster the launcher started are shut down before it exits. Each worker records its PID and, when it
raises, the error and the time in ``RUN/.megaseq-workers/``, so that a failed group's error names the
worker that failed first (one that left no error died: killed, or crashed) rather than a survivor's
broken connection. Ray's own logging is kept to errors through its documented settings (``QUIET_RAY``).

torchrun: ``torchrun --nproc-per-node N -m megaseq.cli train RECIPE --parallel ...`` runs the same worker
code with the process group from torchrun's environment.

Every check that can fail (the layout, the recipe's components and memory policies under it, the checkpoint to resume, the
cluster's address and size) runs in the launching process before any worker starts.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import Collection
from pathlib import Path
from typing import Any

import psutil

from megaseq import threads
from megaseq.capabilities import check_components
from megaseq.config import Recipe, RunConfig, validate_recipe
from megaseq.data.transforms import build_transforms
from megaseq.devices import bind_ray_device, device_type, join_torchrun
from megaseq.distributed.experts import layout_splits
from megaseq.distributed.groups import EXTRA_HINT, destroy_process_groups, init_process_groups, rank_groups
from megaseq.distributed.layout import Layout, check_layout
from megaseq.errors import UserError
from megaseq.memory import heap
from megaseq.plugins import Plugins, get_plugins
from megaseq.train import checkpoint
from megaseq.train.interrupt import HANDLED, Interrupted
from megaseq.train.trainer import Trainer, TrainResult

STOP_FILE = ".megaseq-stop"
WORKER_RECORDS = ".megaseq-workers"
# Ray's documented switches, set unless the user set them: Ray Train's print redirection off (each line once);
# each worker's lines printed as they are, without Ray's deduplication (which colours its "[repeated Nx]" notes
# whether or not the output is a terminal); Ray Train's preemption watcher off (an observability actor whose
# creation logs an error-level core_worker line on every run; a lost worker still fails the group, and
# FailureConfig restarts it). Read when ray is imported and by the processes ray.init starts. The Python log
# levels are set in ray.init (ray.LoggingConfig: Ray's actors, e.g. the placement-group cleaner's warnings) and
# the RunConfig (ray.train.LoggingConfig: the controller's and workers' info lines).
QUIET_RAY = {"RAY_TRAIN_ENABLE_PRINT_PATCH": "0", "RAY_DEDUP_LOGS": "0", "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0"}


def preflight(recipe: Recipe, plugins: Plugins, layout: Layout, resume: bool, address: str | None = None) -> None:
    """Everything about a layout that can be checked before a worker starts: the layout, what it asks of the
    components (their declared capabilities), the data transforms against the windows, the experts' split, the
    checkpoint to resume, the cluster."""
    if address is not None:
        check_address(address)
    check_layout(recipe, layout)
    check_components(recipe, plugins, layout)
    build_transforms(recipe, plugins)
    layout_splits(recipe, plugins, layout.ep, layout.tp, layout.etp)  # builds on the meta device: components may refuse
    if resume and (path := checkpoint.newest_verified(recipe.out_dir / "checkpoints").path) is not None:
        check_resharding(path, recipe, plugins)


def dry_run(recipe: Recipe, plugins: Plugins, layout: Layout, resume: bool, address: str | None = None) -> str:
    """``megaseq train --dry-run``: the launch's pre-flight (:func:`preflight`), then what the launch would
    create, without starting a worker or touching a device: every rank's groups as megatron-core's
    ``parallel_state`` forms them (:func:`megaseq.distributed.groups.rank_groups`) and the memory plan of one
    device under the recipe's memory policies."""
    preflight(recipe, plugins, layout, resume, address)
    lines = [f"{recipe.source}: parallel {layout}: {layout.world_size} rank(s); the layout, the components' "
             f"capabilities and their splits check out (nothing was started)", ""]
    if layout.world_size > 1:
        lines += [*describe_groups(rank_groups(layout)), ""]
    lines.append(describe_plan(recipe, plugins, layout))
    return "\n".join(lines)


def describe_groups(groups: dict[str, list[list[int]]]) -> list[str]:
    """The groups of each kind (ranks of a group as ``a-b`` when consecutive), then each rank's group of each kind
    (its index in the list above it)."""

    def ranks(group: list[int]) -> str:
        consecutive = len(group) > 2 and group == list(range(group[0], group[-1] + 1))
        return f"{group[0]}-{group[-1]}" if consecutive else ",".join(map(str, group))

    world = sum(len(g) for g in groups["tp"])
    lines = [f"groups (megatron-core parallel_state, {world} ranks):"]
    for name, members in groups.items():
        head = f"  {name:<10} {len(members)} of {len(members[0])}: "
        lines += textwrap.wrap("  ".join(ranks(g) for g in members), width=110, initial_indent=head,
                               subsequent_indent=" " * len(head), break_on_hyphens=False)
    index = {name: {r: i for i, g in enumerate(members) for r in g} for name, members in groups.items()}
    lines += ["", "rank -> group (index in each list above):", "  rank" + "".join(f"{n:>11}" for n in groups)]
    lines += [f"  {r:>4}" + "".join(f"{index[n][r]:>11}" for n in groups) for r in range(world)]
    return lines


def describe_plan(recipe: Recipe, plugins: Plugins, layout: Layout) -> str:
    """The memory plan of one device of ``layout`` under the recipe's memory policies: the fit against this
    machine's device where it has the recipe's kind, else the predicted peaks alone."""
    from megaseq.memory.machine import Machine, gib
    from megaseq.memory.plan import plan
    from megaseq.memory.plan_report import render_table

    names = recipe.train.memory_policy
    policies = names if names == "auto" else list(names) or "none"
    kind = device_type(recipe.run.device)
    try:
        machine = Machine.detect(kind)
    except UserError:  # a cuda recipe planned on a machine without one: nothing to fit against
        machine = None
    if machine is not None:
        return render_table(plan(recipe, plugins, layout=layout, machine=machine, policies=policies))
    result = plan(recipe, plugins, layout=layout, machine=Machine(kind, 2**62, None), policies=policies)
    lines = [f"memory plan per {kind} device ({result.tokens} tokens per device per micro-batch); no {kind} device "
             f"here to fit against,", f"`megaseq plan {recipe.source} --parallel {layout} --device-mem GiB` checks the fit:"]
    for e in result.candidates:
        host = f", host {gib(e.host + e.host_optimizer)}" if e.host or e.host_optimizer else ""
        lines.append(f"  {e.label}: peak {gib(e.device_peak)} (weights {gib(e.weights)}, gradients "
                     f"{gib(e.gradients)}){host}")
    return "\n".join(lines)


def check_resharding(path: Path, recipe: Recipe, plugins: Plugins) -> None:
    """The checkpoint's whole tensors must be the recipe's whole model's, and its blocks must hold every value
    of them, so that any layout can read its parts (nothing but ``meta.json`` and the file headers is read)."""
    from megaseq.distributed.sharded import saved_shapes

    shapes = saved_shapes(path, checkpoint.read_meta(path))
    expected = layout_splits(recipe, plugins).shapes
    for name in sorted(set(expected) | set(shapes)):
        if shapes.get(name) != expected.get(name):
            saved, wanted = (list(s) if s is not None else None for s in (shapes.get(name), expected.get(name)))
            raise UserError(
                f"{path}: cannot resume {recipe.source} from it: {name} is {saved} in the checkpoint "
                f"and {wanted} in the recipe's model (the model changed, not only the layout)"
            )


# -- the worker (both launchers) ------------------------------------------------------------------------------
def run_worker(
    raw: dict[str, Any], source: str, mode: str, progress: bool, launch: str | None = None, stop_file: Path | None = None
) -> TrainResult:
    """One worker of a distributed run; ``torch.distributed`` is initialised (by Ray or torchrun).
    ``launch`` identifies the launch in the checkpoints it writes (how restarted workers find theirs);
    ``stop_file``: the launcher's stop request (``megaseq.train.interrupt``). The workers of one machine
    share its cores as any trainers do (``megaseq.threads``)."""
    plugins = get_plugins()
    recipe = validate_recipe(raw, plugins, source=source)
    layout = Layout.of(recipe)
    parallel = init_process_groups(layout)
    try:
        # a Ray run's launcher holds the run directory's lock for the whole launch, restarts included
        trainer = Trainer(recipe, plugins, parallel=parallel, progress=progress, lock_run=launch is None)
        trainer.stop_file = stop_file
        if launch is not None:
            trainer.checkpoint_meta["launch"] = launch
        return trainer.run(mode)
    finally:
        destroy_process_groups()


def run_torchrun(recipe: Recipe, mode: str, progress: bool) -> TrainResult | None:
    """Inside a torchrun worker: join its process group, train; rank 0 returns the result."""
    import torch.distributed as dist

    join_torchrun()
    try:
        result = run_worker(recipe.to_dict(), recipe.source, mode, progress)
    finally:
        dist.destroy_process_group()
    return result if result.eval is not None else None


def in_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ  # set by torchrun in every worker it starts


# -- Ray ----------------------------------------------------------------------------------------------------
def _ray_worker(config: dict[str, Any]) -> None:
    import torch.distributed as dist

    # Ray formed the default group already, but without a device: NCCL makes its communicators at the
    # first collective, on the device current then, which from here on is this worker's own
    bind_ray_device()
    out_dir = RunConfig.model_validate(config["recipe"]["run"]).out_path
    record = out_dir / WORKER_RECORDS / f"rank{dist.get_rank()}.json"
    _write_record(record, {"pid": os.getpid(), "host": socket.gethostname()})
    newest = checkpoint.newest_verified(out_dir / "checkpoints").path
    # A restarted worker group (a worker died) resumes from the newest checkpoint this launch wrote. The
    # launcher prepared the run directory (refused or wiped it): without --resume, all in it is this launch's.
    ours = newest is not None and checkpoint.read_meta(newest).get("launch") == config["launch"]
    mode = "resume" if config["resume"] or ours else "overwrite"
    try:
        run_worker(config["recipe"], config["source"], mode, progress=False, launch=config["launch"],
                   stop_file=out_dir / STOP_FILE)
    except Interrupted:
        return  # the launcher asked for the stop (and reports it): to Ray, a finished run, not one to restart
    except BaseException as exc:
        reason = (str(exc).strip().splitlines() or [""])[0]
        _write_record(record, {"pid": os.getpid(), "host": socket.gethostname(), "failed_at": time.time(),
                               "error": f"{type(exc).__name__}: {reason}" if reason else type(exc).__name__})
        raise


def _write_record(path: Path, record: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)


def first_failure(records_dir: Path, world_size: int, reported: Collection[int] | None = None) -> str | None:
    """Which worker failed first, from the records of the last worker group and the ranks Ray ``reported``
    failed (``WorkerGroupError.worker_failures``; None when unknown). A rank that recorded no error died
    without raising (killed, or crashed), and so before the others, whose errors follow from losing it; a
    survivor that Ray stopped before it could record its error is silent too, but Ray does not report it.
    Else the rank with the earliest recorded error. None when no worker recorded anything."""
    records = {}
    for rank in range(world_size):
        path = records_dir / f"rank{rank}.json"
        if path.exists():
            records[rank] = json.loads(path.read_text())
    if not records:
        return None
    silent = [rank for rank, r in records.items() if "error" not in r]
    if reported is not None and any(rank in reported for rank in silent):
        silent = [rank for rank in silent if rank in reported]
    elif len(silent) == len(records):
        silent = []  # nobody recorded an error and Ray named nobody: nothing tells the ranks apart
    if silent:
        rank = silent[0]
        return f"worker rank {rank} ({_where(records[rank])}) died without an error (killed, or the process crashed)"
    failed = sorted((r["failed_at"], rank) for rank, r in records.items() if "error" in r)
    if not failed:
        return None
    rank = failed[0][1]
    return f"worker rank {rank} ({_where(records[rank])}) failed first: {records[rank]['error']}"


def _where(record: dict[str, Any]) -> str:
    return f"PID {record['pid']} on {record['host']}"


def with_absolute_paths(recipe: Recipe) -> Recipe:
    """The recipe with every path a worker reads or writes made absolute against this process's working
    directory, as the one-process trainer reads them: Ray starts its workers in a working directory of its own.
    ``run.out_dir`` (with ``{name}`` filled in) and FASTA files named in ``data.train``/``data.heldout``;
    data-source names stay names. A component's path fields (``megaseq.records.LocalPath``, such as a data
    source's file in ``[data_source.NAME]``) are absolute already: validating the recipe in this process made them so."""
    from megaseq.data.sources import data_sources

    sources = data_sources()
    data = {}
    for which in ("train", "heldout"):
        spec = getattr(recipe.data, which)
        if spec not in sources and Path(spec).expanduser().is_file():
            data[which] = str(Path(spec).expanduser().absolute())
    return recipe.model_copy(update={
        "run": recipe.run.model_copy(update={"out_dir": str(recipe.out_dir.absolute())}),
        "data": recipe.data.model_copy(update=data),
    })


def worker_environment() -> dict[str, str]:
    """The environment variables megaseq reads that workers must see as this process does (a relative
    ``MEGASEQ_CACHE`` made absolute), for Ray's ``runtime_env``."""
    env = {name: os.environ[name] for name in ("OMP_NUM_THREADS", threads.AUTO, "GOMP_SPINCOUNT", heap.HUGE_PAGES) if name in os.environ}
    if os.environ.get("MEGASEQ_CACHE"):
        env["MEGASEQ_CACHE"] = str(Path(os.environ["MEGASEQ_CACHE"]).expanduser().absolute())
    return env


def check_address(address: str) -> None:
    """An unreachable ``host:port`` is one line, not a long wait inside Ray."""
    if address in ("auto", "local") or address.startswith("ray://"):
        target = address.removeprefix("ray://")
        if target in ("auto", "local"):
            return
    else:
        target = address
    host, _, port = target.rpartition(":")
    if not host or not port.isdigit():
        raise UserError(f"--address {address!r}: expected HOST:PORT of a Ray cluster's head, ray://HOST:PORT, or auto")
    try:
        with socket.create_connection((host, int(port)), timeout=5):
            pass
    except OSError as exc:
        raise UserError(f"--address {address}: cannot reach a Ray cluster there ({exc.strerror or exc})") from None


def run_with_ray(recipe: Recipe, layout: Layout, resume: bool, address: str | None, max_failures: int) -> Path:
    """Train with ``layout.world_size`` Ray workers; returns the run directory."""
    for name, value in QUIET_RAY.items():
        os.environ.setdefault(name, value)
    try:
        import ray
        import ray.train
        from ray.train.torch import TorchConfig, TorchTrainer
    except ImportError:
        raise UserError(f"--workers needs Ray Train: {EXTRA_HINT}") from None
    workers = layout.world_size
    use_gpu = device_type(recipe.run.device) == "cuda"
    init = {"address": address} if address else {"num_cpus": max(workers, os.cpu_count() or 1)}
    recipe = with_absolute_paths(recipe)
    out = recipe.out_dir
    stop_file, records = out / STOP_FILE, out / WORKER_RECORDS
    env = worker_environment() | {name: os.environ[name] for name in QUIET_RAY}

    def before_fit(signum: int, frame: Any) -> None:  # SIGTERM's default would skip the shutdown below
        raise Interrupted(signum, f"{signal.Signals(signum).name}: stopped before the workers started")

    previous = signal.signal(signal.SIGTERM, before_fit)
    try:
        try:
            ray.init(**init, include_dashboard=False, log_to_driver=True, logging_level="ERROR", configure_logging=True,
                     logging_config=ray.LoggingConfig(encoding="TEXT", log_level="ERROR"), runtime_env={"env_vars": env})
        except ConnectionError as exc:
            raise UserError(f"--address {address}: {str(exc).splitlines()[0]}") from None
        available = ray.cluster_resources()
        need = {"CPU": workers, **({"GPU": workers} if use_gpu else {})}
        for resource, amount in need.items():
            if available.get(resource, 0) < amount:
                raise UserError(
                    f"{workers} workers need {amount} {resource}s; the Ray cluster{f' at {address}' if address else ''} "
                    f"has {available.get(resource, 0):g}"
                )
        stop_file.unlink(missing_ok=True)
        trainer = TorchTrainer(
            _ray_worker,
            train_loop_config={"recipe": recipe.to_dict(), "source": recipe.source, "resume": resume, "launch": uuid.uuid4().hex},
            torch_config=TorchConfig(backend="nccl" if use_gpu else "gloo"),
            scaling_config=ray.train.ScalingConfig(num_workers=workers, use_gpu=use_gpu, resources_per_worker={"CPU": 1}),
            run_config=ray.train.RunConfig(
                name="ray",
                storage_path=str(out),
                failure_config=ray.train.FailureConfig(max_failures=max_failures),
                logging_config=ray.train.LoggingConfig(log_level="ERROR"),
            ),
        )
        stopped = _fit_until_done_or_stopped(trainer, stop_file)
        if stopped is not None:
            saved = checkpoint.newest_verified(out / "checkpoints").path
            where = f"stopped after step {checkpoint.read_meta(saved)['step']}; saved {saved}" if saved else "stopped before the first checkpoint"
            raise Interrupted(stopped, f"{where}; continue with --resume")
    except ray.train.TrainingFailedError as exc:
        raise WorkerFailed(exc, first_failure(records, workers, getattr(exc, "worker_failures", None))) from None
    finally:
        started = [] if address else psutil.Process().children(recursive=True)  # the local cluster's processes
        ray.shutdown()  # stops the workers and, when ray.init started it, the local cluster
        _end_processes(started)
        signal.signal(signal.SIGTERM, previous)
        stop_file.unlink(missing_ok=True)
        for path in records.glob("rank*.json"):
            path.unlink()
    return out


def _end_processes(processes: list[psutil.Process], grace_s: float = 5.0) -> None:
    """Terminate what of the local cluster outlives ``ray.shutdown``: a detached actor (Ray Train's placement-group
    cleaner) notices the cluster's end only at its next health check, up to 30 s later."""
    _, alive = psutil.wait_procs(processes, timeout=grace_s)
    for process in alive:
        with contextlib.suppress(psutil.Error):
            process.terminate()
    _, alive = psutil.wait_procs(alive, timeout=grace_s)
    for process in alive:
        with contextlib.suppress(psutil.Error):
            process.kill()


def _fit_until_done_or_stopped(trainer: Any, stop_file: Path) -> int | None:
    """``trainer.fit()`` in a thread (so that Ray installs no SIGINT handler of its own, which would abort
    the workers without saving), while this thread turns the first SIGINT/SIGTERM into the workers' stop
    file and a second into :class:`Interrupted` at once. Returns the signal that stopped the run, if any."""
    outcome: dict[str, BaseException] = {}

    def fit() -> None:
        try:
            trainer.fit()
        except BaseException as exc:
            outcome["error"] = exc

    requested: list[int] = []

    def handle(signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if requested:
            raise Interrupted(signum, f"{name} again: stopped at once, without saving; the workers are stopped")
        requested.append(signum)
        stop_file.write_text(str(int(signum)))
        print(f"\nmegaseq: {name}: the workers save a checkpoint after their current step, then stop "
              f"(send it again to stop at once)", file=sys.stderr, flush=True)

    previous = {signum: signal.signal(signum, handle) for signum in HANDLED}
    try:
        thread = threading.Thread(target=fit, name="ray-train-fit", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(0.2)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if "error" in outcome:
        raise outcome["error"]
    return requested[0] if requested else None


class WorkerFailed(RuntimeError):
    """The workers failed more often than ``--max-failures`` allows: one line naming the worker that failed
    first (``first``, from the workers' records) and why, else Ray's last line."""

    def __init__(self, error: BaseException, first: str | None = None) -> None:
        lines = [line for line in str(error).strip().splitlines() if line.strip()]
        super().__init__(f"training workers failed: {first or (lines[-1] if lines else type(error).__name__)}")


__all__ = ["QUIET_RAY", "STOP_FILE", "WORKER_RECORDS", "WorkerFailed", "dry_run", "first_failure", "in_torchrun", "preflight", "run_torchrun", "run_with_ray", "run_worker", "with_absolute_paths",
           "worker_environment"]
