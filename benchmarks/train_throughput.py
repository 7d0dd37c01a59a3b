"""Training throughput and peak memory of a recipe at several sequence lengths.

Each configuration runs in a fresh subprocess so that its peak RSS is its own. One warm-up step is
excluded from the timing. Prints a table; writes nothing else.

    .venv/bin/python benchmarks/train_throughput.py                       # default recipe, 4k 16k 64k
    .venv/bin/python benchmarks/train_throughput.py --seq-len 4096 --steps 2 --set model.layer_pattern='["kda"]'
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def measure(recipe: str, seq_len: int, steps: int, overrides: list[str]) -> dict:
    from megaseq.config import load_recipe
    from megaseq.plugins import get_plugins
    from megaseq.train.trainer import Trainer

    plugins = get_plugins()
    with tempfile.TemporaryDirectory() as out:
        sets = [f"data.seq_len={seq_len}", "train.batch_size=1", "train.grad_accum=1", f"run.out_dir='{out}'",
                f"train.steps={steps + 1}", *overrides]
        trainer = Trainer(load_recipe(recipe, plugins, sets), plugins, progress=False, tensorboard=False)
        trainer.train_step()  # warm-up: first-call allocations and kernel selection
        start = time.perf_counter()
        for _ in range(steps):
            loss = trainer.train_step()["loss"]
        elapsed = time.perf_counter() - start
    return {
        "seq_len": seq_len,
        "tokens_per_s": steps * seq_len / elapsed,
        "s_per_step": elapsed / steps,
        "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "loss": loss,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", default=str(REPO / "recipes" / "genome-cpu.toml"))
    p.add_argument("--seq-len", type=int, nargs="+", default=[4096, 16384, 65536])
    p.add_argument("--steps", type=int, default=2, help="timed steps per configuration")
    p.add_argument("--set", action="append", default=[], help="recipe override, as for megaseq train")
    p.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child is not None:
        print(json.dumps(measure(args.recipe, args.child, args.steps, args.set)))
        return
    print(f"recipe: {args.recipe} {' '.join(args.set)}; batch 1 window, {args.steps} timed steps after 1 warm-up")
    print(f"{'seq_len':>8} {'tokens/s':>10} {'s/step':>8} {'peak RSS GiB':>13} {'loss':>7}")
    for seq_len in args.seq_len:
        cmd = [sys.executable, __file__, "--recipe", args.recipe, "--steps", str(args.steps), "--child", str(seq_len)]
        for item in args.set:
            cmd += ["--set", item]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode:
            print(f"{seq_len:>8} failed: {proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else proc.returncode}")
            continue
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        print(f"{r['seq_len']:>8} {r['tokens_per_s']:>10.0f} {r['s_per_step']:>8.2f} {r['peak_rss_gib']:>13.2f} {r['loss']:>7.3f}")


if __name__ == "__main__":
    main()
