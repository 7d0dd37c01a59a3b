"""Top-k recall of the DSA selection with bf16 index scores against the fp32 selection, at long sequences.

The indexer's inputs come from a real forward: one training window of ``--seq-len`` bases through the recipe's
model up to its first DSA layer (fresh weights, or a run's newest checkpoint with ``--run``). For ``--queries``
evenly spaced query positions (the last one included) each selection runs over all the keys those queries
see; recall = the share of the fp32 selection's keys that the other selection keeps too
(``megaseq_dsa.ops.selection_recall``). Rows: bf16 scores' own choice (``rescore_margin = 0``) and bf16 then
the exact pass over ``--margin`` more candidates (what ``index_scores = "bf16"`` runs). Also printed: how
close together the fp32 scores lie at the top-k boundary, against bf16's relative rounding step (2^-8).

    OMP_NUM_THREADS=1 .venv/bin/python packages/attn-dsa/benchmarks/indexer_recall.py --seq-len 65536
    OMP_NUM_THREADS=1 .venv/bin/python packages/attn-dsa/benchmarks/indexer_recall.py --run runs/genome-cpu
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[3]


class Captured(Exception):
    pass


def indexer_inputs(recipe_path: str, run: str | None, seq_len: int) -> tuple[torch.Tensor, ...]:
    from megaseq.config import load_recipe
    from megaseq.contracts import ForwardContext
    from megaseq.data.windows import recipe_windows
    from megaseq.model import build_model
    from megaseq.plugins import get_plugins
    from megaseq.train import checkpoint

    plugins = get_plugins()
    recipe = load_recipe(recipe_path, plugins, [f"data.seq_len={seq_len}"])
    torch.manual_seed(recipe.run.seed)
    model = build_model(recipe, plugins).eval()
    if run is not None:
        found = checkpoint.newest_verified(Path(run) / "checkpoints")
        if found.path is None:
            raise SystemExit(f"{run}: no verified checkpoint")
        checkpoint.load_weights(found.path, model)
        print(f"weights: {found.path}")
    else:
        print("weights: fresh (seeded)")
    layer = next(b.attention for b in model.blocks if b.names[0] == "dsa")
    captured: list[torch.Tensor] = []

    def keep(_module, _inputs, outputs):
        captured.extend(x.detach() for x in outputs)
        raise Captured

    layer.indexer.register_forward_hook(keep)
    tokens = recipe_windows(recipe, "train").batch([0]).inputs
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=recipe.train.bf16):
        try:
            model(tokens, ForwardContext())
        except Captured:
            pass
    config = layer.config
    return (*(x.float() for x in captured), config.topk, config.index_pool)


def boundary_spacing(q_idx, k_idx, weights, positions, topk: int, pool: int) -> float:
    """Median over the queries of (s_k - s_{k+1}) / |s_k|: the fp32 scores' relative gap at the k-th best
    complete block (rows that see more than k blocks)."""
    blocks = k_idx.shape[1] // pool
    keys = k_idx[0, : blocks * pool].view(blocks, pool, -1).mean(1)
    k = topk // pool
    gaps = []
    for i, t in enumerate(positions.tolist()):
        seen = (t + 1) // pool
        if seen <= k:
            continue
        per_head = torch.relu(q_idx[0, i] @ keys[:seen].t())  # [Hi, seen]
        best = (weights[0, i] @ per_head).topk(k + 1).values
        gaps.append(float((best[k - 1] - best[k]) / best[k - 1].abs().clamp_min(1e-30)))
    return float(torch.tensor(gaps).median()) if gaps else float("nan")


def main() -> None:
    from megaseq_dsa.ops import select_topk, selection_recall
    from megaseq_dsa.ops.indexer import RESCORE_MARGIN

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", default=str(REPO / "recipes" / "genome-cpu.toml"))
    p.add_argument("--run", help="a run directory: its newest checkpoint's weights (default: fresh weights)")
    p.add_argument("--seq-len", type=int, default=65536)
    p.add_argument("--queries", type=int, default=256, help="query positions measured, evenly spaced")
    p.add_argument("--margin", type=int, default=RESCORE_MARGIN, help="candidates scored again beyond topk // pool")
    args = p.parse_args()
    q_idx, k_idx, weights, topk, pool = indexer_inputs(args.recipe, args.run, args.seq_len)
    positions = torch.linspace(0, args.seq_len - 1, args.queries).round().long().unique()
    q, w = q_idx[:, positions], weights[:, positions]

    def timed(**kw):
        start = time.process_time()
        out = select_topk(q, k_idx, w, topk, pool=pool, query_positions=positions, **kw)
        return out, time.process_time() - start

    exact, t32 = timed()
    plain, t_plain = timed(scores="bf16", rescore_margin=0)
    rescored, t_rescored = timed(scores="bf16", rescore_margin=args.margin)
    print(f"{args.recipe}: seq_len {args.seq_len}, topk {topk}, index_pool {pool}, {len(positions)} queries")
    print(f"{'selection':<34} {'recall':>8} {'CPU s':>8}")
    print(f"{'fp32 scores':<34} {1.0:>8.4f} {t32:>8.2f}")
    print(f"{'bf16 scores alone':<34} {selection_recall(plain, exact):>8.4f} {t_plain:>8.2f}")
    print(f"{f'bf16 + exact pass (margin {args.margin})':<34} {selection_recall(rescored, exact):>8.4f} {t_rescored:>8.2f}")
    gap = boundary_spacing(q_idx[:, positions], k_idx, w, positions, topk, pool)
    print(f"fp32 scores at the k-th best block: median relative gap to the next {gap:.2e} (bf16 rounds to 2^-8 = 3.9e-03)")


if __name__ == "__main__":
    main()
