"""Where a training step's time goes: forward and backward of every component of a recipe, timed alone.

One real training window is run through the model once to capture every component's input; then each
component (embedding, each block's norms, attention and FFN/MoE, the final norm, the chunked LM-head loss)
is run again on its captured input, forward with autograd on, then backward from a fixed random output
gradient (auxiliary losses included). The optimizer step and a whole train step are timed too, so the sum
of the parts can be checked against the whole. Times are CPU seconds of this process (``process_time``):
with one intra-op thread they depend little on what else the machine runs. Best of ``--repeat`` runs.

Memory: "saved" is what autograd keeps from the component's forward until its backward, per token (distinct
storages reached through saved-tensor hooks, its input included when it is saved, parameters not), beside
the component's own ``MemoryEstimate.saved_per_token`` where its record provides one.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/profile_step.py --seq-len 8192
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/profile_step.py --seq-len 65536 --repeat 1
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def cpu_seconds(fn: Callable[[], object], repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.process_time()
        fn()
        best = min(best, time.process_time() - start)
    return best


def saved_bytes(run: Callable[[], object], exclude: set[int]) -> int:
    """Bytes of the distinct storages autograd saves while ``run`` executes, but those in ``exclude``."""
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in exclude:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return sum(storages.values())


def main() -> None:
    from megaseq.config import load_recipe
    from megaseq.contracts import ForwardContext
    from megaseq.eval.evaluate import batch_to
    from megaseq.model import chunked_token_losses
    from megaseq.plugins import get_plugins
    from megaseq.train.trainer import Trainer

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", default=str(REPO / "recipes" / "genome-cpu.toml"))
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--set", action="append", default=[], help="recipe override, as for megaseq train")
    args = p.parse_args()

    plugins = get_plugins()
    with tempfile.TemporaryDirectory() as out:
        sets = [f"data.seq_len={args.seq_len}", "train.batch_size=1", "train.grad_accum=1", f"run.out_dir='{out}'",
                *args.set]
        trainer = Trainer(load_recipe(args.recipe, plugins, sets), plugins, progress=False, tensorboard=False)
        recipe, model = trainer.recipe, trainer.model
        bf16 = recipe.train.bf16
        autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16)
        batch = batch_to(trainer.train_windows.batch([0]), trainer.device)

        # (label, module, record kind and name for its memory estimate, called with the context?)
        parts: list[tuple[str, torch.nn.Module, tuple[str, str] | None, bool]] = [
            ("embed", model.embed, None, False)
        ]
        for i, block in enumerate(model.blocks):
            ffn_kind, ffn_name = recipe.model.ffn_of(i)
            parts += [
                (f"{i}.attn_norm", block.attn_norm, None, False),
                (f"{i}.{recipe.model.attention_of(i)}", block.attention, ("attention", recipe.model.attention_of(i)), True),
                (f"{i}.ffn_norm", block.ffn_norm, None, False),
                (f"{i}.{ffn_name}", block.ffn, (ffn_kind, ffn_name), True),
            ]
        parts.append(("final_norm", model.final_norm, None, False))
        # Capture every component's input from one forward.
        inputs: dict[str, torch.Tensor] = {}
        hooks = [
            module.register_forward_hook(lambda m, a, o, label=label: inputs.__setitem__(label, a[0].detach()))
            for label, module, _, _ in parts
        ]
        with torch.no_grad(), autocast:
            hidden = model(batch.inputs, ForwardContext())
        for h in hooks:
            h.remove()

        def measure(run: Callable[[ForwardContext], torch.Tensor]) -> tuple[float, float, float]:
            """Forward CPU seconds, backward CPU seconds, bytes saved for backward per token."""

            def forward() -> tuple[torch.Tensor, ForwardContext]:
                ctx = ForwardContext()
                with autocast:
                    return run(ctx), ctx

            saved = saved_bytes(forward, parameters) / args.seq_len
            out, _ = forward()
            grad = torch.randn(out.shape).to(out.dtype)

            def forward_backward() -> None:
                out, ctx = forward()
                outputs = [out, *ctx.losses.values()]
                grads = [grad, *(torch.ones_like(v) for v in ctx.losses.values())]
                if any(o.requires_grad for o in outputs):
                    torch.autograd.backward(outputs, grads)

            fwd = cpu_seconds(forward, args.repeat)
            both = cpu_seconds(forward_backward, args.repeat)
            return fwd, max(both - fwd, 0.0), saved

        parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
        rows: list[tuple[str, float, float, float, float | None]] = []
        dims = model.dims
        for label, module, record, with_ctx in parts:
            x = inputs[label]
            if x.is_floating_point():
                x.requires_grad_(True)
            estimate = None
            if record is not None:
                estimator = plugins.get(*record).spec.load_memory()
                if estimator is not None:
                    config = recipe.component(*record)
                    estimate = estimator(config, dims, args.seq_len).saved_per_token
            if with_ctx:
                timings = measure(lambda ctx, m=module, x=x: m(x, ctx))
            else:
                timings = measure(lambda ctx, m=module, x=x: m(x))
            rows.append((label, *timings, estimate))
        h = hidden.detach().requires_grad_(True)
        head = model.head_weight
        loss_timings = measure(lambda ctx: chunked_token_losses(h, head, batch.targets, recipe.train.loss_chunk))
        rows.append(("loss (LM head)", *loss_timings, None))
        step_s = cpu_seconds(trainer.train_step, args.repeat)
        # The optimizer alone, on the gradients of one more backward.
        loss = sum(p.sum() for p in model.parameters() if p.requires_grad)
        loss.backward()
        optimizer_s = cpu_seconds(trainer.optimizer.step, args.repeat)

    total = sum(f + b for _, f, b, _, _ in rows) + optimizer_s
    print(f"recipe: {args.recipe} {' '.join(args.set)}; seq_len {args.seq_len}; bf16 autocast {bf16}; "
          f"{torch.get_num_threads()} intra-op thread(s); CPU seconds, best of {args.repeat}")
    print(f"{'component':<22} {'forward':>8} {'backward':>9} {'total':>7} {'share':>6} {'saved B/tok':>12} {'estimate':>9}")
    for label, f, b, saved, estimate in rows:
        est = f"{estimate:>9.0f}" if estimate is not None else f"{'-':>9}"
        print(f"{label:<22} {f:>8.3f} {b:>9.3f} {f + b:>7.3f} {100 * (f + b) / total:>5.1f}% {saved:>12.0f} {est}")
    print(f"{'optimizer step':<22} {'':>8} {'':>9} {optimizer_s:>7.3f} {100 * optimizer_s / total:>5.1f}%")
    print(f"{'sum of the parts':<22} {'':>8} {'':>9} {total:>7.3f}        {sum(r[3] for r in rows):>12.0f}")
    print(f"{'one train step':<22} {'':>8} {'':>9} {step_s:>7.3f}   ({args.seq_len / step_s:.0f} tokens per CPU second)")


if __name__ == "__main__":
    main()
