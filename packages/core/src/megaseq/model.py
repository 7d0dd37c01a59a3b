"""The model: embeddings, a stack of pre-norm blocks (attention + FFN/MoE from plugins), a tied LM head.

The LM head is never applied to the whole sequence at once: :func:`chunked_token_losses` computes the
per-token cross-entropy over chunks of tokens and recomputes each chunk's logits in backward, so full
``[T, vocab]`` logits never exist.

The residual stream (the embedding's output and every block's input and output) is fp32 unless
``model.residual_dtype = "bf16"``: then, in a forward under bf16 autocast (``train.bf16``: training and
evaluation), the embedding's output is cast to bf16 and the blocks add their bf16 outputs to it in bf16, so
what recomputation keeps and offloading moves per token is half as large. A forward without autocast (an
inference engine's own dtype) is unchanged.

Under tensor parallelism (``ModelDims.tp_size > 1``, ``ForwardContext.tp``) the embedding and the head hold
this rank's block of ``ceil(vocab_size / tp)`` ids of the vocabulary (the last blocks padded with rows that
no token looks up and the loss leaves out of its softmax); the embedding looks up the whole window's tokens in its block and
reduce-scatters the sum, so the blocks see this rank's sequence chunk (``megaseq.contracts.TensorParallel``),
and the final hidden states are that chunk. The loss gathers them back and uses the vocabulary-parallel
cross-entropy. Decoding runs tensor parallelism without sequence parallelism (every rank holds the whole
short sequence) and gathers the sampled positions' logits over the group (:meth:`LanguageModel.logits`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from megaseq.config import Recipe
from megaseq.contracts import ForwardContext, TensorParallel, Tile
from megaseq.parallel import all_gather, tp_gather, tp_reduce_scatter, tp_split, vocab_parallel_cross_entropy
from megaseq.plugins import Plugins
from megaseq.records import ModelDims


class RMSNorm(nn.Module):
    """``(x * rstd).to(x.dtype) * weight`` with ``rstd = (mean(x^2) + eps)^-1/2`` computed in fp32 (float64 for
    float64 inputs)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return _RMSNorm.apply(x, self.weight, self.eps)


class _RMSNorm(torch.autograd.Function):
    """RMSNorm that keeps only its input and ``rstd`` (one number per token) for backward, not the normalised
    input too (recomputed there): half the bytes plain autograd would keep."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, eps: float) -> Tensor:  # type: ignore[override]
        xf = x.to(torch.promote_types(x.dtype, torch.float32))
        rstd = torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return (xf * rstd).to(x.dtype) * weight

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        x, weight, rstd = ctx.saved_tensors
        normed = x.to(rstd.dtype) * rstd
        grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_weight = (grad * normed.to(x.dtype)).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
        grad_normed = (grad * weight).to(rstd.dtype)
        # d/dx of x * rstd(x): rstd * (g - normed * mean(g * normed))
        grad_x = rstd * (grad_normed - normed * (grad_normed * normed).mean(-1, keepdim=True))
        return grad_x.to(x.dtype), grad_weight, None


def make_norm(kind: str, dim: int, eps: float) -> nn.Module:
    return RMSNorm(dim, eps) if kind == "rmsnorm" else nn.LayerNorm(dim, eps=eps)


class Block(nn.Module):
    """A pre-norm residual block: ``h = x + attention(norm(x))``, ``y = h + ffn(norm(h))``.

    ``names``: the recipe's component names, ``(attention name, ffn kind, ffn name)``, e.g.
    ``("sdpa", "ffn", "swiglu")``, so that memory policies can pick layers by component
    (``megaseq.memory.model_layers``); ``tiles``: the attention's record declares ``sequence_tiling``.
    """

    def __init__(
        self, attention: nn.Module, ffn: nn.Module, d_model: int, norm: str, eps: float,
        names: tuple[str, str, str] = ("", "", ""), tiles: bool = False,
    ) -> None:
        super().__init__()
        self.attn_norm = make_norm(norm, d_model, eps)
        self.attention = attention
        self.ffn_norm = make_norm(norm, d_model, eps)
        self.ffn = ffn
        self.names = names
        self.tiles = tiles

    def forward(self, x: Tensor, ctx: ForwardContext, cache: Any | None = None) -> Tensor:
        return self.feed(self.mix(x, ctx, cache), ctx)

    def mix(self, x: Tensor, ctx: ForwardContext, cache: Any | None = None) -> Tensor:
        """The attention half: ``x + attention(norm(x))``, in the residual stream's dtype (``x``'s)."""
        return x + self.attention(self.attn_norm(x), ctx, cache).to(x.dtype)

    def mix_tile(self, x: Tensor, ctx: ForwardContext, tile: Tile, history: list[tuple[Tensor, ...]]) -> tuple[Tensor, tuple[Tensor, ...]]:
        """The attention half on one tile (the attention declares ``sequence_tiling``)."""
        out, carry = self.attention.forward_tile(self.attn_norm(x), ctx, tile, history)
        return x + out.to(x.dtype), carry

    def feed(self, h: Tensor, ctx: ForwardContext) -> Tensor:
        """The feed-forward half: ``h + ffn(norm(h))``, in the residual stream's dtype (``h``'s)."""
        return h + self.ffn(self.ffn_norm(h), ctx).to(h.dtype)


class LanguageModel(nn.Module):
    def __init__(
        self, blocks: list[Block], dims: ModelDims, norm: str, eps: float, tie: bool, residual_bf16: bool = False
    ) -> None:
        super().__init__()
        self.dims = dims
        self.residual_bf16 = residual_bf16
        vocab = -(-dims.vocab_size // dims.tp_size)  # this rank's block of the vocabulary (the last ones padded)
        self.embed = nn.Embedding(vocab, dims.d_model)
        nn.init.normal_(self.embed.weight, std=0.02)
        self.blocks = nn.ModuleList(blocks)
        self.final_norm = make_norm(norm, dims.d_model, eps)
        self.head = None if tie else nn.Linear(dims.d_model, vocab, bias=False)
        if self.head is not None:
            nn.init.normal_(self.head.weight, std=0.02)

    @property
    def head_weight(self) -> Tensor:
        return self.embed.weight if self.head is None else self.head.weight

    def forward(self, tokens: Tensor, ctx: ForwardContext | None = None, caches: list[Any] | None = None) -> Tensor:
        """Final hidden states ``[B, T, d_model]`` (normalised; apply :meth:`logits` or the chunked loss)."""
        ctx = ctx or ForwardContext()
        x = self.embed(tokens) if ctx.tp is None else self._embed_vocab_parallel(tokens, ctx.tp)
        if self.residual_bf16 and torch.is_autocast_enabled(x.device.type) and torch.get_autocast_dtype(x.device.type) == torch.bfloat16:
            x = x.to(torch.bfloat16)
        for i, block in enumerate(self.blocks):
            x = block(x, ctx, None if caches is None else caches[i])
        return self.final_norm(x)

    def _embed_vocab_parallel(self, tokens: Tensor, tp: TensorParallel) -> Tensor:
        if tp.world_size != self.dims.tp_size:
            raise ValueError(f"model built for tp {self.dims.tp_size}, run with tp {tp.world_size}")
        vocab = self.embed.num_embeddings
        local = tokens - tp.rank * vocab
        here = (local >= 0) & (local < vocab)
        partial = self.embed(local.clamp(0, vocab - 1)) * here[..., None].to(self.embed.weight.dtype)
        return tp_reduce_scatter(partial, tp)

    def logits(self, hidden: Tensor, tp: TensorParallel | None = None) -> Tensor:
        """Whole-vocabulary logits ``[..., vocab_size]`` of ``hidden [..., d_model]`` (a few positions: the sampler's
        last ones). Under tensor parallelism each rank computes its vocabulary block's logits and gathers them over
        the group, so every rank holds the same logits and no rank the whole head."""
        local = hidden @ self.head_weight.to(hidden.dtype).t()
        if tp is None:
            return local
        return all_gather(local, tp.group).movedim(0, -2).flatten(-2)[..., : self.dims.vocab_size]

    def init_caches(self, batch_size: int, *, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> list[Any]:
        device = torch.device(device)
        return [b.attention.init_cache(batch_size, device=device, dtype=dtype) for b in self.blocks]


def _chunk_loss(hidden: Tensor, weight: Tensor, targets: Tensor) -> Tensor:
    logits = (hidden @ weight.to(hidden.dtype).t()).float()
    return F.cross_entropy(logits, targets, reduction="none")


def _chunk_loss_vocab_parallel(
    hidden: Tensor, weight: Tensor, targets: Tensor, tp: TensorParallel, vocab_size: int | None
) -> Tensor:
    logits = (hidden @ weight.to(hidden.dtype).t()).float()
    return vocab_parallel_cross_entropy(logits, targets, tp, vocab_size)


def chunked_token_losses(
    hidden: Tensor, weight: Tensor, targets: Tensor, chunk: int, tp: TensorParallel | None = None,
    vocab_size: int | None = None,
) -> Tensor:
    """Per-token cross-entropy (nats, fp32) of ``hidden [B, T, D]`` against ``targets [B, T]``.

    Logits exist for ``chunk`` tokens at a time, in forward and (by recomputation) in backward. With ``tp``:
    ``hidden`` is this rank's sequence chunk, ``weight`` its vocabulary block (``vocab_size``: the whole
    vocabulary's size, past which the last blocks are padding) and ``targets`` the whole window's; the result
    is this rank's chunk of the losses (their sum over ranks is the whole loss).
    """
    if tp is not None:
        hidden = tp_gather(hidden, tp)
    flat_h = hidden.reshape(-1, hidden.shape[-1])
    flat_t = targets.reshape(-1)
    loss_of = _chunk_loss if tp is None else _chunk_loss_vocab_parallel
    extra = () if tp is None else (tp, vocab_size)
    parts = []
    # split, not a slice per chunk: a slice's backward writes its gradient into a zero tensor of the whole
    # sequence's size, once per chunk (quadratic: 0.30 CPU s at 64k against 0.007 at 8k); split's backward
    # joins all the chunks' gradients once
    for h, t in zip(flat_h.split(chunk), flat_t.split(chunk), strict=True):
        if torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad):
            parts.append(checkpoint(loss_of, h, weight, t, *extra, use_reentrant=False))
        else:
            parts.append(loss_of(h, weight, t, *extra))
    losses = torch.cat(parts).view(targets.shape)
    return losses if tp is None else tp_split(losses, tp)


def build_block(recipe: Recipe, plugins: Plugins, dims: ModelDims, layer: int) -> Block:
    """Block ``layer`` of the model a recipe describes, its components through the plugin registry."""
    m = recipe.model
    attn_name = m.attention_of(layer)
    attn_provided = plugins.get("attention", attn_name)
    attn = attn_provided.load()(recipe.component("attention", attn_name), dims, layer)
    ffn_kind, ffn_name = m.ffn_of(layer)
    ffn = plugins.get(ffn_kind, ffn_name).load()(recipe.component(ffn_kind, ffn_name), dims, layer)
    return Block(attn, ffn, m.d_model, m.norm, m.norm_eps, names=(attn_name, ffn_kind, ffn_name),
                 tiles="sequence_tiling" in attn_provided.spec.capabilities)


def build_model(recipe: Recipe, plugins: Plugins, dims: ModelDims | None = None, blocks: bool = True) -> LanguageModel:
    """Build the model a recipe describes (``blocks=False``: without its blocks, the embedding, final norm and
    head alone). The blocks are initialised first, in order, then the embedding and the head: the order in which
    ``megaseq.distributed.experts.initial_parts`` builds them one at a time."""
    m = recipe.model
    dims = dims or ModelDims(d_model=m.d_model, n_layers=m.n_layers, vocab_size=m.vocab_size)
    built = [build_block(recipe, plugins, dims, layer) for layer in range(m.n_layers)] if blocks else []
    return LanguageModel(built, dims, m.norm, m.norm_eps, m.tie_embeddings, residual_bf16=m.residual_dtype == "bf16")


def describe(model: LanguageModel) -> str:
    """One line per distinct block type with parameter counts."""
    n = sum(p.numel() for p in model.parameters())
    kinds = [f"{type(b.attention).__name__}+{type(b.ffn).__name__}" for b in model.blocks]
    return f"{n / 1e6:.2f}M parameters; layers: " + ", ".join(kinds)
