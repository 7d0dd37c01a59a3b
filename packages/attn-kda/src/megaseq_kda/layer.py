"""The Kimi Delta Attention layer (Kimi Linear report, arXiv 2510.26692; fla's KimiDeltaAttention layout).

Per token x, per head h (K = V = head_dim):

    q, k = L2Norm(SiLU(ShortConv(W_q x))), L2Norm(SiLU(ShortConv(W_k x)))      (eps 1e-6)
    v    = SiLU(ShortConv(W_v x))
    beta = sigmoid(W_b x)                                                       (one per head)
    f    = W_up W_down x + dt_bias                                              (low rank, per channel)
    g    = -exp(A_log[h]) * softplus(f)                   (gate = "softplus")
         = lower_bound * sigmoid(exp(A_log[h]) * f)       (gate = "bounded", GLM-5.3-Flash)
    o    = KDA(q, k, v, g, beta)                                                (``megaseq_kda.ops``)
    out  = W_o(sigmoid(W_gup W_gdown x [+ b_g]) * RMSNorm_head(o))     (b_g with out_gate_bias; norm eps norm_eps)

ShortConv is a causal depthwise convolution over time; it restarts at document boundaries and reads its
history from the cache (decoding) or from the preceding segment on another rank (context parallelism,
``megaseq_kda.parallel``). Gates, beta, the state and the output norm are computed in fp32.

Tensor parallelism (``megaseq.contracts.TensorParallel``): a rank holds ``n_heads / tp`` heads, a contiguous
block: its rows of q, k and v in the projection and the convolution (both stored ``[3, H * D, ...]``, so that
one block along the head dimension carries each head's q, k and v), of beta, of the gates' up-projections,
``A_log`` and ``dt_bias``, and its columns of the output projection. The gates' down-projections and the
output norm's weight serve every head and stay whole (their gradients are summed over the ranks). A rank
gathers the sequence chunks (with context parallelism: its context-parallel share), runs its heads over all
of it and reduce-scatters its partial output.
Decoding under tensor parallelism (without sequence parallelism) keeps only the rank's heads in its
cache: their convolution history and their recurrent states.

Memory: backward keeps the input, q, k, v, g, beta, the op's output and one state per chunk (the op keeps its
inputs and recomputes its intra-chunk tensors: ``ops/chunk.py``). The front (projections, convolution, SiLU,
L2 norm, gates) and the tail (norm, output gate, output projection) are cheap per token and would otherwise
keep ~6 buffers of 3 x width and ~5 of width: they run in blocks of ``BLOCK_TOKENS`` under activation
checkpointing and are recomputed in backward one block at a time, so their temporaries are one block's.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from megaseq.contracts import ForwardContext, Tile
from megaseq.documents import Documents, as_documents
from megaseq.dtypes import compute_dtype
from megaseq.parallel import tp_gather, tp_reduce_scatter
from megaseq.records import MemoryEstimate, ModelDims, TileCarry
from megaseq_kda.backends import BACKENDS, plans_native
from megaseq_kda.config import KDAConfig
from megaseq_kda.ops import naive_recurrent_kda
from megaseq_kda.ops.chunk import CHUNK, GROUP_HEAD_TOKENS
from megaseq_kda.parallel import context_parallel_kda, conv_histories

L2_EPS = 1e-6
# The front and the tail are run and recomputed this many tokens at a time.
BLOCK_TOKENS = 4096
# A block's convolution history inside a piece of the input: the projected tail of the block before it.
CONTINUED = object()


@dataclass
class KDACache:
    """Decoding state of a batch of sequences: the last ``conv_size - 1`` projected inputs (the convolution's
    history, in the activation dtype) and the recurrent state (fp32)."""

    conv: Tensor  # [B, conv_size - 1, 3 * H * D]
    state: Tensor  # [B, H, K, V]


def causal_conv(x: Tensor, weight: Tensor, history: Tensor, position_in_doc: Tensor | None = None) -> Tensor:
    """Depthwise causal convolution: ``out[t] = sum_j weight[:, j] * x[t - (W - 1 - j)]``.

    ``x [B, T, C]``, ``weight [C, W]``, ``history [B, W - 1, C]``: the inputs just before ``x``.
    ``position_in_doc [T]``: each token's offset in its document; a tap reaching before the document start
    reads zero, so the convolution restarts at every boundary.

    Without documents it is one depthwise convolution (``[B, T, C]`` is a channels-last image of height 1, so
    no copy): a single pass over the tokens, forward and backward, where the taps below make several
    (fwd + bwd of 4,096 tokens of 384 channels: 16-17 ms against 27-34 on one CPU thread).
    """
    width, length = weight.shape[1], x.shape[1]
    padded = torch.cat([history, x], 1)
    if position_in_doc is None and length:  # (an empty x is shorter than the kernel: the taps below)
        image = padded.transpose(1, 2).unsqueeze(2)  # [B, C, 1, W - 1 + T], channels last
        out = F.conv2d(image, weight[:, None, None, :], groups=weight.shape[0])
        return out.squeeze(2).transpose(1, 2).contiguous()
    out = x * weight[:, -1]
    for lag in range(1, width):
        tap = padded[:, width - 1 - lag : width - 1 - lag + length] * weight[:, -1 - lag]
        if position_in_doc is not None:
            tap = tap * (position_in_doc >= lag)[None, :, None].to(tap.dtype)
        out = out + tap
    return out


class KimiDeltaAttention(nn.Module):
    def __init__(self, d_model: int, config: KDAConfig, n_layers: int, tp_size: int = 1) -> None:
        super().__init__()
        BACKENDS.check(config.backend)
        if config.n_heads % tp_size:
            raise ValueError(f"attention.kda: n_heads {config.n_heads} is not a multiple of tp {tp_size}")
        self.backend = config.backend
        self.n_heads, self.head_dim = config.n_heads // tp_size, config.head_dim  # this rank's heads
        self.gate, self.gate_lower_bound = config.gate, config.gate_lower_bound
        self.norm_eps = config.norm_eps
        width = self.n_heads * self.head_dim
        rank = config.gate_rank or self.head_dim
        self.qkv_weight = nn.Parameter(torch.empty(3, width, d_model))  # q, k, v rows, each [H * D, d_model]
        self.conv_weight = nn.Parameter(torch.empty(3, width, config.conv_size))
        self.beta_proj = nn.Linear(d_model, self.n_heads, bias=False)
        self.gate_down = nn.Linear(d_model, rank, bias=False)
        self.gate_up = nn.Linear(rank, width, bias=False)
        self.A_log = nn.Parameter(torch.empty(self.n_heads))
        self.dt_bias = nn.Parameter(torch.empty(width))
        self.norm_weight = nn.Parameter(torch.ones(self.head_dim))
        self.out_gate_down = nn.Linear(d_model, rank, bias=False)
        self.out_gate_up = nn.Linear(rank, width, bias=config.out_gate_bias)
        self.out_proj = nn.Linear(width, d_model, bias=False)
        self._init_parameters(n_layers)

    def _init_parameters(self, n_layers: int) -> None:
        nn.init.normal_(self.qkv_weight, std=0.02)
        for linear in (
            self.beta_proj,
            self.gate_down,
            self.gate_up,
            self.out_gate_down,
            self.out_gate_up,
        ):
            nn.init.normal_(linear.weight, std=0.02)
        if self.out_gate_up.bias is not None:
            nn.init.zeros_(self.out_gate_up.bias)
        nn.init.normal_(self.out_proj.weight, std=0.02 / (2 * n_layers) ** 0.5)
        # PyTorch's default for a depthwise Conv1d (fan-in = kernel size)
        bound = self.conv_weight.shape[-1] ** -0.5
        nn.init.uniform_(self.conv_weight, -bound, bound)
        # fla's: decay rates A ~ U(1, 16); dt ~ logU(1e-3, 0.1), so that a token with f = 0 starts with the
        # log-decay g = -A dt of the softplus gate. The softplus gate stores dt_bias = softplus^-1(dt). The
        # bounded gate must not reuse that bias: exp(A_log) * dt_bias would be -7..-110, where the sigmoid is
        # saturated (g ~ 1e-17, gradient ~ 1e-13: a gate that never forgets and cannot learn to). It gets the
        # bias giving the same starting decay, lower_bound * sigmoid(A b) = -A dt, i.e. b = logit(A dt / -lower_bound) / A,
        # with the sigmoid capped at 1/2 so that a bound closer to 0 than -2 A dt keeps the gate unsaturated.
        with torch.no_grad():
            rate = torch.empty_like(self.A_log).uniform_(1, 16)
            self.A_log.copy_(rate.log())
            dt = torch.empty_like(self.dt_bias).uniform_(math.log(1e-3), math.log(0.1)).exp().clamp_min(1e-4)
            if self.gate == "softplus":
                self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
            else:
                rate = rate.repeat_interleave(self.head_dim)
                self.dt_bias.copy_(torch.logit((rate * dt / -self.gate_lower_bound).clamp(max=0.5)) / rate)

    def init_cache(self, batch_size: int, *, device: torch.device, dtype: torch.dtype) -> KDACache:
        return KDACache(
            conv=torch.zeros(batch_size, self.history_len, self.conv_weight[..., 0].numel(), device=device, dtype=dtype),
            state=torch.zeros(batch_size, self.n_heads, self.head_dim, self.head_dim, device=device),
        )

    @property
    def history_len(self) -> int:
        """How many inputs before a token the convolution reads: ``conv_size - 1``."""
        return self.conv_weight.shape[-1] - 1

    def project(self, x: Tensor) -> Tensor:
        """The q, k, v projection ``[B, T, 3 * H * D]`` (q's channels, then k's, then v's)."""
        return F.linear(x, self.qkv_weight.flatten(0, 1))

    def forget_gate(self, x: Tensor) -> Tensor:
        """Per-channel log-decay g <= 0, ``[B, T, H, K]`` in ``compute_dtype`` (fp32; float64 for float64)."""
        dtype = compute_dtype(x.dtype)
        f = self.gate_up(self.gate_down(x)).to(dtype) + self.dt_bias.to(dtype)
        f = f.unflatten(-1, (self.n_heads, self.head_dim))
        rate = self.A_log.to(dtype).exp()[:, None]
        if self.gate == "softplus":
            return -rate * F.softplus(f)
        return self.gate_lower_bound * torch.sigmoid(rate * f)

    def forward(self, x: Tensor, ctx: ForwardContext, cache: KDACache | None = None) -> Tensor:
        if cache is not None and (ctx.cu_seqlens is not None or ctx.cp is not None or (ctx.tp and ctx.tp.sequence_parallel)):
            raise ValueError(
                "attention.kda: a decoding cache cannot be combined with packing or context or sequence parallelism"
            )
        if ctx.tp is None:
            return self._forward(x, ctx, cache)
        return tp_reduce_scatter(self._forward(tp_gather(x, ctx.tp), ctx, cache), ctx.tp)

    def _forward(self, x: Tensor, ctx: ForwardContext, cache: KDACache | None) -> Tensor:
        if ctx.cp is not None and x.shape[1] != 2 * ctx.cp.segment_len:
            raise ValueError(
                f"attention.kda: context parallel input has {x.shape[1]} tokens, expected this rank's two "
                f"segments of {ctx.cp.segment_len} (seq_len {ctx.cp.seq_len} over {ctx.cp.world_size} ranks)"
            )
        op = BACKENDS.load(self.backend, x.device)
        if cache is not None:
            projected = self.project(x)
            q, k, v = self._qkv(projected, cache.conv, 0, None)
            g, beta = self._gates(x)
            cache.conv = torch.cat([cache.conv, projected], 1)[:, -self.history_len :]
            step = naive_recurrent_kda if x.shape[1] == 1 else op  # one token: the recurrence is cheapest
            o, cache.state = step(q, k, v, g, beta, initial_state=cache.state, output_final_state=True)
            return self._tail(o, x)
        documents = None  # read once per forward by the context, shared with every other layer
        if ctx.documents is not None:
            length = ctx.cp.seq_len if ctx.cp is not None else x.shape[1]
            documents = as_documents(ctx.documents, batch=x.shape[0], length=length, who="attention.kda: cu_seqlens")
        spans: list[tuple[int, int]] = [(0, x.shape[1])]
        histories: list[Tensor | None] = [None]
        if ctx.cp is not None:  # the projected tails of the segments before each of this rank's two (only the tails projected)
            tails = [self.project(segment[:, -self.history_len :]) for segment in x.chunk(2, dim=1)]
            spans, histories = ctx.cp.segments(), conv_histories(tails, ctx.cp, self.history_len)

        def attend(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor) -> Tensor:
            if ctx.cp is not None:
                return context_parallel_kda(op, q, k, v, g, beta, ctx.cp, documents)
            return op(q, k, v, g, beta, cu_seqlens=documents)[0]

        return self._blockwise(x, spans, histories, documents, attend)

    def forward_tile(
        self, x: Tensor, ctx: ForwardContext, tile: Tile, history: list[tuple[Tensor, ...]]
    ) -> tuple[Tensor, tuple[Tensor, ...]]:
        """Tokens ``[tile.start, tile.stop)`` (``megaseq.contracts.SequenceTiling``). The carry is what the
        decoding cache holds, the convolution's last inputs and the recurrent state after the tile; with
        packing, the tile's first document piece starts from that state only if it continues a document.
        Inside the tile, front and tail run in blocks recomputed in backward, as in :meth:`forward`."""
        if ctx.cp is not None or ctx.tp is not None:
            raise ValueError("attention.kda: sequence tiles run without context parallelism or tensor parallelism")
        op = BACKENDS.load(self.backend, x.device)
        batch = x.shape[0]
        conv_history, state = history[-1] if history else (None, None)
        documents, pieces, continues = None, None, True
        if ctx.documents is not None:
            documents = as_documents(ctx.documents, batch=batch, length=tile.seq_len, who="attention.kda: cu_seqlens")
            pieces, continues = documents.window(tile.start, tile.stop)
        final: list[Tensor] = []

        def attend(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor) -> Tensor:
            initial = None
            if state is not None or pieces is not None:
                rows = batch if pieces is None else 1
                zeros = q.new_zeros(rows, self.n_heads, self.head_dim, self.head_dim, dtype=g.dtype)
                initial = state if state is not None and continues else zeros
                if pieces is not None:  # one state per document piece: only the first may continue
                    initial = torch.cat([initial, zeros.new_zeros(pieces.n_docs - 1, *zeros.shape[1:])])
            o, last = op(q, k, v, g, beta, initial_state=initial, output_final_state=True, cu_seqlens=pieces)
            final.append(last if pieces is None else last[-1:])
            return o

        out = self._blockwise(x, [(tile.start, tile.stop)], [conv_history], documents, attend)
        # the convolution's last inputs: only the tile's last few tokens are projected again
        history_len = self.history_len
        if conv_history is None:
            conv_history = x.new_zeros(batch, history_len, self.conv_weight[..., 0].numel())
        conv_tail = torch.cat([conv_history, self.project(x[:, -history_len:])], 1)[:, -history_len:]
        # copies: both are views of larger tensors (the concatenation, every piece's state), which the carry
        # would keep alive until the backward
        return out, (conv_tail.clone(), final[0].clone())

    def _blockwise(
        self,
        x: Tensor,
        spans: list[tuple[int, int]],
        histories: list[Tensor | None],
        documents: Documents | None,
        attend: Callable[..., Tensor],
    ) -> Tensor:
        """Front, ``attend(q, k, v, g, beta) -> o`` and tail over x, whose pieces cover the global ``spans``
        with the convolution ``histories`` before each. Front and tail run in blocks of tokens, each
        recomputed in backward on its own (memory plan in the module docstring): what they keep is the
        block inputs, their temporaries one block's."""
        blocks = self._blocks(spans, histories)
        sizes = [b - a for a, b, _, _ in blocks]
        # split, not sliced: a slice's backward writes its gradient into a zero tensor of the whole sequence, once
        # per block; the pieces of a split are joined once
        pieces = x.split(sizes, dim=1)
        front = []
        for i, ((_, _, start, history), piece) in enumerate(zip(blocks, pieces, strict=True)):
            if history is CONTINUED:  # the projected tail of the block before, inside the same piece of x
                history = self.project(pieces[i - 1][:, -self.history_len :])
            front.append(self._recomputed(self._front, piece, history, start, documents))
        q, k, v, g, beta = (torch.cat(parts, 1) if len(parts) > 1 else parts[0] for parts in zip(*front, strict=True))
        o = attend(q, k, v, g, beta)
        out = [self._recomputed(self._tail, *parts) for parts in zip(o.split(sizes, dim=1), pieces, strict=True)]
        return torch.cat(out, 1) if len(out) > 1 else out[0]

    @staticmethod
    def _recomputed(fn, *args):  # type: ignore[no-untyped-def]
        """fn(*args), under activation checkpointing when gradients are on."""
        return checkpoint(fn, *args, use_reentrant=False) if torch.is_grad_enabled() else fn(*args)

    @staticmethod
    def _blocks(
        spans: list[tuple[int, int]], histories: list[Tensor | None]
    ) -> list[tuple[int, int, int, Tensor | object | None]]:
        """``(a, b, start, history)`` per block of at most ``BLOCK_TOKENS`` of x: local ``[a, b)``, the global
        position of its first token, and the ``conv_size - 1`` projected inputs before it. Blocks never cross
        a piece of x (a context-parallel segment); a block's history inside a piece is ``CONTINUED``: the
        projected tail of the block before it (recomputed for those few tokens), the first block's the piece's
        history."""
        blocks, offset = [], 0
        for (start, end), history in zip(spans, histories, strict=True):
            for a in range(0, max(end - start, 1), BLOCK_TOKENS):  # an empty piece is one empty block
                b = min(a + BLOCK_TOKENS, end - start)
                blocks.append((offset + a, offset + b, start + a, CONTINUED if a else history))
            offset += end - start
        return blocks

    def _front(
        self, x: Tensor, history: Tensor | None, start: int, documents: Documents | None
    ) -> tuple[Tensor, ...]:
        """x (global tokens from ``start``) -> q, k, v, g, beta; ``history``: the ``conv_size - 1`` projected
        inputs before x (None: zeros, the sequence starts with x)."""
        return *self._qkv(self.project(x), history, start, documents), *self._gates(x)

    def _qkv(
        self, projected: Tensor, history: Tensor | None, start: int, documents: Documents | None
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Convolution (restarting at document starts), SiLU and L2 norm in ``compute_dtype``: q, k, v as
        views of one tensor (so that what the op keeps of them is one 3 x width buffer)."""
        if history is None:  # made here, not by the caller: a block's inputs are what backward keeps
            history = projected.new_zeros(projected.shape[0], self.history_len, projected.shape[2])
        doc_positions = None
        if documents is not None:
            doc_positions = documents.positions_in_doc(projected.device)[start : start + projected.shape[1]]
        convolved = causal_conv(projected, self.conv_weight.flatten(0, 1).to(projected.dtype), history, doc_positions)
        qkv = F.silu(convolved).unflatten(-1, (3, self.n_heads, self.head_dim))
        dtype = compute_dtype(qkv.dtype)
        inv_norms = torch.rsqrt(qkv[:, :, :2].to(dtype).square().sum(-1, keepdim=True) + L2_EPS).to(qkv.dtype)
        q, k, v = (qkv * torch.cat([inv_norms, torch.ones_like(inv_norms[:, :, :1])], 2)).unbind(2)  # v: x 1
        return q, k, v

    def _gates(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """The forget gate g and beta, in ``compute_dtype``."""
        return self.forget_gate(x), torch.sigmoid(self.beta_proj(x).to(compute_dtype(x.dtype)))

    def _tail(self, o: Tensor, x: Tensor) -> Tensor:
        """The op's output -> the layer's: per-head RMSNorm, output gate, output projection (gate and norm in
        ``compute_dtype``)."""
        dtype = compute_dtype(x.dtype)
        o = o.to(dtype)
        o = o * torch.rsqrt(o.square().mean(-1, keepdim=True) + self.norm_eps) * self.norm_weight.to(dtype)
        out_gate = torch.sigmoid(self.out_gate_up(self.out_gate_down(x)).to(dtype))
        o = out_gate * o.flatten(-2)
        return self.out_proj(o.to(x.dtype))


def build(config: KDAConfig, dims: ModelDims, layer_idx: int) -> KimiDeltaAttention:
    return KimiDeltaAttention(dims.d_model, config, dims.n_layers, dims.tp_size)


def memory_estimate(config: KDAConfig, dims: ModelDims, seq_len: int) -> MemoryEstimate:
    """fp32 bytes. Saved per token: the input, q, k, v (one 3 x width buffer), g (width), beta (one per head),
    the op's output (width) and one K x V state per head per 64-token chunk; the front (projections,
    convolution, gates) and the tail (norm, output gate, projection) are recomputed in backward, the op's
    intra-chunk tensors too. Temporary (in backward; measured with ``benchmarks/component_memory.py``, large
    allocations unmapped when freed: 94, 224 and 320 MiB at 4k, 16k and 64k for the default recipe's layer,
    and with the test kit's ``transient_bytes`` at the suite's sizes): the op's gradients of q, k, v, g and
    the incoming one of its output (5 x width per token), then the larger of one group of chunks'
    intra-chunk tensors (~36 x head_dim per token and head, plus ~6 ``CHUNK x CHUNK`` matrices per chunk and
    head, 6 x CHUNK per token and head, the larger part for small heads: the op's backward measured 44.6, 39.6
    and 38.6 x head_dim at head_dim 32, 64 and 128 over 16k tokens; with the native backend's Grams ~30 x
    head_dim, measured 38.0, 33.0 and 32.6; at most ``GROUP_HEAD_TOKENS`` of them)
    and one block of the recomputed front or tail (~24 x width per token, at most ``BLOCK_TOKENS``): backward
    runs them one after another. Under tensor parallelism (``dims.tp_size``) all of it is one rank's, whose
    heads run over the gathered sequence: the gates'
    down-projections and the output norm's weight are whole on every rank."""
    if config.n_heads % dims.tp_size:
        raise ValueError(f"attention.kda: n_heads {config.n_heads} is not a multiple of tp {dims.tp_size}")
    heads = config.n_heads // dims.tp_size  # this rank's
    width = heads * config.head_dim
    rank = config.gate_rank or config.head_dim
    d = dims.d_model
    parameters = d * 3 * width + 3 * width * config.conv_size + d * heads + 2 * (d * rank + rank * width)
    parameters += heads + width + config.head_dim + width * d + (width if config.out_gate_bias else 0)
    per_token = d + 5 * width + heads + heads * config.head_dim**2 / CHUNK
    # the native backend's Grams keep no decays for their backward: 6 x head_dim less per pair
    per_pair = (30 if plans_native(config.backend) else 36) * config.head_dim + 6 * CHUNK
    group = min(GROUP_HEAD_TOKENS, seq_len * heads) * per_pair
    temporary = 5 * width * seq_len + max(group, 24 * min(BLOCK_TOKENS, seq_len) * width)
    # a sequence tile hands on the recurrent state (fp32) and the convolution's last inputs
    carry = TileCarry(per_tile=4 * (heads * config.head_dim**2 + (config.conv_size - 1) * 3 * width))
    return MemoryEstimate(
        parameters=parameters * 4, saved_per_token=per_token * 4, temporary=int(4 * temporary), tiling=carry
    )
