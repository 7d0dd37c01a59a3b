"""Training throughput and peak memory per worker under process layouts: 1 worker vs 2 (DP, CP, TP).

Every configuration trains the same global batch (``--batch`` windows per step) from the same recipe, in
fresh processes joined by gloo (``megaseq_testkit.distributed.run_gloo``; one process for one worker), so
each worker's peak RSS (``VmHWM``) is its own. The ``--threads`` intra-op threads (default: every core) are
shared out: one worker gets all, two get half each. On a busy machine use ``--threads 1`` (several threads
per process spin-wait when the cores are taken). One warm-up step is excluded from the timing. Prints tables; writes nothing else.

    .venv/bin/python benchmarks/distributed_throughput.py                      # default recipe, 16k and 64k
    .venv/bin/python benchmarks/distributed_throughput.py --longest --budget-gib 10
    .venv/bin/python benchmarks/distributed_throughput.py --ray-overhead
    .venv/bin/python benchmarks/distributed_throughput.py --seq-len 2048 --steps 1 --threads 1   # a quick check
    .venv/bin/python benchmarks/distributed_throughput.py --recipe recipes/genome-sdpa-cpu.toml \
        --layouts "1 worker" "2 workers, tp=2"                      # tp needs a recipe whose components split

``--longest``: the longest sequence (doubling from ``--seq-len``) whose one training step keeps every
worker's peak RSS under ``--budget-gib``, for CP=1 (one worker) and CP=2 (two workers), batch 1.
``--ray-overhead``: wall time of a Ray Train run whose workers only join their process group, against
the same workers started by ``run_gloo``: the fixed cost Ray adds to a launch.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

LAYOUTS = {"1 worker": (1, 1, 1), "2 workers, dp=2": (2, 1, 1), "2 workers, cp=2": (1, 2, 1), "2 workers, tp=2": (1, 1, 2)}


def peak_rss_gib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 2**20
    raise RuntimeError("no VmHWM in /proc/self/status")


def _train(rank: int, world: int, recipe: str, overrides: list[str], dp: int, cp: int, tp: int, steps: int,
           threads: int) -> dict:
    import torch

    from megaseq.config import ParallelConfig, load_recipe
    from megaseq.distributed.groups import Parallel, destroy_process_groups, init_process_groups
    from megaseq.distributed.layout import Layout
    from megaseq.plugins import get_plugins
    from megaseq.train.trainer import Trainer

    torch.set_num_threads(threads)
    plugins = get_plugins()
    with tempfile.TemporaryDirectory() as out:
        loaded = load_recipe(recipe, plugins, [*overrides, f"run.out_dir='{out}'", f"train.steps={steps + 1}"])
        loaded = loaded.model_copy(update={"parallel": ParallelConfig(dp=dp, cp=cp, tp=tp)})
        parallel = init_process_groups(Layout(dp=dp, cp=cp, tp=tp)) if world > 1 else Parallel()
        try:
            trainer = Trainer(loaded, plugins, parallel=parallel, progress=False, tensorboard=False)
            trainer.train_step()  # warm-up: first-call allocations
            rates = [trainer.train_step()["tokens_per_s"] for _ in range(steps)]
        finally:
            if world > 1:
                destroy_process_groups()
    return {"tokens_per_s": statistics.median(rates) if rates else 0.0, "peak_rss_gib": peak_rss_gib()}


def run_layout(recipe: str, overrides: list[str], dp: int, cp: int, steps: int, threads: int, tp: int = 1) -> list[dict]:
    """One process per worker (one process for one worker too, so that its peak RSS is its own); the
    ``threads`` intra-op threads are shared out among the workers."""
    from megaseq_testkit.distributed import run_gloo

    world = dp * cp * tp
    return run_gloo(world, _train, recipe, overrides, dp, cp, tp, steps, max(1, threads // world), timeout=3600)


def throughput(args: argparse.Namespace) -> None:
    print(f"recipe: {args.recipe} {' '.join(args.set)}; global batch {args.batch} windows; "
          f"{args.steps} timed steps after 1 warm-up; median tokens/s")
    print(f"{'seq_len':>8}  {'layout':<16} {'tokens/s':>9} {'peak RSS GiB per worker':>24}")
    for seq_len in args.seq_len:
        sets = [*args.set, f"data.seq_len={seq_len}", f"train.batch_size={args.batch}", "train.grad_accum=1"]
        for name in args.layouts:
            dp, cp, tp = LAYOUTS[name]
            ranks = run_layout(args.recipe, sets, dp, cp, args.steps, args.threads, tp)
            rss = " / ".join(f"{r['peak_rss_gib']:.2f}" for r in ranks)
            print(f"{seq_len:>8}  {name:<16} {ranks[0]['tokens_per_s']:>9.0f} {rss:>24}", flush=True)


def longest(args: argparse.Namespace) -> None:
    print(f"recipe: {args.recipe} {' '.join(args.set)}; batch 1; one step; budget {args.budget_gib} GiB per worker")
    print(f"{'layout':<16} {'longest seq_len':>16} {'peak RSS GiB':>13}   tried")
    for name, (dp, cp) in (("cp=1, 1 worker", (1, 1)), ("cp=2, 2 workers", (1, 2))):
        seq_len, best, tried = args.seq_len[0], None, []
        while seq_len <= args.max_seq_len:
            sets = [*args.set, f"data.seq_len={seq_len}", "train.batch_size=1", "train.grad_accum=1"]
            try:
                peak = max(r["peak_rss_gib"] for r in run_layout(args.recipe, sets, dp, cp, 0, args.threads))
            except RuntimeError as exc:  # a worker killed by the kernel's OOM killer, or an allocation failure
                tried.append(f"{seq_len}: failed ({str(exc).splitlines()[0][:60]})")
                break
            tried.append(f"{seq_len}: {peak:.2f}")
            if peak > args.budget_gib:
                break
            best = (seq_len, peak)
            seq_len *= 2
        found = f"{best[0]:>16} {best[1]:>13.2f}" if best else f"{'none':>16} {'':>13}"
        print(f"{name:<16} {found}   {'; '.join(tried)}", flush=True)


def _join_group() -> None:
    import torch
    import torch.distributed as dist

    from megaseq.parallel import collectives

    collectives.all_reduce(torch.ones(1), dist.group.WORLD)


def _gloo_join(rank: int, world: int) -> None:
    _join_group()


def ray_overhead(args: argparse.Namespace) -> None:
    import ray
    import ray.train
    from ray.train.torch import TorchConfig, TorchTrainer

    from megaseq_testkit.distributed import run_gloo

    start = time.perf_counter()
    run_gloo(2, _gloo_join)
    gloo = time.perf_counter() - start
    with tempfile.TemporaryDirectory() as storage:
        start = time.perf_counter()
        ray.init(num_cpus=max(2, os.cpu_count() or 1), include_dashboard=False, logging_level="ERROR")
        started = time.perf_counter()
        TorchTrainer(
            lambda: _join_group(),
            torch_config=TorchConfig(backend="gloo"),
            scaling_config=ray.train.ScalingConfig(num_workers=2),
            run_config=ray.train.RunConfig(name="overhead", storage_path=storage),
        ).fit()
        fitted = time.perf_counter()
        ray.shutdown()
        done = time.perf_counter()
    print("2 workers joining a gloo group and all-reducing once (wall seconds)")
    print(f"{'launcher':<34} {'seconds':>8}")
    print(f"{'run_gloo (spawn)':<34} {gloo:>8.1f}")
    print(f"{'Ray: ray.init':<34} {started - start:>8.1f}")
    print(f"{'Ray: TorchTrainer.fit':<34} {fitted - started:>8.1f}")
    print(f"{'Ray: shutdown':<34} {done - fitted:>8.1f}")
    print(f"{'Ray total':<34} {done - start:>8.1f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", default=str(REPO / "recipes" / "genome-cpu.toml"))
    p.add_argument("--seq-len", type=int, nargs="+", default=[16384, 65536])
    p.add_argument("--batch", type=int, default=2, help="global batch (windows per step), the same for every layout")
    p.add_argument("--steps", type=int, default=2, help="timed steps per configuration")
    p.add_argument("--set", action="append", default=[], help="recipe override, as for megaseq train")
    p.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=list(LAYOUTS)[:3],
                   help="which layouts to measure (default: 1 worker, dp=2, cp=2)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                   help="intra-op threads of all workers together (default: every core; 1 on a busy machine)")
    p.add_argument("--longest", action="store_true", help="longest sequence within --budget-gib, CP=2 vs CP=1")
    p.add_argument("--budget-gib", type=float, default=10.0)
    p.add_argument("--max-seq-len", type=int, default=1 << 20)
    p.add_argument("--ray-overhead", action="store_true", help="Ray Train start-up cost against plain processes")
    args = p.parse_args()
    if args.ray_overhead:
        ray_overhead(args)
    elif args.longest:
        longest(args)
    else:
        throughput(args)


if __name__ == "__main__":
    main()
