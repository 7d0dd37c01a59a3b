"""How many intra-op threads megaseq's own processes use, decided before torch starts OpenMP.

On CPU, torch runs its intra-op work on an OpenMP thread pool (libgomp) whose threads spin while they wait
for the next parallel region. That is fast for a process that has the machine to itself and ruinous when it
does not: every waiting thread burns a core another process needs, so two training processes with
spinning threads on two cores slow each other to a crawl. Passive waiting (``OMP_WAIT_POLICY=PASSIVE``)
shares the cores but makes every parallel region pay a wake-up; one thread per process does neither.
``benchmarks/train_throughput.py --settings alone pair alone-2t pair-2t`` measures the four cases.

So megaseq's commands use one intra-op thread unless told otherwise: ``apply_defaults`` sets
``OMP_NUM_THREADS=1`` when the user has not set it, before torch is imported (libgomp and MKL read it when
they load; child processes inherit it). A value the user set is kept: ``OMP_NUM_THREADS=2 megaseq train ...``
uses two threads, which is faster on a machine nobody else uses (the benchmark shows by how much).
"""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping

DEFAULT_THREADS = 1


def apply_defaults(environ: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """Set the thread variables the user left unset; return what was set (empty when nothing was).

    Call it before ``import torch``: once torch is loaded, OpenMP has read its environment. In a process
    that has already imported torch it still sets the variable (for child processes) and torch's thread
    count, so the process itself follows too.
    """
    if "OMP_NUM_THREADS" in environ:
        return {}
    environ["OMP_NUM_THREADS"] = str(DEFAULT_THREADS)
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(DEFAULT_THREADS)
    return {"OMP_NUM_THREADS": str(DEFAULT_THREADS)}
