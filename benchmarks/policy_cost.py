"""CPU seconds of one training step under fixed memory-policy sets: the measurement behind the CPU costs the
planner ranks policies by (``megaseq_offload.policies``).

Each set runs in a fresh process (its own VmHWM); one window of ``--seq-len`` tokens of ``--recipe``. CPU
seconds barely depend on what else runs on the machine; wall seconds do.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/policy_cost.py --seq-len 65536 --policies none recompute offload

``--set KEY=VALUE`` overrides the recipe in every set (e.g. ``memory_policy.recompute.tile_tokens=16384``).
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


def child(recipe_path: str, seq_len: int, policies: str, overrides: list[str]) -> dict:
    from megaseq.config import load_recipe
    from megaseq.plugins import get_plugins
    from megaseq.train.trainer import Trainer

    plugins = get_plugins()
    names = [] if policies == "none" else policies.split(",")
    with tempfile.TemporaryDirectory() as out:
        sets = [f"data.seq_len={seq_len}", "train.batch_size=1", "train.grad_accum=1", "train.steps=1",
                f"run.out_dir='{out}'", "run.device='cpu'", f"train.memory_policy={json.dumps(names)}", *overrides]
        trainer = Trainer(load_recipe(recipe_path, plugins, sets), plugins, progress=False, tensorboard=False)
        start, cpu = time.perf_counter(), time.process_time()
        metrics = trainer.train_step()
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    peak = int(re.search(r"VmHWM:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1)) * 1024
    return {"policies": policies, "wall_s": wall, "cpu_s": cpu, "peak_gib": peak / 2**30, "loss": metrics["loss"],
            "grad_norm": metrics["grad_norm"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", default=str(REPO / "recipes" / "genome-cpu.toml"))
    p.add_argument("--seq-len", type=int, default=65536)
    p.add_argument("--policies", nargs="+", default=["none", "recompute", "offload"],
                   help="policy sets: none, or comma-separated names configured by the recipe's sections")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE", help="recipe override")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child is not None:
        print(json.dumps(child(args.recipe, args.seq_len, args.child, args.sets)))
        return
    rows = []
    for policies in args.policies:
        cmd = [sys.executable, __file__, "--recipe", args.recipe, "--seq-len", str(args.seq_len), "--child", policies,
               *(f"--set={s}" for s in args.sets)]
        rows.append(json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.splitlines()[-1]))
    base = next((r["cpu_s"] for r in rows if r["policies"] == "none"), None)
    print("| policies | CPU s | extra | wall s | peak RSS | loss | grad norm |\n|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        extra = f"{r['cpu_s'] / base - 1:+.0%}" if base and r["policies"] != "none" else ""
        print(f"| {r['policies']} | {r['cpu_s']:.1f} | {extra} | {r['wall_s']:.0f} | {r['peak_gib']:.2f} GiB "
              f"| {r['loss']:.6f} | {r['grad_norm']:.6f} |")


if __name__ == "__main__":
    main()
