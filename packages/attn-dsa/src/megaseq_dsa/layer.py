"""DeepSeek Sparse Attention layer: MLA in MQA mode over the lightning indexer's top-k keys.

Per token x:

    c_q    = RMSNorm(W_dq x)                          compressed query      [q_lora_rank]
    latent = RMSNorm(W_dkv x)                         the one key AND value [kv_lora_rank]
    q_h    = W_uk,h^T (W_uq,h c_q)                    query absorbed into the latent space, per head
    o_h    = softmax over selected s of (scale q_h . latent_s)  weighting latent_s
    out    = W_o concat_h(W_uv,h o_h)

Absorbing the key up-projection W_uk into the query is MLA's inference form: q_h . latent_s equals
(W_uq,h c_q) . (W_uk,h latent_s), so scale = head_dim^-1/2 as for the unabsorbed heads, and only the latent is
stored per token (cache, all-gather). With ``rope`` a small rotary part is appended: a query part per head from
c_q and one key part per token from x, shared by the heads (MLA's decoupled RoPE); values stay the latent.

Selection (``mode = "sparse"``): the indexer (``megaseq_dsa.indexer``) scores keys from the detached input,
``select_topk`` picks each query's top-k (with key pooling when ``index_pool > 1``; all visible keys when there
are at most k), and ``sparse_attention`` takes the softmax over those keys only. The selection carries no
gradient; a recomputed layer (the ``recompute`` policy) keeps it for the re-run in backward
(``ForwardContext.keep``), so it runs once per step. ``mode = "dense_warmup"``: the main attention is dense causal attention (per document, through
``scaled_dot_product_attention``, whose fused kernels keep memory O(L)); the indexer learns it. In both modes
the indexer's KL loss (``indexer_kl``) is added as ``ctx.add_loss("dsa_indexer", coef * mean KL per token)``
when gradients are enabled and no decoding cache is used; the indexer sees only detached inputs, so that
loss trains the indexer and nothing else, and the main attention's output never depends on the indexer's
parameters in a differentiable way.

Keys and queries: every path works on the keys of a whole sequence and on queries at known positions in it
(the operations' ``query_positions``). Plain and packed rows: both are the local tokens. Context parallelism:
keys are all-gathered (core's ``megaseq.parallel.gather_sequence``), queries are this rank's zig-zag share at their global
positions, so a rank's work is O(T_local x T). Decoding: keys are the cache plus the new tokens, queries the
new tokens, so a step costs O(cache length). The dense warm-up attends each run of consecutive query
positions inside a document to that document's keys up to the run's end (causal aligned to the last key).

Tensor parallelism (``megaseq.contracts.TensorParallel``), as megatron-core's MLA splits the main attention:
a rank holds a contiguous block of the query heads (their rows of ``q_up`` and ``q_rope``, their ``k_up`` and
``v_up``, their columns of ``out``). What every head reads stays whole on every rank: the query and latent
down-projections and norms, the rotary key, and the whole indexer (their gradients are summed over the
ranks). A rank gathers the sequence chunks (with context parallelism: its context-parallel share), runs its
heads over all of it and reduce-scatters its partial output. The selection is shared out by queries, not by
indexer heads: each rank computes the index queries of its contiguous block of the queries, selects their
keys with the whole indexer, and the ranks all-gather the indices (O(queries x top-k) bytes); split heads
would instead have to add each query block's partial scores over every earlier key across the ranks before
the top-k (O(queries x keys)). The indexer loss's target sums the ranks' heads over the selected keys, and
each rank computes the loss of its block of the queries (``megaseq_dsa.indexer``).
Decoding under tensor parallelism (without sequence parallelism): the cache holds what every head reads, the
latent (with the rotary key) and the indexer's key of each token, so it is the same on every rank, as
megatron-core's MLA keeps its compressed key-value cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from megaseq.contracts import ForwardContext, TensorParallel, Tile
from megaseq.documents import Documents, as_documents
from megaseq.model import RMSNorm
from megaseq.parallel import collectives, gather_sequence, tp_gather, tp_reduce_scatter
from megaseq.records import MemoryEstimate, ModelDims, TileCarry
from megaseq.rotary import rotary
from megaseq_dsa.backends import BACKENDS, DSAOps, plans_native
from megaseq_dsa.config import DSAConfig
from megaseq_dsa.indexer import CHUNK_BYTES, LightningIndexer, indexer_kl, query_share
from megaseq_dsa.ops import selected_slots
from megaseq_dsa.ops.indexer import DEFAULT_KEY_BLOCK, DEFAULT_QUERY_BLOCK, SCORE_BLOCK_BYTES, document_starts
from megaseq_dsa.ops.native import ROW_GRADIENT_BYTES, SELECT_ROWS, select_group
from megaseq_dsa.ops.sparse import default_chunk_size

# Tokens a fresh decoding cache has room for before it first grows.
INITIAL_CACHE_TOKENS = 256


@dataclass
class DSACache:
    """Decoding state of one layer: per cached token its key (latent, plus the rotary part) and index key.

    Both live in preallocated buffers that each call writes in place; a buffer that is full is replaced by
    one twice as long (or as long as needed), so decoding L tokens one at a time makes O(log L)
    reallocations (``reallocations`` counts them) instead of copying the whole cache at every step.
    """

    key_buffer: Tensor  # [B, capacity, kv_lora_rank (+ rope_dim)]; the value is key[..., :kv_lora_rank]
    k_idx_buffer: Tensor  # [B, capacity, index_dim]
    length: int = 0
    reallocations: int = 0

    @property
    def key(self) -> Tensor:
        return self.key_buffer[:, : self.length]

    @property
    def k_idx(self) -> Tensor:
        return self.k_idx_buffer[:, : self.length]

    def append(self, key: Tensor, k_idx: Tensor) -> None:
        """Write the new tokens' ``key [B, t, *]`` and ``k_idx [B, t, index_dim]`` after the cached ones."""
        end = self.length + key.shape[1]
        if end > self.key_buffer.shape[1]:
            capacity = max(end, 2 * self.key_buffer.shape[1])
            self.key_buffer = _regrown(self.key_buffer, capacity, self.length)
            self.k_idx_buffer = _regrown(self.k_idx_buffer, capacity, self.length)
            self.reallocations += 1
        self.key_buffer[:, self.length : end] = key
        self.k_idx_buffer[:, self.length : end] = k_idx
        self.length = end


def _regrown(buffer: Tensor, capacity: int, used: int) -> Tensor:
    grown = buffer.new_empty(buffer.shape[0], capacity, *buffer.shape[2:])
    grown[:, :used] = buffer[:, :used]
    return grown


class DeepSeekSparseAttention(nn.Module):
    def __init__(self, d_model: int, config: DSAConfig, n_layers: int, tp_size: int = 1) -> None:
        super().__init__()
        BACKENDS.check(config.backend)
        if config.n_heads % tp_size:
            raise ValueError(f"attention.dsa: n_heads {config.n_heads} is not a multiple of tp {tp_size}")
        self.config = config
        self.n_heads = config.n_heads // tp_size  # this rank's query heads
        heads, head_dim, latent = self.n_heads, config.head_dim, config.kv_lora_rank
        self.rope_dim = config.rope_dim if config.rope else 0
        self.scale = (head_dim + self.rope_dim) ** -0.5
        self.q_down = nn.Linear(d_model, config.q_lora_rank, bias=False)
        self.q_norm = RMSNorm(config.q_lora_rank, 1e-6)
        self.q_up = nn.Linear(config.q_lora_rank, heads * head_dim, bias=False)
        self.k_up = nn.Parameter(torch.randn(heads, head_dim, latent) * latent**-0.5)  # absorbed into q
        self.kv_down = nn.Linear(d_model, latent, bias=False)
        self.kv_norm = RMSNorm(latent, 1e-6)
        self.v_up = nn.Parameter(torch.randn(heads, latent, head_dim) * latent**-0.5)
        self.out = nn.Linear(heads * head_dim, d_model, bias=False)
        if config.rope:
            self.q_rope = nn.Linear(config.q_lora_rank, heads * self.rope_dim, bias=False)
            self.k_rope = nn.Linear(d_model, self.rope_dim, bias=False)
        self.indexer = LightningIndexer(d_model, config.q_lora_rank, config.index_heads, config.index_dim)
        for name, p in self.named_parameters():
            if name.endswith("weight") and p.dim() == 2 and not name.startswith("indexer."):
                nn.init.normal_(p, std=p.shape[1] ** -0.5)  # unit-scale outputs from unit-scale inputs
        nn.init.normal_(self.out.weight, std=0.02 / (2 * n_layers) ** 0.5)
        if config.mode == "dense_warmup" and config.freeze_main_in_warmup:
            for name, p in self.named_parameters():
                if not name.startswith("indexer."):
                    p.requires_grad_(False)

    def init_cache(self, batch_size: int, *, device: torch.device, dtype: torch.dtype) -> DSACache:
        key_width = self.config.kv_lora_rank + self.rope_dim
        return DSACache(
            key_buffer=torch.empty(batch_size, INITIAL_CACHE_TOKENS, key_width, device=device, dtype=dtype),
            k_idx_buffer=torch.empty(
                batch_size, INITIAL_CACHE_TOKENS, self.config.index_dim, device=device, dtype=dtype
            ),
        )

    def forward(self, x: Tensor, ctx: ForwardContext, cache: DSACache | None = None) -> Tensor:
        if ctx.tp is None:
            return self._forward(x, ctx, cache)[0]
        if cache is not None and ctx.tp.sequence_parallel:
            raise ValueError("attention.dsa: a decoding cache cannot be combined with sequence parallelism")
        return tp_reduce_scatter(self._forward(tp_gather(x, ctx.tp), ctx, cache)[0], ctx.tp)

    def forward_tile(
        self, x: Tensor, ctx: ForwardContext, tile: Tile, history: list[tuple[Tensor, ...]]
    ) -> tuple[Tensor, tuple[Tensor, ...]]:
        """Tokens ``[tile.start, tile.stop)`` (``megaseq.contracts.SequenceTiling``): the tile's queries select
        among and attend to the keys of every earlier tile (the carry: each tile's key and index key) and its
        own, as context-parallel queries do over gathered keys."""
        if ctx.cp is not None or ctx.tp is not None:
            raise ValueError("attention.dsa: sequence tiles run without context parallelism or tensor parallelism")
        return self._forward(x, ctx, None, tile, history)

    def _forward(
        self,
        x: Tensor,
        ctx: ForwardContext,
        cache: DSACache | None,
        tile: Tile | None = None,
        history: list[tuple[Tensor, ...]] | None = None,
    ) -> tuple[Tensor, tuple[Tensor, ...]]:
        b, t, _ = x.shape
        if cache is not None and (ctx.cu_seqlens is not None or ctx.cp is not None):
            raise ValueError(
                "attention.dsa: a decoding cache cannot be combined with packing or context parallelism"
            )
        documents = None  # read once per forward by the context, shared with every other layer
        if ctx.documents is not None:
            length = ctx.cp.seq_len if ctx.cp is not None else tile.seq_len if tile is not None else t
            documents = as_documents(ctx.documents, batch=b, length=length, who="attention.dsa: cu_seqlens")
        c_q = self.q_norm(self.q_down(x))
        latent = self.kv_norm(self.kv_down(x))
        # Absorbed query, all heads in one product: c_q (W_uq^T blockdiag_h(W_uk,h)) = [W_uk,h^T W_uq,h c_q]_h.
        # Folding the two matrices first keeps no per-token up-projected query for backward.
        absorb = self.q_up.weight.t() @ torch.block_diag(*self.k_up)
        q = (c_q @ absorb.to(c_q.dtype)).view(b, t, self.n_heads, -1)
        key = latent
        if self.rope_dim:
            pos = self._rope_positions(t, ctx, cache, documents, x.device, tile)
            q_rot = rotary(self.q_rope(c_q).view(b, t, self.n_heads, -1), pos, self.config.rope_theta)
            k_rot = rotary(self.k_rope(x)[:, :, None], pos, self.config.rope_theta)[:, :, 0]
            q, key = torch.cat([q, q_rot], dim=-1), torch.cat([latent, k_rot], dim=-1)
        # under tensor parallelism this rank's block of the queries (megaseq_dsa.indexer.query_share)
        q0, q1 = query_share(t, *_rank_of(ctx.tp))
        q_idx, k_idx, idx_weights = self.indexer(x.detach(), c_q.detach(), slice(q0, q1))
        carry = (key, k_idx)

        # Keys of the whole sequence (of a tile: up to its end); queries at query_pos in it (query_spans: the
        # same, as host ranges).
        if tile is not None:
            query_spans = [(tile.start, tile.stop)]
            query_pos = torch.arange(tile.start, tile.stop, device=x.device)
            key = torch.cat([*(h[0] for h in history or ()), key], dim=1)
            k_idx = torch.cat([*(h[1] for h in history or ()), k_idx], dim=1)
            if documents is not None:  # the documents as far as the keys go
                documents = documents.window(0, tile.stop)[0]
        elif cache is not None:
            query_spans = [(cache.length, cache.length + t)]
            query_pos = torch.arange(cache.length, cache.length + t, device=x.device)
            cache.append(key, k_idx)
            key, k_idx = cache.key, cache.k_idx
        elif ctx.cp is not None:
            query_spans = ctx.cp.segments()
            query_pos = ctx.cp.positions(x.device)
            key, k_idx = gather_sequence(key, ctx.cp), gather_sequence(k_idx, ctx.cp)
        else:
            query_spans = [(0, t)]
            query_pos = torch.arange(t, device=x.device)

        with_kl = cache is None and torch.is_grad_enabled()
        kl = None
        if self.config.mode == "sparse":
            ops = BACKENDS.load(self.config.backend, x.device)
            # a recomputed forward keeps its selection for the re-run in backward: the same inputs, the same choice
            indices = ctx.keep(
                "attention.dsa.indices",
                lambda: self._select(ops, q_idx, k_idx, idx_weights, query_pos, documents, ctx.tp),
            )
            value = key[..., : self.config.kv_lora_rank]
            # the fused pass sees only this rank's heads: under tensor parallelism the loss is indexer_kl's
            if with_kl and ops.sparse_attention_with_indexer_kl is not None and ctx.tp is None:
                # one pass over the selected keys for both (the KL's target is the attention itself)
                o, kl = ops.sparse_attention_with_indexer_kl(
                    q, key, value, indices, self.scale, q_idx, k_idx, idx_weights, self.config.query_chunk
                )
            else:
                o = ops.sparse_attention(q, key, value, indices, self.scale, self.config.query_chunk)
        else:
            indices = None
            o = self._dense(q, key, query_spans, documents)
        if with_kl:
            if kl is None:
                kl = self._indexer_kl(q_idx, k_idx, idx_weights, q, key, query_pos, documents, indices, ctx.tp)
            # Divided by the global token count: the shares of context-parallel and tensor-parallel ranks and of
            # sequence tiles add up to the one-rank mean.
            tokens = b * (ctx.cp.seq_len if ctx.cp is not None else tile.seq_len if tile is not None else t)
            # The trainer logs it as aux/dsa_indexer; a separate KL metric would repeat that number.
            ctx.add_loss("dsa_indexer", self.config.indexer_loss_coef * kl / tokens)
        # W_o concat_h(W_uv,h o_h) as one product with the folded blockdiag_h(W_uv,h) W_o^T: backward keeps only o
        # (which the attention keeps anyway), not the per-head values.
        project = torch.block_diag(*self.v_up) @ self.out.weight.t()
        return o.reshape(b, t, -1) @ project.to(o.dtype), carry

    def _rope_positions(
        self, t: int, ctx: ForwardContext, cache: DSACache | None, documents: Documents | None, device: torch.device,
        tile: Tile | None = None,
    ) -> Tensor:
        """Position of each local token inside its document (rotary angles restart at each document)."""
        if cache is not None:
            return torch.arange(cache.length, cache.length + t, device=device)
        if tile is not None:
            pos = torch.arange(tile.start, tile.stop, device=device)
        else:
            pos = ctx.cp.positions(device) if ctx.cp is not None else torch.arange(t, device=device)
        return pos if documents is None else documents.positions_in_doc(device)[pos]

    def _indexer_kl(
        self, q_idx: Tensor, k_idx: Tensor, weights: Tensor, q: Tensor, key: Tensor, query_pos: Tensor,
        documents: Documents | None, indices: Tensor | None, tp: TensorParallel | None,
    ) -> Tensor:
        doc_start = document_starts(documents, key.shape[1], key.device)
        return indexer_kl(
            q_idx, k_idx, weights, q, key, self.scale, query_pos, doc_start, indices, self.config.query_chunk, tp
        )

    @torch.no_grad()
    def _select(
        self,
        ops: DSAOps,
        q_idx: Tensor,
        k_idx: Tensor,
        weights: Tensor,
        query_pos: Tensor,
        documents: Documents | None,
        tp: TensorParallel | None,
    ) -> Tensor:
        """Top-k key indices [B, Tq, slots] of the queries at query_pos (no gradient: a discrete choice); under
        tensor parallelism q_idx and weights are this rank's block of the queries: it selects for them and the
        ranks all-gather the indices (module docstring)."""
        config = self.config
        rows = len(query_pos)
        q0, q1 = query_share(rows, *_rank_of(tp))

        def select() -> Tensor:
            return ops.select_topk(
                q_idx, k_idx, weights, config.topk, documents, config.index_pool, query_pos[q0:q1],
                config.query_chunk, config.index_scores,
            )

        if tp is None:
            return select()
        share = query_share(rows, 0, tp.world_size)[1]  # the ranks' blocks padded to the first one's
        padded = q_idx.new_full((q_idx.shape[0], share, selected_slots(config.topk, config.index_pool)), -1,
                                dtype=torch.int32)
        if q1 > q0:
            padded[:, : q1 - q0] = select()
        return torch.cat(collectives.all_gather_tensor(padded, tp.group), dim=1)[:, :rows]

    def _dense(
        self, q: Tensor, key: Tensor, query_spans: list[tuple[int, int]], documents: Documents | None
    ) -> Tensor:
        """Dense causal attention of each query over its document's keys up to its position: latent outputs
        [B, Tq, H, kv_lora_rank]; the queries lie at the global positions ``query_spans`` (host ranges, in
        order). One attention call per run of consecutive query positions in a document."""
        batch, _, heads, _ = q.shape
        # Values padded with zeros to the key width: the rotary columns then add nothing, and equal q/k/v
        # widths let SDPA pick its fused O(L)-memory kernels instead of materialising the L x L scores.
        value = F.pad(key[..., : self.config.kv_lora_rank], (0, self.rope_dim))[:, None]
        key = key[:, None]
        q = q.transpose(1, 2)  # [B, H, Tq, D]
        block = self.config.query_chunk or max(1, CHUNK_BYTES // (4 * batch * heads * key.shape[2]))
        parts = []
        for q0, q1, k0, k1 in _query_runs(query_spans, documents):
            parts.append(
                _causal_to_last_key(q[:, :, q0:q1], key[:, :, k0:k1], value[:, :, k0:k1], self.scale, block)
            )
        o = torch.cat(parts, dim=2) if parts else q.new_zeros(batch, heads, 0, value.shape[-1])
        return o.transpose(1, 2)[..., : self.config.kv_lora_rank]


def _rank_of(tp: TensorParallel | None) -> tuple[int, int]:
    """(rank, ranks) of a tensor-parallel group; (0, 1) without one: the arguments of ``query_share``."""
    return (0, 1) if tp is None else (tp.rank, tp.world_size)


def _query_runs(
    query_spans: list[tuple[int, int]], documents: Documents | None
) -> list[tuple[int, int, int, int]]:
    """Maximal runs of consecutive query positions inside one document, as (first query, end query, first key
    of the document, end key = last query position + 1). Host arithmetic on host ranges: no device sync."""
    bounds = documents.bounds if documents is not None else [(0, max((end for _, end in query_spans), default=0))]
    runs, first_query = [], 0
    for span_start, span_end in query_spans:
        for doc_start, doc_end in bounds:
            a, b = max(span_start, doc_start), min(span_end, doc_end)
            if a < b:
                runs.append((first_query + a - span_start, first_query + b - span_start, doc_start, b))
        first_query += span_end - span_start
    return runs


def _causal_to_last_key(q: Tensor, key: Tensor, value: Tensor, scale: float, block: int) -> Tensor:
    """q [B, H, n, D] at the last n of m key positions (key, value [B, 1, m, *]): query i sees keys
    <= m - n + i. n == m is SDPA's own causal mask; otherwise queries go in blocks of `block` with an
    explicit [block, keys] mask, each block recomputed in backward (checkpoint): no mask or score tile is kept
    for backward."""
    n, m = q.shape[2], key.shape[2]
    if n == m:
        return F.scaled_dot_product_attention(q, key, value, is_causal=True, scale=scale, enable_gqa=True)
    recompute = torch.is_grad_enabled() and any(x.requires_grad for x in (q, key, value))
    parts = []
    for q0 in range(0, n, block):
        q1 = min(q0 + block, n)
        args = (q[:, :, q0:q1], key[:, :, : m - n + q1], value[:, :, : m - n + q1], scale)
        parts.append(
            checkpoint(_masked_tail, *args, use_reentrant=False) if recompute else _masked_tail(*args)
        )
    return torch.cat(parts, dim=2)


def _masked_tail(q: Tensor, key: Tensor, value: Tensor, scale: float) -> Tensor:
    """Attention of q [B, H, n, D], the last n of the m key positions, with the causal mask aligned to the
    last key (query i sees keys <= m - n + i)."""
    n, m = q.shape[2], key.shape[2]
    mask = torch.ones(n, m, dtype=torch.bool, device=q.device).tril(m - n)
    return F.scaled_dot_product_attention(q, key, value, attn_mask=mask, scale=scale, enable_gqa=True)


def build(config: DSAConfig, dims: ModelDims, layer_idx: int) -> DeepSeekSparseAttention:
    return DeepSeekSparseAttention(dims.d_model, config, dims.n_layers, dims.tp_size)


def memory_estimate(config: DSAConfig, dims: ModelDims, seq_len: int) -> MemoryEstimate:
    """fp32 bytes. Saved per token (tested against what backward keeps): the input, the compressed query and
    the latent before and after their norms (the norms keep their inputs), the key (the latent, with its
    rotary part) and the absorbed query (H x key width), the attention's output (H x latent) and
    logsumexp, the selected indices (int32, sparse), the indexer loss's gradients (the size of the indexer's
    queries, key and weights), and the rotary angles. Dense warm-up: SDPA's output at the key width and
    the padded values instead of the indices. The layer's input is taken to need a gradient (earlier layers
    train): a frozen main path then still keeps what the input's gradient needs.
    Temporary (the largest of the steps, which run one after another): in backward, the gradients of the
    attention's output and of the absorbed queries (H x (latent + key width) per token), of the compressed
    query and of the key (q_lora_rank + key width), with sparse
    attention's chunk buffers (a few MiB, less for short sequences; the native kernels read the selected rows in
    place, and a second thread adds its copy of the key rows' gradients instead, at most ``ROW_GRADIENT_BYTES``;
    under tensor parallelism the indexer loss keeps its own chunk buffers) or, dense, one chunk of the indexer loss
    (CHUNK_BYTES, less for short sequences); in forward,
    the selection's score block with its CPU selection copies and mask (~3.5 x the block, at most
    SCORE_BLOCK_BYTES), the index heads' scores of one key tile and the block's selected rows (native: the
    transposed candidate keys, a few queries' scores per thread and a block's selected rows). Kept for a recomputation's re-run (``ForwardContext.keep``): the selected indices.
    Measured with ``benchmarks/component_memory.py`` on the default recipe's sparse layer:
    14, 43 and 160 MiB at 4k, 16k and 64k. Under tensor parallelism (``dims.tp_size``) all of it is one rank's,
    whose query heads run over the gathered sequence: what every head reads, the indexer's parameters and keys
    and the gathered indices are whole on every rank, the indexer loss's gradients its block of the queries'."""
    if config.n_heads % dims.tp_size:
        raise ValueError(f"attention.dsa: n_heads {config.n_heads} is not a multiple of tp {dims.tp_size}")
    d, heads, latent = dims.d_model, config.n_heads // dims.tp_size, config.kv_lora_rank
    index_heads = config.index_heads
    rope = config.rope_dim if config.rope else 0
    key_width = latent + rope
    parameters = (
        d * config.q_lora_rank
        + config.q_lora_rank
        + config.q_lora_rank * heads * config.head_dim
        + 2 * heads * config.head_dim * latent
        + d * latent
        + latent
        + heads * config.head_dim * d
        + (config.q_lora_rank * heads * rope + d * rope)
        + config.q_lora_rank * index_heads * config.index_dim
        + d * config.index_dim
        + d * index_heads
    )
    # the indexer loss's gradients: of this rank's block of the queries (1/tp of them), and of every index key
    indexer_grads = -(-(index_heads * config.index_dim + index_heads) // dims.tp_size) + config.index_dim
    per_token = d + 2 * config.q_lora_rank + latent + key_width + heads * key_width + heads + 2 + indexer_grads
    per_token += 2 * rope  # the rotary cos and sin of the query and of the key
    if config.mode == "sparse":
        per_token += heads * latent + selected_slots(config.topk, config.index_pool)
    else:
        per_token += key_width + heads * key_width
        if not config.freeze_main_in_warmup:  # the output projection's input, for its weight's gradient
            per_token += heads * latent
    grads = 4 * (heads * (latent + key_width) + config.q_lora_rank + key_width) * seq_len
    if config.mode == "sparse":
        slots = selected_slots(config.topk, config.index_pool)
        pooled = -(-seq_len // config.index_pool)
        # a block of queries' chosen blocks and their tokens as int64, then the rows as int64 and int32
        expand_per_query = 24 * (config.topk // config.index_pool) + 12 * slots  # (``expand_rows``)
        candidates = 80 * seq_len  # ``pooled_candidates``' int64 ranges and tails per query, positions per key
        native = plans_native(config.backend)
        if native:
            # the transposed candidate keys, two threads' scores of a group of queries over every candidate
            # (select_group) with their selection's scratch, and a block of SELECT_ROWS queries' expanded rows
            threads_scratch = 2 * 4 * (select_group(pooled) + 2) * pooled
            selection = 4 * config.index_dim * pooled + threads_scratch + min(SELECT_ROWS, seq_len) * expand_per_query
            selection += candidates
        else:
            # a query block's score block (fewer rows where it would pass SCORE_BLOCK_BYTES) with its CPU
            # selection copies and mask (~3.5 x the block), the per-head scores of one key tile, and the block's
            # expanded rows
            rows = min(DEFAULT_QUERY_BLOCK, seq_len, max(1, SCORE_BLOCK_BYTES // (4 * pooled)))
            selection = 4 * rows * (7 * pooled // 2 + index_heads * min(DEFAULT_KEY_BLOCK, pooled))
            selection += rows * expand_per_query + candidates
        if native and dims.tp_size == 1:
            # the native kernels read the rows in place; a second thread adds its copy of the key rows' gradients
            chunk = min(ROW_GRADIENT_BYTES, 4 * seq_len * max(key_width, config.index_dim))
        else:
            # one chunk of queries (its gathered keys and values near ops.sparse.CHUNK_BYTES, fewer queries when
            # the sequence is shorter) holds, per query and slot, the gathered key, value and index key rows, the
            # heads' scores and the indexer's per-head products and statistics
            rows = min(seq_len, config.query_chunk or default_chunk_size(1, slots, key_width, latent, torch.float32))
            chunk = 4 * rows * slots * (key_width + latent + config.index_dim + heads + 3 * index_heads + 4)
        temporary = max(grads + chunk, selection)
    else:
        # one chunk of the indexer loss: its score tile over every key, at most CHUNK_BYTES (indexer_kl's chunking)
        wide = 4 * seq_len * max(heads, index_heads, key_width)
        temporary = max(grads, wide * min(seq_len, config.query_chunk or max(1, CHUNK_BYTES // wide)))
    return MemoryEstimate(
        parameters=4 * parameters,
        saved_per_token=4 * per_token,
        temporary=temporary,
        tiling=TileCarry(per_token=4 * (key_width + config.index_dim)),  # each tile's keys and index keys
        kept_per_token=4 * selected_slots(config.topk, config.index_pool) if config.mode == "sparse" else 0,
    )
