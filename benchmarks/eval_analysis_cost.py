"""What the retrieval eval analysis adds to a recipe's held-out evaluation (docs/results.md, "`make train`").

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/eval_analysis_cost.py [--recipe recipes/genome-cpu.toml]

Evaluates the recipe's model (freshly initialised, seed 0: the cost does not depend on the weights) on its
held-out windows beside its baselines twice, with ``eval.analyses = []`` and with ``["retrieval"]``, and
prints the wall time of each and the time spent inside the analysis itself (its ``add`` and ``finish``,
timed where the evaluation calls them): the second difference is noise on a shared machine, the third is not.
Tokenised data and fitted baselines are cached first, so neither evaluation pays for them.
"""

from __future__ import annotations

import argparse
import functools
import time
from typing import Any

import torch

from megaseq.config import load_recipe
from megaseq.eval.evaluate import build_baselines, evaluate_heldout, heldout_windows
from megaseq.model import build_model
from megaseq.plugins import get_plugins
from megaseq_genome.retrieval import RetrievalAnalysis

inside = {"add": 0.0, "finish": 0.0}


def timed(name: str, method: Any) -> Any:
    @functools.wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            inside[name] += time.perf_counter() - start

    return wrapper


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="recipes/genome-cpu.toml")
    args = parser.parse_args()
    RetrievalAnalysis.add = timed("add", RetrievalAnalysis.add)  # type: ignore[method-assign]
    RetrievalAnalysis.finish = timed("finish", RetrievalAnalysis.finish)  # type: ignore[method-assign]
    plugins = get_plugins()
    print("| eval.analyses | windows | evaluation wall (s) | inside the analysis (s): add + finish |")
    print("|---|---:|---:|---:|")
    for analyses in ([], ["retrieval"]):
        recipe = load_recipe(args.recipe, plugins, [f"eval.analyses={analyses!r}".replace("'", '"')])
        heldout_windows(recipe, plugins)
        build_baselines(recipe, plugins)
        torch.manual_seed(0)
        model = build_model(recipe, plugins)
        start = time.perf_counter()
        result = evaluate_heldout(model, recipe, torch.device("cpu"), plugins)
        wall = time.perf_counter() - start
        own = f"{inside['add']:.1f} + {inside['finish']:.1f}" if analyses else "-"
        print(f"| {analyses} | {result['windows']} | {wall:.1f} | {own} |", flush=True)


if __name__ == "__main__":
    main()
