"""Peak memory and time of one chunked MoE layer's forward + backward, chunking on and off.

Each configuration runs in a fresh subprocess so that ``ru_maxrss`` (the process's resident high-water
mark) belongs to that configuration alone. Columns:

- ``peak``: the process's peak RSS.
- ``over inputs``: peak minus the RSS after building the layer and allocating its input and output gradient.
- ``working``: ``over inputs`` minus the layer's output and input gradient (``2 * tokens * d_model * 4``
  bytes), which scale with the sequence by definition; this is what chunking is meant to bound.

Routing: ``balanced`` is the router's own choice (random init, random inputs: close to even); ``skewed``
replays a routing that sends every token to experts 0 and 1.

    python packages/moe-chunked/benchmarks/bench_moe.py                  # the README table
    python packages/moe-chunked/benchmarks/bench_moe.py --tokens 16384   # one size
    python packages/moe-chunked/benchmarks/bench_moe.py --time-ratio --tokens 65536 --repeat 5
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

import torch

from megaseq.contracts import ForwardContext, RoutingReplay
from megaseq.records import ModelDims
from megaseq_moe.config import ChunkedMoEConfig
from megaseq_moe.layer import ChunkedMoE, build, memory_estimate

LAYER = {"n_experts": 16, "top_k": 2, "expert_hidden": 256, "n_shared_experts": 1}
D_MODEL = 256
CHUNK = 4096
# glibc otherwise raises its mmap threshold after the first large free and keeps later freed buffers in the
# heap, so ru_maxrss would depend on allocation history rather than on what is alive at once
CHILD_ENV = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}


def make_layer(chunk: int | None) -> ChunkedMoE:
    torch.manual_seed(0)
    config = ChunkedMoEConfig(**LAYER, chunk_tokens=chunk)
    return build(config, ModelDims(d_model=D_MODEL, n_layers=1, vocab_size=8), 0)


def step(module: ChunkedMoE, n: int, routing: str) -> tuple[float, float]:
    """Seconds of one forward and of its backward on ``n`` random tokens."""
    replay = None
    if routing == "skewed":
        replay = RoutingReplay("replay")
        replay.indices["layer0"] = torch.tensor([0, 1]).expand(n, -1).contiguous()
    x = torch.randn(1, n, D_MODEL, requires_grad=True)
    grad_out = torch.randn(1, n, D_MODEL)
    start = time.perf_counter()
    out = module(x, ForwardContext(routing=replay))
    middle = time.perf_counter()
    out.backward(grad_out)
    return middle - start, time.perf_counter() - middle


def measure(tokens: int, chunk: int | None, routing: str, repeat: int) -> dict[str, float]:
    """Peak memory and the fastest of ``repeat`` forward + backward passes (runs in a fresh subprocess)."""
    module = make_layer(chunk)
    step(module, 1024, routing)  # warm-up: first-call costs are not the layer's
    inputs = torch.randn(2, tokens, D_MODEL)  # stands for x and the output gradient
    baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    del inputs
    forward_s, backward_s = min(step(module, tokens, routing) for _ in range(repeat))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    io = 2 * tokens * D_MODEL * 4
    return {
        "peak": peak,
        "over_inputs": peak - baseline,
        "working": peak - baseline - io,
        "forward_s": forward_s,
        "backward_s": backward_s,
    }


def estimate(tokens: int, chunk: int | None) -> tuple[int, int]:
    """The layer's own ``memory_estimate``: (its temporary bytes, total bytes with inputs and outputs)."""
    est = memory_estimate(ChunkedMoEConfig(**LAYER, chunk_tokens=chunk), ModelDims(D_MODEL, 1, 8), tokens)
    return est.temporary, est.temporary + int(est.saved_per_token * tokens) + 4 * tokens * D_MODEL * 4


def time_ratio(tokens: int, repeat: int) -> None:
    """Chunking on vs off, timed alternately in one process so that load from other users hits both alike."""
    layers = {"on": make_layer(CHUNK), "off": make_layer(None)}
    for module in layers.values():
        step(module, 1024, "balanced")
    times: dict[str, list[float]] = {"on": [], "off": []}
    for _ in range(repeat):
        for name, module in layers.items():
            times[name].append(sum(step(module, tokens, "balanced")))
    ratios = sorted(on / off for on, off in zip(times["on"], times["off"], strict=True))
    print(f"{tokens} tokens, balanced, forward + backward, {repeat} alternating pairs")
    for name, ts in times.items():
        print(f"  chunking {name}: " + ", ".join(f"{t:.2f}" for t in ts) + " s")
    median = ratios[len(ratios) // 2]
    print(f"  time ratio on/off: median {median:.3f} (min {ratios[0]:.3f}, max {ratios[-1]:.3f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[16384, 65536, 262144])
    parser.add_argument("--max-gib", type=float, default=6.0, help="skip configurations estimated above this")
    parser.add_argument(
        "--repeat", type=int, default=1, help="timed passes per configuration (fastest counts)"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (see the README)")
    parser.add_argument("--time-ratio", action="store_true", help="only time chunking on vs off, alternating")
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.child:
        tokens, chunk, routing, repeat = args.child
        print(json.dumps(measure(int(tokens), int(chunk) or None, routing, int(repeat))))
        return
    if args.time_ratio:
        for tokens in args.tokens:
            time_ratio(tokens, args.repeat)
        return

    mib = 2**20
    print(
        f"MoE layer: d_model {D_MODEL}, {LAYER['n_experts']} experts top-{LAYER['top_k']}, expert hidden "
        f"{LAYER['expert_hidden']}, 1 shared expert, fp32, forward + backward, chunk {CHUNK} tokens, "
        f"{args.threads} thread(s)\n"
    )
    columns = ["tokens", "chunking", "routing", "peak MiB", "over inputs MiB", "working MiB", "estimate MiB"]
    columns += ["forward s", "backward s"]
    print("| " + " | ".join(columns) + " |")
    print("|---:|---|---|" + "---:|" * (len(columns) - 3))
    for tokens in args.tokens:
        for routing in ("balanced", "skewed"):
            for chunk in (CHUNK, None):
                label = f"| {tokens} | {'on' if chunk else 'off'} | {routing} |"
                temporary, need = estimate(tokens, chunk)
                if need > args.max_gib * 2**30:
                    print(f"{label} skipped: needs ~{need / 2**30:.1f} GiB > --max-gib |" + " |" * 5)
                    continue
                child = [str(tokens), str(chunk or 0), routing, str(args.repeat)]
                cmd = [sys.executable, __file__, "--threads", str(args.threads), "--child", *child]
                done = subprocess.run(cmd, check=True, capture_output=True, text=True, env=CHILD_ENV)
                r = json.loads(done.stdout)
                mem = [r["peak"], r["over_inputs"], r["working"], temporary]
                cells = [f"{m / mib:.0f}" for m in mem] + [f"{r['forward_s']:.2f}", f"{r['backward_s']:.2f}"]
                print(label, " | ".join(cells), "|", flush=True)


if __name__ == "__main__":
    main()
