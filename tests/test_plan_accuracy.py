"""The planner's predicted peak is within 15% of the measured peak resident memory at small sizes (20% with glibc's heap).

Each case trains one step of a shipped recipe (on the shipped DNA excerpt, one window) in a fresh process
and reads VmHWM. In the ``MAPPED`` cases large allocations are served by their own memory maps
(MALLOC_MMAP_THRESHOLD_, what the offload policy sets itself on CPU), so resident memory follows live memory:
they hold the component formulas the planner reads to their measurements (a formula that drifts from what its
component keeps fails here), against the plan without its heap term (the planner cannot see the child's
environment). The ``DEFAULT_HEAP`` cases run as `megaseq train` does, glibc's defaults and an evaluation
after the step, against the whole plan: the heap term (``HEAP_RETAINED``) included. The ``TENSOR_PARALLEL``
cases start one process per tensor-parallel rank (mapped as the ``MAPPED`` ones) and hold each rank's peak to
the plan of that layout.

The fixed part of the prediction (interpreter, torch, plugins: `CPU_RUNTIME_BYTES`, 0.378 GiB, measured on
our machine) is a property of the machine, not of a formula: CI's machine kept about 0.1 GiB more resident
before the first step. So the child also reports its resident memory once the trainer is built, and the
prediction's fixed part is replaced by that, less the weights (which the planner counts separately).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from megaseq.config import load_recipe
from megaseq.distributed.layout import Layout
from megaseq.memory.machine import Machine
from megaseq.memory.plan import plan
from megaseq.plugins import get_plugins

REPO = Path(__file__).resolve().parents[1]
CHILD = """
import json, re, sys, tempfile
from megaseq.config import load_recipe
from megaseq.distributed.layout import Layout
from megaseq.plugins import get_plugins
from megaseq.train.trainer import Trainer
plugins = get_plugins()
with tempfile.TemporaryDirectory() as out:
    recipe = load_recipe(sys.argv[1], plugins, json.loads(sys.argv[2]) + [f"run.out_dir='{out}'"])
    trainer = Trainer(recipe, plugins, progress=False, tensorboard=False)
    rss = lambda key: int(re.search(key + r":\\s+(\\d+) kB", open("/proc/self/status").read()).group(1)) * 1024
    weights = sum(p.numel() * p.element_size() for p in trainer.model.parameters())
    runtime = rss("VmRSS") - weights
    trainer.train_step()
    if sys.argv[3] == "eval":
        trainer.eval(baseline=False)
print(runtime, rss("VmHWM"))
"""
MAPPED = {
    "hybrid-4k-none": ("genome-cpu.toml", 4096, []),
    "hybrid-4k-recompute+offload": ("genome-cpu.toml", 4096, ["recompute", "offload"]),
    # plain offload: each part's saved tensors come back while its backward runs. A planner that counted only
    # the temporary there predicted -12% here (and -19% at 64k), hence this case's tighter bound below
    "hybrid-16k-offload": ("genome-cpu.toml", 16384, ["offload"]),
    "sdpa-4k-none": ("genome-sdpa-cpu.toml", 4096, []),
    "sdpa-4k-recompute-tiles": ("genome-sdpa-cpu.toml", 4096, ["recompute"]),
}
DEFAULT_HEAP = {
    "hybrid-4k-none-eval": ("genome-cpu.toml", 4096, []),
    "hybrid-8k-none-eval": ("genome-cpu.toml", 8192, []),
}
CASES = {**MAPPED, **DEFAULT_HEAP}
# One process of a tensor-parallel layout (started as torchrun would start it: gloo from the environment), with
# large allocations mapped as in the MAPPED cases.
CHILD_TP = """
import json, re, sys
import torch.distributed as dist
from megaseq.config import load_recipe
from megaseq.distributed.layout import Layout
from megaseq.distributed.groups import destroy_process_groups, init_process_groups
from megaseq.distributed.layout import Layout
from megaseq.plugins import get_plugins
from megaseq.train.trainer import Trainer
dist.init_process_group("gloo")
plugins = get_plugins()
recipe = load_recipe(sys.argv[1], plugins, json.loads(sys.argv[2]))
parallel = init_process_groups(Layout.of(recipe))
trainer = Trainer(recipe, plugins, parallel=parallel, progress=False, tensorboard=False)
rss = lambda key: int(re.search(key + r":\\s+(\\d+) kB", open("/proc/self/status").read()).group(1)) * 1024
runtime = rss("VmRSS") - sum(p.numel() * p.element_size() for p in trainer.model.parameters())
trainer.train_step()
print(runtime, rss("VmHWM"))
destroy_process_groups()
dist.destroy_process_group()
"""
# (recipe, seq_len, tp, policies, bound). Without a policy a layer keeps each split region's input gathered
# whole beside its heads' share of the rest; whole-block recomputation keeps only the block inputs, 1/tp of the
# residual stream under sequence parallelism, and re-creates the regions' gathered inputs: a plan that divided
# all a layer keeps by tp, with the whole stream on each rank, is within the bound without a policy (-1.5%)
# but not with it (+6.0%). The hybrid's KDA re-creates a chunk group whose size is capped in (token, head)
# pairs, which does not shrink with a rank's heads; and its recomputed blocks peak in the attention's backward,
# after the feed-forward's activations are freed: a planner that keeps them there predicts +5.8% to +7.4%.
TENSOR_PARALLEL = {
    "sdpa-4k-tp2": ("genome-sdpa-cpu.toml", 4096, 2, [], 0.06),
    "sdpa-16k-tp2-recompute": ("genome-sdpa-cpu.toml", 16384, 2, ["recompute"], 0.04),
    "hybrid-16k-tp2-recompute": ("genome-cpu.toml", 16384, 2, ["recompute"], 0.05),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_predicted_peak_within_15_percent(case, tmp_path):  # 10% for plain offload
    name, seq_len, policies = CASES[case]
    overrides = [f"data.seq_len={seq_len}", "train.batch_size=1", "data.train='excerpt-chr20'",
                 "data.heldout='excerpt-chrX'", "run.device='cpu'", f"train.memory_policy={json.dumps(policies)}"]
    if "recompute" in policies:
        overrides.append("memory_policy.recompute.tile_tokens=1024" if "tiles" in case else "memory_policy.recompute.part='block'")
    plugins = get_plugins()
    recipe = load_recipe(REPO / "recipes" / name, plugins, overrides)
    estimate = plan(recipe, plugins, machine=Machine.detect("cpu"), policies=policies or "none").candidates[0]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MEGASEQ_SCRATCH": str(tmp_path), "MEGASEQ_CACHE": str(tmp_path / "cache")}
    env.pop("MALLOC_MMAP_THRESHOLD_", None)
    if case in MAPPED:
        env["MALLOC_MMAP_THRESHOLD_"] = "1048576"
    else:
        overrides.append("eval.windows=1")
    out = subprocess.run([sys.executable, "-c", CHILD, str(REPO / "recipes" / name), json.dumps(overrides),
                          "eval" if case in DEFAULT_HEAP else "no-eval"], capture_output=True, text=True, env=env, check=True)
    runtime, measured = map(int, out.stdout.strip().splitlines()[-1].split())
    unseen = 0 if case in DEFAULT_HEAP else estimate.heap  # a MAPPED child's heap keeps nothing
    predicted = estimate.device_peak - unseen - estimate.runtime + runtime
    error = predicted / measured - 1
    # glibc's retained heap varies from run to run: the 8k case measured 0.977-1.047 GiB in four runs of the same
    # child on one machine (+6% to +17% against a plan of 1.11-1.14 GiB), so the default-heap cases get 20%
    bound = 0.10 if case == "hybrid-16k-offload" else 0.20 if case in DEFAULT_HEAP else 0.15
    assert abs(error) <= bound, (f"{case}: predicted {predicted / 2**30:.3f} GiB, measured {measured / 2**30:.3f} GiB ({error:+.1%}); "
                                f"fixed part measured {runtime / 2**30:.3f} GiB, planner's constant {estimate.runtime / 2**30:.3f} GiB")


@pytest.mark.slow
@pytest.mark.parametrize("case", list(TENSOR_PARALLEL))
def test_tensor_parallel_peak_within_bound(case, tmp_path):
    """Each rank of a tp layout against the plan of that layout; the same measurement against the plan of one
    process (a planner whose tp terms did nothing) is off by more than the bound, so the case holds those terms."""
    name, seq_len, tp, policies, bound = TENSOR_PARALLEL[case]
    overrides = [f"data.seq_len={seq_len}", "train.batch_size=1", "data.train='excerpt-chr20'",
                 "data.heldout='excerpt-chrX'", "run.device='cpu'", f"train.memory_policy={json.dumps(policies)}",
                 f"parallel.tp={tp}", f"run.out_dir='{tmp_path / 'run'}'"]
    if "recompute" in policies:
        overrides.append("memory_policy.recompute.part='block'")
    plugins = get_plugins()
    recipe = load_recipe(REPO / "recipes" / name, plugins, overrides)
    machine = Machine.detect("cpu")
    estimate = plan(recipe, plugins, layout=Layout(tp=tp), machine=machine, policies=policies or "none").candidates[0]
    one_process = plan(recipe, plugins, layout=Layout(), machine=machine, policies=policies or "none").candidates[0]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "1048576", "MEGASEQ_CACHE": str(tmp_path / "cache"),
           "WORLD_SIZE": str(tp), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    ranks = [subprocess.Popen([sys.executable, "-c", CHILD_TP, str(REPO / "recipes" / name), json.dumps(overrides)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**env, "RANK": str(r)})
             for r in range(tp)]
    outputs = [rank.communicate(timeout=1200) for rank in ranks]
    for r, (rank, (out, err)) in enumerate(zip(ranks, outputs, strict=True)):
        assert rank.returncode == 0, f"rank {r}: {err[-2000:]}"
        runtime, measured = map(int, out.strip().splitlines()[-1].split())
        # a MAPPED child's heap keeps nothing; the fixed part is the child's own (module docstring)
        predicted = estimate.device_peak - estimate.heap - estimate.runtime + runtime
        ignoring_tp = one_process.device_peak - one_process.heap - one_process.runtime + runtime
        error, wrong = predicted / measured - 1, ignoring_tp / measured - 1
        print(f"{case} rank {r}: measured {measured / 2**30:.3f} GiB, predicted {predicted / 2**30:.3f} ({error:+.1%}), "
              f"planned as one process {ignoring_tp / 2**30:.3f} ({wrong:+.1%})")
        assert abs(error) <= bound, f"{case} rank {r}: predicted {predicted / 2**30:.3f} GiB, measured {measured / 2**30:.3f} GiB ({error:+.1%})"
        assert abs(wrong) > bound, f"{case}: the one-process plan is within the bound too ({wrong:+.1%}): the case holds no tp term"
