"""A tiny correct attention component and deliberately wrong variants of it, one per conformance check.

Built through the suite's ``factory`` knob (``path/to/this/file.py:Class``), so the suite's gloo ranks can
rebuild them. Each variant changes one thing of ``ToyAttention`` and is caught by the check named in
``test_attention_suite.py``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from megaseq.contracts import ContextParallel, ForwardContext
from megaseq.documents import Documents
from megaseq.parallel import gather_sequence
from megaseq.records import MemoryEstimate, ModelDims


@dataclass
class Cache:
    k: Tensor  # [B, L, D]
    v: Tensor


class ToyAttention(nn.Module):
    """One-head causal softmax attention with a dense mask: packing, decoding and exact context parallelism
    (keys and values gathered with core's ``gather_sequence``)."""

    def __init__(self, config: dict[str, Any], dims: ModelDims, layer_idx: int) -> None:
        super().__init__()
        self.qkv = nn.Linear(dims.d_model, 3 * dims.d_model, bias=False)
        self.out = nn.Linear(dims.d_model, dims.d_model, bias=False)

    def init_cache(self, batch_size: int, *, device: torch.device, dtype: torch.dtype) -> Cache:
        empty = torch.zeros(batch_size, 0, self.out.in_features, device=device, dtype=dtype)
        return Cache(empty, empty.clone())

    def project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return q, k, v

    def query_positions(self, cp: ContextParallel, device: torch.device) -> Tensor:
        return cp.positions(device)

    def keys(self, k: Tensor, v: Tensor, cp: ContextParallel, documents: Documents | None) -> tuple[Tensor, Tensor]:
        return gather_sequence(k, cp), gather_sequence(v, cp)

    def mask(self, q_pos: Tensor, k_pos: Tensor, documents: Documents | None) -> Tensor:
        allowed = k_pos[None, :] <= q_pos[:, None]
        if documents is not None:
            doc = documents.doc_ids(q_pos.device)
            allowed = allowed & (doc[k_pos][None, :] == doc[q_pos][:, None])
        return allowed

    def attend(self, q: Tensor, k: Tensor, v: Tensor, allowed: Tensor) -> Tensor:
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
        return scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ v

    def forward(self, x: Tensor, ctx: ForwardContext, cache: Cache | None = None) -> Tensor:
        q, k, v = self.project(x)
        t, device = x.shape[1], x.device
        documents = ctx.documents
        if cache is not None:
            start = cache.k.shape[1]
            cache.k, cache.v = torch.cat([cache.k, k], 1), torch.cat([cache.v, v], 1)
            k, v = cache.k, cache.v
            q_pos, k_pos = torch.arange(start, start + t, device=device), torch.arange(start + t, device=device)
        elif ctx.cp is not None:
            q_pos = self.query_positions(ctx.cp, device)
            k_pos = torch.arange(ctx.cp.seq_len, device=device)
            k, v = self.keys(k, v, ctx.cp, documents)
        else:
            q_pos = k_pos = torch.arange(t, device=device)
        out = self.output(self.attend(q, k, v, self.mask(q_pos, k_pos, documents)))
        self.log_metrics(ctx, out)
        return out

    def output(self, hidden: Tensor) -> Tensor:
        return self.out(hidden)

    def log_metrics(self, ctx: ForwardContext, out: Tensor) -> None:
        ctx.log("toy/out_abs", out.abs().mean())  # a per-token mean over this call's tokens


# --- shape and dtype -----------------------------------------------------------------------------------


class UpcastsOutput(ToyAttention):
    """Returns float64 whatever the input dtype."""

    def forward(self, x: Tensor, ctx: ForwardContext, cache: Cache | None = None) -> Tensor:
        return super().forward(x, ctx, cache).double()


# --- causality -----------------------------------------------------------------------------------------


class PeeksAhead(ToyAttention):
    """Lets every query see the next token too."""

    def mask(self, q_pos: Tensor, k_pos: Tensor, documents: Documents | None) -> Tensor:
        return super().mask(q_pos + 1, k_pos, documents) | super().mask(q_pos, k_pos, documents)


# --- packing -------------------------------------------------------------------------------------------


class CrossesDocuments(ToyAttention):
    """Ignores document boundaries."""

    def mask(self, q_pos: Tensor, k_pos: Tensor, documents: Documents | None) -> Tensor:
        return super().mask(q_pos, k_pos, None)


# --- decoding ------------------------------------------------------------------------------------------


class ForgetfulCache(ToyAttention):
    """Decoding steps attend only to the new tokens (the cache is kept but not read)."""

    def forward(self, x: Tensor, ctx: ForwardContext, cache: Cache | None = None) -> Tensor:
        return super().forward(x, ctx, None if cache is None else self.init_cache(x.shape[0], device=x.device, dtype=x.dtype))


class OneTokenSteps(ToyAttention):
    """Decoding steps place all their queries at the step's last position: right for one new token, but the
    queries of a step of several tokens see the tokens after them."""

    def mask(self, q_pos: Tensor, k_pos: Tensor, documents: Documents | None) -> Tensor:
        if len(q_pos) < len(k_pos):  # a decoding step after a prefill
            q_pos = q_pos[-1:].expand_as(q_pos)
        return super().mask(q_pos, k_pos, documents)


# --- two forwards before one backward ------------------------------------------------------------------


class StashesOutputInput(ToyAttention):
    """A hand-written output projection that keeps its input on the module for its backward: a second
    forward before the backward overwrites it."""

    def output(self, hidden: Tensor) -> Tensor:
        self.stash = hidden.detach()
        return _StashedLinear.apply(hidden, self.out.weight, self)


class _StashedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, h: Tensor, weight: Tensor, module: StashesOutputInput) -> Tensor:  # type: ignore[override]
        ctx.module, ctx.weight = module, weight.detach()
        return F.linear(h, weight)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, None]:  # type: ignore[override]
        h = ctx.module.stash
        return grad @ ctx.weight, grad.reshape(-1, grad.shape[-1]).t() @ h.reshape(-1, h.shape[-1]), None


# --- kept for a re-run ---------------------------------------------------------------------------------


class KeepsOrder(ToyAttention):
    """Keeps a choice for recomputation's re-run (``ForwardContext.keep``): each query's keys by score, int64,
    which the output does not need (a correct component; its estimate must declare the bytes)."""

    def attend(self, q: Tensor, k: Tensor, v: Tensor, allowed: Tensor) -> Tensor:
        self.kept = self.ctx.keep("order", lambda: (q @ k.transpose(-1, -2)).detach().argmax(-1))
        return super().attend(q, k, v, allowed)

    def forward(self, x: Tensor, ctx: ForwardContext, cache: Cache | None = None) -> Tensor:
        self.ctx = ctx
        return super().forward(x, ctx, cache)


class ChangesKeptValue(KeepsOrder):
    """Uses its kept choice and then changes it in place: a re-run gets another value than its forward used."""

    def attend(self, q: Tensor, k: Tensor, v: Tensor, allowed: Tensor) -> Tensor:
        out = super().attend(q, k, v, allowed)
        scale = 1.0 + self.kept.float().mean() / 64  # the output depends on the choice
        self.kept.add_(1)
        return out * scale


class ChangesKeptValueWhenPacked(ChangesKeptValue):
    """Changes its kept choice in place only on packed documents: right on plain rows, wrong on packed ones."""

    def attend(self, q: Tensor, k: Tensor, v: Tensor, allowed: Tensor) -> Tensor:
        if self.ctx.cu_seqlens is None:
            return KeepsOrder.attend(self, q, k, v, allowed)
        return super().attend(q, k, v, allowed)


def keeps_order_memory(config: dict[str, Any], dims: ModelDims, seq_len: int) -> MemoryEstimate:
    """``KeepsOrder``'s estimate: one int64 per token kept (``kept_per_token``), beside ``ToyAttention``'s saved bytes."""
    return MemoryEstimate(parameters=0, saved_per_token=0.0, kept_per_token=8.0)


def keeps_order_undeclared(config: dict[str, Any], dims: ModelDims, seq_len: int) -> MemoryEstimate:
    """``KeepsOrder``'s estimate without what it keeps for a re-run."""
    return MemoryEstimate(parameters=0, saved_per_token=0.0)


# --- memory estimates ----------------------------------------------------------------------------------


def sdpa(config: dict[str, Any], dims: ModelDims, layer_idx: int) -> nn.Module:
    """Core's ``sdpa`` built from a plain config, to pair with the estimates below."""
    from megaseq.builtins.config import SDPAConfig
    from megaseq.builtins.sdpa import build

    return build(SDPAConfig(**config), dims, layer_idx)


def sdpa_memory_third(config: dict[str, Any], dims: ModelDims, seq_len: int) -> MemoryEstimate:
    """A third of what ``sdpa`` keeps for backward: the estimate an author writes who forgot the projections."""
    from megaseq.builtins.config import SDPAConfig
    from megaseq.builtins.sdpa import memory_estimate

    estimate = memory_estimate(SDPAConfig(**config), dims, seq_len)
    return dataclasses.replace(estimate, saved_per_token=estimate.saved_per_token / 3)


def toy_memory_at_64(config: dict[str, Any], dims: ModelDims, seq_len: int) -> MemoryEstimate:
    """``ToyAttention``'s bytes kept for backward, measured at 64 tokens and divided by 64: right there, but
    the toy keeps its ``[T, T]`` attention probabilities, which grow faster than the tokens."""
    from megaseq_testkit.checks import saved_bytes

    torch.manual_seed(0)
    module = ToyAttention(config, dims, 0)
    x = torch.randn(1, 64, dims.d_model, requires_grad=True)
    count, _ = saved_bytes(lambda: module(x, ForwardContext()), (x,), tuple(module.parameters()))
    return MemoryEstimate(parameters=0, saved_per_token=count / 64)


class WideScratch(ToyAttention):
    """Runs its attention output through a scratch 32 times as wide (a lookup's expansion) before projecting it:
    a buffer of 32 x d_model floats per token, freed before forward returns."""

    def output(self, hidden: Tensor) -> Tensor:
        wide = hidden.unsqueeze(-1).expand(*hidden.shape, 32).contiguous()
        return super().output(wide.mean(-1))


def no_temporary(config: dict[str, Any], dims: ModelDims, seq_len: int) -> MemoryEstimate:
    """An estimate that declares no transient working set at all."""
    return MemoryEstimate(parameters=0, saved_per_token=0.0)


def sdpa_memory(config: dict[str, Any], dims: ModelDims, seq_len: int) -> MemoryEstimate:
    """``sdpa``'s own estimate, from a plain config."""
    from megaseq.builtins.config import SDPAConfig
    from megaseq.builtins.sdpa import memory_estimate

    return memory_estimate(SDPAConfig(**config), dims, seq_len)


def sdpa_temporary_tenfold(config: dict[str, Any], dims: ModelDims, seq_len: int) -> MemoryEstimate:
    """Ten times ``sdpa``'s working set: the planner would refuse layouts that fit."""
    estimate = sdpa_memory(config, dims, seq_len)
    return dataclasses.replace(estimate, temporary=10 * estimate.temporary)


# --- gradients -----------------------------------------------------------------------------------------


class DetachedProjection(ToyAttention):
    """The value projection's weight is used detached: ``qkv.weight`` misses part of its gradient."""

    def project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        q, k, _ = super().project(x)
        d = x.shape[-1]
        return q, k, F.linear(x, self.qkv.weight[2 * d :].detach())


class FrozenByData(ToyAttention):
    """The output projection is applied through ``.data``: it gets no gradient at all (``grad is None``)."""

    def output(self, hidden: Tensor) -> Tensor:
        return F.linear(hidden, self.out.weight.data)


class _HalfGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:  # type: ignore[override]
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:  # type: ignore[override]
        return 0.5 * grad  # wrong: the identity's gradient is grad


class WrongBackward(ToyAttention):
    """A hand-written backward (here of the identity, on the values) with a mistake."""

    def project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        q, k, v = super().project(x)
        return q, k, _HalfGradient.apply(v)


# --- determinism ---------------------------------------------------------------------------------------


class GlobalNoise(ToyAttention):
    """Adds noise drawn from torch's global generator."""

    def forward(self, x: Tensor, ctx: ForwardContext, cache: Cache | None = None) -> Tensor:
        return super().forward(x, ctx, cache) + 1e-3 * torch.randn_like(x)


# --- zeros and padding ---------------------------------------------------------------------------------


class NormalisesWithoutEpsilon(ToyAttention):
    """Normalises queries by their length: NaN for an all-zero token."""

    def project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        q, k, v = super().project(x)
        return q / q.norm(dim=-1, keepdim=True), k, v


class NormalisesDocumentsWithoutEpsilon(ToyAttention):
    """Scales each packed document's values by their mean magnitude: NaN for an all-zero document (rows
    without packing are left alone, so all-zero rows pass)."""

    def forward(self, x: Tensor, ctx: ForwardContext, cache: Cache | None = None) -> Tensor:
        if ctx.documents is not None and ctx.cp is None:
            doc = ctx.documents.doc_ids(x.device)
            size = torch.zeros(ctx.documents.n_docs, dtype=x.dtype).index_add(0, doc, x[0].abs().mean(-1))
            count = torch.zeros(ctx.documents.n_docs, dtype=x.dtype).index_add(0, doc, torch.ones_like(doc, dtype=x.dtype))
            x = x / (size / count.clamp_min(1))[doc][None, :, None]
        return super().forward(x, ctx, cache)


# --- host synchronisation ------------------------------------------------------------------------------


class ReadsBoundariesEveryLayer(ToyAttention):
    """Reads ``cu_seqlens`` to the host in every layer (instead of using ``ctx.documents``)."""

    def forward(self, x: Tensor, ctx: ForwardContext, cache: Cache | None = None) -> Tensor:
        if ctx.cu_seqlens is not None:
            ctx = ForwardContext(cu_seqlens=ctx.cu_seqlens, cp=ctx.cp)  # a fresh layout per layer
        return super().forward(x, ctx, cache)


# --- context parallelism -------------------------------------------------------------------------------


class IgnoresContextParallel(ToyAttention):
    """Treats the rank's zig-zag share as if it were the whole sequence."""

    def forward(self, x: Tensor, ctx: ForwardContext, cache: Cache | None = None) -> Tensor:
        if ctx.cp is not None:
            ctx = ForwardContext()
        return super().forward(x, ctx, cache)


class TwoRanksOnly(ToyAttention):
    """Computes the global positions of its queries as if there were always two ranks."""

    def query_positions(self, cp: ContextParallel, device: torch.device) -> Tensor:
        n = cp.segment_len
        first, second = cp.rank, 3 - cp.rank  # right for 2 ranks only: the pair of segment r is 2W - 1 - r
        return torch.cat([torch.arange(s * n, (s + 1) * n, device=device) for s in (first, second)])


class SkipsGatherWhenUnneeded(ToyAttention):
    """On a rank whose segments both start a document (so no query needs another rank's keys) the gathered
    keys are replaced by local ones: the values are right, but this rank's backward skips the gather's
    collective that the other ranks run."""

    def keys(self, k: Tensor, v: Tensor, cp: ContextParallel, documents: Documents | None) -> tuple[Tensor, Tensor]:
        k_all, v_all = super().keys(k, v, cp, documents)
        starts = set(documents.offsets[:-1]) if documents is not None else {0}
        if all(start in starts for start, _ in cp.segments()):
            local = torch.zeros_like(k_all), torch.zeros_like(v_all)
            for i, (start, end) in enumerate(cp.segments()):
                n = end - start
                local[0][:, start:end] = k[:, i * n : (i + 1) * n]
                local[1][:, start:end] = v[:, i * n : (i + 1) * n]
            return local
        return k_all, v_all


class SumsMetric(ToyAttention):
    """Logs a sum over its tokens where the contract asks for a per-token mean: each rank's share of the
    sum, so the mean over ranks is the single rank's value divided by the ranks."""

    def log_metrics(self, ctx: ForwardContext, out: Tensor) -> None:
        ctx.log("toy/out_abs", out.abs().sum())


class OptOutRaises(ToyAttention):
    """Declares no context-parallel support and says so."""

    def forward(self, x: Tensor, ctx: ForwardContext, cache: Cache | None = None) -> Tensor:
        if ctx.cp is not None:
            raise ValueError("attention.toy: context parallelism is not supported; use another attention")
        return super().forward(x, ctx, cache)
