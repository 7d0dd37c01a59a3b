"""What context parallelism costs the KDA recurrence on CPU: one rank holding two zig-zag segments (the
all-gathers run on a one-rank gloo group, so this measures compute, not communication) against one
``chunk_kda`` pass over the same tokens, forward+backward in fp32, process CPU time, best of ``--repeat``.

    OMP_NUM_THREADS=1 python packages/attn-kda/benchmarks/bench_cp.py --T 8192 --heads 2 --dim 64

The ratio is what matters (both are measured in the same process, interleaved); absolute times drift on a
shared machine.
"""

import argparse
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megaseq.contracts import ContextParallel
from megaseq_kda.ops import chunk_kda
from megaseq_kda.parallel import context_parallel_kda


def inputs(T: int, H: int, D: int, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q, k = (F.normalize(torch.randn(1, T, H, D, generator=gen), dim=-1) for _ in range(2))
    v, g, beta = torch.randn(1, T, H, D, generator=gen), -torch.rand(1, T, H, D, generator=gen), torch.rand(1, T, H, generator=gen)
    return [x.requires_grad_() for x in (q, k, v, g, beta)]


def cpu_seconds(fn, leaves: list[torch.Tensor]) -> float:
    start = time.process_time()
    o = fn(*leaves)
    o.backward(torch.ones_like(o))
    return time.process_time() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--T", type=int, default=8192)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--dim", type=int, default=64, help="K = V")
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        cp = ContextParallel(group=dist.group.WORLD, rank=0, world_size=1, seq_len=args.T)
        runs = {
            "one chunk_kda pass": lambda *x: chunk_kda(*x)[0],
            "context parallel (2 segments)": lambda *x: context_parallel_kda(chunk_kda, *x, cp, None),
        }
        best = {name: float("inf") for name in runs}
        for _ in range(args.repeat):  # interleaved, so drift hits both alike
            for name, fn in runs.items():
                best[name] = min(best[name], cpu_seconds(fn, inputs(args.T, args.heads, args.dim)))
    finally:
        dist.destroy_process_group()
    base = best["one chunk_kda pass"]
    print(f"T={args.T} H={args.heads} K=V={args.dim}, fp32 forward+backward, CPU s (best of {args.repeat}), "
          f"{torch.get_num_threads()} thread(s)")
    print(f"{'':<32}{'CPU s':>8}{'x one pass':>12}")
    for name, t in best.items():
        print(f"{name:<32}{t:>8.3f}{t / base:>12.2f}")


if __name__ == "__main__":
    main()
