"""``megaseq rl`` and ``megaseq logprob-gap``: commands this plugin adds to the ``megaseq`` command line
(hook ``megaseq_command``). Mistakes raise ``megaseq.errors.UserError``; core prints one line, exit 2."""

from __future__ import annotations

import argparse
import json
import sys

from megaseq.commands import add_run_arguments
from megaseq.errors import UserError


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line through core's handler instead of usage + message
        raise UserError(f"{self.prog}: {message} (see {self.prog} --help)")


def rl_main(argv: list[str]) -> int:
    p = _Parser(
        prog="megaseq rl",
        description="RL fine-tuning of a megaseq checkpoint, as an RL recipe describes. Each optimizer step is "
        "megaseq train's (train.grad_clip clips before every one); the algorithm's ratio clip (eps_low, eps_high, "
        "dual_clip) acts only when update.updates_per_step > 1. parallel.dp > 1: one process per rank under "
        "torchrun --nproc-per-node N --no-python megaseq rl RECIPE.",
    )
    p.add_argument("recipe", help="an RL recipe, e.g. packages/rl/recipes/genome-rl-cpu.toml")
    add_run_arguments(p)
    args = p.parse_args(argv)

    from megaseq.plugins import get_plugins
    from megaseq_rl.recipe import load_rl_recipe

    plugins = get_plugins()
    out = [f"run.out_dir={json.dumps(args.out)}"] if args.out else []  # TOML reads a JSON string as a string
    recipe = load_rl_recipe(args.recipe, plugins, [*args.set, *out])
    mode = "resume" if args.resume else "overwrite" if args.overwrite else "new"
    result = _run(recipe, plugins, mode, progress=not args.no_progress)
    if result is None:  # a rank other than 0 of a data-parallel run
        return 0
    first, last = result.history[0], result.history[-1]
    rewards = [h["reward/mean"] for h in result.history if "reward/mean" in h]
    k = max(1, len(rewards) // 4)
    print(f"mean rollout reward: first {k} steps {sum(rewards[:k]) / k:.4f}, last {k} steps {sum(rewards[-k:]) / k:.4f}")
    print(f"held-out reward {first['eval/heldout_reward']:.4f} -> {last['eval/heldout_reward']:.4f}; "
          f"held-out loss {first['eval/heldout_bits_per_base']:.4f} -> {last['eval/heldout_bits_per_base']:.4f} bits/base")
    print(f"wrote {result.out_dir}/rl_curve.png, rl_history.json, metrics.jsonl; checkpoints in {result.out_dir}/checkpoints")
    return 0


def _run(recipe, plugins, mode: str, progress: bool):
    """The RL run in this process, or this torchrun worker's rank of a data-parallel one (None off rank 0)."""
    from megaseq.distributed.launch import in_torchrun
    from megaseq_rl.loop import RLRun

    dp = recipe.parallel.dp
    if dp == 1:
        return RLRun(recipe, plugins, progress=progress).run(mode)
    if not in_torchrun():
        raise UserError(
            f"{recipe.source}: parallel.dp = {dp}: start one process per rank with torchrun, e.g. "
            f"torchrun --nproc-per-node {dp} --no-python megaseq rl {recipe.source}"
        )
    import torch.distributed as dist

    from megaseq.devices import join_torchrun
    from megaseq.distributed.groups import destroy_process_groups, init_process_groups
    from megaseq.distributed.layout import Layout

    join_torchrun()
    try:
        parallel = init_process_groups(Layout(dp=dp))
        try:
            result = RLRun(recipe, plugins, parallel=parallel, progress=progress).run(mode)
        finally:
            destroy_process_groups()
    finally:
        dist.destroy_process_group()
    return result if parallel.is_main else None


def _lengths(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise UserError(f"megaseq logprob-gap: --lengths: expected comma-separated positive integers, got {text!r}")
    return values


def logprob_gap_main(argv: list[str]) -> int:
    p = _Parser(
        prog="megaseq logprob-gap",
        description="An engine generates greedily after a held-out DNA prompt of each length; the training forward "
        "re-scores the same tokens; mean and max |delta logprob| per length.",
    )
    p.add_argument("checkpoint", help="a checkpoint directory, or a run directory (its newest checkpoint)")
    p.add_argument("--lengths", default="1024,16384,131072", help="prompt lengths, comma-separated")
    p.add_argument("--engine", default="cached", help="inference engine name (megaseq plugins lists them)")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--new-tokens", type=int, default=32, help="greedy tokens generated after each prompt")
    p.add_argument("--prompts", type=int, default=1, help="held-out prompts per length (evenly spaced windows)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--no-routing-replay", action="store_true", help="report the gap without R3 (MoE models)")
    p.add_argument("--data", help="dataset or FASTA of the prompts; default: the checkpoint's data.heldout")
    p.add_argument("--json", action="store_true", help="print a JSON list, one object per length")
    args = p.parse_args(argv)
    lengths = _lengths(args.lengths)
    if args.new_tokens < 1 or args.prompts < 1:
        raise UserError(f"megaseq logprob-gap: --new-tokens and --prompts must be >= 1, got {args.new_tokens}, {args.prompts}")

    from megaseq.plugins import get_plugins
    from megaseq_rl.gap import format_rows, measure_gap

    rows = measure_gap(
        args.checkpoint, lengths, get_plugins(), engine=args.engine, dtype=args.dtype, new_tokens=args.new_tokens,
        device=args.device, routing_replay=not args.no_routing_replay, dataset=args.data, prompts=args.prompts,
    )
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print(format_rows(rows))
    sys.stdout.flush()
    return 0
