"""The lightning indexer module and its KL training loss.

The indexer scores query t against an earlier key s by I(t, s) = sum_j w[t, j] relu(q[t, j] . k[s]) with H^I
heads of width d^I, one shared index key per token (from the hidden state x), index queries from the
compressed query c_q, and per-head weights from x scaled by (H^I d^I)^-1/2 so that the score's magnitude does
not grow with the indexer's size.

Its loss (DeepSeek-V3.2) is KL(p || softmax(I)) per query, where p is the main attention distribution summed
over heads and L1-normalised (the mean over heads) and is a fixed target (no gradient). The keys it runs over:

- dense warm-up: every key the query can see (its document, positions <= its own);
- sparse training: the query's selected keys (p is then the main attention itself, a softmax over them, and
  softmax(I) is renormalised over them).

Computed in query chunks, so memory is O(chunk x keys), never L x L. Because the target is fixed, the loss's
gradient needs nothing from later layers but a scalar: each chunk's gradient with respect to the indexer's
inputs is formed in the same pass as its loss (dKL/dI = softmax(I) - p on the visible keys, then through the
head weights and the relu), and backward only scales it. So nothing is recomputed and autograd keeps one
gradient per input (index queries, keys and head weights), not the inputs and the main queries and keys.
Selected keys are gathered as flat rows (``index_select``) with the main key and the index key of a token
side by side, and their gradients scattered back with one ``index_add_`` per chunk.

Tensor parallelism (``tp``): every rank holds the whole indexer (it is small, and whole heads let a rank
select keys without the other ranks' scores, ``megaseq_dsa.layer``) and a block of the main heads. The
queries are shared out in contiguous blocks (``query_share``): a rank computes the index queries and head
weights of its own block only, selects its keys, and computes the KL and its gradients for it. The target, a
mean over all main heads, is a sum of per-rank parts: for every chunk of every rank's block, each rank adds
its heads' part over the ranks (O(queries x keys of the chunk) bytes: the selected keys in sparse training),
and the chunk's owner uses it. The ranks' losses add up to the whole KL and their gradients to its gradients
(the trainer sums the indexer's over the ranks).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from megaseq.contracts import TensorParallel
from megaseq.parallel import collectives

# One chunk's largest score tile takes about this many bytes (dense warm-up).
CHUNK_BYTES = 64 * 2**20
# One chunk's gathered key rows take about this many bytes (sparse): products per query are small and bound by
# memory traffic, so chunks that stay in cache are faster than big ones (as in ``ops/sparse.py``).
GATHER_BYTES = 4 * 2**20


def query_share(rows: int, rank: int = 0, ranks: int = 1) -> tuple[int, int]:
    """Tensor-parallel rank ``rank`` of ``ranks``'s contiguous block ``[first, end)`` of ``rows`` queries (a
    rank past the end gets an empty block)."""
    share = -(-rows // ranks)
    return min(rank * share, rows), min((rank + 1) * share, rows)


class LightningIndexer(nn.Module):
    """x [B, T, d_model] and c_q [B, T, q_lora_rank] -> index queries and head weights of the query rows
    ``rows`` (all by default), and index keys of every token (whole on every tensor-parallel rank: module
    docstring)."""

    def __init__(self, d_model: int, q_lora_rank: int, heads: int, dim: int) -> None:
        super().__init__()
        self.heads, self.dim = heads, dim
        self.query = nn.Linear(q_lora_rank, self.heads * dim, bias=False)
        self.key = nn.Linear(d_model, dim, bias=False)
        self.head_weights = nn.Linear(d_model, self.heads, bias=False)
        self.weight_scale = (heads * dim) ** -0.5
        for linear in (self.query, self.key, self.head_weights):
            nn.init.normal_(linear.weight, std=linear.in_features**-0.5)

    def forward(self, x: Tensor, c_q: Tensor, rows: slice = slice(None)) -> tuple[Tensor, Tensor, Tensor]:
        """q_idx [B, R, Hi, Di], k_idx [B, T, Di], weights [B, R, Hi] (R: the rows)."""
        x_rows, c_q = x[:, rows], c_q[:, rows]
        q_idx = self.query(c_q).view(*c_q.shape[:2], self.heads, self.dim)
        return q_idx, self.key(x), self.head_weights(x_rows) * self.weight_scale


def indexer_kl(
    q_idx: Tensor,
    k_idx: Tensor,
    weights: Tensor,
    q: Tensor,
    key: Tensor,
    scale: float,
    query_pos: Tensor,
    doc_start: Tensor,
    indices: Tensor | None = None,
    chunk: int | None = None,
    tp: TensorParallel | None = None,
) -> Tensor:
    """Sum over query rows of KL(p_attn || softmax(I)), differentiable in the indexer inputs only.

    Queries (rows): q_idx [B, Tq, Hi, Di], weights [B, Tq, Hi], main queries q [B, Tq, H, D] at global
    positions query_pos [Tq]; under ``tp`` q_idx and weights are this rank's block of the rows
    (:func:`query_share`). Keys: k_idx [B, Tk, Di], main keys key [B, Tk, D], document start of every key
    doc_start [Tk]. indices [B, Tq, S] (-1 = padding): KL over those keys (sparse training); None: over every
    visible key (dense warm-up). The main attention is softmax(scale q . key) over the same keys. ``tp``: the
    heads of q are this rank's block; the KL is that of this rank's block of the queries (module docstring).
    """
    batch, _, heads, _ = q.shape
    if chunk is None and indices is None:
        chunk = max(1, CHUNK_BYTES // (4 * batch * key.shape[1] * max(heads, q_idx.shape[2], key.shape[-1])))
    elif chunk is None:
        chunk = max(1, GATHER_BYTES // (4 * batch * indices.shape[-1] * (key.shape[-1] + k_idx.shape[-1])))
    with torch.autocast(q.device.type, enabled=False):  # fp32 softmaxes and products under any autocast
        return _IndexerKL.apply(
            q_idx, k_idx, weights, q.detach(), key.detach(), scale, query_pos, doc_start, indices, chunk, tp
        )


class _IndexerKL(torch.autograd.Function):
    """The summed KL; its gradients with respect to (q_idx, k_idx, weights) are formed in forward (module
    docstring) and scaled by the incoming scalar in backward."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        q_idx: Tensor,
        k_idx: Tensor,
        weights: Tensor,
        q: Tensor,
        key: Tensor,
        scale: float,
        query_pos: Tensor,
        doc_start: Tensor,
        indices: Tensor | None,
        chunk: int,
        tp: TensorParallel | None,
    ) -> Tensor:
        batch, rows, heads, dim = q.shape
        add = None if tp is None else (lambda part: collectives.all_reduce(part, tp.group))
        all_heads = heads * (1 if tp is None else tp.world_size)
        me, ranks = (0, 1) if tp is None else (tp.rank, tp.world_size)
        blocks = [query_share(rows, rank, ranks) for rank in range(ranks)]
        dtype = torch.promote_types(q_idx.dtype, torch.float32)
        want_grads = any(ctx.needs_input_grad[:3])
        total = torch.zeros((), dtype=dtype, device=q.device)
        if want_grads:
            grad_q_idx = torch.empty(q_idx.shape, dtype=dtype, device=q.device)
            grad_weights = torch.empty(weights.shape, dtype=dtype, device=q.device)
            grad_k_idx = torch.zeros(k_idx.shape, dtype=dtype, device=q.device)
        if indices is not None:
            # [key | k_idx] of every token as flat rows: one gather serves both scores.
            table = torch.cat([key.to(dtype), k_idx.to(dtype)], -1).view(-1, dim + k_idx.shape[-1])
            offsets = torch.arange(batch, device=q.device)[:, None, None] * key.shape[1]
            # reused by every chunk: a fresh multi-MB tensor per chunk would pay for its page faults each time
            buffer = table.new_empty(batch * min(chunk, rows) * indices.shape[-1], table.shape[1])
        # Every rank walks every rank's block in the same chunks (the target's sums); the owner computes the KL.
        chunks = [(c0, min(c0 + chunk, end), rank == me) for rank, (first, end) in enumerate(blocks)
                  for c0 in range(first, end, chunk)]
        for c0, c1, own in chunks:
            n = c1 - c0
            r0, r1 = c0 - blocks[me][0], c1 - blocks[me][0]  # the chunk's rows in this rank's q_idx and weights
            if indices is None:
                # Dense warm-up: the chunk's queries share the key range [k0, k1); one group per batch row.
                pos = query_pos[c0:c1]
                k0, k1 = int(doc_start[pos].min()), int(pos.max()) + 1
                key_ids = torch.arange(k0, k1, device=pos.device)
                visible = (key_ids >= doc_start[pos][:, None]) & (key_ids <= pos[:, None])
                visible = visible.expand(batch, -1, -1)
                target = attention_target(q[:, c0:c1], key[:, k0:k1], visible, scale, dtype, add, all_heads)
                if not own:
                    continue
                kl, grads = kl_and_grads(target, q_idx[:, r0:r1], weights[:, r0:r1], k_idx[:, k0:k1], visible, want_grads)
            else:
                # Sparse: each query has its own keys; one group per (batch row, query).
                ids = indices[:, c0:c1]
                flat = (ids.long().clamp_min(0) + offsets).view(-1)
                gathered = torch.index_select(table, 0, flat, out=buffer[: len(flat)]).view(batch * n, -1, table.shape[1])
                visible = (ids >= 0).view(batch * n, 1, -1)
                target = attention_target(
                    q[:, c0:c1].reshape(batch * n, 1, heads, dim), gathered[..., :dim], visible, scale, dtype, add,
                    all_heads,
                )
                if not own:
                    continue
                kl, grads = kl_and_grads(
                    target,
                    q_idx[:, r0:r1].reshape(batch * n, 1, *q_idx.shape[2:]),
                    weights[:, r0:r1].reshape(batch * n, 1, -1),
                    gathered[..., dim:],
                    visible,
                    want_grads,
                )
            total += kl
            if grads is None:
                continue
            d_q_idx, d_weights, d_keys = grads
            grad_q_idx[:, r0:r1] = d_q_idx.view(batch, n, *q_idx.shape[2:])
            grad_weights[:, r0:r1] = d_weights.view(batch, n, -1)
            if indices is None:
                grad_k_idx[:, k0:k1] += d_keys
            else:
                grad_k_idx.view(-1, k_idx.shape[-1]).index_add_(0, flat, d_keys.reshape(len(flat), -1))
        if want_grads:
            ctx.save_for_backward(grad_q_idx, grad_k_idx, grad_weights)
            ctx.dtypes = (q_idx.dtype, k_idx.dtype, weights.dtype)
        return total

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        grads = [(grad * g).to(dtype) for g, dtype in zip(ctx.saved_tensors, ctx.dtypes, strict=True)]
        return (*grads, None, None, None, None, None, None, None, None)


def attention_target(
    q: Tensor, key: Tensor, visible: Tensor, scale: float, dtype: torch.dtype, add: Callable[[Tensor], Tensor] | None = None,
    all_heads: int | None = None,
) -> Tensor:
    """The KL's fixed target for G groups of n queries over their S keys: the main attention distribution
    softmax(scale q . key) averaged over heads. q [G, n, H, D], key [G, S, D], visible [G, n, S] -> [G, n, S].
    ``add``: sums the other tensor-parallel ranks' parts (their heads' summed distributions) into this rank's,
    in place; ``all_heads``: the heads of all ranks."""
    groups, n, heads, _ = q.shape
    with torch.no_grad():
        scores = torch.bmm(q.to(dtype).reshape(groups, n * heads, -1), key.to(dtype).transpose(1, 2)).mul_(scale)
        scores = scores.view(groups, n, heads, -1).masked_fill_(~visible[:, :, None], float("-inf"))
        if add is None:
            mean = scores.softmax(-1).mean(2)
        else:
            mean = add(scores.softmax(-1).sum(2)).div_(all_heads)
        # a query that sees no key (padding only) has no distribution: 0, not softmax's 0 / 0
        return mean.masked_fill_(~visible.any(-1, keepdim=True), 0.0)


def kl_and_grads(
    target: Tensor, q_idx: Tensor, weights: Tensor, k_idx: Tensor, visible: Tensor, want_grads: bool
) -> tuple[Tensor, tuple[Tensor, Tensor, Tensor] | None]:
    """Summed KL(target || softmax(I)) of G groups of n queries, each group over its own S keys, and (if wanted)
    its gradients, all in target's dtype.

    target [G, n, S] (rows sum to 1 over the visible keys), q_idx [G, n, Hi, Di], weights [G, n, Hi],
    k_idx [G, S, Di], visible [G, n, S] -> KL, (dKL/dq_idx [G, n, Hi, Di], dKL/dweights [G, n, Hi],
    dKL/dk_idx [G, S, Di]).
    """
    groups, n, heads_idx, dim_idx = q_idx.shape
    slots = k_idx.shape[1]
    q_idx, weights, k_idx = (x.to(target.dtype) for x in (q_idx, weights, k_idx))
    hidden = ~visible
    per_head = torch.bmm(q_idx.reshape(groups, n * heads_idx, dim_idx), k_idx.transpose(1, 2)).relu_()
    per_head = per_head.view(groups * n, heads_idx, slots)
    index = torch.bmm(weights.reshape(groups * n, 1, heads_idx), per_head).view(groups, n, slots)
    log_q = index.masked_fill_(hidden, float("-inf")).log_softmax(-1).masked_fill_(hidden, 0.0)
    kl = (torch.xlogy(target, target) - target * log_q).sum()
    if not want_grads:
        return kl, None
    # dKL/dI = softmax(I) sum(p) - p on the visible keys; both terms are 0 on the hidden ones.
    d_index = log_q.exp_().masked_fill_(hidden, 0.0).mul_(target.sum(-1, keepdim=True)).sub_(target)
    d_index = d_index.view(groups * n, slots, 1)
    d_weights = torch.bmm(per_head, d_index).view(groups, n, heads_idx)
    d_per_head = (per_head > 0) * weights.reshape(groups * n, heads_idx, 1) * d_index.view(groups * n, 1, slots)
    d_per_head = d_per_head.view(groups, n * heads_idx, slots)
    d_q_idx = torch.bmm(d_per_head, k_idx).view(groups, n, heads_idx, dim_idx)
    d_k_idx = torch.bmm(d_per_head.transpose(1, 2), q_idx.reshape(groups, n * heads_idx, dim_idx))
    return kl, (d_q_idx, d_weights, d_k_idx)
