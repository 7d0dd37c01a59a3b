"""sdpa under context parallelism: each run of one document's local queries attends lower-right causally to that
document's keys, equal to the dense ``[T / cp, T]`` mask by position and document (the oracle here), with memory
that grows linearly with the sequence. Across real gloo ranks: the conformance suite (test_sdpa_conformance.py)."""

from __future__ import annotations

import weakref

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from megaseq.builtins import sdpa
from megaseq.builtins.config import SDPAConfig
from megaseq.contracts import ContextParallel, ForwardContext
from megaseq.documents import Documents
from megaseq.parallel import zigzag_shard
from megaseq.rotary import rotary
from megaseq_testkit import assert_close


def masked_oracle(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, doc: torch.Tensor) -> torch.Tensor:
    """``q [B, n, H, D]`` at global positions ``q_pos`` against the whole ``k, v [B, T, H, D]``: a key is seen
    when it is not after the query and lies in the query's document (``doc``: document of every position)."""
    k_pos = torch.arange(k.shape[1])
    mask = (k_pos[None, :] <= q_pos[:, None]) & (doc[None, :] == doc[q_pos][:, None])
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask)
    return o.transpose(1, 2)


def test_context_runs_cut_at_segment_and_document_edges():
    segments = [(0, 4), (12, 16)]  # rank 0 of cp=2 over 16 tokens
    assert sdpa.context_runs(segments, (0, 16)) == [(0, 0, 4, 0), (4, 12, 16, 0)]
    # a document ending inside segment 0, an empty one, one from 3 to 13 that spans both segments
    assert sdpa.context_runs(segments, (0, 2, 2, 3, 13, 16)) == [
        (0, 0, 2, 0), (2, 2, 3, 2), (3, 3, 4, 3), (4, 12, 13, 3), (5, 13, 16, 13),
    ]


@pytest.mark.parametrize(("n", "m"), [(1, 1), (7, 7), (5, 23), (13, 40), (1, 9)])
def test_attend_lower_right_equals_the_masked_oracle(monkeypatch, n, m):
    """Forward and gradients, in one block and in blocks of a few queries (each recomputed in backward)."""
    gen = torch.Generator().manual_seed(n * 100 + m)
    q, k, v = (torch.randn(2, size, 3, 8, generator=gen) for size in (n, m, m))
    grad = torch.randn(2, n, 3, 8, generator=gen)
    q_pos = torch.arange(m - n, m)

    def run(fn):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        out = fn(*leaves)
        (out * grad).sum().backward()
        return out.detach(), [t.grad for t in leaves]

    want, want_grads = run(lambda q, k, v: masked_oracle(q, k, v, q_pos, torch.zeros(m, dtype=torch.long)))
    for tile in (sdpa.TILE_SCORE_BYTES, 4 * 2 * 3 * m * 2):  # the whole run, then two queries a block
        monkeypatch.setattr(sdpa, "TILE_SCORE_BYTES", tile)
        got, grads = run(sdpa.attend_lower_right)
        assert_close(got, want, 1e-5, f"output, n={n} m={m} tile={tile}")
        for name, g, w in zip("qkv", grads, want_grads, strict=True):
            assert_close(g, w, 1e-5, f"gradient of {name}, n={n} m={m} tile={tile}")


LAYOUTS = {
    "one document": None,
    "documents inside and across segments": [0, 3, 17, 18, 18, 35, 48],
    "documents on segment edges": [0, 6, 12, 42, 48],
    "an empty and a one-token document": [0, 0, 1, 47, 48],
}


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_each_rank_equals_the_dense_mask(monkeypatch, world, layout):
    """Every rank's output equals the dense-mask formula on the whole sequence's keys, with small blocks."""
    t, d_model = 48, 16
    torch.manual_seed(0)
    module = sdpa.SDPAttention(d_model, SDPAConfig(n_heads=2), n_layers=2)
    x = torch.randn(1, t, d_model)
    offsets = LAYOUTS[layout] or [0, t]
    documents = Documents.from_offsets(offsets)
    rope_pos, doc = documents.positions_in_doc("cpu"), documents.doc_ids("cpu")
    with torch.no_grad():
        q, k, v = module._qkv(x)
        q, k = rotary(q, rope_pos, module.theta), rotary(k, rope_pos, module.theta)
    monkeypatch.setattr(sdpa, "TILE_SCORE_BYTES", 4 * 2 * t * 3)  # three queries a block
    for rank in range(world):
        whole = iter([k, v])  # what the gathers return: every rank's rotated keys, then values
        monkeypatch.setattr(sdpa, "gather_sequence", lambda local, cp, dim=1, whole=whole: next(whole))
        cp = ContextParallel(group=None, rank=rank, world_size=world, seq_len=t)
        ctx = ForwardContext(cu_seqlens=None if LAYOUTS[layout] is None else documents.tensor, cp=cp)
        with torch.no_grad():
            got = module._context_parallel(*module._qkv(zigzag_shard(x, rank, world)), ctx)
            want = masked_oracle(zigzag_shard(q, rank, world), k, v, cp.positions(), doc)
        assert_close(got, want, 1e-5, f"{layout}, cp{world} rank {rank}")


class PeakLiveBytes(TorchDispatchMode):
    """The most bytes that tensors made inside the block held at once (each storage counted once, from the
    operation that made it until it is freed). Past ``budget`` it stops the run, so that a quadratic path is
    caught at its first large tensor instead of filling the machine."""

    def __init__(self, budget: int) -> None:
        super().__init__()
        self.budget, self.live, self.peak = budget, 0, 0
        self.storages: set[int] = set()

    def _freed(self, key: int, nbytes: int) -> None:
        self.storages.discard(key)
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and (key := (storage := t.untyped_storage())._cdata) not in self.storages:
                self.storages.add(key)
                self.live += storage.nbytes()
                weakref.finalize(storage, self._freed, key, storage.nbytes())
                self.peak = max(self.peak, self.live)
                if self.live > self.budget:
                    raise AssertionError(f"{func} took the live tensors to {self.live / 2**20:.0f} MiB")
        return out


def cp_peak_bytes(seq_len: int, budget: int) -> int:
    """Peak bytes of one forward and backward of rank 0 of cp=2 (a stand-in gather of the same size: values do
    not change what is allocated), one head of width 8, a long document that spans both segments."""
    torch.manual_seed(0)
    module = sdpa.SDPAttention(8, SDPAConfig(n_heads=1), n_layers=2)
    x = torch.randn(1, seq_len // 2, 8, requires_grad=True)
    cu = torch.tensor([0, 5, seq_len // 2 + 3, seq_len], dtype=torch.int32)
    ctx = ForwardContext(cu_seqlens=cu, cp=ContextParallel(group=None, rank=0, world_size=2, seq_len=seq_len))
    with PeakLiveBytes(budget) as peak:
        module(x, ctx).square().sum().backward()
    return peak.peak


@pytest.mark.slow  # about ten seconds of attention on one core
def test_context_parallel_memory_grows_linearly(monkeypatch):
    """Doubling the sequence from 32k to 64k tokens at most doubles (plus slack) the peak, and it stays far under
    a ``[T / cp, T]`` mask (2 GiB of booleans at 64k). The score tile is made small so that the linear terms,
    not the constant tile, dominate what is measured."""
    monkeypatch.setattr(sdpa, "TILE_SCORE_BYTES", 4 * 2**20)
    monkeypatch.setattr(sdpa, "gather_sequence", lambda local, cp, dim=1: local.repeat(1, cp.world_size, 1, 1))
    budget = 256 * 2**20
    short, long = cp_peak_bytes(32768, budget), cp_peak_bytes(65536, budget)
    assert long <= 2.2 * short, f"peak grew from {short / 2**20:.1f} MiB to {long / 2**20:.1f} MiB when T doubled"
