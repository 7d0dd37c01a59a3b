"""One full training step (forward, backward, optimizer) of a recipe at long sequence lengths on this CPU,
without memory policies and with the set the planner picks: peak resident memory, step time and loss.

Each configuration runs in a fresh process (its own VmHWM). "with policies" is `train.memory_policy =
"auto"`: the planner's choice for this machine, or, with --device-mem, for a machine of that size (e.g. 16 to
aim at the 16 GiB goal). A configuration the planner predicts above --max-gib is not run. Where both runs
exist, the gradient norms must agree (they do to 1e-6 relative: recomputation in tiles reorders sums).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/long_sequence_step.py --seq-len 16384 32768     # minutes
    .venv/bin/python benchmarks/long_sequence_step.py --device-mem 16 --max-gib 22            # quiet machine:
                                                                          # 64k, 256k and 1M, about an hour
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/long_sequence_step.py --seq-len 1048576 --device-mem 6 \
        --only auto                                                       # the 1M row: the plan for 6 GiB

``--set KEY=VALUE`` passes recipe overrides to every run (e.g. ``--set attention.dsa.index_scores='bf16'`` on a
machine with bf16 units, or ``--set train.bf16=true --set model.residual_dtype='bf16'``).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GiB = 2**30


def vm(key: str) -> int:
    return int(re.search(rf"{key}:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1)) * 1024


def child(recipe_path: str, seq_len: int, policy: str, device_mem: float | None, extra: list[str]) -> dict:
    from megaseq.config import load_recipe
    from megaseq.memory import machine as planner_machine
    from megaseq.plugins import get_plugins
    from megaseq.train.trainer import Trainer

    if device_mem is not None:  # plan for a machine of this size
        planner_machine.total_ram = lambda: int(device_mem * GiB)
    plugins = get_plugins()
    with tempfile.TemporaryDirectory() as out:
        sets = [f"data.seq_len={seq_len}", "train.batch_size=1", "train.grad_accum=1", "train.steps=1",
                "train.checkpoint_every=0", f"run.out_dir='{out}'", "run.device='cpu'",
                f"train.memory_policy={json.dumps(policy if policy == 'auto' else [])}", *extra]
        trainer = Trainer(load_recipe(recipe_path, plugins, sets), plugins, progress=False, tensorboard=False)
        predicted = trainer.memory.peak_gib * GiB if trainer.memory.peak_gib is not None else None  # the run's own policies
        start, cpu = time.perf_counter(), time.process_time()
        metrics = trainer.train_step()
        elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    from megaseq.memory.plan_report import describe_memory_policy

    return {"policies": describe_memory_policy(trainer.recipe), "predicted": predicted, "peak": vm("VmHWM"),
            "s": elapsed, "cpu_s": cpu, "loss": metrics["loss"], "grad_norm": metrics["grad_norm"]}


def predicted_none(recipe_path: str, seq_len: int, extra: list[str]) -> int:
    from megaseq.config import load_recipe
    from megaseq.memory.machine import Machine
    from megaseq.memory.plan import plan
    from megaseq.plugins import get_plugins

    plugins = get_plugins()
    recipe = load_recipe(recipe_path, plugins, [f"data.seq_len={seq_len}", "train.batch_size=1", "run.device='cpu'", *extra])
    return plan(recipe, plugins, machine=Machine.detect("cpu"), policies="none").candidates[0].device_peak


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", default=str(REPO / "recipes" / "genome-cpu.toml"))
    p.add_argument("--seq-len", type=int, nargs="+", default=[65536, 262144, 1048576])
    p.add_argument("--device-mem", type=float, help="GiB: let the planner pick for a machine of this size")
    p.add_argument("--max-gib", type=float, default=4.0, help="skip runs without policies predicted above this")
    p.add_argument("--only", choices=("none", "auto"), help="run only this configuration")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE", help="recipe override")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(*json.loads(args.child))))
        return
    print(f"recipe {args.recipe}; one window per step" + (f"; policies planned for {args.device_mem:g} GiB" if args.device_mem else ""))
    print(f"{'seq_len':>9} {'policies':<62} {'predicted':>9} {'peak RSS':>9} {'step s':>8} {'cpu s':>8} {'loss':>7} {'grad norm':>10}")
    for seq_len in args.seq_len:
        norms = []
        for policy in [args.only] if args.only else ("none", "auto"):
            none_peak = predicted_none(args.recipe, seq_len, args.sets) if policy == "none" else 0
            if none_peak > args.max_gib * GiB:
                print(f"{seq_len:>9} {'none':<62} {none_peak / GiB:>8.2f}G  not run: above --max-gib", flush=True)
                continue
            cmd = [sys.executable, __file__, "--child", json.dumps([args.recipe, seq_len, policy, args.device_mem, args.sets])]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode:
                tail = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}"
                print(f"{seq_len:>9} {policy:<62} failed: {tail}", flush=True)
                continue
            r = json.loads(proc.stdout.strip().splitlines()[-1])
            norms.append(r["grad_norm"])
            label = r["policies"] if len(r["policies"]) <= 62 else r["policies"][:59] + "..."
            pred = f"{r['predicted'] / GiB:>8.2f}G" if r["predicted"] else f"{'':>9}"
            print(f"{seq_len:>9} {label:<62} {pred} {r['peak'] / GiB:>8.2f}G {r['s']:>8.1f} {r['cpu_s']:>8.1f} "
                  f"{r['loss']:>7.4f} {r['grad_norm']:>10.6f}", flush=True)
        if len(norms) == 2:
            print(f"{'':>9} gradient norms agree to {abs(norms[0] - norms[1]) / norms[0]:.1e} relative", flush=True)


if __name__ == "__main__":
    main()
