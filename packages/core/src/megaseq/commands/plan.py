"""``megaseq plan``: the peak memory per device under each memory-policy set, and the cheapest that fits."""

from __future__ import annotations

import argparse
import json

from megaseq.commands import memory_policy_override, parse_policy_argument, run_parsed
from megaseq.errors import UserError


def parser() -> argparse.ArgumentParser:
    mp = argparse.ArgumentParser(prog="megaseq plan", description="Predict a recipe's peak memory per device under each memory-policy set and "
                        "propose the cheapest set that fits.")
    mp.add_argument("recipe", help="path to a TOML recipe")
    mp.add_argument("--seq-len", metavar="N", help="tokens per sequence, read as --set data.seq_len=N is (default: the recipe's)")
    mp.add_argument("--parallel", metavar="dp=..,cp=..,ep=..,tp=..,etp=..",
                    help="ranks per dimension, over the recipe's [parallel]")
    mp.add_argument("--device-mem", type=float, metavar="GiB", help="memory per device (default: this machine's RAM or GPU)")
    mp.add_argument("--host-mem", type=float, metavar="GiB", help="host memory per device for offloaded activations and the host optimizer state (default: unlimited)")
    mp.add_argument("--memory-policy", default="auto", metavar="auto|none|NAMES",
                    help="auto (default): every candidate set; none; or the names of the set to plan")
    mp.add_argument("--set", action="append", default=[], metavar="KEY.PATH=VALUE", help="override a recipe value")
    mp.add_argument("--json", action="store_true", help="one JSON object")
    mp.set_defaults(func=cmd_plan)
    return mp



def main(argv: list[str]) -> int:
    return run_parsed(parser(), argv)


def cmd_plan(args: argparse.Namespace) -> int:
    from megaseq.config import load_recipe
    from megaseq.devices import device_type
    from megaseq.distributed.layout import Layout
    from megaseq.memory.machine import Machine, gib
    from megaseq.memory.plan import plan, plan_stages
    from megaseq.memory.plan_report import plan_json, render_table
    from megaseq.plugins import get_plugins

    policies = parse_policy_argument(args.memory_policy)
    plugins = get_plugins()
    overrides = list(args.set)
    if isinstance(policies, list):
        overrides += memory_policy_override(args.memory_policy)
    recipe = load_recipe(args.recipe, plugins, overrides)
    # the recipe's [parallel] layout, with --parallel's dimensions on top
    layout = Layout.parse(args.parallel, base=Layout.of(recipe))
    machine = Machine.detect(device_type(recipe.run.device), args.device_mem, args.host_mem)
    seq_len = None if args.seq_len is None else seq_len_argument(args.seq_len)
    result = plan(recipe, plugins, seq_len=seq_len, layout=layout, machine=machine, policies=policies)
    stages = []
    if recipe.data.schedule and seq_len is None:
        # the window-length schedule under the set chosen, else the set given, else none (each line names its set)
        given = policies if isinstance(policies, list) else []
        names = [p.name for p in result.chosen.policies] if result.chosen is not None else given
        stages = plan_stages(recipe, plugins, layout, machine, names or "none")
    if args.json:
        found = plan_json(result)
        if stages:
            found["stages"] = [{"window": label, "device_peak_bytes": e.device_peak} for label, e in stages]
        print(json.dumps(found, indent=2))
        return 0
    print(render_table(result))
    if stages:
        print(f"window-length schedule (data.schedule), each step {result.tokens} tokens per device; the peak is the "
              "longest window's:")
        for label, e in stages:
            print(f"  {label}: peak {gib(e.device_peak)} under {e.label}")
    return 0


def seq_len_argument(value: str) -> int:
    """``--seq-len`` read and checked as ``--set data.seq_len=VALUE`` is (so ``1e6`` works in both)."""
    from pydantic import ValidationError

    from megaseq.config import DataConfig, parse_override

    _, parsed = parse_override(f"data.seq_len={value}")
    try:
        return DataConfig(seq_len=parsed).seq_len
    except ValidationError as exc:
        raise UserError(f"--seq-len {value}: {exc.errors()[0]['msg']}") from None
