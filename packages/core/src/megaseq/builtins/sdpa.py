"""Causal softmax attention, the reference token mixer.

Paths, all exact: plain rows use ``scaled_dot_product_attention(is_causal=True)``; packed rows run each
document separately (no ``T x T`` mask); context parallelism all-gathers keys and values (autograd-aware)
and masks by global position and document; decoding appends to a key/value cache. On CUDA with fp16/bf16
and flash-attn installed, plain and packed rows use flash-attn (varlen for packed).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from megaseq.contracts import ForwardContext
from megaseq.documents import Documents, as_documents
from megaseq.parallel import gather_sequence
from megaseq.records import MemoryEstimate, ModelDims
from megaseq.rotary import rotary

from .config import SDPAConfig

HAS_FLASH_ATTN = importlib.util.find_spec("flash_attn") is not None


@dataclass
class KVCache:
    k: Tensor  # [B, H, L, D]
    v: Tensor

    @property
    def length(self) -> int:
        return self.k.shape[2]


class SDPAttention(nn.Module):
    def __init__(self, d_model: int, config: SDPAConfig, n_layers: int) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.head_dim = config.head_dim or d_model // config.n_heads
        if self.head_dim % 2 and config.rope:
            raise ValueError(f"attention.sdpa: head_dim must be even with rope = true, got {self.head_dim}")
        self.rope = config.rope
        self.theta = config.rope_theta
        width = self.n_heads * self.head_dim
        self.qkv = nn.Linear(d_model, 3 * width, bias=False)
        self.out = nn.Linear(width, d_model, bias=False)
        nn.init.normal_(self.qkv.weight, std=0.02)
        nn.init.normal_(self.out.weight, std=0.02 / (2 * n_layers) ** 0.5)

    def init_cache(self, batch_size: int, *, device: torch.device, dtype: torch.dtype) -> KVCache:
        empty = torch.zeros(batch_size, self.n_heads, 0, self.head_dim, device=device, dtype=dtype)
        return KVCache(empty, empty.clone())

    def _rope(self, x: Tensor, positions: Tensor) -> Tensor:
        return rotary(x, positions, self.theta) if self.rope else x

    def forward(self, x: Tensor, ctx: ForwardContext, cache: KVCache | None = None) -> Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_heads, self.head_dim).unbind(2)  # [B, T, H, D] each
        if cache is not None:
            if ctx.cu_seqlens is not None or ctx.cp is not None:
                raise ValueError("sdpa: a decoding cache cannot be combined with packing or context parallelism")
            o = self._decode(q, k, v, cache)
        elif ctx.cp is not None:
            o = self._context_parallel(q, k, v, ctx)
        elif ctx.documents is not None:
            o = self._packed(q, k, v, as_documents(ctx.documents, batch=b, length=t, who="sdpa: cu_seqlens"))
        else:
            pos = torch.arange(t, device=x.device)
            o = self._causal(self._rope(q, pos), self._rope(k, pos), v)
        return self.out(o.reshape(b, t, -1))

    def _causal(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        if q.is_cuda and HAS_FLASH_ATTN and q.dtype in (torch.float16, torch.bfloat16):
            from flash_attn import flash_attn_func

            return flash_attn_func(q, k, v, causal=True)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return o.transpose(1, 2)

    def _packed(self, q: Tensor, k: Tensor, v: Tensor, documents: Documents) -> Tensor:
        pos = documents.positions_in_doc(q.device)
        q, k = self._rope(q, pos), self._rope(k, pos)
        if q.is_cuda and HAS_FLASH_ATTN and q.dtype in (torch.float16, torch.bfloat16):
            from flash_attn import flash_attn_varlen_func

            cu = documents.on(q.device, torch.int32)
            longest = max(documents.lengths)
            return flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, longest, longest, causal=True)[None]
        parts = [self._causal(q[:, s:e], k[:, s:e], v[:, s:e]) for s, e in documents.bounds if e > s]
        return torch.cat(parts, dim=1)

    def _decode(self, q: Tensor, k: Tensor, v: Tensor, cache: KVCache) -> Tensor:
        start, t = cache.length, q.shape[1]
        pos = torch.arange(start, start + t, device=q.device)
        q, k = self._rope(q, pos), self._rope(k, pos)
        cache.k = torch.cat([cache.k, k.transpose(1, 2)], dim=2)
        cache.v = torch.cat([cache.v, v.transpose(1, 2)], dim=2)
        key_pos = torch.arange(cache.length, device=q.device)
        mask = key_pos[None, :] <= pos[:, None]  # [T, L]: a query sees the cache and the new tokens up to itself
        o = F.scaled_dot_product_attention(q.transpose(1, 2), cache.k, cache.v, attn_mask=mask)
        return o.transpose(1, 2)

    def _context_parallel(self, q: Tensor, k: Tensor, v: Tensor, ctx: ForwardContext) -> Tensor:
        cp = ctx.cp
        assert cp is not None
        q_pos = cp.positions(q.device)
        k_pos = torch.arange(cp.seq_len, device=q.device)
        if ctx.documents is not None:
            documents = as_documents(ctx.documents, batch=q.shape[0], length=cp.seq_len, who="sdpa: cu_seqlens")
            doc = documents.doc_ids(q.device)
            rope_pos = documents.positions_in_doc(q.device)
            mask = (k_pos[None, :] <= q_pos[:, None]) & (doc[None, :] == doc[q_pos][:, None])
        else:
            rope_pos = k_pos
            mask = k_pos[None, :] <= q_pos[:, None]
        q = self._rope(q, rope_pos[q_pos])
        k = self._rope(k, rope_pos[q_pos])
        # differentiable gathers: key/value gradients flow back to the ranks that own those positions
        k_all, v_all = gather_sequence(k, cp), gather_sequence(v, cp)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k_all.transpose(1, 2), v_all.transpose(1, 2), attn_mask=mask)
        return o.transpose(1, 2)


def build(config: SDPAConfig, dims: ModelDims, layer_idx: int) -> SDPAttention:
    return SDPAttention(dims.d_model, config, dims.n_layers)


def memory_estimate(config: SDPAConfig, dims: ModelDims, seq_len: int) -> MemoryEstimate:
    width = config.n_heads * (config.head_dim or dims.d_model // config.n_heads)
    # saved per token (fp32): input, q, k, v, attention output, logsumexp per head
    return MemoryEstimate(
        parameters=4 * dims.d_model * width * 4,
        saved_per_token=(dims.d_model + 4 * width + config.n_heads) * 4,
        temporary=0,
    )
