"""The ``chunked`` MoE layer: dropless, sort-based, expert-parallel, processed in token chunks.

Forward: a first pass picks every token's experts (``[N, k]`` indices, the only per-token routing state
that is kept; routing replay may substitute recorded ones). Then the tokens are processed ``chunk_tokens``
at a time without building an autograd graph: route weights, dispatch rows to the experts' ranks, run the
SwiGLU experts on rows grouped by expert, send the outputs back, combine, add the shared expert.

Backward (one custom autograd function): chunk by chunk, the forward of that chunk is recomputed with
gradients on and differentiated at once. Each origin rank sends ``[x | dL/dy | w]`` for every (token, slot)
pair; the expert's rank recomputes the expert output ``h``, back-propagates ``w * dL/dy`` into the expert
weights and the row, and returns ``[dL/dx_row | <dL/dy, h>]``, the latter being dL/dw. The router and
shared expert are differentiated locally. So autograd keeps only the layer input and the indices between
forward and backward, and the peak of both passes is bounded by the chunk (times the number of
expert-parallel ranks under the worst skew), not by the sequence. The price is one recomputed forward.

Tensor parallelism (megatron-core's layout, with sequence parallelism): each rank routes the tokens of its
sequence chunk, with the router and shared expert whole on every rank. The routed experts are split by
expert tensor parallelism (``ModelDims.etp_size``, ``ctx.etp_group``): each rank of an expert-tensor-parallel
group holds a block of every local expert's hidden width and runs it on the rows the whole group received
(``megaseq_moe.dispatch.TensorGather``); with ``etp = 1`` every rank holds its experts whole. The balance
loss counts each sequence over the context- and tensor-parallel ranks that hold its tokens. Without sequence
parallelism (decoding) every tensor-parallel rank routes the whole sequence.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from megaseq.contracts import ForwardContext, iter_modules
from megaseq.documents import as_documents
from megaseq.dtypes import compute_dtype
from megaseq.parallel import collectives, tp_chunk
from megaseq.records import MemoryEstimate, ModelDims
from megaseq_moe.config import ChunkedMoEConfig
from megaseq_moe.dispatch import count_ids, plan_dispatch, plan_tensor_gather
from megaseq_moe.ep import agree_max, group_size, sum_over
from megaseq_moe.experts import GroupedExperts, SharedExpert, expert_dtype
from megaseq_moe.router import Router

AUX_LOSS_NAME = "moe/aux"


class ChunkedMoE(nn.Module):
    """One MoE layer (see the module docstring); implements ``megaseq.contracts.MoE``."""

    def __init__(self, config: ChunkedMoEConfig, dims: ModelDims, layer_idx: int) -> None:
        super().__init__()
        check_expert_split(config, dims)
        self.n_experts = config.n_experts
        self.top_k = config.top_k
        self.chunk_tokens = config.chunk_tokens
        self.bias_update_rate = config.bias_update_rate
        self.aux_loss_coef = config.aux_loss_coef
        self.routing_key = f"layer{layer_idx}"
        self.ep_rank, self.ep_size = dims.ep_rank, dims.ep_size
        self.etp_rank, self.etp_size = dims.etp_rank, dims.etp_size
        self.n_local = config.n_experts // dims.ep_size
        self.first_expert = dims.ep_rank * self.n_local
        d = dims.d_model
        self.router = Router(d, config.n_experts, config.top_k, config.routed_scaling_factor, config.init_std)
        self.experts = GroupedExperts(
            self.n_local, d, config.expert_hidden // dims.etp_size, config.swiglu_limit, config.init_std,
            self.first_expert, config.n_experts, dims.etp_rank, dims.etp_size,
        )
        self.shared = (
            SharedExpert(d, config.shared_width, config.swiglu_limit, config.init_std)
            if config.shared_width
            else None
        )
        # assignments per expert over the whole expert-parallel group since the last optimizer step
        self.register_buffer("step_load", torch.zeros(config.n_experts, dtype=torch.int64), persistent=False)
        self.last_load: Tensor | None = None

    # --- the per-token definition (megaseq.contracts.MoE) -------------------------------------------------

    def route(self, x: Tensor, indices: Tensor | None = None) -> tuple[Tensor, Tensor]:
        affinities = self.router.affinities(x)
        if indices is None:
            indices = self.router.select(affinities)
        return indices, self.router.combine_weights(affinities, indices)

    def expert_forward(self, expert: int, x: Tensor) -> Tensor:
        local = expert - self.first_expert
        if not 0 <= local < self.n_local:
            raise ValueError(
                f"expert {expert} is not on expert-parallel rank {self.ep_rank} "
                f"(it holds {self.first_expert}..{self.first_expert + self.n_local - 1})"
            )
        return self.experts.one(local, x)

    def shared_forward(self, x: Tensor, dtype: torch.dtype | None = None) -> Tensor:
        return self.shared(x, dtype) if self.shared is not None else torch.zeros_like(x)

    def load_stats(self) -> dict[str, float]:
        """Load of the last training forward over the expert-parallel group; empty before the first one."""
        return {} if self.last_load is None else load_summary(self.last_load, self.ep_size)

    # --- the chunked computation --------------------------------------------------------------------------

    def forward(self, x: Tensor, ctx: ForwardContext) -> Tensor:
        # Routing and the combination run in the input's dtype, also under autocast: a bf16 router would pick
        # other experts than the recomputation and the fp32 path (near-ties). The routed and shared experts take
        # the dtype of a CUDA bf16 autocast (expert_dtype), decided here once for the forward and its recomputation.
        kind = x.device.type
        experts_dtype = expert_dtype(kind, x.dtype, torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None)
        with torch.autocast(kind, enabled=False):
            return self._forward(x, ctx, experts_dtype)

    def _forward(self, x: Tensor, ctx: ForwardContext, experts_dtype: torch.dtype) -> Tensor:
        batch, length, d = x.shape
        tokens = x.reshape(-1, d)
        group, etp_group = self._ep_group(ctx), self._etp_group(ctx)
        indices = self._select(tokens)
        if ctx.routing is not None:
            indices = ctx.routing.route(self.routing_key, indices)
        if self.training and not ctx.recomputing:  # a re-run for recomputation must not count the load again
            self.last_load = sum_over(count_ids(indices, self.n_experts), group)
            self.step_load += self.last_load
        with_aux = self.training and self.aux_loss_coef > 0
        segments, n_segments = self._segments(batch, length, ctx, x.device) if with_aux else (None, 0)
        out, affinity_sums = _ChunkedMoEFunction.apply(
            self, tokens, indices, segments, n_segments, group, etp_group, experts_dtype, *self._params()
        )
        if with_aux:
            sharing = [part.group for part in (ctx.cp, _splitting(ctx)) if part is not None]  # ranks holding a sequence's tokens
            ctx.add_loss(AUX_LOSS_NAME, self._aux_loss(indices, segments, n_segments, affinity_sums, sharing))
        return out.view(batch, length, d)

    def _params(self) -> list[nn.Parameter]:
        """Parameters in the order the autograd function receives and returns them."""
        shared = [self.shared.w_gate_up, self.shared.w_down] if self.shared is not None else []
        return [self.router.weight, self.experts.w_gate_up, self.experts.w_down, *shared]

    def _ep_group(self, ctx: ForwardContext) -> Any | None:
        size = group_size(ctx.ep_group)
        if size != self.ep_size:
            raise ValueError(
                f"{self.routing_key}: built for {self.ep_size} expert-parallel ranks, ctx.ep_group has {size}"
            )
        if size == 1:
            return None
        if dist.get_rank(ctx.ep_group) != self.ep_rank:
            raise ValueError(
                f"{self.routing_key}: built as expert-parallel rank {self.ep_rank}, "
                f"running as rank {dist.get_rank(ctx.ep_group)} of ctx.ep_group"
            )
        return ctx.ep_group

    def _etp_group(self, ctx: ForwardContext) -> Any | None:
        size = group_size(ctx.etp_group)
        if size != self.etp_size:
            raise ValueError(
                f"{self.routing_key}: built for {self.etp_size} expert-tensor-parallel ranks, ctx.etp_group has {size}"
            )
        if size == 1:
            return None
        if dist.get_rank(ctx.etp_group) != self.etp_rank:
            raise ValueError(
                f"{self.routing_key}: built as expert-tensor-parallel rank {self.etp_rank}, "
                f"running as rank {dist.get_rank(ctx.etp_group)} of ctx.etp_group"
            )
        return ctx.etp_group

    def _chunk_size(self, n_tokens: int) -> int:
        return self.chunk_tokens or max(1, n_tokens)

    @torch.no_grad()
    def _select(self, tokens: Tensor) -> Tensor:
        """Every token's experts ``[N, k]``, chunk by chunk so that no ``[N, E]`` affinity matrix exists."""
        chunks = tokens.split(self._chunk_size(tokens.shape[0]))
        return torch.cat([self.router.select(self.router.affinities(c)) for c in chunks])

    def _chunk_bounds(
        self, n_tokens: int, group: Any | None, etp_group: Any | None, device: torch.device
    ) -> list[tuple[int, int]]:
        """``[start, end)`` of each chunk; every rank of the expert-parallel and expert-tensor-parallel groups runs
        the same number (some maybe empty): the largest over the first, then over the second, is the largest over
        every rank they connect."""
        size = self._chunk_size(n_tokens)
        n_chunks = agree_max(agree_max(math.ceil(n_tokens / size), group, device), etp_group, device)
        return [(min(i * size, n_tokens), min((i + 1) * size, n_tokens)) for i in range(n_chunks)]

    def _segments(
        self, batch: int, length: int, ctx: ForwardContext, device: torch.device
    ) -> tuple[Tensor, int]:
        """Sequence id of each token for the balance loss: the document under packing, else the batch row."""
        if ctx.documents is None:
            return torch.arange(batch, device=device).repeat_interleave(length), batch
        # the tokens here: the tensor-parallel chunk of the context-parallel shard of the whole sequence
        shard = length * (ctx.tp.world_size if _splitting(ctx) is not None else 1)
        total = ctx.cp.seq_len if ctx.cp is not None else shard
        documents = as_documents(ctx.documents, batch=batch, length=total, who=f"moe {self.routing_key}: cu_seqlens")
        doc_ids = documents.doc_ids(device)
        if ctx.cp is not None:
            doc_ids = doc_ids[ctx.cp.positions(device)]
        return (doc_ids if ctx.tp is None else tp_chunk(doc_ids, ctx.tp, dim=0)), documents.n_docs

    def _aux_loss(
        self, indices: Tensor, segments: Tensor, n_segments: int, affinity_sums: Tensor, sharing: list[Any]
    ) -> Tensor:
        """Sequence-level balance loss (DeepSeek-V3): ``coef * mean_s sum_e f_se P_se``, ``f_se`` = E/(k T_s)
        times the assignments of sequence s to expert e, ``P_se`` its mean normalised affinity.

        Under context or tensor parallelism a sequence is spread over the ranks (the groups in ``sharing``): the
        counts (``f``, ``T_s``, no gradient) are summed over them, and each rank multiplies them with its own
        affinity sums, so the ranks' losses are shares that add up to the single-rank loss (the contract for
        auxiliary losses) and each rank's gradient is its tokens' part of it."""
        e, k = self.n_experts, self.top_k
        counts = torch.zeros(n_segments * e, device=indices.device)
        counts.index_add_(
            0,
            (segments[:, None] * e + indices).reshape(-1),
            torch.ones(indices.numel(), device=indices.device),
        )
        tokens = count_ids(segments, n_segments).float()
        for group in sharing:
            counts, tokens = sum_over(counts, group), sum_over(tokens, group)
        present = tokens > 0
        per_token = tokens.clamp_min(1)[:, None]
        f = counts.view(n_segments, e) * e / (k * per_token)
        per_segment = (f * affinity_sums / per_token).sum(-1)
        return self.aux_loss_coef * per_segment[present].sum() / present.sum().clamp_min(1)

    def _local_part(
        self, x: Tensor, indices: Tensor, segments: Tensor | None, n_segments: int, experts_dtype: torch.dtype | None
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        """What the origin rank computes for a chunk: routing weights, shared output, affinity sums."""
        affinities = self.router.affinities(x)
        weights = self.router.combine_weights(affinities, indices)
        sums = None
        if n_segments:
            normalised = affinities / affinities.sum(-1, keepdim=True)
            sums = affinities.new_zeros(n_segments, self.n_experts).index_add(0, segments, normalised)
        return weights, self.shared_forward(x, experts_dtype), sums

    def chunk_forward(
        self, x: Tensor, indices: Tensor, segments: Tensor | None, n_segments: int, group: Any | None,
        etp_group: Any | None = None, experts_dtype: torch.dtype | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        weights, out, sums = self._local_part(x, indices, segments, n_segments, experts_dtype)
        plan = plan_dispatch(indices, self.n_experts, group)
        rows = plan.send(x[plan.tokens])
        if etp_group is None:
            h = self.experts(rows, plan.expert_counts, experts_dtype)
        else:  # this rank's block of the hidden width on the group's rows, summed back over the group
            shared = plan_tensor_gather(plan.expert_counts, etp_group)
            h = shared.reduce(self.experts(shared.gather(rows), shared.expert_counts, experts_dtype))
        h = plan.send_back(h)
        acc = compute_dtype(x.dtype)
        combined = out.to(acc).index_add(
            0, plan.tokens, h.to(acc) * weights.to(acc).reshape(-1)[plan.order, None]
        )
        return combined.to(x.dtype), sums

    def chunk_backward(
        self,
        x: Tensor,
        indices: Tensor,
        segments: Tensor | None,
        n_segments: int,
        group: Any | None,
        grad_out: Tensor,
        grad_sums: Tensor | None,
        etp_group: Any | None = None,
        experts_dtype: torch.dtype | None = None,
    ) -> tuple[Tensor, list[Tensor | None]]:
        """Recompute one chunk; return the chunk's ``dL/dx`` and its share of each ``_params()`` gradient.

        Under expert tensor parallelism the received payloads are shared over the group: each rank's expert
        block gets the gradient of every row the group received, and a row's ``dL/dx`` and ``<dL/dy, h>`` are
        sums over the blocks (``h`` is), so the partial ones are summed back on the row's rank."""
        d = x.shape[1]
        x = x.detach().requires_grad_(True)
        with torch.enable_grad():
            weights, out, sums = self._local_part(x, indices, segments, n_segments, experts_dtype)
        plan = plan_dispatch(indices, self.n_experts, group)
        pair_weights = weights.detach().reshape(-1)[plan.order, None].to(x.dtype)
        received = plan.send(torch.cat([x.detach()[plan.tokens], grad_out[plan.tokens], pair_weights], dim=1))
        counts, shared = plan.expert_counts, None
        if etp_group is not None:
            shared = plan_tensor_gather(plan.expert_counts, etp_group)
            received, counts = shared.gather(received), shared.expert_counts
        rows = received[:, :d].contiguous().requires_grad_(True)
        grad_h = received[:, d : 2 * d]
        with torch.enable_grad():
            h = self.experts(rows, counts, experts_dtype)
        expert_weights = [self.experts.w_gate_up, self.experts.w_down]
        grad_rows, *expert_grads = _grads([h], [grad_h * received[:, 2 * d :]], [rows, *expert_weights])
        acc = compute_dtype(x.dtype)
        grad_pair_weights = (grad_h.to(acc) * h.detach().to(acc)).sum(-1, keepdim=True)
        answer = torch.cat([_or_zeros(grad_rows, rows), grad_pair_weights.to(x.dtype)], dim=1)
        back = plan.send_back(answer if shared is None else shared.reduce(answer))
        grad_x = torch.zeros(x.shape, dtype=acc, device=x.device).index_add_(
            0, plan.tokens, back[:, :d].to(acc)
        )
        grad_weights = weights.new_zeros(weights.numel()).index_copy_(
            0, plan.order, back[:, d].to(weights.dtype)
        )
        shared = [self.shared.w_gate_up, self.shared.w_down] if self.shared is not None else []
        grad_x_local, grad_router, *shared_grads = _grads(
            [weights, out, sums],
            [grad_weights.view_as(weights), grad_out, grad_sums],
            [x, self.router.weight, *shared],
        )
        if grad_x_local is not None:
            grad_x += grad_x_local
        return grad_x.to(x.dtype), [grad_router, *expert_grads, *shared_grads]


class _ChunkedMoEFunction(torch.autograd.Function):
    """Chunked forward without a graph; chunked recompute-and-differentiate backward (module docstring)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        layer: ChunkedMoE,
        x: Tensor,
        indices: Tensor,
        segments: Tensor | None,
        n_segments: int,
        group: Any | None,
        etp_group: Any | None,
        experts_dtype: torch.dtype,
        *params: Tensor,
    ) -> tuple[Tensor, Tensor]:
        bounds = layer._chunk_bounds(x.shape[0], group, etp_group, x.device)
        out = torch.empty_like(x)
        sums = torch.zeros(n_segments, layer.n_experts, dtype=compute_dtype(x.dtype), device=x.device)
        for a, b in bounds:
            seg = segments[a:b] if segments is not None else None
            out[a:b], chunk_sums = layer.chunk_forward(
                x[a:b], indices[a:b], seg, n_segments, group, etp_group, experts_dtype
            )
            if chunk_sums is not None:
                sums += chunk_sums
        ctx.layer, ctx.group, ctx.etp_group, ctx.n_segments, ctx.bounds = layer, group, etp_group, n_segments, bounds
        ctx.experts_dtype = experts_dtype
        ctx.save_for_backward(x, indices, segments)
        return out, sums

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor, grad_sums: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        x, indices, segments = ctx.saved_tensors
        layer: ChunkedMoE = ctx.layer
        params = layer._params()
        grad_x = torch.empty_like(x)
        # accumulate over chunks in fp32 (at least) so that bf16 weights do not lose the small per-chunk terms
        grad_params = [
            torch.zeros(p.shape, dtype=compute_dtype(p.dtype), device=p.device) for p in params
        ]
        grad_out = grad_out.contiguous()
        for a, b in ctx.bounds:
            seg = segments[a:b] if segments is not None else None
            grad_sums_arg = grad_sums if ctx.n_segments else None
            grad_x[a:b], chunk_grads = layer.chunk_backward(
                x[a:b], indices[a:b], seg, ctx.n_segments, ctx.group, grad_out[a:b], grad_sums_arg, ctx.etp_group,
                ctx.experts_dtype,
            )
            for total, g in zip(grad_params, chunk_grads, strict=True):
                if g is not None:
                    total += g
        return (
            None,
            grad_x,
            None,
            None,
            None,
            None,
            None,
            None,
            *(g.to(p.dtype) for g, p in zip(grad_params, params, strict=True)),
        )


def _grads(
    outputs: list[Tensor | None], grad_outputs: list[Tensor | None], inputs: list[Tensor]
) -> list[Tensor | None]:
    """``torch.autograd.grad`` skipping outputs without a graph and inputs that need no gradient (frozen)."""
    pairs = [
        (o, g)
        for o, g in zip(outputs, grad_outputs, strict=True)
        if o is not None and g is not None and o.requires_grad
    ]
    wanted = [i for i in inputs if i.requires_grad]
    if not pairs or not wanted:
        return [None] * len(inputs)
    got = iter(torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True))
    return [next(got) if i.requires_grad else None for i in inputs]


def _or_zeros(grad: Tensor | None, like: Tensor) -> Tensor:
    return grad if grad is not None else torch.zeros_like(like)


def load_summary(load: Tensor, ep_size: int) -> dict[str, Tensor]:
    """Statistics of (token, expert) assignments per expert: max / mean per expert and per expert-parallel
    rank, and the routing entropy in nats of the share per expert (``log(n_experts)`` when perfectly even).
    0-dim float64 tensors on ``load``'s device: the trainer reads them together with every other layer's."""
    load = load.double()
    per_rank = load.view(ep_size, -1).sum(1)
    share = load / load.sum().clamp_min(1)
    entropy = -(share * share.clamp_min(1e-300).log()).sum()
    return {
        "tokens_per_expert_max": load.max(),
        "tokens_per_expert_mean": load.mean(),
        "tokens_per_rank_max": per_rank.max(),
        "tokens_per_rank_mean": per_rank.mean(),
        "routing_entropy": entropy,
    }


def end_step(model: nn.Module, metrics: dict[str, float]) -> None:
    """After an optimizer step: nudge every layer's balancing bias by the step's load and report the load.

    The loads are summed over all ranks (when torch.distributed is up) so every data-parallel replica moves
    its bias identically; the rule uses only the sign of ``mean - load``, which the sum does not change. A layer
    without a training forward since the last step (no load) keeps its bias and reports nothing. Every layer is
    handled on the device and the metrics are read once, whatever the number of layers.
    """
    layers = [module for _, module in iter_modules(model, ChunkedMoE)]
    if not layers:
        return
    loads = torch.stack([layer.step_load for layer in layers])
    if dist.is_available() and dist.is_initialized():
        collectives.all_reduce(loads, dist.group.WORLD)
    routed = loads.sum(1) > 0
    rows = []
    for layer, load, moved in zip(layers, loads, routed, strict=True):
        layer.step_load.zero_()
        layer.router.update_bias(load, layer.bias_update_rate * moved)
        stats = load_summary(load, layer.ep_size)
        rows.append(torch.stack([
            stats["tokens_per_expert_max"] / stats["tokens_per_expert_mean"],
            stats["tokens_per_rank_max"] / stats["tokens_per_rank_mean"],
            stats["routing_entropy"],
            layer.router.expert_bias.abs().max().double(),
        ]))
    table = torch.cat([routed[:, None].double(), torch.stack(rows)], dim=1).tolist()  # the one read
    used = [(layer, row[1:]) for layer, row in zip(layers, table, strict=True) if row[0]]
    if not used:
        return
    for layer, (expert_ratio, _, _, _) in used:
        metrics[f"moe/{layer.routing_key}/expert_max_over_mean"] = expert_ratio
    metrics["moe/expert_max_over_mean"] = max(row[0] for _, row in used)
    metrics["moe/rank_max_over_mean"] = max(row[1] for _, row in used)
    metrics["moe/routing_entropy"] = sum(row[2] for _, row in used) / len(used)
    metrics["moe/bias_abs_max"] = max(row[4] for row in table)


def build(config: ChunkedMoEConfig, dims: ModelDims, layer_idx: int) -> ChunkedMoE:
    return ChunkedMoE(ChunkedMoEConfig.model_validate(config), dims, layer_idx)


def check_expert_split(config: ChunkedMoEConfig, dims: ModelDims) -> None:
    if config.n_experts % dims.ep_size:
        raise ValueError(f"n_experts ({config.n_experts}) must be a multiple of the expert-parallel size ({dims.ep_size})")
    if config.expert_hidden % dims.etp_size:
        raise ValueError(f"moe.chunked: expert_hidden {config.expert_hidden} is not a multiple of etp {dims.etp_size}")


def memory_estimate(config: ChunkedMoEConfig, dims: ModelDims, seq_len: int) -> MemoryEstimate:
    """Bytes for one layer in fp32. ``temporary`` is the peak inside one chunk's backward (the larger pass),
    sized for the worst skew: every expert-parallel rank sends its whole chunk to this rank (and under expert
    tensor parallelism, to each rank of its group)."""
    check_expert_split(config, dims)
    d, h, hs, e, k = dims.d_model, config.expert_hidden // dims.etp_size, config.shared_width, config.n_experts, config.top_k
    n_local = e // dims.ep_size
    parameters = 4 * (n_local * 3 * d * h + e * d + 3 * d * hs + e)
    chunk = min(seq_len, config.chunk_tokens or seq_len)
    rows = chunk * k * dims.ep_size * dims.etp_size
    # per received row: the [x | dy | w] payload, the row, the recomputed expert (gate_up, silu, act, h) and
    # its gradients; per token: affinities and the shared expert's graph; plus the weight gradients twice
    # (the fp32 accumulators and one chunk's share). Compared with measured peaks in benchmarks/bench_moe.py.
    temporary = 4 * (rows * (4 * d + 6 * h) + chunk * (3 * e + 4 * hs + 2 * d)) + 2 * parameters
    return MemoryEstimate(parameters=parameters, saved_per_token=4 * d + 8 * k, temporary=temporary)


def _splitting(ctx: ForwardContext) -> Any | None:
    """The tensor-parallel rank's place when it holds a chunk of the sequence (sequence parallelism), else None:
    without sequence parallelism every tensor-parallel rank routes all the tokens, as one rank does."""
    return ctx.tp if ctx.tp is not None and ctx.tp.sequence_parallel else None
