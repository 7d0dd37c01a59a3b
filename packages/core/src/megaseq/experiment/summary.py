"""What ``megaseq train`` prints after a genome run: how far it is from the context-extension experiment.

The two use different held-out windows (the run: ``[eval]`` windows spread over chrX; the experiment: its
fixed set), so the comparison is made where it is fair: each model's change from the order-8 Markov
baseline scored on its own windows. The experiment's numbers come from a local report when one exists
(``runs/context-extension/report.json``), else from the run recorded in the README (:data:`RECORDED`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

COMMAND = "megaseq experiment context-extension recipes/genome-cpu.toml"
DEFAULT_REPORT = Path("runs/context-extension/report.json")
# The README's context-extension run (its table has the details): long continuation and Markov baselines
# overall on the fixed held-out set, and the pretraining + continuation tokens the long model saw.
RECORDED: dict[str, Any] = {"source": "the README's context-extension run"}


def experiment_numbers(report_path: Path = DEFAULT_REPORT) -> dict[str, Any]:
    if not report_path.exists():
        return RECORDED
    report = json.loads(report_path.read_text())
    overall = report["columns"].index("all")
    models = report["models"]
    numbers: dict[str, Any] = {"source": str(report_path)}
    for name in ("long", "markov-8", "markov-11"):
        if name in models:
            numbers[name] = models[name]["bits_per_base"]["mean"][overall]
    numbers["tokens_seen"] = models.get("long", {}).get("tokens_seen")
    return numbers


def comparison(result_eval: dict[str, Any], tokens: int, markov_order: int, report_path: Path = DEFAULT_REPORT) -> str:
    """Lines saying how this run compares with the experiment and how to run the experiment."""
    results = result_eval["results"]
    own = results["model"]["bits_per_base"]
    lines = ["", "How far this run is from the context-extension experiment (README, 'The context-extension experiment'):"]
    baseline = results.get(f"markov-{markov_order}", {}).get("bits_per_base")
    relative = f", {100 * (own / baseline - 1):+.1f}% vs order-{markov_order} Markov on the same windows" if baseline else ""
    lines.append(f"  this run:    {own:.4f} bits/base{relative} ({tokens:,} tokens)")
    exp = experiment_numbers(report_path)
    if "long" in exp and "markov-8" in exp:
        seen = f", {exp['tokens_seen']:,} tokens" if exp.get("tokens_seen") else ""
        lines.append(
            f"  experiment:  {exp['long']:.4f} bits/base, {100 * (exp['long'] / exp['markov-8'] - 1):+.1f}% vs order-8 Markov "
            f"(64k-context hybrid{seen}; {exp['source']})"
        )
    if "markov-11" in exp:
        lines.append(
            f"  target:      at most {0.97 * exp['markov-11']:.4f} bits/base on the experiment's set "
            f"(3% below order-11 Markov, {exp['markov-11']:.4f})"
        )
    lines.append(f"  run it:      {COMMAND}   (about 2 h on a quiet 2-core CPU; add --scale gpu on a GPU)")
    return "\n".join(lines)
