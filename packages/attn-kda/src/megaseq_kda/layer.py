"""The Kimi Delta Attention layer (Kimi Linear report, arXiv 2510.26692; fla's KimiDeltaAttention layout).

Per token x, per head h (K = V = head_dim):

    q, k = L2Norm(SiLU(ShortConv(W_q x))), L2Norm(SiLU(ShortConv(W_k x)))      (eps 1e-6)
    v    = SiLU(ShortConv(W_v x))
    beta = sigmoid(W_b x)                                                       (one per head)
    f    = W_up W_down x + dt_bias                                              (low rank, per channel)
    g    = -exp(A_log[h]) * softplus(f)                   (gate = "softplus")
         = lower_bound * sigmoid(exp(A_log[h]) * f)       (gate = "bounded", GLM-5.3-Flash)
    o    = KDA(q, k, v, g, beta)                                                (``megaseq_kda.ops``)
    out  = W_o(sigmoid(W_gup W_gdown x) * RMSNorm_head(o))

ShortConv is a causal depthwise convolution over time; it restarts at document boundaries and reads its
history from the cache (decoding) or from the preceding segment on another rank (context parallelism,
``megaseq_kda.parallel``). Gates, beta, the state and the output norm are computed in fp32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from megaseq.contracts import ForwardContext, Tile
from megaseq.documents import Documents, as_documents
from megaseq.dtypes import compute_dtype
from megaseq.records import MemoryEstimate, ModelDims, TileCarry
from megaseq_kda.backends import BACKENDS
from megaseq_kda.config import KDAConfig
from megaseq_kda.ops import naive_recurrent_kda
from megaseq_kda.parallel import context_parallel_kda, conv_histories

L2_EPS = 1e-6
NORM_EPS = 1e-5


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
    """
    width, length = weight.shape[1], x.shape[1]
    padded = torch.cat([history, x], 1)
    out = x * weight[:, -1]
    for lag in range(1, width):
        tap = padded[:, width - 1 - lag : width - 1 - lag + length] * weight[:, -1 - lag]
        if position_in_doc is not None:
            tap = tap * (position_in_doc >= lag)[None, :, None].to(tap.dtype)
        out = out + tap
    return out


class KimiDeltaAttention(nn.Module):
    def __init__(self, d_model: int, config: KDAConfig, n_layers: int) -> None:
        super().__init__()
        BACKENDS.check(config.backend)
        self.backend = config.backend
        self.n_heads, self.head_dim = config.n_heads, config.head_dim
        self.gate, self.gate_lower_bound = config.gate, config.gate_lower_bound
        width = self.n_heads * self.head_dim
        rank = config.gate_rank or self.head_dim
        self.qkv_proj = nn.Linear(d_model, 3 * width, bias=False)
        self.conv_weight = nn.Parameter(torch.empty(3 * width, config.conv_size))
        self.beta_proj = nn.Linear(d_model, self.n_heads, bias=False)
        self.gate_down = nn.Linear(d_model, rank, bias=False)
        self.gate_up = nn.Linear(rank, width, bias=False)
        self.A_log = nn.Parameter(torch.empty(self.n_heads))
        self.dt_bias = nn.Parameter(torch.empty(width))
        self.norm_weight = nn.Parameter(torch.ones(self.head_dim))
        self.out_gate_down = nn.Linear(d_model, rank, bias=False)
        self.out_gate_up = nn.Linear(rank, width, bias=False)
        self.out_proj = nn.Linear(width, d_model, bias=False)
        self._init_parameters(n_layers)

    def _init_parameters(self, n_layers: int) -> None:
        for linear in (
            self.qkv_proj,
            self.beta_proj,
            self.gate_down,
            self.gate_up,
            self.out_gate_down,
            self.out_gate_up,
        ):
            nn.init.normal_(linear.weight, std=0.02)
        nn.init.normal_(self.out_proj.weight, std=0.02 / (2 * n_layers) ** 0.5)
        # PyTorch's default for a depthwise Conv1d (fan-in = kernel size)
        bound = self.conv_weight.shape[1] ** -0.5
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
        channels, width = self.conv_weight.shape
        return KDACache(
            conv=torch.zeros(batch_size, width - 1, channels, device=device, dtype=dtype),
            state=torch.zeros(batch_size, self.n_heads, self.head_dim, self.head_dim, device=device),
        )

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
        if cache is not None and (ctx.cu_seqlens is not None or ctx.cp is not None):
            raise ValueError(
                "attention.kda: a decoding cache cannot be combined with packing or context parallelism"
            )
        if ctx.cp is not None and x.shape[1] != 2 * ctx.cp.segment_len:
            raise ValueError(
                f"attention.kda: context parallel input has {x.shape[1]} tokens, expected this rank's two "
                f"segments of {ctx.cp.segment_len} (seq_len {ctx.cp.seq_len} over {ctx.cp.world_size} ranks)"
            )
        op = BACKENDS.load(self.backend, x.device)
        documents = None  # read once per forward by the context, shared with every other layer
        if ctx.documents is not None:
            length = ctx.cp.seq_len if ctx.cp is not None else x.shape[1]
            documents = as_documents(ctx.documents, batch=x.shape[0], length=length, who="attention.kda: cu_seqlens")
        dtype = compute_dtype(x.dtype)
        q, k, v = self._qkv(self._convolve(self.qkv_proj(x), ctx, cache, documents), dtype)
        g = self.forget_gate(x)
        beta = torch.sigmoid(self.beta_proj(x).to(dtype))
        if cache is not None:
            step = naive_recurrent_kda if x.shape[1] == 1 else op  # one token: the recurrence is cheapest
            o, cache.state = step(q, k, v, g, beta, initial_state=cache.state, output_final_state=True)
        elif ctx.cp is not None:
            o = context_parallel_kda(op, q, k, v, g, beta, ctx.cp, documents)
        else:
            o, _ = op(q, k, v, g, beta, cu_seqlens=documents)
        return self._output(o, x, dtype)

    def forward_tile(
        self, x: Tensor, ctx: ForwardContext, tile: Tile, history: list[tuple[Tensor, ...]]
    ) -> tuple[Tensor, tuple[Tensor, ...]]:
        """Tokens ``[tile.start, tile.stop)`` (``megaseq.contracts.SequenceTiling``). The carry is what the
        decoding cache holds, the convolution's last inputs and the recurrent state after the tile; with
        packing, the tile's first document piece starts from that state only if it continues a document."""
        if ctx.cp is not None:
            raise ValueError("attention.kda: sequence tiles run without context parallelism")
        op = BACKENDS.load(self.backend, x.device)
        dtype = compute_dtype(x.dtype)
        batch = x.shape[0]
        projected = self.qkv_proj(x)
        channels, width = self.conv_weight.shape
        conv_history, state = history[-1] if history else (projected.new_zeros(batch, width - 1, channels), None)
        doc_positions, pieces, continues = None, None, True
        if ctx.documents is not None:
            documents = as_documents(ctx.documents, batch=batch, length=tile.seq_len, who="attention.kda: cu_seqlens")
            doc_positions = documents.positions_in_doc(x.device)[tile.start : tile.stop]
            pieces, continues = documents.window(tile.start, tile.stop)
        q, k, v = self._qkv(causal_conv(projected, self.conv_weight.to(projected.dtype), conv_history, doc_positions), dtype)
        g = self.forget_gate(x)
        beta = torch.sigmoid(self.beta_proj(x).to(dtype))
        initial = None
        if state is not None or pieces is not None:
            zeros = q.new_zeros(batch if pieces is None else 1, self.n_heads, self.head_dim, self.head_dim, dtype=dtype)
            initial = state if state is not None and continues else zeros
            if pieces is not None:  # one state per document piece: only the first may continue
                initial = torch.cat([initial, zeros.new_zeros(pieces.n_docs - 1, *zeros.shape[1:])])
        o, final = op(q, k, v, g, beta, initial_state=initial, output_final_state=True, cu_seqlens=pieces)
        final = final if pieces is None else final[-1:]
        carry = (torch.cat([conv_history, projected], 1)[:, -(width - 1) :], final)
        return self._output(o, x, dtype), carry

    def _qkv(self, convolved: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
        """q, k (L2-normalised in ``dtype``) and v ``[B, T, H, D]`` from the convolved projections."""
        q, k, v = F.silu(convolved).unflatten(-1, (3, self.n_heads, self.head_dim)).unbind(2)
        q, k = (
            y * torch.rsqrt(y.to(dtype).square().sum(-1, keepdim=True) + L2_EPS).to(y.dtype) for y in (q, k)
        )
        return q, k, v

    def _output(self, o: Tensor, x: Tensor, dtype: torch.dtype) -> Tensor:
        """The per-head norm, the output gate and the output projection of the op's output ``o``."""
        o = o.to(dtype)
        o = o * torch.rsqrt(o.square().mean(-1, keepdim=True) + NORM_EPS) * self.norm_weight.to(dtype)
        out_gate = torch.sigmoid(self.out_gate_up(self.out_gate_down(x)).to(dtype))
        o = out_gate * o.flatten(-2)
        return self.out_proj(o.to(x.dtype))

    def _convolve(
        self, projected: Tensor, ctx: ForwardContext, cache: KDACache | None, documents: Documents | None
    ) -> Tensor:
        """The short convolution over ``projected [B, T, C]`` with the history each case calls for."""
        batch, length, channels = projected.shape
        history_len = self.conv_weight.shape[1] - 1
        weight = self.conv_weight.to(projected.dtype)
        if cache is not None:
            out = causal_conv(projected, weight, cache.conv)
            cache.conv = torch.cat([cache.conv, projected], 1)[:, -history_len:]
            return out
        if ctx.cp is None:
            spans = [(0, length)]
            segments = [projected]
            histories = [projected.new_zeros(batch, history_len, channels)]
        else:
            spans = ctx.cp.segments()
            segments = list(projected.chunk(2, dim=1))
            histories = conv_histories(segments, ctx.cp, history_len)
        outputs = []
        for (start, end), segment, history in zip(spans, segments, histories, strict=True):
            doc_positions = None if documents is None else documents.positions_in_doc(projected.device)[start:end]
            outputs.append(causal_conv(segment, weight, history, doc_positions))
        return torch.cat(outputs, 1)


def build(config: KDAConfig, dims: ModelDims, layer_idx: int) -> KimiDeltaAttention:
    return KimiDeltaAttention(dims.d_model, config, dims.n_layers)


def memory_estimate(config: KDAConfig, dims: ModelDims, seq_len: int) -> MemoryEstimate:
    """fp32 bytes, as measured on the chunked op with saved-tensor hooks and resident memory
    (``benchmarks/component_memory.py``; the planner's accuracy test holds this to the measurement).

    Saved per token (floats): the input (d_model), about 39 per channel of width (the projections before and
    after the convolution, the gates, q/k/v/g/beta and the op's per-token W, U and sub-chunk tensors, the
    output before and after its norm), 3 x 64 per head for the in-chunk score matrices, 5 per head (beta and
    the norm statistics), the two low-rank gate projections, and one K x V state per head per 64-token chunk.
    Temporary: backward's per-token gradients, about 3.5 floats per channel of width, over the whole call."""
    width = config.n_heads * config.head_dim
    rank = config.gate_rank or config.head_dim
    d = dims.d_model
    parameters = (
        d * 3 * width + 3 * width * config.conv_size + d * config.n_heads + 2 * (d * rank + rank * width)
    )
    parameters += config.n_heads + width + config.head_dim + width * d
    per_token = d + 39 * width + 3 * 64 * config.n_heads + 5 * config.n_heads + 2 * rank
    per_token += config.n_heads * config.head_dim**2 / 64
    # a sequence tile hands on the recurrent state (fp32) and the convolution's last inputs
    carry = TileCarry(per_tile=4 * (config.n_heads * config.head_dim**2 + (config.conv_size - 1) * 3 * width))
    return MemoryEstimate(
        parameters=parameters * 4, saved_per_token=per_token * 4, temporary=int(14 * width * seq_len), tiling=carry
    )
