"""The bf16 residual stream against the fp32 one: the default recipe trained under ``train.bf16`` both ways.

Both runs start from the same weights and read the same windows (same seed); each runs in its own process.
Printed: the gradient at the initial weights on the first batch (the bf16 stream's relative difference from
the fp32 stream's, both under bf16 autocast), each run's loss at every ``--every`` steps, the final losses and
the largest per-step loss difference, and each run's CPU seconds.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bf16_residual.py                       # 50 steps at 8k
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bf16_residual.py --seq-len 2048 --steps 50     # smaller
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def overrides(seq_len: int, steps: int, residual: str, out: str) -> list[str]:
    return [f"data.seq_len={seq_len}", f"train.steps={steps}", "train.bf16=true", f"model.residual_dtype='{residual}'",
            "train.checkpoint_every=0", "run.device='cpu'", f"run.out_dir='{out}'"]


def child(recipe_path: str, seq_len: int, steps: int, residual: str) -> dict:
    import torch

    from megaseq.config import load_recipe
    from megaseq.eval.evaluate import batch_to
    from megaseq.plugins import get_plugins
    from megaseq.train.trainer import Trainer, lm_loss

    plugins = get_plugins()
    with tempfile.TemporaryDirectory() as out:
        trainer = Trainer(load_recipe(recipe_path, plugins, overrides(seq_len, steps, residual, out)), plugins,
                          progress=False, tensorboard=False)
        # the gradient at the initial weights on the first batch, without moving the sampler
        batch = batch_to(trainer.train_windows.batch(list(range(trainer.recipe.train.batch_size))), trainer.device)
        ctx = trainer.parallel.forward_context(seq_len)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss, _ = lm_loss(trainer.model, batch, ctx, trainer.recipe.train.loss_chunk)
        (loss + sum(ctx.losses.values())).backward()
        grad = torch.cat([p.grad.flatten() for p in trainer.model.parameters() if p.grad is not None])
        trainer.optimizer.zero_grad(set_to_none=True)
        cpu = time.process_time()
        losses = [trainer.train_step()["loss"] for _ in range(steps)]
        cpu = time.process_time() - cpu
    return {"losses": losses, "grad": grad.tolist(), "cpu_s": cpu}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", default=str(REPO / "recipes" / "genome-cpu.toml"))
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--every", type=int, default=10, help="print the losses every this many steps")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(*json.loads(args.child))))
        return
    runs = {}
    for residual in ("fp32", "bf16"):
        spec = json.dumps([args.recipe, args.seq_len, args.steps, residual])
        done = subprocess.run([sys.executable, __file__, "--child", spec], capture_output=True, text=True, check=True)
        runs[residual] = json.loads(done.stdout.strip().splitlines()[-1])

    import torch

    g32, g16 = (torch.tensor(runs[r]["grad"], dtype=torch.float64) for r in ("fp32", "bf16"))
    l32, l16 = runs["fp32"]["losses"], runs["bf16"]["losses"]
    print(f"recipe {args.recipe}, seq_len {args.seq_len}, {args.steps} steps under train.bf16")
    print(f"initial gradient: |g_bf16 - g_fp32| / |g_fp32| = {float((g16 - g32).norm() / g32.norm()):.4f}, "
          f"cosine {float(g16 @ g32 / (g16.norm() * g32.norm())):.5f}")
    print(f"{'step':>5} {'loss fp32':>10} {'loss bf16':>10} {'diff':>8}")
    for i in range(args.every - 1, args.steps, args.every):
        print(f"{i + 1:>5} {l32[i]:>10.4f} {l16[i]:>10.4f} {l16[i] - l32[i]:>+8.4f}")
    worst = max(range(args.steps), key=lambda i: abs(l16[i] - l32[i]))
    print(f"final loss fp32 {l32[-1]:.4f}, bf16 {l16[-1]:.4f}; largest per-step difference "
          f"{l16[worst] - l32[worst]:+.4f} nats at step {worst + 1}")
    print(f"CPU seconds: fp32 {runs['fp32']['cpu_s']:.0f}, bf16 {runs['bf16']['cpu_s']:.0f}")


if __name__ == "__main__":
    main()
