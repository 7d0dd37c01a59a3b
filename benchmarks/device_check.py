"""One prepared check of megaseq on a GPU: the numbers users ask for first, then correctness of every GPU path,
speed tables and a few training steps.

    python benchmarks/device_check.py --out dc.json                            # CUDA machine: <= 10 min on one GPU
    python benchmarks/device_check.py --parts launch memory model_speed --out dc.json  # some parts only
    python benchmarks/device_check.py --rehearse --out /tmp/rehearsal.json     # CPU rehearsal (CI): tiny shapes

Writes one JSON file (every row with its numbers, tolerances, versions) and prints one table. Every check is
a row; a check that raises is an ``error`` row and the rest still run. Each part has a time budget: a
check predicted (from the ones before it) not to fit in what is left is a ``skipped`` row, and a watchdog
writes what was measured and exits if the whole run passes its deadline. The parts run in the order below,
so that a run cut short by its deadline has measured the first ones; compiled Triton kernels (and autotuning
results) are cached in one directory that every part and every process the check starts shares
(``--kernel-cache``), so a kernel is compiled once per run, and once per machine over reruns.

Parts:
1. setup: what is importable (and where from), versions, the GPU.
2. launch: ``megaseq train --workers 1`` of ``recipes/tiny.toml`` (one step) under Ray Train and under
   torchrun, side by side, each rank recording the CUDA device current in it (``torch.cuda.current_device()``)
   and the devices of the trainer's parameters (``benchmarks/device_probe.py``, a plugin every rank loads):
   with one worker both must be ``cuda:0``. ``--address local`` makes the one worker a Ray worker (without an
   address ``megaseq train`` runs one worker in its own process).
3. memory: three steps of the model of part 5 at 64k tokens with AdamW's state in host memory
   (``train.optimizer_state = "host"``) and the reported run's policies (block recomputation, the block
   inputs offloaded to the offload policy's pinned host pool), in a fresh process: the allocator's peak
   (``torch.cuda.max_memory_allocated``) against the planner's prediction for the same recipe and layout less
   its fixed CUDA-runtime term, which the allocator does not see; pass within ``MEMORY_TOLERANCE``. Its
   weights are the next part's checkpoint.
4. vllm: ``megaseq logprob-gap --engine vllm --dtype bf16`` on that checkpoint at 4k and 32k tokens: that the
   engine starts, and the trainer/vLLM log-probability gap per length (pass: mean within ``GAP_TOLERANCE``).
   Without vLLM the rows say so; a command that fails is a row with its one-line error.
5. model_speed: first the component head-to-heads at the model's shapes and 64k tokens (megaseq's Triton KDA
   against fla's ``chunk_kda``; DSA's Triton selection and sparse attention against dense causal attention),
   then training steps of a realistic width (``MODEL``: d_model 2048, KDA, KDA, KDA, DSA, a dense first layer
   then a chunked MoE, bf16, the memory policies the planner picks for the GPU) at 64k and 256k tokens:
   tokens/s and model FLOPs utilisation against the GPU's dense bf16 peak (``model_flops_per_token``).
6. correctness on CUDA in fp32 and bf16, at awkward shapes with packed documents (1-token documents,
   lengths that are not chunk multiples), forward outputs and every gradient against float64 oracles on
   the CPU: KDA Triton (``chunk_kda_triton``) against the token-loop oracle; the DSA Triton top-k (pool 1 and 4, queries at chosen key positions) against the torch reference
   (equal rows, and any difference only between keys whose float64 scores tie within the tolerance); DSA
   Triton sparse attention against the dense masked softmax; the ``sdpa`` layer (flash-attn where it
   imports, else torch's flash SDPA kernel for bf16) against itself in float64 on the CPU.
   Error = max |x - oracle| / max(1, max |oracle|) over the output and every gradient (``TOLERANCE``).
7. Training: a few steps of the default hybrid recipe (recipes/genome-cpu.toml: KDA/DSA/MoE) at 64k tokens
   on CUDA with the backends ``auto`` picks (the choices are logged into the row): tokens/s, peak memory.
8. KDA speed: megaseq's Triton ``chunk_kda_triton`` against fla's ``chunk_kda`` at T = 8k, 32k, 128k (B=1,
   H=16, D=128) and fla's published shape (B=4, H=32, D=128, T=32k); forward and forward+backward time,
   peak device memory above the inputs; bf16 q/k/v, fp32 gates and beta (as the layer calls it).
9. DSA speed at T = 32k and 128k, GLM-5.3-Flash shapes (index heads 32 x 128, top-k 2048, pool 4; 16 query
   heads over a 512-wide latent key/value): Triton selection (no backward: a discrete choice) plus sparse
   attention forward+backward, against dense causal attention (flash-attn, else torch's flash SDPA) at
   16 heads x 128, forward+backward.
10. Distributed over NCCL, one process per GPU: two optimizer steps of the hybrid recipe at tiny width
   (KDA, DSA, chunked MoE with its balance loss: the layout-equivalence tests' recipe) under tp=2, cp=2 and
   dp=2 x ep=2 (two GPUs) and tp=2 x cp=2 (four), each against the same steps in one process: every logged
   metric (loss and gradient norm included) of every step, the tokens and every weight after them (expert
   and tensor-parallel blocks gathered), fp32 with TF32 off, one row per layout with the largest relative
   difference (``DIST_TOLERANCE``). The ranks run ``megaseq_testkit.layouts.train_under_layouts``, what the
   gloo equivalence tests run, one launch per number of ranks. A layout needing more GPUs than are visible
   is a ``skipped: needs N GPUs`` row. The rehearsal runs every layout the same way on gloo CPU processes.
11. correctness_fla: fla's KDA (``kda`` backend ``fla``) against the same oracle as part 6. Last and apart:
   fla autotunes at first use (fp32: over four minutes on an H200).

What it needs: Python >= 3.11, torch (a CUDA build), triton, numpy, pydantic >= 2.6, pluggy, packaging, and
megaseq's packages (core, testkit, attn-kda, attn-dsa, moe-chunked, genome, offload, rl), installed (``pip
install -e packages/core ...``) or else imported from this repository's ``packages/*/src``: their plugins are
then registered here, and the processes the check starts find them through entry points that the check
writes for them (``write_distributions``). Optional: fla-core (import ``fla``), flash-attn (``flash_attn``),
megatron-core (``megatron``: the launch and distributed parts' process groups, core's ``distributed`` extra), Ray
(``ray``: the Ray launch) and vLLM (``vllm``: the vllm part); without them their rows say ``missing`` or
``skipped`` (flash-attn publishes no wheels: building it takes longer than the whole check, so torch's flash
SDPA kernel stands in). On a machine without network, carry the missing wheels and put them on the path
before Python starts (pydantic needs a recent typing-extensions, which torch imports first), e.g. from the
repository root:

    pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux2014_x86_64 -d .whl fla-core==0.6.0 pydantic==2.14.4 pydantic-core==2.50.5 \
        annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0      # where there is network
    pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
    python benchmarks/device_check.py --out dc.json                                    # on the GPU machine

``--rehearse`` runs every part's code on the CPU (Triton kernels in the Triton interpreter, fp32 only:
the interpreter's bf16 tl.dot is wrong) at tiny shapes, so the script cannot rot between GPU runs: the
launches train on the CPU (gloo), the memory row holds the peak resident memory (``VmHWM``, the measure of the
planner's CPU plan) of a fresh process to the CPU plan, and the model's speed row has no peak to compare
with; checks that need CUDA (bf16 kernels, fla, flash kernels, device memory) are ``skipped: no CUDA`` rows,
and the vllm rows say why vLLM cannot run.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import importlib.metadata as md
import importlib.util
import json
import logging
import math
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
SOURCES = {  # import name -> (distribution, source folder, plugin module or None)
    "megaseq": ("megaseq-core", "packages/core/src", None),
    "megaseq_testkit": ("megaseq-testkit", "packages/testkit/src", None),
    "megaseq_kda": ("megaseq-attn-kda", "packages/attn-kda/src", "megaseq_kda.plugin"),
    "megaseq_dsa": ("megaseq-attn-dsa", "packages/attn-dsa/src", "megaseq_dsa.plugin"),
    "megaseq_moe": ("megaseq-moe-chunked", "packages/moe-chunked/src", "megaseq_moe.plugin"),
    # the training part's recipe (recipes/genome-cpu.toml) evaluates against genome's Markov baseline
    "megaseq_genome": ("megaseq-genome", "packages/genome/src", "megaseq_genome.plugin"),
    "megaseq_offload": ("megaseq-offload", "packages/offload/src", "megaseq_offload.plugin"),  # the memory part
    "megaseq_rl": ("megaseq-rl", "packages/rl/src", "megaseq_rl.plugin"),  # the vllm part's command and engine
}
REQUIRED = ["torch", "triton", "numpy", "pydantic", "pluggy", "packaging"]
OPTIONAL = {"fla": "fla-core", "flash_attn": "flash-attn", "megatron": "megatron-core", "ray": "ray", "vllm": "vllm"}

# max |x - oracle| / max(1, max |oracle|) over the output and every gradient. fp32: megaseq's kernels multiply
# and accumulate in fp32 (ieee dots); fla's multiply fp32 in TF32 on tensor cores (10-bit mantissa). bf16:
# inputs, outputs and input gradients are bf16 (2^-8 relative rounding); fla and flash kernels also multiply
# in bf16 on tensor cores.
TOLERANCE = {
    ("megaseq", "fp32"): 1e-5,
    ("megaseq", "bf16"): 2e-2,
    ("fla", "fp32"): 5e-3,
    ("fla", "bf16"): 3e-2,
    ("sdpa", "fp32"): 1e-4,
    ("sdpa", "bf16"): 3e-2,
}
# |predicted / measured - 1| of the memory part's peak
MEMORY_TOLERANCE = 0.10
# mean |trainer - engine| log-probability per generated token: the targets docs/results.md states for the
# gap ("The trainer/engine log-probability gap")
GAP_TOLERANCE = {"fp32": 1e-4, "bf16": 2e-2}

# The model of the memory and model_speed parts: GLM-5.3-Flash's layer structure (3 KDA : 1 DSA, a dense
# first layer then MoE) at d_model 2048, with the attention shapes of the component speed rows (KDA 16 heads
# x 128; DSA 16 query heads over a 512-wide latent, indexer 32 x 128, top-k 2048, keys pooled 4 at a time).
MODEL = {
    "model": {"d_model": 2048, "n_layers": 4, "layer_pattern": ["kda", "kda", "kda", "dsa"], "ffn": "swiglu",
              "moe": "chunked", "dense_layers": 1, "residual_dtype": "bf16"},
    "attention": {"kda": {"n_heads": 16, "head_dim": 128},
                  "dsa": {"n_heads": 16, "head_dim": 128, "q_lora_rank": 768, "kv_lora_rank": 512, "index_heads": 32,
                          "index_dim": 128, "topk": 2048, "index_pool": 4}},
    "ffn": {"swiglu": {"hidden": 5632}},
    "moe": {"chunked": {"n_experts": 16, "top_k": 4, "expert_hidden": 1024, "n_shared_experts": 1,
                        "chunk_tokens": 4096}},
    "train": {"bf16": True},
}
# The same structure at the rehearsal's size (fp32: the CPU rehearsal checks that the code runs)
TINY_MODEL = {
    "model": {"d_model": 32, "n_layers": 4, "layer_pattern": ["kda", "kda", "kda", "dsa"], "ffn": "swiglu",
              "moe": "chunked", "dense_layers": 1},
    "attention": {"kda": {"n_heads": 2, "head_dim": 16},
                  "dsa": {"n_heads": 2, "head_dim": 8, "q_lora_rank": 16, "kv_lora_rank": 16, "index_heads": 2,
                          "index_dim": 8, "topk": 16, "index_pool": 4}},
    "ffn": {"swiglu": {"hidden": 64}},
    "moe": {"chunked": {"n_experts": 4, "top_k": 2, "expert_hidden": 32, "n_shared_experts": 1, "chunk_tokens": 64}},
    "train": {"bf16": False},
}


@dataclass(frozen=True)
class Sizes:
    kda: tuple[int, int, int, int, list[int]]  # T, H, K, V, cu_seqlens
    topk: tuple[int, int, int, int, list[int]]  # T, index heads, index dim, topk, cu_seqlens
    sparse: tuple[int, int, int, int, int]  # T, heads, key width, value width, topk
    sdpa: tuple[int, int, int, list[int]]  # T, d_model, heads, cu_seqlens
    kda_speed: list[tuple[int, int, int, int]]  # B, T, H, D
    dsa_speed: list[int]  # T
    dsa_shape: tuple[int, int, int, int, int, int, int]  # index heads, index dim, topk, pool, heads, D, dense D
    train_seq_len: int
    train_steps: int
    dist_seq_len: int
    model: dict[str, Any]  # the memory and model_speed parts' recipe sections (MODEL, TINY_MODEL)
    memory_seq_len: int
    memory_policies: dict[str, dict[str, Any]]  # the memory part's policies and their recipe sections
    gap_lengths: list[int]
    gap_new_tokens: int
    model_lengths: list[int]  # the model_speed part's sequence lengths; the component rows run at the first
    model_steps: int  # timed training steps per length, after one warm-up step
    budgets: dict[str, float]
    deadline: float


FULL = Sizes(
    kda=(700, 3, 128, 128, [0, 1, 130, 131, 450, 700]),
    topk=(600, 8, 64, 64, [0, 1, 203, 204, 600]),
    sparse=(600, 16, 512, 512, 128),
    sdpa=(1000, 256, 4, [0, 300, 301, 1000]),
    kda_speed=[(1, 8192, 16, 128), (1, 32768, 16, 128), (1, 131072, 16, 128), (4, 32768, 32, 128)],
    dsa_speed=[32768, 131072],
    dsa_shape=(32, 128, 2048, 4, 16, 512, 128),
    train_seq_len=65536,
    train_steps=3,
    dist_seq_len=1024,
    model=MODEL,
    memory_seq_len=65536,
    memory_policies={"recompute": {"part": "block"}, "offload": {}},
    gap_lengths=[4096, 32768],
    gap_new_tokens=32,
    model_lengths=[65536, 262144],
    model_steps=2,
    # the first five parts take at most 490 s of the 560 s deadline (10 minutes of a GPU with Python's start-up and
    # the machine's); the later ones run in what the deadline leaves. A cold Ray start takes tens of seconds.
    budgets={"setup": 30, "launch": 90, "memory": 100, "vllm": 90, "model_speed": 180, "correctness": 140,
             "train": 110, "kda_speed": 90, "dsa_speed": 90, "distributed": 80, "correctness_fla": 300},
    deadline=560,
)
REHEARSAL = Sizes(
    kda=(70, 1, 16, 16, [0, 1, 40, 70]),
    topk=(72, 2, 16, 8, [0, 1, 30, 31, 72]),
    sparse=(40, 2, 32, 16, 8),
    sdpa=(40, 16, 2, [0, 9, 10, 40]),
    kda_speed=[(1, 40, 1, 16)],
    dsa_speed=[32],
    dsa_shape=(2, 16, 16, 4, 2, 32, 16),
    train_seq_len=512,
    train_steps=1,
    dist_seq_len=96,
    model=TINY_MODEL,
    memory_seq_len=256,
    # the tiny model's block inputs (32 KiB) are below the offload policy's default threshold
    memory_policies={"recompute": {"part": "block"}, "offload": {"min_bytes": 4096}},
    gap_lengths=[64, 128],
    gap_new_tokens=4,
    model_lengths=[64, 128],
    model_steps=1,
    budgets={"setup": 40, "launch": 240, "memory": 60, "vllm": 60, "model_speed": 60, "correctness": 100,
             "train": 40, "kda_speed": 20, "dsa_speed": 20, "distributed": 120, "correctness_fla": 10},
    deadline=600,
)


class Skip(Exception):
    """A check that cannot run here (no CUDA, a missing package); its message is the row's note."""


@dataclass
class Env:
    rehearse: bool
    sizes: Sizes
    device: Any = None  # torch.device
    found: dict[str, str] = field(default_factory=dict)  # module -> version / origin ("missing" if absent)
    source_paths: list[str] = field(default_factory=list)  # this checkout's package sources that setup imports
    work: Path | None = None  # the run's scratch directory (run directories, checkpoints, the probes' records)
    checkpoint: Path | None = None  # the memory part's weights, which the vllm part serves

    @property
    def cuda(self) -> bool:
        return self.device is not None and self.device.type == "cuda"

    def has(self, module: str) -> bool:
        return self.found.get(module, "missing") != "missing"

    def dtypes(self) -> list[str]:
        return ["fp32", "bf16"] if self.cuda else ["fp32"]


class Report:
    """Rows, parts with time budgets, the JSON file and the printed table."""

    def __init__(self, out: Path, env: Env) -> None:
        self.out, self.env = out, env
        self.rows: list[dict[str, Any]] = []
        self.meta: dict[str, Any] = {"argv": sys.argv, "rehearse": env.rehearse, "tolerance": {
            f"{impl} {dtype}": tol for (impl, dtype), tol in TOLERANCE.items()}}
        self.started = time.perf_counter()
        self._part: tuple[str, float, float] = ("", 0.0, 0.0)  # name, start, budget
        self._lock = threading.Lock()

    # -- budgets ---------------------------------------------------------------------------------------
    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def part_left(self) -> float:
        _, start, budget = self._part
        return min(budget - (time.perf_counter() - start), self.env.sizes.deadline - self.elapsed())

    def part(self, name: str, fn: Callable[[Env, Report], None]) -> None:
        self._part = (name, time.perf_counter(), self.env.sizes.budgets[name])
        try:
            fn(self.env, self)
        except Exception as exc:  # a part that breaks outside its checks is one error row
            self.add(name, "(part)", "", "error", note=_last_line(exc), traceback=traceback.format_exc()[-4000:])

    # -- rows ------------------------------------------------------------------------------------------
    def add(self, part: str, check: str, dtype: str, status: str, measured: str = "", note: str = "", **data: Any):
        """One row; in a rehearsal every measurement says so (tiny shapes on the CPU: not a result), the setup's
        findings excepted."""
        if self.env.rehearse and measured and part != "setup":
            measured = f"rehearsal: {measured}"
        row = {"part": part, "check": check, "dtype": dtype, "status": status, "measured": measured,
               "note": note, "rehearsal": self.env.rehearse, **data}
        with self._lock:
            self.rows.append(row)
        print(f"  [{self.elapsed():6.1f}s] {part:<11} {check:<44} {dtype:<5} {status:<8} {measured} {note}",
              flush=True)

    def check(self, check: str, dtype: str, fn: Callable[[], tuple[str, str, dict]], predicted_s: float = 0.0,
              note: str = "") -> dict | None:
        """Run one check: ``fn() -> (status, measured, data)``; Skip -> a skipped row, other errors -> error row.
        Not started when ``predicted_s`` exceeds what is left of the part's budget."""
        part = self._part[0]
        left = self.part_left()
        if predicted_s > left:
            self.add(part, check, dtype, "skipped", note=f"budget: predicted {predicted_s:.0f}s, {left:.0f}s left")
            return None
        started = time.perf_counter()
        try:
            status, measured, data = fn()
        except Skip as why:
            self.add(part, check, dtype, "skipped", note=str(why))
            return None
        except Exception as exc:
            self.add(part, check, dtype, "error", note=_last_line(exc), traceback=traceback.format_exc()[-4000:])
            return None
        finally:
            _release_device_memory()
        data = {**data, "seconds": round(time.perf_counter() - started, 3)}
        self.add(part, check, dtype, status, measured, note, **data)
        return data

    # -- output ----------------------------------------------------------------------------------------
    def write(self, aborted: str = "") -> None:
        with self._lock:
            document = {**self.meta, "environment": self.env.found, "elapsed_s": round(self.elapsed(), 1),
                        "aborted": aborted, "rows": list(self.rows)}
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.out.write_text(json.dumps(document, indent=1, default=str))

    def table(self) -> str:
        lines = [f"megaseq device check ({'CPU rehearsal' if self.env.rehearse else self.meta.get('gpu', '')}), "
                 f"{self.elapsed():.0f}s; error = max|x - oracle| / max(1, max|oracle|); tolerances: "
                 + ", ".join(f"{k} {v:g}" for k, v in self.meta["tolerance"].items())]
        if "kernel_cache" in self.meta:
            cache = self.meta["kernel_cache"]
            lines.append(f"kernel cache {cache['dir']}: {cache['files_at_start']} files at the start, "
                         f"{cache.get('files_at_end', cache['files_at_start'])} at the end")
        header = f"{'part':<11} {'check':<44} {'dtype':<5} {'status':<8} {'measured':<52} note"
        lines += [header, "-" * len(header)]
        for r in self.rows:
            lines.append(f"{r['part']:<11} {r['check']:<44} {r['dtype']:<5} {r['status']:<8} {r['measured']:<52} "
                         f"{r['note']}")
        counts = {s: sum(r["status"] == s for r in self.rows) for s in ("pass", "FAIL", "error", "skipped", "missing")}
        lines.append(", ".join(f"{n} {s}" for s, n in counts.items()))
        return "\n".join(lines)


def _last_line(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip().splitlines()
    return text[-1][:300] if text else type(exc).__name__


def _release_device_memory() -> None:
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        gc.collect()  # a trainer's modules and hooks hold reference cycles: free its tensors before the next check
        torch.cuda.empty_cache()


# ==== 1. setup =================================================================================================


def part_setup(env: Env, report: Report) -> None:
    for module in REQUIRED + list(SOURCES) + list(OPTIONAL):
        env.found[module] = _origin(module)
    missing_sources = [m for m in SOURCES if not env.has(m)]
    if missing_sources:
        # Not installed: import them from this checkout (their plugins are then registered by part_train).
        for module in missing_sources:
            sys.path.insert(0, str(REPO / SOURCES[module][1]))
            env.source_paths.append(str(REPO / SOURCES[module][1]))
        importlib.invalidate_caches()
        for module in missing_sources:
            found = _origin(module)
            env.found[module] = "missing" if found == "missing" else f"{found} (from source, not installed)"
    import torch

    env.device = torch.device("cuda" if torch.cuda.is_available() and not env.rehearse else "cpu")
    info = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "device": str(env.device)}
    if env.cuda:
        props = torch.cuda.get_device_properties(env.device)
        info |= {"gpu": props.name, "capability": f"{props.major}.{props.minor}",
                 "gpu_memory_gib": round(props.total_memory / 2**30, 1), "sms": props.multi_processor_count}
        report.meta["gpu"] = props.name
    report.meta["platform"] = info
    for module, origin in env.found.items():
        status = "pass" if origin != "missing" else ("missing" if module in OPTIONAL else "FAIL")
        need = "optional: " + OPTIONAL[module] if module in OPTIONAL else "required"
        report.add("setup", f"import {module}", "", status, origin, need)
    report.add("setup", "device", "", "pass" if env.cuda or env.rehearse else "FAIL", str(env.device),
               ", ".join(f"{k} {v}" for k, v in info.items()))


def _origin(module: str) -> str:
    if importlib.util.find_spec(module) is None:
        return "missing"
    dist = {**{m: d for m, (d, _, _) in SOURCES.items()}, **OPTIONAL}.get(module, module)
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        try:
            about = f"{module}.__about__" if module in SOURCES else module
            return getattr(importlib.import_module(about), "__version__", "importable")
        except Exception as exc:  # an import that fails is as good as missing, with its reason
            return f"missing ({_last_line(exc)})"


# ==== processes the check starts ===============================================================================


def write_distributions(env: Env, site: Path) -> None:
    """Make ``site`` a folder that, on a process's path, shows it the device probe (``benchmarks/device_probe.py``)
    and the packages setup imports from this checkout's sources as installed distributions: a ``.dist-info``
    folder each, with its metadata and the entry points of its pyproject.toml (every group: megaseq's plugins,
    vLLM's model registration). Entry points are how every Ray or torchrun worker finds megaseq's plugins, and
    how every process vLLM starts finds its model class."""
    site.mkdir(parents=True, exist_ok=True)
    shutil.copy(REPO / "benchmarks" / "device_probe.py", site / "device_probe.py")
    _dist_info(site, "megaseq-device-probe", "0", {"megaseq": {"device-probe": "device_probe"}}, [])
    for module, (_, folder, _) in SOURCES.items():
        if "from source" not in env.found.get(module, ""):
            continue
        project = tomllib.loads((REPO / folder).parent.joinpath("pyproject.toml").read_text())["project"]
        about = (REPO / folder / module / "__about__.py").read_text()
        version = re.search(r"__version__ = \"([^\"]+)\"", about).group(1)
        _dist_info(site, project["name"], version, project.get("entry-points", {}), project.get("dependencies", []))


def _dist_info(site: Path, name: str, version: str, entry_points: dict[str, dict[str, str]], requires: list[str]):
    folder = site / f"{name.replace('-', '_')}-{version}.dist-info"
    folder.mkdir(exist_ok=True)
    metadata = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}", *(f"Requires-Dist: {r}" for r in requires)]
    (folder / "METADATA").write_text("\n".join(metadata) + "\n")
    groups = [f"[{group}]\n" + "".join(f"{key} = {value}\n" for key, value in points.items())
              for group, points in entry_points.items()]
    (folder / "entry_points.txt").write_text("\n".join(groups))


def process_environment(env: Env, **extra: str) -> dict[str, str]:
    """The environment of a process the check starts: this one's (the kernel cache included), with the folder of
    :func:`write_distributions` and the sources setup imports in front of the path; Ray's and torchrun's workers
    and vLLM's processes inherit it."""
    site = env.work / "site"
    if not site.exists():
        write_distributions(env, site)
    path = [str(site), *env.source_paths, *filter(None, [os.environ.get("PYTHONPATH")])]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path), **extra}


@dataclass
class Started:
    """A process the check started, writing its output (stdout and stderr) to ``log``."""

    command: list[str]
    proc: subprocess.Popen
    log: Path
    started: float

    def finish(self, timeout: float) -> tuple[int, str, float]:
        """Its exit status, output and seconds, waiting at most ``timeout`` seconds: one still running then is
        stopped (SIGTERM to its process group, as to ``megaseq train``, which stops its workers and Ray; SIGKILL
        20 s later) and raises."""
        try:
            code = self.proc.wait(timeout=max(timeout, 1.0))
        except subprocess.TimeoutExpired:
            stop_group(self.proc)
            raise RuntimeError(f"did not finish within {max(timeout, 1.0):.0f} s (the part's budget); stopped") from None
        return code, self.log.read_text(errors="replace"), time.perf_counter() - self.started


STARTED: list[Started] = []  # every process started, so that the deadline stops those still running


def start(env: Env, command: list[str], name: str, **extra: str) -> Started:
    log = env.work / f"{name}.log"
    with log.open("w") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, cwd=env.work, start_new_session=True,
                                env=process_environment(env, **extra))
    STARTED.append(Started(command, proc, log, time.perf_counter()))
    return STARTED[-1]


def stop_group(proc: subprocess.Popen) -> None:
    for signum, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, 5)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signum)
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def error_line(output: str, code: int) -> str:
    """Why a command failed, in one line: megaseq's own error line, else its output's last line."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("megaseq: error:")]
    last = errors[-1] if errors else (lines[-1] if lines else "no output")
    return f"exit {code}: {last[:300]}"


def vm(key: str) -> int:
    """A ``/proc/self/status`` figure in bytes (``VmRSS``, ``VmHWM``)."""
    return int(re.search(rf"{key}:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1)) * 1024


def run_child(env: Env, name: str, spec: dict, timeout: float) -> dict:
    """This script in a fresh process (``--child NAME``), given ``spec``: its result, the last line of its output
    that is a JSON object (libraries may print after it, at exit)."""
    command = [sys.executable, str(Path(__file__).resolve()), "--child", name, json.dumps(spec)]
    code, output, _ = start(env, command, f"child-{name}").finish(timeout)
    if code != 0:
        raise RuntimeError(error_line(output, code))
    for line in reversed(output.splitlines()):
        if line.startswith("{"):
            with contextlib.suppress(json.JSONDecodeError):
                return json.loads(line)
    raise RuntimeError(f"the child printed no result: {error_line(output, code)}")


# ==== 2. launch ================================================================================================

LAUNCHES = {  # name -> (check, note)
    "ray": ("megaseq train --workers 1 under Ray", "--address local: one Ray Train worker"),
    "torchrun": ("megaseq train --workers 1 under torchrun", "torchrun --standalone --nproc-per-node 1"),
}


def part_launch(env: Env, report: Report) -> None:
    """The two launches run side by side (each is mostly process start-up); their rows wait for them in turn."""
    device = "cuda" if env.cuda else "cpu"
    train = ["-m", "megaseq.cli", "train", str(REPO / "recipes" / "tiny.toml"), "--workers", "1", "--no-progress",
             "--set", f"run.device='{device}'", "--set", "train.steps=1", "--set", "eval.windows=1"]
    commands = {
        "ray": [sys.executable, *train, "--address", "local", "--out", str(env.work / "launch-ray")],
        "torchrun": [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", *train,
                     "--out", str(env.work / "launch-torchrun")],
    }
    # a worker forms its groups with megatron-core's parallel_state; Ray's workers are Ray Train's
    needs = {"ray": ["megatron", "ray"], "torchrun": ["megatron"]}
    missing = {name: [m for m in modules if not env.has(m)] for name, modules in needs.items()}
    started = {name: start(env, command, f"launch-{name}", MEGASEQ_DEVICE_PROBE=str(env.work / f"probe-{name}"))
               for name, command in commands.items() if not missing[name]}
    for name, (check, note) in LAUNCHES.items():
        report.check(check, "fp32", lambda n=name: launched_device(env, report, n, started.get(n), missing[n]),
                     note=note)


def launched_device(env: Env, report: Report, name: str, started: Started | None,
                    missing: list[str]) -> tuple[str, str, dict]:
    """Pass when the run succeeded with one rank, which recorded CUDA device 0 as current and every parameter
    on ``cuda:0`` (on the CPU: no CUDA device, parameters on ``cpu``), and whose run header names that device."""
    if started is None:
        raise Skip(f"{' and '.join(OPTIONAL[m] for m in missing)} missing: pip install 'megaseq-core[distributed]'")
    code, output, seconds = started.finish(report.part_left())
    if code != 0:
        raise RuntimeError(error_line(output, code))
    ranks = [json.loads(p.read_text()) for p in sorted((env.work / f"probe-{name}").glob("rank*.json"))]
    if not ranks:
        raise RuntimeError("the run finished but no rank recorded its device: the device probe plugin did not load")
    header = re.search(r"megaseq run '[^']*' from \S+ on (\S+)", output)
    trainer_device = header.group(1) if header else None
    expected = "cuda:0" if env.cuda else "cpu"
    rank = ranks[0]
    current = rank["current_device"]
    good = (len(ranks) == 1 and rank["rank"] == 0 and rank["world_size"] == 1 and trainer_device == expected
            and rank["parameter_devices"] == [expected] and current == (0 if env.cuda else None))
    measured = (f"rank {rank['rank']} of {rank['world_size']}: current device "
                f"{'none (no CUDA)' if current is None else f'cuda:{current}'}, parameters on "
                f"{', '.join(rank['parameter_devices'])}, run header {trainer_device}; {seconds:.0f} s")
    return ("pass" if good else "FAIL"), measured, {"ranks": ranks, "trainer_device": trainer_device, "launch_s": seconds,
                                                     "command": " ".join(started.command)}


# ==== 3. memory ================================================================================================


def model_recipe(env: Env, seq_len: int, out_dir: Path, **train: Any) -> dict[str, Any]:
    """The recipe (TOML-shaped) of the memory and model_speed parts' model, one window of ``seq_len`` tokens of
    the shipped chr20 excerpt per step, ``train`` on top of its ``[train]``."""
    sections = {k: v for k, v in env.sizes.model.items() if k != "train"}
    return {
        "run": {"name": "device-check", "device": env.device.type, "out_dir": str(out_dir), "seed": 0},
        "data": {"train": "excerpt-chr20", "heldout": "excerpt-chrX", "seq_len": seq_len},
        **sections,
        "train": {**env.sizes.model["train"], "batch_size": 1, "grad_accum": 1, "warmup_steps": 1, **train},
    }


def part_memory(env: Env, report: Report) -> None:
    policies = " + ".join(env.sizes.memory_policies)
    report.check(f"host optimizer state + {policies}, T{env.sizes.memory_seq_len}, 3 steps",
                 "bf16" if env.sizes.model["train"]["bf16"] else "fp32", lambda: memory_against_plan(env, report),
                 note="peak " + ("torch.cuda.max_memory_allocated" if env.cuda else "RSS (VmHWM)") + " vs the plan")


def memory_against_plan(env: Env, report: Report) -> tuple[str, str, dict]:
    """The measured peak of the child's three steps against the plan the trainer made for them (the same recipe,
    layout and machine). The plan's fixed term is a guess at what the allocator cannot see (CUDA: the context,
    cuBLAS workspaces; CPU: the interpreter, libraries and data), so it is replaced by what the child measures:
    nothing on CUDA, where the allocator's peak counts only tensors; on the CPU its resident memory once the
    trainer is built less the weights (as tests/test_plan_accuracy.py does), plus the library pages the steps
    map in as they run code for the first time (``RssFile``'s growth: at T256, where the runtime is nearly all
    of the peak, 27 MB in one environment and 59 MB in a freshly installed one, where the anonymous memory grew
    by the same 5 MB; an upper bound, as some of them may come in after the peak)."""
    out = env.work / "memory-run"
    policies = list(env.sizes.memory_policies)
    raw = model_recipe(env, env.sizes.memory_seq_len, out, steps=3, optimizer_state="host", memory_policy=policies)
    raw["memory_policy"] = env.sizes.memory_policies
    got = run_child(env, "memory", {"recipe": raw, "steps": 3, "save": str(out)}, report.part_left())
    env.checkpoint = Path(got["checkpoint"])
    plan, measured = got["plan"], got["peak_bytes"]
    predicted = plan["device_peak"] - plan["runtime"] + got["runtime"]
    error = predicted / measured - 1
    finite = all(math.isfinite(x) for x in got["losses"])
    status = "pass" if abs(error) <= MEMORY_TOLERANCE and finite else "FAIL"
    what = "allocator" if env.cuda else "RSS"
    pool = "" if got["pool_bytes"] is None else f"; pinned pool {got['pool_bytes'] / 2**30:.2f} GiB (plan {plan['host'] / 2**30:.2f})"
    measured_text = (f"{what} peak {measured / 2**30:.3f} GiB, plan {predicted / 2**30:.3f} GiB ({error:+.1%}), "
                     f"tol {MEMORY_TOLERANCE:.0%}{pool}")
    return status, measured_text, {**got, "predicted_bytes": predicted, "error": error, "tolerance": MEMORY_TOLERANCE}


def memory_child(spec: dict) -> dict:
    """``--child memory``: build the trainer of ``spec["recipe"]``, take ``spec["steps"]`` steps, report the peak,
    the trainer's own plan, and save the weights (a checkpoint ``megaseq logprob-gap`` reads)."""
    import torch

    from megaseq.config import validate_recipe
    from megaseq.train import checkpoint
    from megaseq.train.trainer import Trainer

    plugins = megaseq_plugins()
    recipe = validate_recipe(spec["recipe"], plugins, source="device_check.py memory part")
    cuda = recipe.run.device == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    trainer = Trainer(recipe, plugins, progress=False, tensorboard=False)
    estimate = trainer.memory.peak
    if isinstance(estimate, str):
        raise RuntimeError(f"the trainer has no plan: {estimate}")
    weights = sum(p.numel() * p.element_size() for p in trainer.model.parameters())
    runtime, libraries = (0, 0) if cuda else (vm("VmRSS") - weights, vm("RssFile"))
    losses = [trainer.train_step()["loss"] for _ in range(spec["steps"])]
    if not cuda:  # the libraries' pages the steps ran for the first time are the runtime's too
        runtime += vm("RssFile") - libraries
    extra: dict[str, Any] = {}
    if cuda:
        torch.cuda.synchronize()
        measured = torch.cuda.max_memory_allocated()
        free, total = torch.cuda.mem_get_info()
        # what the process holds on the device beyond its allocator's reservation: the term the plan guesses
        extra = {"max_reserved": torch.cuda.max_memory_reserved(),
                 "outside_allocator": total - free - torch.cuda.memory_reserved()}
    else:
        measured = vm("VmHWM")
    pools = [policy.pool for policy in trainer.optimizer_step.policies if getattr(policy, "pool", None) is not None]
    pool_bytes = sum(s.numel() for pool in pools for s in pool.segments) if pools else None
    meta = {"tokens": trainer.tokens, "recipe": trainer.recipe.to_dict(), "plugins": plugins.active()}
    saved = checkpoint.save_checkpoint(Path(spec["save"]) / "checkpoints", trainer.step, trainer.model, {}, meta)
    plan = {name: getattr(estimate, name) for name in ("device_peak", "runtime", "weights", "gradients", "optimizer",
                                                        "layers_peak", "host", "host_optimizer", "heap")}
    return {"peak_bytes": measured, "runtime": runtime, "plan": plan, "losses": losses, "pool_bytes": pool_bytes,
            "policies": trainer.recipe.train.memory_policy, "checkpoint": str(saved), **extra}


# ==== 4. vllm ==================================================================================================


def part_vllm(env: Env, report: Report) -> None:
    lengths = env.sizes.gap_lengths
    checks = ["engine starts and serves (megaseq logprob-gap --engine vllm)", *(f"logprob gap vllm vs trainer T{n}" for n in lengths)]
    if not env.has("vllm"):
        for check in checks:
            report.add("vllm", check, "bf16", "skipped", note="vllm not installed: pip install 'megaseq-rl[vllm]'")
        return
    rows: dict[int, dict] = {}
    report.check(checks[0], "bf16", lambda: vllm_gap(env, report, rows))
    for length, check in zip(lengths, checks[1:], strict=True):
        report.check(check, "bf16", lambda n=length: gap_row(rows, n))


def vllm_gap(env: Env, report: Report, rows: dict[int, dict]) -> tuple[str, str, dict]:
    """``megaseq logprob-gap`` with the vllm engine, on the memory part's weights (or, without them, the model's
    initial weights), through the command line as a user runs it."""
    checkpoint = env.checkpoint or initial_checkpoint(env)
    lengths = ",".join(map(str, env.sizes.gap_lengths))
    command = [sys.executable, "-m", "megaseq.cli", "logprob-gap", str(checkpoint), "--engine", "vllm", "--dtype", "bf16",
               "--lengths", lengths, "--new-tokens", str(env.sizes.gap_new_tokens), "--json"]
    code, output, seconds = start(env, command, "vllm-gap").finish(report.part_left())
    if code != 0:
        raise RuntimeError(error_line(output, code))
    found = last_json_list(output)
    rows.update({row["length"]: row for row in found})
    return "pass", f"served {len(found)} lengths in {seconds:.0f} s (start, prompts, re-scoring)", {
        "seconds": seconds, "checkpoint": str(checkpoint), "command": " ".join(command)}


def last_json_list(output: str) -> list:
    """The JSON list the command printed last (``--json``), whatever other output came before or after it."""
    decoder = json.JSONDecoder()
    for match in reversed(list(re.finditer(r"^\[$", output, re.MULTILINE))):
        with contextlib.suppress(json.JSONDecodeError):
            return decoder.raw_decode(output, match.start())[0]
    raise RuntimeError("the command printed no JSON list")


def gap_row(rows: dict[int, dict], length: int) -> tuple[str, str, dict]:
    if length not in rows:
        raise Skip("the engine did not run (the row above says why)")
    row = rows[length]
    tol = GAP_TOLERANCE[row["dtype"]]
    status = "pass" if row["mean_abs"] <= tol else "FAIL"
    routing = f", routing differs {row['routing_mismatch']:.2%}" if "routing_mismatch" in row else ""
    measured = f"mean |d| {row['mean_abs']:.2e}, max {row['max_abs']:.2e}{routing}, tol {tol:g} (mean)"
    return status, measured, {"gap": row, "tolerance": tol}


def initial_checkpoint(env: Env) -> Path:
    """The model's initial weights (seed 0) as a checkpoint, for a vllm part run without the memory part."""
    import torch

    from megaseq.config import validate_recipe
    from megaseq.model import build_model
    from megaseq.train import checkpoint

    plugins = megaseq_plugins()
    raw = model_recipe(env, env.sizes.memory_seq_len, env.work / "initial")
    recipe = validate_recipe(raw, plugins, source="device_check.py vllm part")
    torch.manual_seed(0)
    meta = {"tokens": 0, "recipe": recipe.to_dict(), "plugins": plugins.active()}
    return checkpoint.save_checkpoint(env.work / "initial" / "checkpoints", 0, build_model(recipe, plugins), {}, meta)


# ==== 5. model speed ===========================================================================================

# Dense (not 2:4 sparse) bf16 tensor-core peaks in FLOP/s from NVIDIA's data sheets, matched in this order on the
# device's name (torch names an H100 SXM "NVIDIA H100 80GB HBM3").
BF16_PEAK = [("GH200", 989e12), ("H200 NVL", 835e12), ("H200", 989e12), ("H100 NVL", 835e12), ("H100 PCIe", 756e12),
             ("H100", 989e12), ("B200", 2.25e15), ("A100", 312e12)]
KDA_CHUNK = 64  # tokens per chunk of megaseq's chunk_kda_triton and fla's chunk_kda


def bf16_peak(env: Env) -> tuple[float | None, str]:
    """The GPU's dense bf16 peak (FLOP/s) and what it is, or None and why there is none."""
    if not env.cuda:
        return None, "no GPU peak on the CPU"
    import torch

    name = torch.cuda.get_device_name(env.device)
    for key, peak in BF16_PEAK:
        if key in name:
            return peak, f"{name}: {peak / 1e12:.0f} TFLOP/s dense bf16"
    return None, f"no bf16 peak known for {name}"


def _mean_seen(length: int, cap: int) -> float:
    """Mean over the positions t = 0 .. length-1 of min(t + 1, cap): the keys a causal query sees, at most cap."""
    ramp = min(length, cap)  # positions t < cap see t + 1 keys, the later ones cap
    return (ramp * (ramp + 1) / 2 + (length - ramp) * cap) / length


def model_flops_per_token(recipe: Any, seq_len: int) -> dict[str, float]:
    """Model FLOPs per token of one window of ``seq_len`` tokens, by term, from the components' shapes.

    A product of an [m, k] and a [k, n] matrix is 2 m k n FLOPs. Per token (d = d_model):

    - KDA (H heads of width D = K = V, W = H D, gate rank r, convolution c, chunks of C = 64 tokens): projections
      2 d 3W (q, k, v) + 2 d H (beta) + 2 x 2 (d r + r W) (forget and output gates) + 2 W d (output); the
      depthwise convolution 2 c 3W; the chunked delta rule per head 2 (3 C K + 2 C V + 3 K V) + 2 C^2 / 3: in a
      chunk, k k^T, q k^T and A k (C K each), A v and the masked attention's values (C V each); against the
      state, w h, q h and the state update k^T v (K V each); and the unit-triangular solve for A (C^3 / 3
      multiply-adds per chunk).
    - DSA (H heads of width h, query rank Q, latent L, rotary part R, indexer I heads x e, top-k k, pool p): the
      layer's products as it computes them (the absorbed form: queries against the latent), 2 d Q + 2 d L +
      2 Q H L + 2 Q H R + 2 d R + 2 H L d; the two folded matrices once per window, 2 Q (H h)(H L) +
      2 (H L)(H h) d, shared by its T tokens; the indexer's projections 2 Q I e + 2 d e + 2 d I; sparse
      attention over the k' keys a query sees (k' = the mean of min(t + 1, k)): 2 H k' (L + R) + 2 H k' L; and
      the selection, scoring the b' pooled blocks a query sees (b' = the mean of ceil((t + 1) / p)): 2 I e b' +
      2 I b'.
    - sdpa (H heads of width h, causal): 2 d 3Hh + 2 H h d, and 2 H t' 2h over the t' = (T + 1) / 2 keys a query
      sees on average.
    - SwiGLU of width f: 3 x 2 d f. Chunked MoE (E experts of width f, top-k k, shared width s): the router
      2 d E, k x 3 x 2 d f, and 3 x 2 d s.
    - The LM head: 2 d V (the embedding is a lookup).

    ``train`` = 3 x ``forward`` (backward computes two products per forward product: the input's gradient and
    the weight's) + ``selection`` once (a discrete choice: no backward). Not counted: norms, activations,
    softmax and exponentials, the rotary embedding, routing's top-k and dispatch, the indexer's KL loss, and
    whatever recomputation runs again: these are model FLOPs, not the hardware's.
    """
    m, length = recipe.model, seq_len
    d = m.d_model
    terms: dict[str, float] = {}

    def add(name: str, flops: float) -> None:
        terms[name] = terms.get(name, 0.0) + flops

    for layer in range(m.n_layers):
        name = m.attention_of(layer)
        c = recipe.component("attention", name)
        if name == "kda":
            heads, dim = c.n_heads, c.head_dim
            width, rank = heads * dim, c.gate_rank or dim
            add("kda projections", 2 * d * 3 * width + 2 * d * heads + 2 * 2 * (d * rank + rank * width) + 2 * width * d)
            add("kda convolution", 2 * c.conv_size * 3 * width)
            add("kda delta rule", heads * (2 * (3 * KDA_CHUNK * dim + 2 * KDA_CHUNK * dim + 3 * dim * dim)
                                           + 2 * KDA_CHUNK**2 / 3))
        elif name == "dsa":
            if c.mode != "sparse":
                raise ValueError(f"attention.dsa mode {c.mode!r}: the FLOPs formula is the sparse mode's")
            heads, h, q, latent = c.n_heads, c.head_dim, c.q_lora_rank, c.kv_lora_rank
            rope = c.rope_dim if c.rope else 0
            add("dsa projections", 2 * d * q + 2 * d * latent + 2 * q * heads * latent + 2 * q * heads * rope
                + 2 * d * rope + 2 * heads * latent * d
                + (2 * q * heads * h * heads * latent + 2 * heads * latent * heads * h * d) / length
                + 2 * q * c.index_heads * c.index_dim + 2 * d * c.index_dim + 2 * d * c.index_heads)
            seen = _mean_seen(length, c.topk)
            add("dsa sparse attention", 2 * heads * seen * (latent + rope) + 2 * heads * seen * latent)
            blocks = sum(-(-(t + 1) // c.index_pool) for t in range(length)) / length
            add("selection", 2 * c.index_heads * c.index_dim * blocks + 2 * c.index_heads * blocks)
        elif name == "sdpa":
            heads = c.n_heads
            h = c.head_dim or d // heads
            add("sdpa projections", 2 * d * 3 * heads * h + 2 * heads * h * d)
            add("sdpa attention", 2 * heads * (length + 1) / 2 * 2 * h)
        else:
            raise ValueError(f"attention {name!r}: no FLOPs formula (kda, dsa and sdpa have one)")
        kind, ffn_name = m.ffn_of(layer)
        f = recipe.component(kind, ffn_name)
        if (kind, ffn_name) == ("ffn", "swiglu"):
            hidden = f.hidden if f.hidden is not None else -(-8 * d // 3 // 64) * 64  # the swiglu layer's default
            add("ffn", 3 * 2 * d * hidden)
        elif (kind, ffn_name) == ("moe", "chunked"):
            add("moe", 2 * d * f.n_experts + f.top_k * 3 * 2 * d * f.expert_hidden + 3 * 2 * d * f.shared_width)
        else:
            raise ValueError(f"{kind} {ffn_name!r}: no FLOPs formula (swiglu and the chunked MoE have one)")
    add("head", 2 * d * m.vocab_size)
    forward = sum(v for k, v in terms.items() if k != "selection")
    return {**terms, "forward": forward, "train": 3 * forward + terms.get("selection", 0.0)}


def part_model_speed(env: Env, report: Report) -> None:
    """The component head-to-heads at the model's shapes first (short, and what the model's step is made of),
    then the model's training steps at each length."""
    length = env.sizes.model_lengths[0]
    kda, dsa = env.sizes.model["attention"]["kda"], env.sizes.model["attention"]["dsa"]
    dtype = "bf16" if env.cuda else "fp32"
    heads, dim = kda["n_heads"], kda["head_dim"]
    for name, backend in (("megaseq triton", "triton"), ("fla chunk_kda", "fla")):
        report.check(f"kda {name} B1 T{length} H{heads} D{dim}", dtype,
                     lambda b=backend: kda_speed(env, report, b, 1, length, heads, dim))
    shape = (dsa["index_heads"], dsa["index_dim"], dsa["topk"], dsa["index_pool"], dsa["n_heads"], dsa["kv_lora_rank"],
             dsa["head_dim"])
    report.check(f"dsa triton select+sparse T{length} top-k {dsa['topk']} pool {dsa['index_pool']}", dtype,
                 lambda: dsa_sparse_speed(env, report, length, shape))
    report.check(f"dense causal {dense_name(env)} T{length} H{dsa['n_heads']} D{dsa['head_dim']}", dtype,
                 lambda: dense_speed(env, report, length, shape))
    m = env.sizes.model["model"]
    described = f"model d{m['d_model']} {','.join(m['layer_pattern'])} + {m['moe']} MoE"
    steps, last = env.sizes.model_steps, None  # (work, seconds per step, seconds outside the steps) of the last row
    for length in env.sizes.model_lengths:
        work = length * model_flops_per_token(model_recipe_validated(env, length), length)["train"]
        # a step's time scales with its FLOPs; building the trainer does not, nor does compiling (done by then)
        predicted = 0.0 if last is None else last[2] + (steps + 1) * last[1] * work / last[0]
        data = report.check(f"{described} T{length}", dtype, lambda n=length: model_speed(env, n), predicted,
                            note="training steps")
        if data is not None:
            step_s = length / data["tokens_per_s"]
            last = (work, step_s, max(0.0, data["seconds"] - data["first_step_s"] - steps * step_s))


def model_recipe_validated(env: Env, length: int, **train: Any) -> Any:
    from megaseq.config import validate_recipe

    raw = model_recipe(env, length, env.work / f"model-T{length}", **train)
    return validate_recipe(raw, megaseq_plugins(), source="device_check.py model_speed part")


def model_speed(env: Env, length: int) -> tuple[str, str, dict]:
    import torch

    from megaseq.train.trainer import Trainer

    plugins = megaseq_plugins()
    steps = env.sizes.model_steps
    recipe = model_recipe_validated(env, length, steps=steps + 1, memory_policy="auto")
    flops = model_flops_per_token(recipe, length)
    trainer = Trainer(recipe, plugins, progress=False, tensorboard=False)
    policies = " + ".join(trainer.recipe.train.memory_policy) or "none"
    first = time.perf_counter()
    trainer.train_step()  # warm-up: kernel compilation (or the kernel cache), first allocations
    first = time.perf_counter() - first
    if env.cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start_time = time.perf_counter()
    losses = [trainer.train_step()["loss"] for _ in range(steps)]
    if env.cuda:
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start_time
    tokens_per_s = steps * length / elapsed
    peak, peak_note = bf16_peak(env)
    mfu = flops["train"] * tokens_per_s / peak if peak else None
    memory = f"peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB" if env.cuda else "peak n/a (cpu)"
    utilisation = f"MFU {mfu:.1%}" if mfu is not None else f"MFU n/a ({peak_note})"
    measured = (f"{tokens_per_s:,.0f} tokens/s, {utilisation}, {flops['train'] / 1e9:.3g} GFLOP/token; {memory}; "
                f"policies {policies}")
    finite = all(math.isfinite(x) for x in losses)
    return ("pass" if finite else "FAIL"), measured, {
        "tokens_per_s": tokens_per_s, "mfu": mfu, "peak_flops": peak, "peak_note": peak_note, "flops_per_token": flops,
        "first_step_s": first, "steps": steps, "losses": losses, "policies": policies}


# ==== 6. correctness ===========================================================================================


def relative_error(actual, expected) -> float:
    return ((actual.double().cpu() - expected.double()).abs().max() / expected.abs().max().clamp_min(1)).item()


def compare(results: dict, oracle: dict, tol: float) -> tuple[str, str, dict]:
    errors = {name: relative_error(results[name], oracle[name]) for name in oracle}
    worst = max(errors, key=errors.get)
    status = "pass" if all(e <= tol for e in errors.values()) else "FAIL"
    return status, f"max error {errors[worst]:.2e} ({worst}), tol {tol:g}", {"errors": errors, "tolerance": tol}


def torch_dtype(name: str):
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16}[name]


def part_correctness(env: Env, report: Report) -> None:
    if not env.cuda:
        for dtype in ("fp32", "bf16"):
            report.add("correctness", "sdpa layer flash kernels fwd+bwd", dtype, "skipped", note="no CUDA")
        report.add("correctness", "kda/dsa triton kernels", "bf16", "skipped",
                   note="no CUDA (the Triton interpreter's bf16 tl.dot is wrong)")
    # DSA first: on an H200 each KDA row takes over a minute (about nine kernels compiled per dtype, and the
    # float64 oracle on the host), which would leave the DSA rows no budget
    for dtype in env.dtypes():
        for pool in (1, 4):
            report.check(f"dsa triton top-k pool {pool}", dtype, lambda d=dtype, p=pool: check_topk(env, d, p))
            report.check(f"dsa triton top-k pool {pool}, query positions", dtype,
                         lambda d=dtype, p=pool: check_topk(env, d, p, positions=True))
    for dtype in env.dtypes():
        report.check("dsa triton sparse attention fwd+bwd", dtype, lambda d=dtype: check_sparse(env, d))
    kda_oracles: dict[str, Any] = {}
    for dtype in env.dtypes():
        report.check("kda triton fwd+bwd (chunk_kda_triton)", dtype,
                     lambda dtype=dtype: check_kda(env, "triton", dtype, kda_oracles))
    for dtype in env.dtypes():
        for packed in (False, True):
            report.check(f"sdpa layer fwd+bwd{', packed' if packed else ''}", dtype,
                         lambda d=dtype, p=packed: check_sdpa(env, d, p))


def part_correctness_fla(env: Env, report: Report) -> None:
    """fla's KDA against the same oracle. A part of its own, run last: fla autotunes its kernels at first use
    (over four minutes for fp32 on an H200), which must not use up the budget of megaseq's own checks."""
    if not env.cuda:
        for dtype in ("fp32", "bf16"):
            report.add("correctness_fla", "kda fla fwd+bwd", dtype, "skipped", note="no CUDA")
        return
    kda_oracles: dict[str, Any] = {}
    for dtype in env.dtypes():
        report.check("kda fla fwd+bwd (backend fla)", dtype, lambda d=dtype: check_kda(env, "fla", d, kda_oracles))


def kda_inputs(env: Env, seed: int = 0) -> dict:
    """float64 inputs in the layer's ranges; gates strong early and weak late in each chunk (exponent
    differences near 0 between large cumulative sums), and a random part."""
    import torch
    import torch.nn.functional as F

    length, heads, k_dim, v_dim, cu = env.sizes.kda
    gen = torch.Generator().manual_seed(seed)
    f64 = dict(dtype=torch.float64, generator=gen)
    in_chunk = torch.arange(length, dtype=torch.float64)[None, :, None, None] % 64
    uniform = torch.rand(1, length, heads, k_dim, **f64)
    g = torch.where(in_chunk < 40, -5 * uniform, -1e-3 * uniform)
    return {
        "q": F.normalize(torch.randn(1, length, heads, k_dim, **f64), dim=-1),
        "k": F.normalize(torch.randn(1, length, heads, k_dim, **f64), dim=-1),
        "v": torch.randn(1, length, heads, v_dim, **f64),
        "g": g,
        "beta": torch.rand(1, length, heads, **f64),
        "h0": torch.randn(len(cu) - 1, heads, k_dim, v_dim, **f64),
        "cu": torch.tensor(cu, dtype=torch.int32),
        "d_o": torch.randn(1, length, heads, v_dim, **f64),
        "d_final": torch.randn(len(cu) - 1, heads, k_dim, v_dim, **f64),
    }


def run_kda(op, x: dict, device, dtype) -> dict:
    """Forward and backward of a KDA op; q, k, v in ``dtype``, gates, beta and states fp32 (as the layer)."""
    import torch

    act = {"q": dtype, "k": dtype, "v": dtype}
    leaves = {n: x[n].to(device, act.get(n, torch.float32 if dtype != torch.float64 else dtype)).requires_grad_()
              for n in ("q", "k", "v", "g", "beta", "h0")}
    o, final = op(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"], initial_state=leaves["h0"],
                  output_final_state=True, cu_seqlens=x["cu"].to(device))
    ((o * x["d_o"].to(device, o.dtype)).sum() + (final * x["d_final"].to(device, final.dtype)).sum()).backward()
    results = {"o": o.detach(), "final_state": final.detach()}
    results |= {f"d{n}": leaf.grad for n, leaf in leaves.items()}
    return {n: t.cpu() for n, t in results.items()}


def check_kda(env: Env, backend: str, dtype: str, oracles: dict) -> tuple[str, str, dict]:
    import torch

    from megaseq_kda.backends import BACKENDS
    from megaseq_kda.ops import naive_recurrent_kda

    if backend == "fla" and not env.has("fla"):
        raise Skip("fla-core not installed")
    op = BACKENDS.load(backend, env.device)
    x = kda_inputs(env)
    if dtype not in oracles:
        # The oracle sees exactly the inputs the kernel sees (rounded to the dtype), in float64.
        rounded = dict(x)
        for n in ("q", "k", "v"):
            rounded[n] = x[n].to(torch_dtype(dtype)).double()
        for n in ("g", "beta", "h0"):
            rounded[n] = x[n].float().double()
        oracles[dtype] = run_kda(naive_recurrent_kda, rounded, "cpu", torch.float64)
    results = run_kda(op, x, env.device, torch_dtype(dtype))
    status, measured, data = compare(results, oracles[dtype], TOLERANCE["megaseq" if backend == "triton" else "fla",
                                                                       dtype])
    if results["o"].dtype != torch_dtype(dtype):
        status, measured = "FAIL", measured + f"; o is {results['o'].dtype}, not q's dtype"
    return status, measured, data


def topk_inputs(env: Env, seed: int = 1) -> tuple:
    import torch

    length, heads, dim, _, cu = env.sizes.topk
    gen = torch.Generator().manual_seed(seed)
    q_idx = torch.randn(1, length, heads, dim, generator=gen)
    k_idx = torch.randn(1, length, dim, generator=gen)
    weights = torch.randn(1, length, heads, generator=gen)
    return q_idx, k_idx, weights, torch.tensor(cu, dtype=torch.int32)


def check_topk(env: Env, dtype: str, pool: int, positions: bool = False) -> tuple[str, str, dict]:
    """Rows equal to the torch reference's, or different only between keys whose float64 (pooled) scores
    tie with the row's cut within the tolerance (accumulation order differs between the two)."""
    import torch

    from megaseq_dsa.ops import select_topk_reference
    from megaseq_dsa.ops.indexer import pooled_candidates
    from megaseq_dsa.ops.triton import select_topk_triton

    length, _, _, topk, _ = env.sizes.topk
    q_idx, k_idx, weights, cu = topk_inputs(env)
    query_pos = torch.arange(length)
    if positions:  # a zig-zag share over all the keys: the second quarter and the last quarter
        query_pos = torch.cat([torch.arange(length // 4, length // 2), torch.arange(3 * length // 4, length)])
    q_rows, w_rows = q_idx[:, query_pos], weights[:, query_pos]
    dt = torch_dtype(dtype)
    q_dev, k_dev, w_dev = (x.to(env.device, dt) for x in (q_rows, k_idx, w_rows))
    got = select_topk_triton(q_dev, k_dev, w_dev, topk, cu.to(env.device), pool, query_pos.to(env.device)).cpu()
    rounded = [x.cpu().float() for x in (q_dev, k_dev, w_dev)]
    expected = select_topk_reference(*rounded, topk, cu, pool, query_pos)
    # float64 score of every key: its block's score; tail keys +inf (always chosen); invisible keys -inf
    q64, k64, w64 = (x.double() for x in rounded)
    cand = pooled_candidates(k64, query_pos[None], cu, pool, torch.float64)
    block = torch.einsum("thn,th->tn", torch.einsum("thd,nd->thn", q64[0], cand.keys[0]).relu(), w64[0])
    n_blocks = block.shape[1]
    seen = (torch.arange(n_blocks) >= cand.first[0, :, None]) & (torch.arange(n_blocks) <= cand.last[0, :, None])
    block = block.masked_fill(~seen, float("-inf"))
    token = torch.full((len(query_pos), length), float("-inf"), dtype=torch.float64)
    for j in range(pool):
        token[:, cand.block_first + j] = block
    for row, (start, count) in enumerate(zip(cand.tail_start[0].tolist(), cand.tail_len[0].tolist(), strict=True)):
        token[row, start : start + count] = float("inf")
    tol = TOLERANCE["megaseq", dtype]
    equal_rows = int((got == expected).all(-1).sum())
    worst = 0.0
    for row in (got != expected).any(-1)[0].nonzero()[:, 0].tolist():
        chosen = {int(i) for i in got[0, row] if i >= 0}
        reference = {int(i) for i in expected[0, row] if i >= 0}
        cut = min(float(token[row, i]) for i in reference)
        scale = max(1.0, float(token[row][token[row].isfinite()].abs().max()))
        for i in chosen ^ reference:
            gap = abs(float(token[row, i]) - cut) / scale  # inf for invisible or tail keys: a real error
            worst = max(worst, gap)
    rows = got.shape[1]
    status = "pass" if worst <= tol and got.shape == expected.shape else "FAIL"
    measured = f"{equal_rows}/{rows} rows equal; largest tie gap {worst:.1e}, tol {tol:g}"
    return status, measured, {"equal_rows": equal_rows, "rows": rows, "tie_gap": worst, "tolerance": tol}


def check_sparse(env: Env, dtype: str) -> tuple[str, str, dict]:
    import torch

    from megaseq_dsa.ops import select_topk_reference, sparse_attention_reference
    from megaseq_dsa.ops.triton import sparse_attention_triton

    length, heads, dim, dim_v, topk = env.sizes.sparse
    gen = torch.Generator().manual_seed(2)
    q_idx, k_idx, weights = (torch.randn(*s, generator=gen) for s in ((1, length, 2, 8), (1, length, 8),
                                                                         (1, length, 2)))
    cu = torch.tensor([0, length // 3, length // 3 + 1, length], dtype=torch.int32)
    indices = select_topk_reference(q_idx, k_idx, weights, topk, cu, 4)
    holes = torch.rand(indices.shape, generator=gen) < 0.1
    indices = indices.masked_fill(holes, -1)  # -1 in the middle of rows, not only at the end
    q = torch.randn(1, length, heads, dim, generator=gen, dtype=torch.float64)
    k = torch.randn(1, length, dim, generator=gen, dtype=torch.float64)
    v = torch.randn(1, length, dim_v, generator=gen, dtype=torch.float64)
    d_o = torch.randn(1, length, heads, dim_v, generator=gen, dtype=torch.float64)
    dt, scale = torch_dtype(dtype), dim**-0.5
    leaves = [x.to(env.device, dt).requires_grad_() for x in (q, k, v)]
    out = sparse_attention_triton(*leaves, indices.to(env.device), scale)
    out.backward(d_o.to(env.device, dt))
    oracle_leaves = [x.detach().double().cpu().requires_grad_() for x in leaves]
    expected = sparse_attention_reference(*oracle_leaves, indices, scale)
    expected.backward(d_o)
    names = ("dq", "dk", "dv")
    results = {"o": out.detach().cpu(), **{n: x.grad.cpu() for n, x in zip(names, leaves, strict=True)}}
    oracle = {"o": expected.detach(), **{n: x.grad for n, x in zip(names, oracle_leaves, strict=True)}}
    return compare(results, oracle, TOLERANCE["megaseq", dtype])


def check_sdpa(env: Env, dtype: str, packed: bool) -> tuple[str, str, dict]:
    """The built-in sdpa layer on the device against itself in float64 on the CPU (same rounded weights)."""
    import copy

    import torch

    from megaseq.builtins.config import SDPAConfig
    from megaseq.builtins.sdpa import HAS_FLASH_ATTN, SDPAttention
    from megaseq.contracts import ForwardContext

    length, d_model, heads, cu = env.sizes.sdpa
    torch.manual_seed(3)
    dt = torch_dtype(dtype)
    layer = SDPAttention(d_model, SDPAConfig(n_heads=heads, rope=True), n_layers=2).to(env.device, dt)
    reference = copy.deepcopy(layer).cpu().double()
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(1, length, d_model, generator=gen, dtype=torch.float64)
    d_out = torch.randn(1, length, d_model, generator=gen, dtype=torch.float64)
    cu_seqlens = torch.tensor(cu, dtype=torch.int32) if packed else None
    if env.cuda and dt != torch.float32:
        path = "flash-attn" if HAS_FLASH_ATTN else "torch flash SDPA kernel"
    else:
        path = f"torch SDPA ({env.device.type})"
    flash_only = contextlib.nullcontext()
    if env.cuda and dt != torch.float32 and not HAS_FLASH_ATTN:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        flash_only = sdpa_kernel([SDPBackend.FLASH_ATTENTION])
    results = {}
    for module, device, dtype_ in ((layer, env.device, dt), (reference, torch.device("cpu"), torch.float64)):
        xr = x.to(device, dtype_).requires_grad_()
        ctx = ForwardContext(cu_seqlens=None if cu_seqlens is None else cu_seqlens.to(device))
        with flash_only if module is layer else contextlib.nullcontext():
            out = module(xr, ctx)
            out.backward(d_out.to(device, dtype_))
        results[device.type if module is layer else "reference"] = {
            "out": out.detach().cpu(), "dx": xr.grad.cpu(), **{f"d{n}": p.grad.cpu() for n, p in module.named_parameters()}}
    status, measured, data = compare(results[env.device.type], results["reference"], TOLERANCE["sdpa", dtype])
    return status, measured + f" [{path}]", {**data, "path": path}


# ==== 8./9. speed (and the model_speed part's component rows) ================================================


def timed(fn: Callable[[], Any], device, budget_s: float) -> dict[str, float]:
    """Median seconds of fn() after one warm-up (compilation), repeated up to 5 times within budget_s; peak
    device memory above what was allocated before (GiB; None on the CPU). On the CPU (the rehearsal, in the
    Triton interpreter: nothing to compile) one timed call and no warm-up."""
    import torch

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    first, base, reps = None, 0, 5
    if device.type == "cuda":
        sync()
        start = time.perf_counter()
        fn()
        sync()
        first = time.perf_counter() - start
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        reps = 1
    times = []
    while len(times) < reps and (not times or sum(times) + times[-1] < budget_s):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30 if device.type == "cuda" else None
    return {"seconds": sorted(times)[len(times) // 2], "first_call_s": first, "peak_gib": peak, "reps": len(times)}


def describe_speed(fwd: dict, both: dict) -> str:
    peak = "n/a (cpu)" if both["peak_gib"] is None else f"{both['peak_gib']:.2f} GiB"
    return f"fwd {1e3 * fwd['seconds']:.1f} ms, fwd+bwd {1e3 * both['seconds']:.1f} ms, peak {peak}"


class Predictor:
    """Predicts a check's time from the last measured one, scaled by a work ratio."""

    def __init__(self, first_guess_s: float) -> None:
        self.last: tuple[float, float] | None = None  # (work, seconds)
        self.first_guess = first_guess_s

    def predict(self, work: float) -> float:
        if self.last is None:
            return self.first_guess
        return self.last[1] * work / self.last[0]

    def record(self, work: float, data: dict | None) -> None:
        if data is not None:
            self.last = (work, data["seconds"])


def part_kda_speed(env: Env, report: Report) -> None:
    impls = {"megaseq triton": "triton", "fla chunk_kda": "fla"}
    predictors = {name: Predictor(0.0) for name in impls}  # the first (smallest) size always runs
    for batch, length, heads, dim in env.sizes.kda_speed:
        work = batch * length * heads
        for name, backend in impls.items():
            check = f"kda {name} B{batch} T{length} H{heads} D{dim}"
            data = report.check(check, "bf16" if env.cuda else "fp32",
                                lambda b=backend, s=(batch, length, heads, dim): kda_speed(env, report, b, *s),
                                predictors[name].predict(work))
            predictors[name].record(work, data)


def kda_speed(env: Env, report: Report, backend: str, batch: int, length: int, heads: int, dim: int):
    import torch
    import torch.nn.functional as F

    from megaseq_kda.backends import BACKENDS

    if backend == "fla" and not (env.cuda and env.has("fla")):
        raise Skip("no CUDA" if not env.cuda else "fla-core not installed")
    op = BACKENDS.load(backend, env.device)
    dtype = torch.bfloat16 if env.cuda else torch.float32
    gen = torch.Generator(device=env.device).manual_seed(0)
    shape = (batch, length, heads, dim)
    q, k = (F.normalize(torch.randn(*shape, generator=gen, device=env.device), dim=-1).to(dtype) for _ in range(2))
    v, d_o = (torch.randn(*shape, generator=gen, device=env.device).to(dtype) for _ in range(2))
    g = -5 * torch.rand(*shape, generator=gen, device=env.device)
    beta = torch.rand(*shape[:3], generator=gen, device=env.device)
    leaves = [x.requires_grad_() for x in (q, k, v, g, beta)]

    def forward() -> None:
        with torch.no_grad():
            op(*leaves)

    def forward_backward() -> None:
        o, _ = op(*leaves)
        o.backward(d_o)
        for x in leaves:
            x.grad = None

    left = max(1.0, report.part_left() / 4)
    fwd, both = timed(forward, env.device, left), timed(forward_backward, env.device, left)
    return "pass", describe_speed(fwd, both), {"forward": fwd, "forward_backward": both}


def dense_name(env: Env) -> str:
    return "flash-attn" if env.cuda and env.has("flash_attn") else ("torch flash SDPA" if env.cuda else "torch SDPA (cpu)")


def part_dsa_speed(env: Env, report: Report) -> None:
    _, _, topk, pool, heads, _, dense_dim = env.sizes.dsa_shape
    dtype = "bf16" if env.cuda else "fp32"
    sparse_predictor, dense_predictor = Predictor(0.0), Predictor(0.0)  # the first size always runs
    for length in env.sizes.dsa_speed:
        data = report.check(f"dsa triton select+sparse T{length} top-k {topk} pool {pool}", dtype,
                            lambda n=length: dsa_sparse_speed(env, report, n), sparse_predictor.predict(length**2))
        sparse_predictor.record(length**2, data)
        data = report.check(f"dense causal {dense_name(env)} T{length} H{heads} D{dense_dim}", dtype,
                            lambda n=length: dense_speed(env, report, n), dense_predictor.predict(length**2))
        dense_predictor.record(length**2, data)


def dsa_sparse_speed(env: Env, report: Report, length: int, shape: tuple | None = None) -> tuple[str, str, dict]:
    """``shape``: as ``Sizes.dsa_shape`` (its default)."""
    import torch

    from megaseq_dsa.backends import BACKENDS

    index_heads, index_dim, topk, pool, heads, dim, _ = shape or env.sizes.dsa_shape
    ops = BACKENDS.load("triton", env.device)
    dtype = torch.bfloat16 if env.cuda else torch.float32
    gen = torch.Generator(device=env.device).manual_seed(0)
    q_idx, k_idx, weights, q, key, d_o = (
        torch.randn(*shape, generator=gen, device=env.device).to(dtype)
        for shape in ((1, length, index_heads, index_dim), (1, length, index_dim), (1, length, index_heads),
                      (1, length, heads, dim), (1, length, dim), (1, length, heads, dim))
    )
    q.requires_grad_(), key.requires_grad_()
    left = max(1.0, report.part_left() / 4)
    holder = {}

    def select() -> None:
        holder["indices"] = ops.select_topk(q_idx, k_idx, weights, topk, None, pool, None, None)

    def attend() -> None:
        o = ops.sparse_attention(q, key, key, holder["indices"], dim**-0.5, None)  # MLA: value = latent key
        o.backward(d_o)
        q.grad = key.grad = None

    select_t = timed(select, env.device, left)
    attend_t = timed(attend, env.device, left)
    total = select_t["seconds"] + attend_t["seconds"]
    peaks = [t["peak_gib"] for t in (select_t, attend_t)]
    peak = "n/a (cpu)" if peaks[0] is None else f"{max(peaks):.2f} GiB"
    measured = (f"select {1e3 * select_t['seconds']:.1f} ms + attention fwd+bwd {1e3 * attend_t['seconds']:.1f} ms"
                f" = {1e3 * total:.1f} ms, peak {peak}")
    return "pass", measured, {"select": select_t, "attention_forward_backward": attend_t, "total_s": total}


def dense_speed(env: Env, report: Report, length: int, shape: tuple | None = None) -> tuple[str, str, dict]:
    """``shape``: as ``Sizes.dsa_shape`` (its default)."""
    import torch
    import torch.nn.functional as F

    _, _, _, _, heads, _, dense_dim = shape or env.sizes.dsa_shape
    dtype = torch.bfloat16 if env.cuda else torch.float32
    gen = torch.Generator(device=env.device).manual_seed(0)
    q, k, v, d_o = (torch.randn(1, length, heads, dense_dim, generator=gen, device=env.device).to(dtype)
                    for _ in range(4))
    for x in (q, k, v):
        x.requires_grad_()
    if env.cuda and env.has("flash_attn"):
        from flash_attn import flash_attn_func

        def attend() -> None:
            flash_attn_func(q, k, v, causal=True).backward(d_o)
    else:
        def flash_only() -> contextlib.AbstractContextManager:  # a fresh context per call: it is single-use
            if not env.cuda:
                return contextlib.nullcontext()
            from torch.nn.attention import SDPBackend, sdpa_kernel

            return sdpa_kernel([SDPBackend.FLASH_ATTENTION])

        def attend() -> None:
            with flash_only():
                o = F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v)), is_causal=True)
            o.transpose(1, 2).backward(d_o)

    both = timed(attend, env.device, max(1.0, report.part_left() / 4))
    peak = "n/a (cpu)" if both["peak_gib"] is None else f"{both['peak_gib']:.2f} GiB"
    return "pass", f"fwd+bwd {1e3 * both['seconds']:.1f} ms, peak {peak}", {"forward_backward": both}


# ==== 7. training ==============================================================================================


def part_train(env: Env, report: Report) -> None:
    report.check(f"hybrid recipe (genome-cpu) T{env.sizes.train_seq_len}", "fp32", lambda: train_steps(env),
                 note="recipe as shipped, data excerpt-chr20")


def megaseq_plugins():
    """The installed plugins, with megaseq's own registered from this checkout where they are not installed:
    ``megaseq_testkit``'s manager (one per process), which ``megaseq_testkit.layouts`` trains with."""
    from megaseq_testkit import installed_plugins

    plugins = installed_plugins()
    active = {info.dist for info in plugins if info.status == "active"}
    for module, (dist, _, plugin_module) in SOURCES.items():
        if plugin_module and dist not in active:  # not installed: registered from this checkout
            plugins.register(importlib.import_module(plugin_module), name=module, dist=dist, version="source")
    return plugins


def train_steps(env: Env) -> tuple[str, str, dict]:
    import torch

    from megaseq.config import load_recipe
    from megaseq.train.trainer import Trainer

    plugins = megaseq_plugins()
    choices: list[str] = []

    class Choices(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            choices.append(record.getMessage())

    handler = Choices(level=logging.INFO)
    backend_log = logging.getLogger("megaseq.backends")
    backend_log.addHandler(handler)
    backend_log.setLevel(logging.INFO)
    steps = env.sizes.train_steps
    try:
        with tempfile.TemporaryDirectory() as out:
            overrides = [f"data.seq_len={env.sizes.train_seq_len}", "data.train='excerpt-chr20'",
                         "data.heldout='excerpt-chrX'", f"run.device='{env.device.type}'", f"run.out_dir='{out}'",
                         f"train.steps={steps + 1}", "train.batch_size=1", "train.grad_accum=1"]
            trainer = Trainer(load_recipe(REPO / "recipes" / "genome-cpu.toml", plugins, overrides), plugins,
                              progress=False, tensorboard=False)
            first = time.perf_counter()
            trainer.train_step()  # warm-up: kernel compilation, first allocations
            first = time.perf_counter() - first
            if env.cuda:
                torch.cuda.reset_peak_memory_stats()
            start = time.perf_counter()
            losses = [trainer.train_step()["loss"] for _ in range(steps)]
            if env.cuda:
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - start
    finally:
        backend_log.removeHandler(handler)
    tokens_per_s = steps * env.sizes.train_seq_len / elapsed
    peak = torch.cuda.max_memory_allocated() / 2**30 if env.cuda else None
    peak_text = "n/a (cpu)" if peak is None else f"{peak:.2f} GiB"
    finite = all(math.isfinite(x) for x in losses)
    measured = f"{tokens_per_s:,.0f} tokens/s, peak {peak_text}, loss {losses[-1]:.3f}"
    return ("pass" if finite else "FAIL"), measured, {
        "tokens_per_s": tokens_per_s, "peak_gib": peak, "losses": losses, "first_step_s": first,
        "backend_choices": choices}


# ==== 10. distributed ==========================================================================================

# max relative difference (``megaseq_testkit.layouts.run_differences``: max |x - one process| / max(1, max |one
# process|)) of every logged metric (loss and gradient norm included) and every weight after the steps, with
# TF32 off (``fp32_products``). CPU: fp32 sums in the same order up to the collectives' (1e-5, as in the gloo
# tests). CUDA: NCCL's reduction order, and cuBLAS and the Triton kernels choosing other splits of their sums at
# a rank's shape (half the heads, half the sequence), move the last bits of every product, and AdamW's first
# steps (lr x g / (|g| + eps)) carry those bits into weights whose gradient is near zero: 1e-4.
DIST_TOLERANCE = {"cpu": 1e-5, "cuda": 1e-4}
DIST_STEPS = 2
# The hybrid recipe (KDA, DSA, chunked MoE with its balance loss) as the layout-equivalence tests run it
# (tests/conftest.py's ``layouts_recipe``; tests/test_device_check.py holds the two equal).
DIST_RECIPE = {
    "data": {"train": "excerpt-chr20", "heldout": "excerpt-chrX"},
    "model": {"d_model": 32, "n_layers": 4, "layer_pattern": ["kda", "kda", "kda", "dsa"], "moe": "chunked",
              "dense_layers": 1},
    "attention": {"kda": {"n_heads": 2, "head_dim": 16},
                  "dsa": {"n_heads": 2, "head_dim": 8, "q_lora_rank": 16, "kv_lora_rank": 16, "index_heads": 2,
                          "index_dim": 8, "topk": 16, "index_pool": 4}},
    "moe": {"chunked": {"n_experts": 4, "top_k": 2, "expert_hidden": 32, "chunk_tokens": 40, "aux_loss_coef": 0.01}},
    "train": {"steps": 3, "batch_size": 2, "warmup_steps": 1, "log_every": 1, "loss_chunk": 64, "lr": 1e-3},
}
# check name -> layout; each runs on one process per rank (one GPU each under NCCL)
DIST_LAYOUTS = {"hybrid tp=2": {"tp": 2}, "hybrid cp=2": {"cp": 2}, "hybrid dp=2 x ep=2": {"dp": 2, "ep": 2},
                "hybrid tp=2 x cp=2": {"tp": 2, "cp": 2}}


def fp32_products() -> None:
    """fp32 products in fp32 on CUDA: cuBLAS may and cuDNN's convolutions do by default multiply in TF32."""
    import torch

    if hasattr(torch.backends, "fp32_precision"):
        torch.backends.fp32_precision = "ieee"
    else:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False


def _dist_worker(rank: int, world: int, raw: dict, layouts: list[dict[str, int]], out_dir: str) -> list[dict]:
    """One rank (in ``run_gloo``): the layout-equivalence tests' ``train_under_layouts`` with TF32 off."""
    from megaseq.distributed.layout import Layout
    from megaseq_testkit.layouts import train_under_layouts

    fp32_products()
    megaseq_plugins()
    return train_under_layouts(rank, world, raw, [Layout(**layout) for layout in layouts], out_dir, DIST_STEPS)


def dist_world(layout: dict[str, int]) -> int:
    from megaseq.distributed.layout import Layout

    return Layout(**layout).world_size


@dataclass
class DistRuns:
    """The runs the distributed rows compare, each made once: the one-process run, and per world size one
    launch (NCCL on CUDA, gloo in the rehearsal) that trains every layout of that size in turn (a launch costs
    seconds: starting the processes, joining the group, building each rank's trainer)."""

    env: Env
    single: dict = field(default_factory=dict)
    launches: dict[int, list[dict] | Exception] = field(default_factory=dict)  # world size -> rank 0's results

    @property
    def backend(self) -> str:
        return "nccl" if self.env.cuda else "gloo"

    def recipe(self) -> dict:
        return {**DIST_RECIPE, "run": {"name": "dist", "device": self.env.device.type},
                "data": {**DIST_RECIPE["data"], "seq_len": self.env.sizes.dist_seq_len}}

    def one_process(self) -> dict:
        from megaseq_testkit.layouts import single_trainer, train_single

        if not self.single:
            fp32_products()
            megaseq_plugins()
            with tempfile.TemporaryDirectory() as out:
                self.single |= train_single(single_trainer(self.recipe(), Path(out)), DIST_STEPS)
        return self.single

    def under(self, layout: dict[str, int]) -> dict:
        """Rank 0's run under ``layout`` (whole weights); a launch that failed fails every row of its size."""
        from megaseq_testkit.distributed import run_gloo

        world = dist_world(layout)
        layouts = [other for other in DIST_LAYOUTS.values() if dist_world(other) == world]
        if world not in self.launches:
            try:
                with tempfile.TemporaryDirectory() as out:
                    self.launches[world] = run_gloo(world, _dist_worker, self.recipe(), layouts, out,
                                                    timeout=240, backend=self.backend)[0]
            except Exception as exc:
                self.launches[world] = exc
        launched = self.launches[world]
        if isinstance(launched, Exception):
            raise launched
        return launched[layouts.index(layout)]


def part_distributed(env: Env, report: Report) -> None:
    import torch

    gpus = torch.cuda.device_count() if env.cuda else 0
    runs = DistRuns(env)
    for name, layout in DIST_LAYOUTS.items():
        report.check(name, "fp32", lambda layout=layout: dist_equivalence(runs, gpus, layout),
                     note=f"{dist_world(layout)} ranks against one process, {DIST_STEPS} optimizer steps")


def dist_equivalence(runs: DistRuns, gpus: int, layout: dict[str, int]) -> tuple[str, str, dict]:
    """``DIST_STEPS`` steps of the hybrid recipe under ``layout`` against the same steps in one process."""
    env, world = runs.env, dist_world(layout)
    if env.cuda and gpus < world:
        raise Skip(f"needs {world} GPUs for NCCL, {gpus} visible")
    if not env.cuda and not env.rehearse:
        raise Skip("no CUDA")
    if not all(env.has(m) for m in SOURCES):
        raise Skip("megaseq's packages are not importable")
    if not env.has("megatron"):
        raise Skip("megatron-core is missing: pip install 'megaseq-core[distributed]'")
    return judge(runs.under(layout), runs.one_process(), DIST_TOLERANCE[env.device.type], runs.backend)


def judge(got: dict, single: dict, tol: float, backend: str) -> tuple[str, str, dict]:
    """A row from rank 0's run (whole weights) against the one-process run: pass when every metric of every
    step (loss and gradient norm included), the tokens and every weight are within ``tol``."""
    from megaseq.contracts import LOAD_STAT_KEYS
    from megaseq_testkit.layouts import run_differences

    # metrics that describe the layout, not the training: each MoE layer's load over the last micro-batch a rank
    # routed, and the busiest expert-parallel rank over the mean (1 by definition with one rank)
    layout_metrics = frozenset({"moe/rank_max_over_mean", *(f"moe/load/{key}" for key in LOAD_STAT_KEYS)})
    differences = run_differences(got, single, layout_metrics)
    worst = max(differences, key=differences.get)
    status = "pass" if all(d <= tol for d in differences.values()) else "FAIL"
    return status, f"{backend}: max rel diff {differences[worst]:.2e} ({worst}), tol {tol:g}", {
        "differences": differences, "tolerance": tol, "backend": backend}


# ==== main =====================================================================================================


def kernel_cache(directory: Path) -> Path:
    """Point Triton's cache at ``directory`` for this process and every process it starts (the environment is
    inherited), unless the caller set TRITON_CACHE_DIR, and cache autotuning results there too (fla autotunes
    its kernels at first use: minutes, which a rerun on the same machine then skips)."""
    os.environ.setdefault("TRITON_CACHE_DIR", str(directory.expanduser().absolute()))
    os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")
    return Path(os.environ["TRITON_CACHE_DIR"])


def cached_files(directory: Path) -> int:
    return sum(1 for p in directory.rglob("*") if p.is_file()) if directory.is_dir() else 0


CHILDREN = {"memory": memory_child}  # --child NAME: a measurement that needs a fresh process


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="where to write the JSON report")
    parser.add_argument("--rehearse", action="store_true", help="CPU rehearsal: tiny shapes, Triton interpreter")
    parser.add_argument("--parts", nargs="+", choices=list(FULL.budgets), help="run only these parts")
    parser.add_argument("--kernel-cache", type=Path, default=Path("~/.triton/cache"), metavar="DIR",
                        help="Triton's cache of compiled kernels and autotuning results, shared by every part and "
                        "every process the check starts (default: Triton's own; TRITON_CACHE_DIR overrides)")
    parser.add_argument("--child", nargs=2, metavar=("NAME", "JSON"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        name, spec = args.child
        print(json.dumps(CHILDREN[name](json.loads(spec))), flush=True)
        return 0
    if args.out is None:
        parser.error("--out is required")
    if args.rehearse:
        if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
            raise SystemExit("--rehearse needs TRITON_INTERPRET=1 before triton is imported")
        os.environ["TRITON_INTERPRET"] = "1"
    cache = kernel_cache(args.kernel_cache)
    env = Env(rehearse=args.rehearse, sizes=REHEARSAL if args.rehearse else FULL,
              work=Path(tempfile.mkdtemp(prefix="megaseq-device-check-")))
    report = Report(args.out, env)
    report.meta["kernel_cache"] = {"dir": str(cache), "files_at_start": cached_files(cache)}

    def deadline_passed() -> None:
        report.add("(all)", "deadline", "", "error", note=f"whole run passed {env.sizes.deadline:.0f}s: stopped")
        report.write(aborted="deadline")
        print(report.table(), flush=True)
        for started in STARTED:  # a launch or an engine left running would hold the GPU after this process
            with contextlib.suppress(ProcessLookupError):
                os.killpg(started.proc.pid, signal.SIGKILL)
        shutil.rmtree(env.work, ignore_errors=True)
        os._exit(3)

    watchdog = threading.Timer(env.sizes.deadline + 15, deadline_passed)
    watchdog.daemon = True
    watchdog.start()
    parts: dict[str, Callable[[Env, Report], None]] = {  # the order they run in (module docstring)
        "setup": part_setup,
        "launch": part_launch,
        "memory": part_memory,
        "vllm": part_vllm,
        "model_speed": part_model_speed,
        "correctness": part_correctness,
        "train": part_train,
        "kda_speed": part_kda_speed,
        "dsa_speed": part_dsa_speed,
        "distributed": part_distributed,
        "correctness_fla": part_correctness_fla,
    }
    try:
        for name, fn in parts.items():
            if name == "setup" or args.parts is None or name in args.parts:
                report.part(name, fn)
                report.meta["kernel_cache"]["files_at_end"] = cached_files(cache)
                report.write()
    finally:
        shutil.rmtree(env.work, ignore_errors=True)
    watchdog.cancel()
    report.write()
    print(report.table())
    return 0 if all(r["status"] in ("pass", "skipped", "missing") for r in report.rows) else 1


if __name__ == "__main__":
    sys.exit(main())
