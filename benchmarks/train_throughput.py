"""Training throughput and peak memory of recipes at several sequence lengths, alone and two at once.

Every measurement runs in fresh processes (so that each peak RSS is its own): one warm-up step, then
``--steps`` timed steps. Columns: tokens/s (wall clock), CPU seconds per step (all threads of the process),
peak RSS (``VmHWM``), the last loss, and the ratio of tokens/s to the recorded baseline where it has the same
recipe, length and setting. Settings (``--settings``):

- ``alone``: one process with megaseq's thread default (``megaseq.threads``: the cores shared among the
  live trainers, so all of them here);
- ``alone-1t`` / ``alone-2t``: one process with one, or two OpenMP threads that spin-wait (OpenMP's default);
- ``pair`` / ``pair-1t`` / ``pair-2t``: the same, two processes at once (each row is one process; ``sum`` adds them); under
  megaseq's default each takes half the cores once it sees the other (within ``megaseq.threads.RECOUNT_S``).

The recorded baseline (``benchmarks/baselines/train_throughput.json``) holds reference numbers of another
version of the code (``--code`` measures any checkout), each with the command it was measured with. Wall-clock numbers
mean something only on a machine that runs nothing else; on a shared one compare CPU seconds per step.

    .venv/bin/python benchmarks/train_throughput.py                                   # default recipe, 8k 64k
    .venv/bin/python benchmarks/train_throughput.py --seq-len 8192 --settings alone pair alone-2t pair-2t
    .venv/bin/python benchmarks/train_throughput.py --recipe recipes/genome-cpu.toml recipes/genome-sdpa-cpu.toml \\
        --seq-len 65536 --settings alone-1t --steps 1                                    # the memory comparison
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BASELINE = REPO / "benchmarks" / "baselines" / "train_throughput.json"
SETTINGS = {
    # name: (processes at once, OMP_NUM_THREADS or None for megaseq's default)
    "alone": (1, None),
    "alone-1t": (1, "1"),
    "alone-2t": (1, "2"),
    "pair": (2, None),
    "pair-1t": (2, "1"),
    "pair-2t": (2, "2"),
}


def peak_rss_gib() -> float:
    """This process's peak resident set (``VmHWM``), in GiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 2**20
    raise RuntimeError("no VmHWM in /proc/self/status")


def child(recipe: str, seq_len: int, steps: int, overrides: list[str]) -> dict:
    """One measurement, in this (fresh) process; its thread variables came from the parent."""
    import torch

    from megaseq.config import load_recipe
    from megaseq.plugins import get_plugins
    from megaseq.train.trainer import Trainer

    plugins = get_plugins()
    with tempfile.TemporaryDirectory() as out:
        sets = [f"data.seq_len={seq_len}", "train.batch_size=1", "train.grad_accum=1", f"run.out_dir='{out}'",
                f"train.steps={steps + 1}", *overrides]
        trainer = Trainer(load_recipe(recipe, plugins, sets), plugins, progress=False, tensorboard=False)
        trainer.train_step()  # warm-up: first-call allocations and kernel selection
        wall, cpu = time.perf_counter(), time.process_time()
        for _ in range(steps):
            loss = trainer.train_step()["loss"]
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return {
        "tokens_per_s": steps * seq_len / wall,
        "cpu_s_per_step": cpu / steps,
        "peak_rss_gib": peak_rss_gib(),
        "loss": loss,
        "threads": torch.get_num_threads(),
    }


def run_setting(recipe: str, seq_len: int, setting: str, args: argparse.Namespace) -> list[dict | str]:
    """Start the setting's processes together; their results (or one-line failures) in start order."""
    from megaseq import threads

    processes, count = SETTINGS[setting]
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    if count is None:
        threads.apply_defaults(env)  # what the megaseq command sets
    else:
        env["OMP_NUM_THREADS"] = count
    if args.code is not None:
        env["PYTHONPATH"] = os.pathsep.join(str(src) for src in sorted(args.code.glob("packages/*/src")))
    cmd = [sys.executable, __file__, "--child", recipe, str(seq_len), "--steps", str(args.steps)]
    for item in args.set:
        cmd += ["--set", item]
    running = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for _ in range(processes)]
    results: list[dict | str] = []
    for proc in running:
        out, err = proc.communicate()
        if proc.returncode:
            results.append(err.strip().splitlines()[-1] if err.strip() else f"exit status {proc.returncode}")
        else:
            results.append(json.loads(out.strip().splitlines()[-1]))
    return results


# What the baseline's code did by default in each setting's situation (one process alone, two at once).
OLD_DEFAULT = {"alone": "alone-2t", "alone-1t": "alone-2t", "alone-2t": "alone-2t", "pair": "pair-2t", "pair-1t": "pair-2t",
               "pair-2t": "pair-2t"}


def load_baseline(path: Path) -> tuple[dict, dict[tuple[str, int, str], dict]]:
    if not path.is_file():
        return {}, {}
    data = json.loads(path.read_text())
    return data, {(r["recipe"], r["seq_len"], r["setting"]): r for r in data["results"]}


def compare(value: float, base: dict | None, key: str, higher_is_better: bool) -> str:
    """``old value  ratio`` (ratio > 1: better now), or blanks without a recorded value."""
    if base is None or base.get(key) is None:
        return f"{'-':>9} {'':>6}"
    old = base[key]
    ratio = value / old if higher_is_better else old / value
    return f"{old:>9,.2f} {ratio:>5.2f}x" if old < 100 else f"{old:>9,.0f} {ratio:>5.2f}x"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", nargs="+", default=[str(REPO / "recipes" / "genome-cpu.toml")])
    p.add_argument("--seq-len", type=int, nargs="+", default=[8192, 65536])
    p.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=["alone", "pair", "alone-2t"])
    p.add_argument("--steps", type=int, default=2, help="timed steps per measurement (after one warm-up step)")
    p.add_argument("--set", action="append", default=[], help="recipe override, as for megaseq train")
    p.add_argument("--baseline", type=Path, default=BASELINE, help="recorded results to compare with")
    p.add_argument("--code", type=Path, help="measure the megaseq sources of this checkout (e.g. a worktree of another "
                   "commit: how the baseline was recorded) instead of the installed ones")
    p.add_argument("--child", nargs=2, metavar=("RECIPE", "SEQ_LEN"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child is not None:
        print(json.dumps(child(args.child[0], int(args.child[1]), args.steps, args.set)))
        return

    meta, baseline = load_baseline(args.baseline)
    print(f"{' '.join(args.set)} batch 1 window, {args.steps} timed steps after 1 warm-up; {os.cpu_count()} CPUs")
    if meta:
        print(f"old: {args.baseline.name} (megaseq {meta['commit']}): tokens/s of what it did by default in the "
              "same situation (alone: two spinning threads); CPU s/step and peak of the same setting")
    print(f"{'recipe':<16} {'seq_len':>7} {'setting':<9} {'threads':>7} {'tokens/s':>9} {'old':>9} {'':>6} "
          f"{'CPU s/step':>10} {'old':>9} {'':>6} {'peak GiB':>8} {'old':>9} {'':>6} {'loss':>6}")
    for recipe in args.recipe:
        name = Path(recipe).stem
        for seq_len in args.seq_len:
            for setting in args.settings:
                results = run_setting(recipe, seq_len, setting, args)
                old_default = baseline.get((name, seq_len, OLD_DEFAULT[setting]))
                same = baseline.get((name, seq_len, setting))
                for r in results:
                    if isinstance(r, str):
                        print(f"{name:<16} {seq_len:>7} {setting:<9} failed: {r}")
                        continue
                    print(
                        f"{name:<16} {seq_len:>7} {setting:<9} {r['threads']:>7} {r['tokens_per_s']:>9,.0f} "
                        f"{compare(r['tokens_per_s'], old_default, 'tokens_per_s', True)} "
                        f"{r['cpu_s_per_step']:>10.2f} {compare(r['cpu_s_per_step'], same, 'cpu_s_per_step', False)} "
                        f"{r['peak_rss_gib']:>8.2f} {compare(r['peak_rss_gib'], same or old_default, 'peak_rss_gib', False)} "
                        f"{r['loss']:>6.3f}"
                    )
                good = [r for r in results if isinstance(r, dict)]
                if len(results) > 1 and len(good) == len(results):
                    total = sum(r["tokens_per_s"] for r in good)
                    print(f"{name:<16} {seq_len:>7} {setting:<9} {'sum':>7} {total:>9,.0f}")
                sys.stdout.flush()


if __name__ == "__main__":
    main()
