"""Controlled short training runs: one factor changed at a time against a baseline, same seed and data.

Each variant is a `megaseq train` run of the same recipe with a few `--set` overrides, in its own process
with one intra-op thread (so several can share a machine). Prints one table row per variant: training
bits/base averaged over the last quarter of the logged steps, held-out bits/base, and the MoE routing
state at the end (busiest expert over the mean in the worst layer, routing entropy, largest bias).

    .venv/bin/python benchmarks/diagnose_training.py --list
    .venv/bin/python benchmarks/diagnose_training.py baseline lr-1e-3 --steps 150 --jobs 2
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# name -> overrides on top of the common ones; each changes one factor of the recipe
VARIANTS: dict[str, list[str]] = {
    "baseline": [],
    "lr-4e-3": ["train.lr=4e-3"],
    "lr-1e-3": ["train.lr=1e-3"],
    "lr-2e-3": ["train.lr=2e-3"],
    "lr-8e-3": ["train.lr=8e-3"],
    "bias-1e-2": ["moe.chunked.bias_update_rate=1e-2"],
    "aux-1e-2": ["moe.chunked.aux_loss_coef=1e-2"],
    "gate-softplus": ["attention.kda.gate='softplus'"],
    "batch-x4": ["train.batch_size=4"],
    "no-decay": ["train.weight_decay=0.0"],
}


def run_variant(name: str, overrides: list[str], args: argparse.Namespace) -> subprocess.Popen:
    out = Path(args.out) / name
    sets = [
        f"run.out_dir='{out}'",
        f"train.steps={args.steps}",
        f"data.seq_len={args.seq_len}",
        f"train.batch_size={args.batch_size}",
        "train.log_every=5",
        "train.checkpoint_every=0",
        f"eval.windows={args.eval_windows}",
        *args.set,
        *overrides,
    ]
    cmd = [sys.executable, "-m", "megaseq.cli", "train", args.recipe, "--no-progress", "--overwrite"]
    for item in sets:
        cmd += ["--set", item]
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    log = (out / "log.txt").open("w")
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)


def summarise(name: str, out: Path) -> dict:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "bits_per_base" in r]
    tail = steps[-max(1, len(steps) // 4) :]
    final = max(r["step"] for r in rows)  # the trainer evaluates the final step into eval/step_N
    heldout = json.loads((out / "eval" / f"step_{final:07d}" / "heldout.json").read_text())["results"]
    last = steps[-1]
    loads = [v for k, v in last.items() if k.startswith("moe/layer") and k.endswith("expert_max_over_mean")]
    return {
        "variant": name,
        "train": sum(r["bits_per_base"] for r in tail) / len(tail),
        "heldout": heldout["model"]["bits_per_base"],
        "markov": next(v["bits_per_base"] for k, v in heldout.items() if k != "model"),
        "load": max(loads) if loads else float("nan"),
        "entropy": last.get("moe/routing_entropy", float("nan")),
        "bias": last.get("moe/bias_abs_max", float("nan")),
        "tok_s": sum(r["tokens_per_s"] for r in steps) / len(steps),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("variants", nargs="*", default=["baseline"])
    p.add_argument("--recipe", default=str(REPO / "recipes" / "genome-cpu.toml"))
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--eval-windows", type=int, default=32)
    p.add_argument("--set", action="append", default=[], help="override applied to every variant")
    p.add_argument("--jobs", type=int, default=1, help="variants run at once (one thread each)")
    p.add_argument("--out", default=str(REPO / "runs" / "diagnose"))
    p.add_argument("--list", action="store_true", help="print the variants and exit")
    args = p.parse_args()
    if args.list:
        for name, overrides in VARIANTS.items():
            print(f"{name:16} {' '.join(overrides) or '(the recipe)'}")
        return
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:
        sys.exit(f"unknown variant(s) {unknown}; choose from {list(VARIANTS)}")
    started = time.perf_counter()
    pending, running, failed = list(args.variants), {}, []
    while pending or running:
        while pending and len(running) < args.jobs:
            name = pending.pop(0)
            running[name] = run_variant(name, VARIANTS[name], args)
        time.sleep(1)
        for name, proc in list(running.items()):
            if proc.poll() is not None:
                del running[name]
                if proc.returncode:
                    failed.append(name)
    print(f"recipe {args.recipe}; {args.steps} steps of {args.batch_size} x {args.seq_len} bases; "
          f"{' '.join(args.set)}; wall {time.perf_counter() - started:.0f} s, "
          f"children CPU {resource.getrusage(resource.RUSAGE_CHILDREN).ru_utime:.0f} s")
    print(f"{'variant':16} {'train':>7} {'heldout':>8} {'markov':>7} {'load':>5} {'entropy':>7} {'bias':>6} {'tok/s':>6}")
    for name in args.variants:
        if name in failed:
            print(f"{name:16} FAILED: see {Path(args.out) / name / 'log.txt'}")
            continue
        s = summarise(name, Path(args.out) / name)
        print(f"{name:16} {s['train']:7.4f} {s['heldout']:8.4f} {s['markov']:7.4f} {s['load']:5.2f} "
              f"{s['entropy']:7.3f} {s['bias']:6.3f} {s['tok_s']:6.0f}")


if __name__ == "__main__":
    main()
