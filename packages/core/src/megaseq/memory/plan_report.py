"""What ``megaseq plan`` and a run's header show of a memory plan (``megaseq.memory.plan``): the table, the
JSON object, and the one-line description of the policies in use."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from megaseq.config import Recipe
from megaseq.memory.machine import gib
from megaseq.memory.plan import Estimate, Plan


def plan_json(plan: Plan) -> dict[str, Any]:
    def one(e: Estimate) -> dict[str, Any]:
        return {
            "policies": [{"name": p.name, "config": p.config} for p in e.policies],
            "label": e.label,
            "device_peak_bytes": e.device_peak,
            "host_peak_bytes": e.host,
            "host_optimizer_bytes": e.host_optimizer,
            "disk_bytes": e.disk,
            "fits": e.fits,
            "idle": e.idle or None,
            "time_cost": e.time_cost,
            "weights_bytes": e.weights,
            "gradients_bytes": e.gradients,
            "reduction_bytes": e.reduction,
            "optimizer_bytes": e.optimizer,
            "runtime_bytes": e.runtime,
            "saved_bytes_by_layer_kind": e.saved_by_kind,
            "recompute_peak_bytes": e.recompute_peak,
            "gradient_stream_bytes": e.gradient_stream,
            "temporary_bytes": e.temporary,
            "heap_bytes": e.heap,
        }

    chosen = plan.chosen or (plan.candidates[0] if plan.given else None)
    return {
        "recipe": plan.recipe_source,
        "seq_len": plan.seq_len,
        "tokens_per_device": plan.tokens,
        "parallel": asdict(plan.layout),
        "device": plan.machine.kind,
        "device_bytes": plan.machine.device_bytes,
        "host_bytes": plan.machine.host_bytes,
        "policies": [p.name for p in chosen.policies] if chosen else None,
        "policy_configs": {p.name: p.config for p in chosen.policies} if chosen else None,
        "device_peak_bytes": chosen.device_peak if chosen else None,
        "host_peak_bytes": chosen.host if chosen else None,
        "fits": bool(chosen and chosen.fits),
        "candidates": [one(e) for e in plan.candidates],
    }


def render_table(plan: Plan) -> str:
    m = plan.machine
    host = "unlimited" if m.host_bytes is None else gib(m.host_bytes)
    head = (
        f"memory plan for {plan.recipe_source}: seq_len {plan.seq_len}, parallel {plan.layout}, "
        f"{plan.tokens} tokens per device per micro-batch\n"
        f"device: {m.kind}, {gib(m.device_bytes)}" + (f"; host memory {host}" if m.kind == "cuda" else "")
        + (f"; scratch disk {gib(m.disk_bytes)} free" if m.disk_bytes is not None else "")
    )
    first = plan.candidates[0]
    lines = [head, "", "per device (policy-independent):",
             f"  runtime {gib(first.runtime)}   weights {gib(first.weights)}   gradients {gib(first.gradients)}"
             + (f" (+ {gib(first.reduction)} reduction buckets)" if first.reduction else "")
             + f"   optimizer state {gib(first.optimizer) if first.optimizer else f'{gib(first.host_optimizer)} in host memory'}",
             ""]
    kinds = sorted({k for e in plan.candidates for k in e.saved_by_kind})
    width = max(24, *(len(e.label) for e in plan.candidates))
    cols = "".join(f"{k[:18]:>19}" for k in kinds)
    off = "disk" if m.kind == "cpu" else "host"
    lines.append(f"{'policies':<{width}}{cols}{'re-run':>9}{'temp':>9}{'heap':>9}{off:>9}{'peak':>9}  fits  cost")
    for e in plan.candidates:
        # a space before every cell, so that a number wider than its column never runs into the next
        cells = "".join(f" {gib(e.saved_by_kind.get(k, 0)):>18}" for k in kinds)
        mark = "yes" if e.fits else "idle" if e.idle else "no"
        chosen = "  <- proposed" if e is plan.chosen and not plan.given else ""
        lines.append(
            f"{e.label:<{width}}{cells} {gib(e.recompute_peak):>8} {gib(e.temporary):>8} {gib(e.heap):>8}"
            f" {gib(e.disk if m.kind == 'cpu' else e.host_total):>8} {gib(e.device_peak):>8}  {mark:<4}  {e.time_cost:+.0%}{chosen}"
        )
    lines.append("")
    lines.append("(saved activations by layer kind; re-run: the most one layer re-creates in backward; heap: freed "
                 "memory the C library keeps resident" + ("; host: offloaded activations and host optimizer state)"
                                                          if m.kind == "cuda" else ")"))
    for reason in dict.fromkeys(e.idle for e in plan.candidates if e.idle):
        lines.append(f"idle (never proposed: the run would stop at its first step): offloading {reason}")
    host_over = m.host_bytes is not None and first.host_total > m.host_bytes
    if plan.given:
        verdict = "fits" if first.fits else "is idle" if first.idle else "does NOT fit"
        lines.append(f"the given set ({first.label}) {verdict}: peak {gib(first.device_peak)} of {gib(m.device_bytes)}"
                     + (f"; host memory {gib(first.host_total)} of {gib(m.host_bytes)} (--host-mem)" if host_over else ""))
    elif plan.chosen is None:
        least = min(plan.candidates, key=lambda e: e.device_peak)
        if least.device_peak <= m.device_bytes and m.host_bytes is not None:
            lines.append(f"nothing fits host memory: the least any set holds there is "
                         f"{gib(min(e.host_total for e in plan.candidates))} of {gib(m.host_bytes)} (--host-mem)")
        else:
            lines.append(f"nothing fits: the smallest peak is {gib(least.device_peak)} "
                         f"of {gib(m.device_bytes)} per device. Shorter sequences, more context parallelism or more memory would.")
    else:
        lines.append(f"proposed: {plan.chosen.label} (predicted peak {gib(plan.chosen.device_peak)}, "
                     f"about {plan.chosen.time_cost:+.0%} step time)")
    return "\n".join(lines)


def describe_memory_policy(recipe: Recipe, plan_result: Plan | None = None) -> str:
    """One line for a run's header: the policies in use with their configs, and the plan when there is one."""
    names = recipe.train.memory_policy
    if names == "auto":
        return "auto (not planned yet)"
    if not names:
        text = "no memory policy"
    else:
        parts = []
        for name in names:
            cfg = recipe.components.get("memory_policy", {}).get(name)
            options = ", ".join(f"{k}={v}" for k, v in (cfg.model_dump() if cfg else {}).items() if v is not None)
            parts.append(f"{name}({options})" if options else name)
        text = " + ".join(parts)
    if plan_result is not None:
        text += f" (chosen by the planner: {plan_result.summary()})"
    return text


__all__ = ["describe_memory_policy", "plan_json", "render_table"]
