"""Forward+backward speed and peak memory of the KDA ops on CPU: oracle vs chunk_kda vs fla's naive_chunk_kda.

Each (implementation, config, T) runs in a fresh subprocess so that its peak resident memory
(``resource.getrusage(...).ru_maxrss``, Linux) belongs to that run alone; the reported peak is its growth
over the resident size just before the timed runs (inputs built, a small warm-up done). Timings on a shared
machine are noisy: compare the ratio columns (measured in the same invocation), not absolute numbers.
On an oversubscribed machine use ``--threads 1``: multi-threaded ops stall waiting for descheduled threads.

    python packages/attn-kda/benchmarks/bench_ops.py --T 4096 16384 --configs small --threads 1 --clock cpu
"""

import argparse
import json
import resource
import subprocess
import sys
import time
import warnings

import torch
import torch.nn.functional as F

CONFIGS = {"small": (4, 64, 64), "large": (16, 128, 128)}  # name -> (H, K, V)
IMPLS = ("oracle", "chunk", "fla")
WARMUP_T = 256
REPEAT_BUDGET_S = 20.0  # stop repeating once a run has used this much time: slow rows run once


def load_impl(name: str):
    if name == "oracle":
        from megaseq_kda.ops import naive_recurrent_kda

        return naive_recurrent_kda
    if name == "chunk":
        from megaseq_kda.ops import chunk_kda

        return chunk_kda
    warnings.filterwarnings("ignore")  # fla warns that Triton has no CPU backend; its naive path is torch
    from fla.ops.kda.naive import naive_chunk_kda

    return naive_chunk_kda


def make_inputs(T: int, H: int, K: int, V: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    q, k = (F.normalize(torch.randn(1, T, H, K, generator=gen), dim=-1) for _ in range(2))
    v = torch.randn(1, T, H, V, generator=gen)
    g = -5.0 * torch.rand(1, T, H, K, generator=gen)
    beta = torch.rand(1, T, H, generator=gen)
    return [x.requires_grad_() for x in (q, k, v, g, beta)]


def forward_backward_seconds(fn, inputs: list[torch.Tensor]) -> dict[str, float]:
    """Wall time, and this process's CPU time (steadier on a shared machine when single-threaded)."""
    wall, cpu = time.perf_counter(), time.process_time()
    o, _ = fn(*inputs)
    o.sum().backward()
    return {"wall": time.perf_counter() - wall, "cpu": time.process_time() - cpu}


def resident_kib() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize() / 1024


def worker(impl: str, config: str, T: int, repeats: int, threads: int) -> None:
    """Measure one row; print a JSON line with the best wall and CPU seconds of the repeats and peak MiB."""
    torch.set_num_threads(threads)
    fn = load_impl(impl)
    H, K, V = CONFIGS[config]
    forward_backward_seconds(fn, make_inputs(WARMUP_T, H, K, V))
    inputs = make_inputs(T, H, K, V)
    baseline_kib = resident_kib()
    times = []
    while len(times) < repeats and sum(t["wall"] for t in times) < REPEAT_BUDGET_S:
        times.append(forward_backward_seconds(fn, inputs))
        for x in inputs:
            x.grad = None
    peak_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - baseline_kib) / 1024
    best = {clock: min(t[clock] for t in times) for clock in ("wall", "cpu")}
    print(json.dumps(best | {"peak_mib": peak_mib}))


def measure(impl: str, config: str, T: int, args: argparse.Namespace) -> dict | None:
    command = [sys.executable, __file__, "--worker", impl, config, str(T)]
    command += ["--repeats", str(args.repeats), "--threads", str(args.threads)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout, check=True)
    except subprocess.TimeoutExpired:
        return None
    return json.loads(done.stdout.strip().splitlines()[-1])


def fla_available() -> bool:
    try:
        load_impl("fla")
    except ImportError:
        return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--T", type=int, nargs="+", default=[4096, 16384, 65536, 262144])
    parser.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS))
    parser.add_argument("--oracle-max-T", type=int, default=16384, help="skip the oracle beyond this length")
    parser.add_argument("--fla-max-T", type=int, default=16384, help="skip fla's naive_chunk_kda beyond this")
    parser.add_argument("--repeats", type=int, default=3, help="best of this many runs (slow runs run once)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch threads per run")
    parser.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="cpu: process CPU time (use with --threads 1)",
    )
    parser.add_argument(
        "--timeout", type=float, default=1800, help="seconds per row before giving up ('t/o')"
    )
    parser.add_argument("--worker", nargs=3, metavar=("IMPL", "CONFIG", "T"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        impl, config, T = args.worker
        worker(impl, config, int(T), args.repeats, args.threads)
        return

    max_T = {
        "oracle": args.oracle_max_T,
        "chunk": max(args.T),
        "fla": args.fla_max_T if fla_available() else 0,
    }
    print(
        f"KDA forward+backward, B=1, fp32, torch {torch.__version__}, {args.threads} thread(s), "
        f"{args.clock} clock"
    )
    header = ["config", "T"] + [f"{i} tok/s" for i in IMPLS] + [f"{i} MiB" for i in IMPLS]
    header += ["chunk/oracle", "chunk/fla"]
    print(" | ".join(header))
    for config in args.configs:
        for T in args.T:
            rows = {}
            for impl in IMPLS:
                if T <= max_T[impl] and (impl != "fla" or T % 64 == 0):  # fla's naive needs whole chunks
                    rows[impl] = measure(impl, config, T, args) or "t/o"
            print(" | ".join(_format_row(config, T, rows, args.clock)), flush=True)


def _format_row(config: str, T: int, rows: dict, clock: str) -> list[str]:
    def stat(impl: str, key: str) -> str:
        row = rows.get(impl, "-")
        if isinstance(row, str):
            return row
        return f"{T / row[clock]:,.0f}" if key == "tok/s" else f"{row['peak_mib']:,.0f}"

    def speedup(other: str) -> str:
        if not all(isinstance(rows.get(i), dict) for i in ("chunk", other)):
            return "-"
        return f"{rows[other][clock] / rows['chunk'][clock]:.1f}x"

    cells = [config, str(T)] + [stat(i, "tok/s") for i in IMPLS] + [stat(i, "MiB") for i in IMPLS]
    return [*cells, speedup("oracle"), speedup("fla")]


if __name__ == "__main__":
    main()
