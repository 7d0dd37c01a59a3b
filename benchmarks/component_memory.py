"""What each component of a recipe really keeps and needs on this CPU, beside what its memory formula says.

For every distinct attention and feed-forward component of the recipe, in a fresh process whose allocator
returns every large block on free (MALLOC_MMAP_THRESHOLD_=65536, so resident memory follows live memory):
one forward and backward of one layer on a ``[1, T, d_model]`` input. ``saved`` is resident memory after
the forward minus before (the output, which did not exist before, stands in for the input, which the
formulas count and which existed before: they have the same size); ``temp`` is the most resident
memory rose above that during the forward or the backward (less the gradients it returns). Beside them,
the component's ``MemoryEstimate`` at the same length. This is how the formulas the planner reads are
checked; ``tests/test_plan_accuracy.py`` holds them to the measured values.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/component_memory.py recipes/genome-cpu.toml --seq-len 16384
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def status(key: str) -> int:
    return int(re.search(rf"{key}:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1)) * 1024


def reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current resident size


def measure_one(recipe_path: str, kind: str, name: str, seq_len: int) -> dict:
    import torch

    from megaseq.config import load_recipe
    from megaseq.contracts import ForwardContext
    from megaseq.plugins import get_plugins
    from megaseq.records import ModelDims

    plugins = get_plugins()
    recipe = load_recipe(recipe_path, plugins)
    m = recipe.model
    dims = ModelDims(d_model=m.d_model, n_layers=m.n_layers, vocab_size=m.vocab_size)
    provided = plugins.get(kind, name)
    config = recipe.component(kind, name)
    torch.manual_seed(0)
    module = provided.load()(config, dims, 1)
    estimate = provided.spec.load_memory()(config, dims, seq_len)
    x = torch.randn(1, seq_len, m.d_model, requires_grad=True)
    grad_out = torch.randn(1, seq_len, m.d_model)
    for _ in range(2):  # the second pass is measured: the first warms caches and allocators
        module.zero_grad(set_to_none=True)
        x.grad = None
        before = status("VmRSS")
        reset_peak()
        out = module(x, ForwardContext())
        after = status("VmRSS")
        forward_peak = status("VmHWM")
        reset_peak()
        (out * grad_out).sum().backward()
        backward_peak = status("VmHWM")
        del out
    out_bytes = x.numel() * 4
    grads = out_bytes + sum(p.numel() * 4 for p in module.parameters())
    saved = after - before  # + the input - the output: the same size
    temp = max(forward_peak - after, backward_peak - after - grads)
    return {
        "component": f"{kind} {name}",
        "saved_per_token": saved / seq_len,
        "estimate_saved_per_token": estimate.saved_per_token,
        "temporary": temp,
        "estimate_temporary": estimate.temporary,
    }


def components(recipe_path: str) -> list[tuple[str, str]]:
    from megaseq.config import load_recipe
    from megaseq.plugins import get_plugins

    recipe = load_recipe(recipe_path, get_plugins())
    out: list[tuple[str, str]] = []
    for layer in range(recipe.model.n_layers):
        for key in (("attention", recipe.model.attention_of(layer)), recipe.model.ffn_of(layer)):
            if key not in out:
                out.append(key)
    return out


def measure(recipe_path: str, kind: str, name: str, seq_len: int) -> dict:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}
    cmd = [sys.executable, __file__, "--child", json.dumps([recipe_path, kind, name, seq_len])]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("recipe", nargs="?", default=str(REPO / "recipes" / "genome-cpu.toml"))
    p.add_argument("--seq-len", type=int, default=16384)
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(measure_one(*json.loads(args.child))))
        return
    print(f"{args.recipe} at {args.seq_len} tokens (bytes per token; temporaries in MiB)")
    print(f"{'component':<22} {'saved':>9} {'formula':>9} {'error':>7} {'temp':>8} {'formula':>8}")
    for kind, name in components(args.recipe):
        r = measure(args.recipe, kind, name, args.seq_len)
        err = r["estimate_saved_per_token"] / r["saved_per_token"] - 1
        print(f"{r['component']:<22} {r['saved_per_token']:>9.0f} {r['estimate_saved_per_token']:>9.0f} {err:>+7.0%} "
              f"{r['temporary'] / 2**20:>8.0f} {r['estimate_temporary'] / 2**20:>8.0f}", flush=True)


if __name__ == "__main__":
    main()
