"""How many intra-op threads megaseq's training processes use: the machine's cores shared among the
trainers that run on it.

On CPU, torch runs its intra-op work on an OpenMP thread pool (libgomp) whose threads spin while they wait
for the next parallel region. That is fast for a process that has the machine to itself and ruinous when it
does not: two training processes with spinning threads on two cores slow each other to a crawl. So a
trainer uses ``cores // live trainers`` threads, where the live trainers are the processes registered in
``$MEGASEQ_CACHE/trainers/`` (:class:`CoreShare`): alone it uses every core it may run on, two at once use
half each. Work that is not a megaseq trainer counts too: each decision measures the cores the rest of the
machine kept busy since the last one (``/proc/stat`` less this process's own CPU time), and a trainer takes
no more threads than the cores left idle, at least one: two spinning threads beside a busy compiler or test
run wait for each other on a core that is not theirs. Each trainer re-decides at most every ``RECOUNT_S``
seconds, at a step boundary, so one that started alone gives cores back when a second one (or other work)
starts, and takes them again when it ends. ``benchmarks/train_throughput.py --settings alone
pair`` measures both situations.

The host optimizer's update (``train.optimizer_state = "host"`` on an accelerator,
``megaseq.train.optimizer.HostAdamW``) runs on the CPU while the process's own work is on the device, where
one thread suffices: it uses ``cores // ranks on the machine`` threads while it runs (:func:`host_update_threads`:
the training processes of a machine share its cores evenly, each assumed to see all of them), then goes back
to the process's count. A thread count the user set is kept there too.

Every command starts with one thread: ``apply_defaults`` sets ``OMP_NUM_THREADS=1`` when the user has not
set it, before torch is imported (libgomp reads it when it loads; child processes inherit it), and marks it
as megaseq's own (``MEGASEQ_AUTO_THREADS``), so that child processes share cores too. A value the user set
is kept and no sharing happens: ``OMP_NUM_THREADS=2 megaseq train ...`` uses two threads throughout.

With it, where the user set no waiting policy, ``GOMP_SPINCOUNT``: a waiting OpenMP thread spins
``SPIN_COUNT`` times before it sleeps instead of libgomp's 300,000. A CPU step of a small model is thousands of
short operators, and between two of them (Python, a native kernel on its own threads) the second thread
spun for nothing: at 8k tokens the default recipe's step took 2-13% less CPU and ran 2-14% faster with the
shorter spin (``docs/results.md``, "Threads beside other work"), and shorter spins (1,000) gave no more.
"""

from __future__ import annotations

import fcntl
import os
import socket
import sys
import time
from collections.abc import Callable, MutableMapping
from pathlib import Path
from typing import IO

DEFAULT_THREADS = 1
SPIN_COUNT = 10000  # GOMP_SPINCOUNT: a few microseconds of spinning, where libgomp's default is about a millisecond
AUTO = "MEGASEQ_AUTO_THREADS"  # set beside OMP_NUM_THREADS when megaseq, not the user, chose it
RECOUNT_S = 1.0  # a count costs a directory listing; steps take longer than this at any useful length


def apply_defaults(environ: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """Set the thread variables the user left unset; return what was set (empty when nothing was).

    Call it before ``import torch``: once torch is loaded, OpenMP has read its environment. In a process
    that has already imported torch it still sets the variable (for child processes) and torch's thread
    count, so the process itself follows too.
    """
    if "OMP_NUM_THREADS" in environ:
        return {}
    changed = {"OMP_NUM_THREADS": str(DEFAULT_THREADS), AUTO: "1"}
    if "GOMP_SPINCOUNT" not in environ and "OMP_WAIT_POLICY" not in environ:
        changed["GOMP_SPINCOUNT"] = str(SPIN_COUNT)
    environ.update(changed)
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(DEFAULT_THREADS)
    return changed


def fix(threads: int) -> None:
    """Use ``threads`` intra-op threads in this process and its children, as a user's ``OMP_NUM_THREADS``
    would: for a caller that shares the cores out itself (a plugin's experiment running several jobs at once)."""
    import torch

    os.environ["OMP_NUM_THREADS"] = str(threads)
    os.environ.pop(AUTO, None)
    torch.set_num_threads(threads)


def shared(environ: MutableMapping[str, str] = os.environ) -> bool:
    """Whether this process shares the cores (megaseq chose its thread count, the user did not)."""
    return "OMP_NUM_THREADS" not in environ or environ.get(AUTO) == "1"


def cores() -> int:
    """The cores this process may run on (its affinity mask, which containers and taskset narrow)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def host_update_threads(ranks_on_host: int, environ: MutableMapping[str, str] = os.environ) -> int:
    """Intra-op threads for the host optimizer's update in one of ``ranks_on_host`` training processes of this
    machine whose work is otherwise on an accelerator (module docstring); the user's ``OMP_NUM_THREADS`` when
    set."""
    if not shared(environ):
        return max(1, int(environ["OMP_NUM_THREADS"]))
    return max(1, cores() // max(1, ranks_on_host))


def registry_dir() -> Path:
    """``trainers/`` in megaseq's cache (``$MEGASEQ_CACHE``, else ``~/.cache/megaseq``)."""
    from megaseq.data.sources import default_cache_dir

    return default_cache_dir() / "trainers"


def machine_busy() -> tuple[float, float] | None:
    """``(seconds every core of the machine spent busy, seconds this process spent on the CPU)`` since boot and
    since it started; None where the machine's counters do not describe this process's cores (no ``/proc``,
    or more cores in ``/proc/stat`` than this process may use, as in a container on a larger host)."""
    try:
        lines = Path("/proc/stat").read_text().splitlines()
    except OSError:
        return None
    per_core = [line for line in lines if line.startswith("cpu") and line[3:4].isdigit()]
    if len(per_core) != cores():
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal, *_ = (int(v) for v in lines[0].split()[1:])
    ticks = os.sysconf("SC_CLK_TCK")
    own = os.times()
    return (user + nice + system + irq + softirq + steal) / ticks, own.user + own.system


class CoreShare:
    """This process's entry in the registry of live trainers: a file ``PID@HOST`` it holds an ``flock`` on
    while it lives (the kernel drops the lock when the process dies, however it dies). The other entries
    whose lock can be taken belong to dead processes and are removed."""

    def __init__(self, directory: Path, busy: Callable[[], tuple[float, float] | None] = machine_busy) -> None:
        self.directory = directory
        self._busy = busy
        self._last: tuple[float, float, float] | None = None  # (time, machine busy, own) at the last decision
        directory.mkdir(parents=True, exist_ok=True)
        self.name = f"{os.getpid()}@{socket.gethostname()}"
        # locked under a hidden name first, then renamed: no other trainer ever sees the entry unlocked
        hidden = directory / f".{self.name}"
        self._file: IO[str] | None = hidden.open("w")
        fcntl.flock(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.replace(hidden, directory / self.name)
        self.threads: int | None = None
        self._counted_at = -float("inf")

    def live(self) -> int:
        """Live trainers on this registry, this one included."""
        count = 1
        for path in self.directory.iterdir():
            if path.name == self.name or path.name.startswith("."):
                continue
            try:
                with path.open("r") as f:
                    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    path.unlink(missing_ok=True)  # nobody holds it: its process is gone
            except BlockingIOError:
                count += 1
            except OSError:  # removed meanwhile by another trainer
                continue
        return count

    def others_busy(self, now: float) -> float | None:
        """Cores the rest of the machine (every other process) kept busy since the last call, None the first time
        or without counters."""
        busy = self._busy()
        if busy is None:
            return None
        last, self._last = self._last, (now, *busy)
        if last is None or now <= last[0]:
            return None
        return max(0.0, (busy[0] - last[1]) - (busy[1] - last[2])) / (now - last[0])

    def decide(self, now: float | None = None) -> int:
        share = cores() // self.live()
        others = self.others_busy(time.monotonic() if now is None else now)
        if others is None:
            return max(1, share)
        # another megaseq trainer's busy cores are counted in both terms, its share and the busy ones: the
        # smaller of the two is what is left for this one
        idle = cores() - round(others)
        return max(1, min(share, idle))

    def update(self, now: float | None = None) -> int | None:
        """Set torch's intra-op threads to this process's share when ``RECOUNT_S`` has passed since the last
        count; returns the new count when it changed, else None."""
        now = time.monotonic() if now is None else now
        if now - self._counted_at < RECOUNT_S:
            return None
        self._counted_at = now
        threads = self.decide(now)
        if threads == self.threads:
            return None
        import torch

        torch.set_num_threads(threads)
        self.threads = threads
        return threads

    def close(self) -> None:
        """Leave the registry (a process that exits leaves it anyway: its lock goes with it)."""
        if self._file is not None:
            (self.directory / self.name).unlink(missing_ok=True)
            self._file.close()
            self._file = None
            _shares.pop(self.directory, None)


_shares: dict[Path, CoreShare] = {}


def core_share() -> CoreShare | None:
    """This process's :class:`CoreShare` in the current registry (one per process: its trainers run one
    after another), or None when the user set the thread count."""
    if not shared():
        return None
    directory = registry_dir()
    if directory not in _shares:
        _shares[directory] = CoreShare(directory)
    return _shares[directory]


__all__ = [
    "AUTO", "DEFAULT_THREADS", "RECOUNT_S", "CoreShare", "apply_defaults", "core_share", "cores", "fix",
    "host_update_threads", "registry_dir", "shared",
]
