"""How close `megaseq plan` comes to the peak resident memory of real training steps on this CPU.

For each recipe and sequence length it plans the recipe, then measures, each in a fresh process (so that
VmHWM is its own): no policy, the set the planner proposes for this machine, and the sets it proposes for
smaller machines (the no-policy prediction times each --budget fraction), i.e. every set the planner would
propose on the way down. Each measurement runs --steps training steps (the second has optimizer state) of
one window. A configuration whose prediction exceeds --max-gib is not run (the table says so).

Two measurements per row: with glibc's default allocator settings, and with allocations of 1 MiB or more
served by their own memory maps (MALLOC_MMAP_THRESHOLD_=1048576, what the offload policy sets on CPU).
The first is compared with the whole plan, which counts what glibc's heap keeps resident where the run does
not trim it (the plan's heap term); the second, whose resident memory follows live memory, with the plan less
that term.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/plan_accuracy.py --seq-len 4096 16384       # minutes
    .venv/bin/python benchmarks/plan_accuracy.py --seq-len 4096 16384 65536 262144 --max-gib 22  # quiet machine
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/plan_accuracy.py --seq-len 262144 --allocator default --steps 1

Prints a table (predicted, measured, error) and, with --json, one JSON object per row.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECIPES = [str(REPO / "recipes" / "genome-cpu.toml"), str(REPO / "recipes" / "genome-sdpa-cpu.toml")]
GiB = 2**30


def vm(key: str) -> int:
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"{key}:\s+(\d+) kB", text).group(1)) * 1024


def run_overrides(seq_len: int, steps: int, out_dir: str) -> list[str]:
    return [f"data.seq_len={seq_len}", "train.batch_size=1", "train.grad_accum=1", f"train.steps={steps}",
            f"run.out_dir='{out_dir}'", "run.device='cpu'", "train.checkpoint_every=0"]


def policy_overrides(policies: list[dict]) -> list[str]:
    """``--set`` items that switch on ``policies`` ([{"name", "config"}]) with their configs."""
    out = [f"train.memory_policy={json.dumps([p['name'] for p in policies])}"]
    for p in policies:
        for key, value in p["config"].items():
            if value is not None:
                out.append(f"memory_policy.{p['name']}.{key}={json.dumps(value)}")
    return out


def child(recipe_path: str, seq_len: int, steps: int, policies: list[dict]) -> dict:
    """Train ``steps`` steps in this process; report peak RSS and what it took."""
    from megaseq.config import load_recipe
    from megaseq.plugins import get_plugins
    from megaseq.train.trainer import Trainer

    plugins = get_plugins()
    with tempfile.TemporaryDirectory() as out:
        recipe = load_recipe(recipe_path, plugins, run_overrides(seq_len, steps, out) + policy_overrides(policies))
        trainer = Trainer(recipe, plugins, progress=False, tensorboard=False)
        after_init = vm("VmRSS")
        times, losses = [], []
        for _ in range(steps):
            start = time.perf_counter()
            losses.append(trainer.train_step()["loss"])
            times.append(time.perf_counter() - start)
    return {"peak": vm("VmHWM"), "after_init": after_init, "s_per_step": min(times), "loss": losses[-1]}


def measure(recipe: str, seq_len: int, steps: int, policies: list[dict], mapped: bool) -> dict:
    cmd = [sys.executable, __file__, "--child", json.dumps([recipe, seq_len, steps, policies])]
    env = {**os.environ, **({"MALLOC_MMAP_THRESHOLD_": "1048576"} if mapped else {})}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode:
        tail = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}"
        return {"error": tail}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def planned_sets(recipe_path: str, seq_len: int, budgets: list[float]) -> list[tuple[str, list[dict], int, int]]:
    """(label, policies, predicted peak, its heap term) for no policy and each distinct set proposed at the
    budgets."""
    from megaseq.config import load_recipe
    from megaseq.memory.machine import Machine
    from megaseq.memory.plan import plan
    from megaseq.plugins import get_plugins

    plugins = get_plugins()
    recipe = load_recipe(recipe_path, plugins, [f"data.seq_len={seq_len}", "train.batch_size=1", "run.device='cpu'"])
    none = plan(recipe, plugins, machine=Machine.detect("cpu"), policies="none").candidates[0]
    rows = [("none", [], none.device_peak, none.heap)]
    machines = [Machine.detect("cpu")] + [Machine("cpu", int(none.device_peak * f), None) for f in budgets]
    for machine in machines:
        result = plan(recipe, plugins, machine=machine)
        if result.chosen is not None and result.chosen.policies and result.chosen.label not in [r[0] for r in rows]:
            policies = [{"name": p.name, "config": p.config} for p in result.chosen.policies]
            rows.append((result.chosen.label, policies, result.chosen.device_peak, result.chosen.heap))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", nargs="+", default=RECIPES)
    p.add_argument("--seq-len", type=int, nargs="+", default=[4096, 16384, 65536, 262144])
    p.add_argument("--budget", type=float, nargs="*", default=[0.5, 0.25],
                   help="fractions of the no-policy prediction: the planner's proposal for each is measured")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--max-gib", type=float, default=4.0, help="do not run configurations predicted above this")
    p.add_argument("--allocator", choices=["both", "default", "mapped"], default="both",
                   help="measure with glibc's defaults, with large allocations mapped, or both (twice the time)")
    p.add_argument("--no-baseline", action="store_true", help="measure only the proposed policy sets, not the no-policy row")
    p.add_argument("--json", action="store_true")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(*json.loads(args.child))))
        return
    print(f"{'recipe':<16} {'seq_len':>8} {'policies':<50} {'predicted':>9} {'default':>8} {'error':>7} "
          f"{'mapped':>8} {'error':>7} {'s/step':>7}", flush=True)
    for recipe in args.recipe:
        for seq_len in args.seq_len:
            for label, policies, predicted, heap in planned_sets(recipe, seq_len, args.budget)[args.no_baseline:]:
                row = {"recipe": Path(recipe).stem, "seq_len": seq_len, "policies": label, "predicted_bytes": predicted}
                short = label if len(label) <= 50 else label[:47] + "..."
                head = f"{row['recipe']:<16} {seq_len:>8} {short:<50} {predicted / GiB:>8.2f}G"
                if predicted > args.max_gib * GiB:
                    print(f"{head} {'not run: above --max-gib':>26}", flush=True)
                    continue
                cells = []
                for mapped in (False, True):
                    key = "mapped" if mapped else "default"
                    if args.allocator not in ("both", key):
                        cells.append(f"{'-':>8} {'':>7}")
                        continue
                    result = measure(recipe, seq_len, args.steps, policies, mapped)
                    row[key] = result
                    if "error" in result:
                        cells.append(f"failed: {result['error']}")
                        continue
                    row[f"{key}_error"] = (predicted - (heap if mapped else 0)) / result["peak"] - 1
                    cells.append(f"{result['peak'] / GiB:>7.2f}G {row[f'{key}_error']:>+7.1%}")
                step = row.get("default", row.get("mapped", {})).get("s_per_step", float("nan"))
                print(f"{head} {' '.join(cells)} {step:>7.1f}", flush=True)
                if args.json:
                    print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
