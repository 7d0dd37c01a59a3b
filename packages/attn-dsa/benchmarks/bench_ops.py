"""DSA operations vs dense causal attention on CPU: time and peak memory per configuration.

For each length L and top-k: select_topk (indexer, no gradient) + sparse_attention forward and backward,
against torch's causal scaled_dot_product_attention of the same width (H heads x D, forward + backward). Every
configuration runs in a fresh subprocess so that its peak resident memory (ru_maxrss) is its own; "extra" is
the peak minus the resident memory once the inputs exist. Also prints the indexer's recall of the exact top-k
set (select_topk vs the dense select_topk_reference) at --recall-length.

    python packages/attn-dsa/benchmarks/bench_ops.py --lengths 8192 32768 --topk 2048 512
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import torch

CLOCKS = {"cpu": time.process_time, "wall": time.perf_counter}


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def run_dsa(args: argparse.Namespace, length: int | None = None) -> dict:
    from megaseq_dsa.ops import select_topk, sparse_attention

    if length is None:  # warm up at a small size so that lazy library buffers do not count as "extra"
        run_dsa(args, min(args.length, 2 * args.topk))
    gen = torch.Generator().manual_seed(0)
    length = length or args.length
    heads, dim = args.heads, args.dim
    clock = CLOCKS[args.clock]
    q_idx = torch.randn(1, length, args.index_heads, args.index_dim, generator=gen)
    k_idx = torch.randn(1, length, args.index_dim, generator=gen)
    weights = torch.randn(1, length, args.index_heads, generator=gen)
    q = torch.randn(1, length, heads, dim, generator=gen, requires_grad=True)
    k = torch.randn(1, length, dim, generator=gen, requires_grad=True)
    v = torch.randn(1, length, dim, generator=gen, requires_grad=True)
    grad_out = torch.randn(1, length, heads, dim, generator=gen)
    base = peak_rss_mib()
    start = clock()
    indices = select_topk(q_idx, k_idx, weights, args.topk, pool=args.pool)
    selected = clock()
    out = sparse_attention(q, k, v, indices, dim**-0.5)
    forward = clock()
    out.backward(grad_out)
    backward = clock()
    return {
        "select_s": selected - start,
        "attn_fwd_s": forward - selected,
        "attn_bwd_s": backward - forward,
        "total_s": backward - start,
        "peak_mib": peak_rss_mib(),
        "extra_mib": peak_rss_mib() - base,
    }


def run_sdpa(args: argparse.Namespace, length: int | None = None) -> dict:
    if length is None:  # warm up, as in run_dsa
        run_sdpa(args, min(args.length, 1024))
    clock = CLOCKS[args.clock]
    gen = torch.Generator().manual_seed(0)
    shape = (1, args.heads, length or args.length, args.dim)
    q, k, v = (torch.randn(shape, generator=gen, requires_grad=True) for _ in range(3))
    grad_out = torch.randn(shape, generator=gen)
    base = peak_rss_mib()
    start = clock()
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    out.backward(grad_out)
    return {
        "total_s": clock() - start,
        "peak_mib": peak_rss_mib(),
        "extra_mib": peak_rss_mib() - base,
    }


def run_recall(args: argparse.Namespace) -> dict:
    """Share of the exact top-k set (the dense reference, same tie rule: equal scores go to the earlier key)
    that select_topk finds."""
    from megaseq_dsa.ops import select_topk, select_topk_reference

    gen = torch.Generator().manual_seed(1)
    q_idx = torch.randn(1, args.length, args.index_heads, args.index_dim, generator=gen)
    k_idx = torch.randn(1, args.length, args.index_dim, generator=gen)
    weights = torch.randn(1, args.length, args.index_heads, generator=gen)
    fast = select_topk(q_idx, k_idx, weights, args.topk, pool=args.pool)[0].long()
    exact = select_topk_reference(q_idx, k_idx, weights, args.topk, pool=args.pool)[0].long()
    wanted = int((exact >= 0).sum())
    found = sum(
        len(set(got[got >= 0].tolist()) & set(want[want >= 0].tolist()))
        for got, want in zip(fast, exact, strict=True)
    )
    return {"recall": found / wanted}


WORKERS = {"dsa": run_dsa, "sdpa": run_sdpa, "recall": run_recall}


def in_subprocess(args: argparse.Namespace, worker: str, **overrides: int) -> dict:
    flags = {**vars(args), **overrides}
    command = [sys.executable, __file__, "--worker", worker]
    for name in ("length", "topk", "heads", "dim", "index_heads", "index_dim", "pool", "threads", "clock"):
        command += [f"--{name.replace('_', '-')}", str(flags[name])]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192, 32768, 131072])
    parser.add_argument("--topks", "--topk", type=int, nargs="+", default=[2048, 512], dest="topks")
    parser.add_argument("--heads", type=int, default=4, help="attention heads (MQA: one shared K/V)")
    parser.add_argument("--dim", type=int, default=64, help="attention width (single latent, K = V)")
    parser.add_argument("--index-heads", type=int, default=4)
    parser.add_argument("--index-dim", type=int, default=64)
    parser.add_argument("--pool", type=int, default=1, help="indexer key pooling (GLM-5.3-Flash: 4)")
    parser.add_argument("--recall-length", type=int, default=8192, help="0 skips the recall check")
    # One thread by default: on a shared 2-core machine a second OpenMP thread waits at every barrier.
    parser.add_argument("--threads", type=int, default=1)
    # Process CPU time by default: with one thread it is the work done, unlike wall time on a busy machine.
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="cpu")
    parser.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    parser.add_argument("--length", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        torch.set_num_threads(args.threads)
        args.topk = args.topks[0]
        print(json.dumps(WORKERS[args.worker](args)))
        return

    args.topk = args.topks[0]
    print(
        f"H={args.heads} D={args.dim} indexer {args.index_heads}x{args.index_dim} pool={args.pool} "
        f"threads={args.threads}; {args.clock} times in s (forward+backward), "
        "memory in MiB (peak RSS / extra over inputs)"
    )
    header = (
        f"{'L':>7} {'k':>5} | {'select':>7} {'attn f':>7} {'attn b':>7} {'total':>7} {'peak':>7} "
        f"{'extra':>7} {'L*k*4':>7} | {'sdpa':>7} {'peak':>7} {'extra':>7} | {'sdpa/dsa':>8}"
    )
    print(header)
    print("-" * len(header))
    for length in args.lengths:
        sdpa = in_subprocess(args, "sdpa", length=length)
        for topk in args.topks:
            dsa = in_subprocess(args, "dsa", length=length, topk=topk)
            print(
                f"{length:>7} {topk:>5} | {dsa['select_s']:>7.2f} {dsa['attn_fwd_s']:>7.2f} "
                f"{dsa['attn_bwd_s']:>7.2f} "
                f"{dsa['total_s']:>7.2f} {dsa['peak_mib']:>7.0f} {dsa['extra_mib']:>7.0f} "
                f"{length * topk * 4 / 2**20:>7.0f} | {sdpa['total_s']:>7.2f} {sdpa['peak_mib']:>7.0f} "
                f"{sdpa['extra_mib']:>7.0f} | {sdpa['total_s'] / dsa['total_s']:>8.2f}",
                flush=True,
            )
    if args.recall_length:
        for topk in args.topks:
            recall = in_subprocess(args, "recall", length=args.recall_length, topk=topk)
            print(
                f"indexer recall of the exact top-{topk} set at L={args.recall_length}: "
                + ", ".join(f"{name} {value:.6f}" for name, value in recall.items())
            )


if __name__ == "__main__":
    main()
