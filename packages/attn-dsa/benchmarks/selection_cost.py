"""CPU cost of one query block of the DSA selection at long sequences, per query-block pair, by part: the scores
(per-head products, relu, weighted head sum) and the top-k threshold with the kept positions, the latter both by
a selection over whole rows and through the group-maxima bound (``megaseq_dsa.ops.indexer._kth_and_kept``),
in the same process on the same scores (the two agree exactly; checked here too); then the whole block's
selection (scores, threshold, ties, rows) with the path the selection takes at that length, and the same
block by the ``native`` backend's kernel (``select.c``: its scores summed in another order, so the share of
the same keys chosen is printed too; "-" where no C compiler builds it).

One block of the queries at the end of a sequence of ``--seq-len`` tokens (pool 4, top-k 512, 4 index heads of
32: the default recipe's indexer), random inputs, as many queries as SCORE_BLOCK_BYTES allows; each time is the
fastest of ``--repeats`` runs in process CPU seconds. ``--negative-share``: the share of negative head weights
(0.5: symmetric; 0.78 as in the trained default recipe's indexer, where a query whose weights are all negative
has 0 as its best score, tied by many keys).

    OMP_NUM_THREADS=1 .venv/bin/python packages/attn-dsa/benchmarks/selection_cost.py --negative-share 0.5 0.78
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from megaseq_dsa.ops import indexer
from megaseq_dsa.ops.native import build as native_build
from megaseq_dsa.ops.native import select_group


def fastest(fn: Callable[[], object], repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.process_time()
        fn()
        best = min(best, time.process_time() - start)
    return best


def measure(seq_len: int, repeats: int, negative_share: float) -> tuple[int, float, ...]:
    """Queries in the block and CPU ns per query-block pair: scores, whole-row threshold, bounded threshold, the
    block's whole selection, the native kernel's; and the share of the same keys the kernel chose."""
    heads, dim, pool, kept = 4, 32, 4, 512 // 4
    gen = torch.Generator().manual_seed(0)
    n_blocks = seq_len // pool
    queries = max(1, min(indexer.DEFAULT_QUERY_BLOCK, indexer.SCORE_BLOCK_BYTES // (4 * n_blocks)))
    q = torch.randn(1, queries, heads, dim, generator=gen)
    shift = torch.distributions.Normal(0.0, 1.0).icdf(torch.tensor(negative_share))
    weights = (torch.randn(1, queries, heads, generator=gen) - shift) * (heads * dim) ** -0.5
    keys = torch.randn(1, n_blocks, dim, generator=gen)
    scores = torch.empty(1, queries, n_blocks)
    work = torch.empty(queries * heads * indexer.DEFAULT_KEY_BLOCK)

    def score() -> None:
        for k0 in range(0, n_blocks, indexer.DEFAULT_KEY_BLOCK):
            k1 = min(k0 + indexer.DEFAULT_KEY_BLOCK, n_blocks)
            indexer._index_scores(q, keys[:, k0:k1], weights, scores[..., k0:k1], work)

    rows = scores.view(queries, n_blocks)
    full = torch.ones(queries, dtype=torch.bool)

    def whole_rows() -> tuple[torch.Tensor, torch.Tensor]:
        kth = indexer._kth_largest(rows, kept)
        return kth, indexer._flat_positions_at_least(rows, kth)

    def bound() -> tuple[torch.Tensor, torch.Tensor]:
        saved, indexer.MIN_GROUP = indexer.MIN_GROUP, 1
        try:
            return indexer._kth_and_kept(rows, kept, full)
        finally:
            indexer.MIN_GROUP = saved

    t_score = fastest(score, repeats)
    a, b = whole_rows(), bound()
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), "the bound changed the selection"
    lo = torch.zeros(1, queries, dtype=torch.long)
    hi = torch.full((1, queries), n_blocks - 1)
    flat, work_all = scores.view(-1), work

    def block() -> torch.Tensor:
        return indexer._select_block(q, weights, keys, lo, hi, kept, indexer.DEFAULT_KEY_BLOCK, flat, work_all)

    pairs = queries * n_blocks / 1e9
    t_whole, t_bound = fastest(whole_rows, repeats) / pairs, fastest(bound, repeats) / pairs
    t_native = same = float("nan")
    if native_build.unavailable() is None:
        lib, n_pad = native_build.library(), -(-n_blocks // 16) * 16 + 16
        keys_t = torch.zeros(dim, n_pad)
        keys_t[:, :n_blocks] = keys[0].t()
        out = torch.empty(queries, kept, dtype=torch.long)
        group = select_group(n_blocks)
        scratch = [torch.empty(group * n_blocks), torch.empty(2 * n_blocks),
                   torch.empty(4 * heads * (dim + 1) + group * (n_blocks // 16 + 1))]

        def native_block() -> None:
            lib.dsa_select(0, queries, heads, dim, q.data_ptr(), weights.data_ptr(), keys_t.data_ptr(), n_pad,
                           lo.data_ptr(), hi.data_ptr(), kept, group, out.data_ptr(), *(x.data_ptr() for x in scratch))

        t_native = fastest(native_block, repeats) / pairs
        want = block()[0]
        same = sum(len(set(a) & set(b)) for a, b in zip(out.tolist(), want.tolist(), strict=True)) / want.numel()
    return queries, t_score / pairs, t_whole, t_bound, fastest(block, repeats) / pairs, t_native, same


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-len", type=int, nargs="+", default=[65536, 262144, 1048576])
    p.add_argument("--negative-share", type=float, nargs="+", default=[0.5])
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args()
    print(f"{'negative':>8} {'seq_len':>9} {'queries':>7} {'scores ns':>9} {'whole rows ns':>13} {'bound ns':>8} "
          f"{'ratio':>6} {'block ns':>8} {'native ns':>9} {'same keys':>9}")
    for share in args.negative_share:
        for seq_len in args.seq_len:
            queries, t_score, t_whole, t_bound, t_block, t_native, same = measure(seq_len, args.repeats, share)
            print(f"{share:>8.2f} {seq_len:>9} {queries:>7} {t_score:>9.2f} {t_whole:>13.2f} {t_bound:>8.2f} "
                  f"{t_whole / t_bound:>6.2f} {t_block:>8.2f} {t_native:>9.2f} {same:>9.4f}", flush=True)


if __name__ == "__main__":
    main()
