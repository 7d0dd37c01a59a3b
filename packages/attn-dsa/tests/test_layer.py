"""The ``dsa`` layer against slow, obviously-correct references built from the same weights.

The reference is MLA written out without absorption (per-head keys W_uk latent and values W_uv latent) and a
dense masked softmax over a T x T score matrix in float64. Selections come from the dense
``select_topk_reference`` on the indexer outputs recomputed here (it breaks the exact-zero ties relu makes
towards the earlier key, as the layer's ``select_topk`` does).
Tolerance: max |layer - reference| <= rtol * max(1, max |reference|), rtol 1e-5 for fp32 layers and 1e-10 for
float64 layers.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from typing import Any

import pytest
import torch
from pydantic import ValidationError
from torch.utils._python_dispatch import TorchDispatchMode

from megaseq import backends as core_backends
from megaseq.contracts import ForwardContext
from megaseq.records import ModelDims
from megaseq.rotary import rotary
from megaseq_dsa.backends import BACKENDS
from megaseq_dsa.config import DSAConfig
from megaseq_dsa.layer import memory_estimate
from megaseq_dsa.ops import indexer_scores_reference, select_topk_reference
from megaseq_dsa.ops.indexer import document_starts
from megaseq_testkit import build_component
from megaseq_testkit.attention import assert_close

SMALL = {"n_heads": 3, "head_dim": 8, "q_lora_rank": 12, "kv_lora_rank": 8, "index_heads": 2, "index_dim": 8}
D_MODEL = 16
DIMS = ModelDims(d_model=D_MODEL, n_layers=2, vocab_size=8)


def build(dtype: torch.dtype = torch.float32, seed: int = 0, **config: Any) -> torch.nn.Module:
    torch.manual_seed(seed)
    return build_component("attention", "dsa", {**SMALL, **config}, DIMS).to(dtype)


def inputs(length: int, batch: int = 1, seed: int = 1, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(batch, length, D_MODEL, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def cumulative(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def indexer_outputs(m: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return m.indexer(x, m.q_norm(m.q_down(x)))


def reference_probs(
    m: torch.nn.Module, x: torch.Tensor, cu: torch.Tensor | None, indices: torch.Tensor | None
):
    """Main attention probabilities [B, H, T, T] (float64, unabsorbed MLA) and the allowed-key mask [B, T, T]."""
    m, x = m.double(), x.double()
    b, t, _ = x.shape
    heads = m.config.n_heads
    c_q, latent = m.q_norm(m.q_down(x)), m.kv_norm(m.kv_down(x))
    q_heads = m.q_up(c_q).view(b, t, heads, -1)
    k_heads = torch.einsum("bsc,hdc->bshd", latent, m.k_up)
    scores = torch.einsum("bthd,bshd->bhts", q_heads, k_heads)
    doc_start = document_starts(cu, t, x.device)
    if m.config.rope:
        pos = torch.arange(t) - doc_start
        q_rot = rotary(m.q_rope(c_q).view(b, t, heads, -1), pos, m.config.rope_theta)
        k_rot = rotary(m.k_rope(x)[:, :, None], pos, m.config.rope_theta)[:, :, 0]
        scores = scores + torch.einsum("bthr,bsr->bhts", q_rot, k_rot)
    positions = torch.arange(t)
    allowed = (positions[None, :] <= positions[:, None]) & (doc_start[None, :] == doc_start[:, None])
    allowed = allowed.expand(b, t, t)
    if indices is not None:
        chosen = torch.zeros(b, t, t + 1, dtype=torch.bool).scatter_(
            2, indices.long().masked_fill(indices < 0, t), True
        )
        allowed = allowed & chosen[..., :t]
    probs = (scores * m.scale).masked_fill(~allowed[:, None], float("-inf")).softmax(-1)
    return probs, allowed


def reference_forward(m: torch.nn.Module, x: torch.Tensor, cu=None, indices=None) -> torch.Tensor:
    probs, _ = reference_probs(m, x, cu, indices)
    latent = m.kv_norm(m.kv_down(x.double()))
    values = torch.einsum("bsc,hcd->bshd", latent, m.v_up)
    o = torch.einsum("bhts,bshd->bthd", probs, values)
    return m.out(o.reshape(x.shape[0], x.shape[1], -1))


def reference_kl(m: torch.nn.Module, x: torch.Tensor, cu=None, indices=None) -> torch.Tensor:
    """Mean over tokens of KL(mean_h p_h || softmax(I)) over the allowed keys, dense, float64."""
    with torch.no_grad():
        probs, allowed = reference_probs(m, x, cu, indices)
    target = probs.mean(1)
    q_idx, k_idx, w = indexer_outputs(m.double(), x.double())
    scores = indexer_scores_reference(q_idx, k_idx, w, cu).masked_fill(~allowed, float("-inf"))
    log_q = scores.log_softmax(-1).masked_fill(~allowed, 0.0)
    return (torch.xlogy(target, target) - target * log_q).sum() / (x.shape[0] * x.shape[1])


def run(m: torch.nn.Module, x: torch.Tensor, cu=None) -> tuple[torch.Tensor, ForwardContext]:
    ctx = ForwardContext(cu_seqlens=cu)
    return m(x, ctx), ctx


@pytest.mark.parametrize("mode", ["sparse", "dense_warmup"])
@pytest.mark.parametrize("rope", [False, True])
def test_short_sequences_equal_dense_causal_mla(mode: str, rope: bool):
    """T <= topk: every query attends to every visible key, in both modes (fp32 layer vs float64 oracle)."""
    m = build(topk=64, index_pool=4, mode=mode, rope=rope, rope_dim=4)
    cu = cumulative([7, 1, 22, 13])
    x = inputs(43)
    out, _ = run(m, x, cu)
    assert_close(out, reference_forward(m, x, cu).float(), 1e-5, "layer vs dense causal MLA")


@pytest.mark.parametrize("pool", [1, 4])
def test_sparse_mode_attends_to_the_reference_selection(pool: int):
    m = build(torch.float64, topk=8, index_pool=pool, rope=True, rope_dim=4)
    cu = cumulative([30, 3, 20])
    x = inputs(53, dtype=torch.float64)
    q_idx, k_idx, w = indexer_outputs(m, x)
    indices = select_topk_reference(q_idx, k_idx, w, 8, cu, pool)
    assert (indices >= 0).sum(-1).max() < 30, "the test must leave keys out"
    out, _ = run(m, x, cu)
    assert_close(out, reference_forward(m, x, cu, indices), 1e-10, "layer vs masked dense MLA")


@pytest.mark.parametrize("pool", [1, 4])
def test_bf16_index_scores_attend_to_the_reference_selection(pool: int):
    """index_scores = "bf16": the exact second pass gives the selection of the fp32 scores, so the layer's
    output is the masked dense reference's over that selection."""
    m = build(torch.float64, topk=8, index_pool=pool, index_scores="bf16")
    cu = cumulative([30, 3, 20])
    x = inputs(53, dtype=torch.float64)
    q_idx, k_idx, w = indexer_outputs(m, x)
    indices = select_topk_reference(q_idx, k_idx, w, 8, cu, pool)
    out, _ = run(m, x, cu)
    assert_close(out, reference_forward(m, x, cu, indices), 1e-10, "layer vs masked dense MLA")


def test_batch_rows_are_independent():
    m = build(topk=8)
    x = inputs(21, batch=3)
    out, _ = run(m, x)
    for row in range(3):
        assert_close(out[row : row + 1], run(m, x[row : row + 1])[0], 1e-5, f"row {row}")


@pytest.mark.parametrize("mode", ["sparse", "dense_warmup"])
def test_indexer_loss_equals_dense_reference(mode: str):
    """The added loss is coef x mean KL: dense warm-up over all visible keys, sparse over the selected ones;
    its gradient on the indexer's parameters equals the dense reference's."""
    coef = 0.7
    m = build(torch.float64, topk=8, mode=mode, indexer_loss_coef=coef, query_chunk=5)
    cu = cumulative([19, 2, 16])
    x = inputs(37, dtype=torch.float64)
    _, ctx = run(m, x, cu)
    assert set(ctx.losses) == {"dsa_indexer"} and not ctx.metrics  # logged once, as the loss
    loss = ctx.losses["dsa_indexer"]
    ctx.losses["dsa_indexer"].backward()
    grads = {n: p.grad.clone() for n, p in m.indexer.named_parameters()}
    m.zero_grad()
    indices = None
    if mode == "sparse":
        q_idx, k_idx, w = indexer_outputs(m, x)
        indices = select_topk_reference(q_idx, k_idx, w, 8, cu)
    expected = coef * reference_kl(m, x, cu, indices)
    expected.backward()
    assert torch.isfinite(loss) and loss > 0
    assert_close(loss, expected, 1e-10, "indexer loss")
    for n, p in m.indexer.named_parameters():
        assert_close(grads[n], p.grad, 1e-10, f"indexer loss gradient of {n}")


def test_sparse_mode_separates_the_indexer_from_the_main_path():
    m = build(topk=8, index_pool=4)
    x = inputs(40).requires_grad_(True)
    out, ctx = run(m, x)
    indexer_params = {id(p) for p in m.indexer.parameters()}
    ctx.losses["dsa_indexer"].backward(retain_graph=True)
    assert x.grad is None, "the indexer loss reached the layer input"
    for n, p in m.named_parameters():
        if id(p) in indexer_params:
            assert p.grad is not None and p.grad.abs().sum() > 0, f"indexer parameter {n} got no gradient"
        else:
            assert p.grad is None, f"the indexer loss reached main parameter {n}"
    m.zero_grad()
    out.square().sum().backward()
    for n, p in m.indexer.named_parameters():
        assert p.grad is None, f"the LM path reached indexer parameter {n}"
    assert x.grad.abs().sum() > 0


def test_freeze_main_in_warmup():
    frozen = build(mode="dense_warmup")
    assert all(p.requires_grad == n.startswith("indexer.") for n, p in frozen.named_parameters())
    assert all(p.requires_grad for p in build(mode="dense_warmup", freeze_main_in_warmup=False).parameters())
    assert all(p.requires_grad for p in build(mode="sparse").parameters())


def test_no_loss_without_gradients_or_with_a_cache():
    m = build(topk=8)
    x = inputs(12)
    with torch.no_grad():
        _, ctx = run(m, x)
    assert ctx.losses == {}
    ctx = ForwardContext()
    m(x, ctx, m.init_cache(1, device=x.device, dtype=x.dtype))
    assert ctx.losses == {}


def test_decode_step_selects_for_the_new_tokens_only(monkeypatch: pytest.MonkeyPatch):
    """A decoding call scores and attends only its new queries, over the cached keys: selection and attention
    see Tq = new tokens and Tk = cache + new tokens, so a step costs O(cache length), not O(length^2)."""
    import megaseq_dsa.ops as ops_module

    calls: list[tuple[str, int, int]] = []

    def recorded(name: str, fn):
        def wrapper(q, k, *args, **kwargs):
            calls.append((name, q.shape[1], k.shape[1]))
            return fn(q, k, *args, **kwargs)

        return wrapper

    monkeypatch.setattr(ops_module, "select_topk", recorded("select", ops_module.select_topk))
    monkeypatch.setattr(ops_module, "sparse_attention", recorded("attend", ops_module.sparse_attention))
    m = build(topk=8, index_pool=4, backend="torch")
    x = inputs(15, batch=2)
    with torch.no_grad():
        full, _ = run(m, x)
        calls.clear()
        cache = m.init_cache(2, device=x.device, dtype=x.dtype)
        steps = [m(x[:, :11], ForwardContext(), cache)]
        steps += [m(x[:, t : t + 2], ForwardContext(), cache) for t in (11, 13)]
    shapes = [(11, 11), (2, 13), (2, 15)]  # (new tokens, cached + new)
    assert calls == [(name, new, total) for new, total in shapes for name in ("select", "attend")]
    assert_close(torch.cat(steps, dim=1), full, 1e-5, "prefill + steps vs full forward")


def test_decoding_writes_the_cache_in_place():
    """Decoding 300 tokens one at a time after a 5-token prefill moves the cache's storage only when it grows
    (256 -> 512 tokens: once), instead of copying the whole cache at every step; results equal the full
    forward."""
    m = build(topk=8, index_pool=4, backend="torch")
    x = inputs(305, batch=2)
    with torch.no_grad():
        full, _ = run(m, x)
        cache = m.init_cache(2, device=x.device, dtype=x.dtype)
        steps = [m(x[:, :5], ForwardContext(), cache)]
        moves, storage = 0, cache.key.data_ptr()
        for t in range(5, 305):
            steps.append(m(x[:, t : t + 1], ForwardContext(), cache))
            moves += cache.key.data_ptr() != storage
            storage = cache.key.data_ptr()
    assert cache.length == 305 and cache.key.shape == (2, 305, 8) and cache.k_idx.shape == (2, 305, 8)
    assert moves == cache.reallocations == 1
    assert_close(torch.cat(steps, dim=1), full, 1e-5, "prefill + steps vs full forward")


def test_dense_warmup_decode_step_attends_with_the_new_tokens_only(monkeypatch: pytest.MonkeyPatch):
    calls: list[tuple[int, int]] = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def recorded(q, k, v, *args, **kwargs):
        calls.append((q.shape[2], k.shape[2]))
        return sdpa(q, k, v, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recorded)
    m = build(mode="dense_warmup", rope=True, rope_dim=4)
    x = inputs(12)
    with torch.no_grad():
        full, _ = run(m, x)
        calls.clear()
        cache = m.init_cache(1, device=x.device, dtype=x.dtype)
        steps = [m(x[:, :9], ForwardContext(), cache)]
        steps += [m(x[:, t : t + 1], ForwardContext(), cache) for t in (9, 10, 11)]
    assert calls == [(9, 9), (1, 10), (1, 11), (1, 12)]
    assert_close(torch.cat(steps, dim=1), full, 1e-5, "prefill + steps vs full forward")


@pytest.mark.parametrize("mode", ["sparse", "dense_warmup"])
def test_chunk_sizes_do_not_change_results(mode: str):
    cu = cumulative([25, 4, 18])
    x = inputs(47)
    results = []
    for chunk in (3, 7, None):
        m = build(
            topk=8,
            index_pool=4,
            rope=True,
            rope_dim=4,
            mode=mode,
            query_chunk=chunk,
            freeze_main_in_warmup=False,
        )
        xr = x.clone().requires_grad_(True)
        out, ctx = run(m, xr, cu)
        (out.square().sum() + ctx.losses["dsa_indexer"]).backward()
        results.append(
            (out, ctx.losses["dsa_indexer"], xr.grad, {n: p.grad for n, p in m.named_parameters()})
        )
    for out, loss, x_grad, grads in results[:2]:
        assert_close(out, results[-1][0], 1e-5, "output")
        assert_close(loss, results[-1][1], 1e-5, "indexer loss")
        assert_close(x_grad, results[-1][2], 1e-5, "input gradient")
        for n, g in grads.items():
            assert_close(g, results[-1][3][n], 1e-5, f"gradient of {n}")


class LargestTensor(TorchDispatchMode):
    """Records the element count of the largest tensor any operation produces."""

    def __init__(self) -> None:
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return out


def largest_intermediate(mode: str, t: int) -> int:
    m = build(topk=8, mode=mode, query_chunk=16, freeze_main_in_warmup=False)
    x = inputs(t).requires_grad_(True)
    with LargestTensor() as largest:
        out, ctx = run(m, x)
        (out.sum() + ctx.losses["dsa_indexer"]).backward()
    return largest.numel


@pytest.mark.parametrize("mode", ["sparse", "dense_warmup"])
def test_no_length_squared_tensor(mode: str):
    """With small chunks, the largest forward or backward intermediate grows at most linearly with T (a
    T x T tensor would grow 4x when T doubles) and stays below T x T."""
    short, long = largest_intermediate(mode, 192), largest_intermediate(mode, 384)
    assert long <= 2.2 * short, f"largest intermediate grew from {short} to {long} elements when T doubled"
    assert long < 384 * 384, f"an intermediate has {long} elements (T x T = {384 * 384})"


def test_config_errors_are_one_line():
    with pytest.raises(ValidationError, match="index_pool"):
        DSAConfig(topk=2, index_pool=4)
    with pytest.raises(ValidationError, match="rope_dim"):
        DSAConfig(rope=True, rope_dim=5)
    with pytest.raises(ValidationError, match="index_scores = 'bf16' has no triton kernel"):
        DSAConfig(backend="triton", index_scores="bf16")
    DSAConfig(backend="auto", index_scores="bf16")  # auto: torch's bf16 selection beside the kernel, logged
    with pytest.raises(ValidationError, match="mode"):
        DSAConfig(mode="dense")


def test_memory_estimate_counts_the_parameters():
    for config in ({}, {"rope": True, "rope_dim": 4}):
        m = build(**config)
        estimate = memory_estimate(DSAConfig(**SMALL, **config), DIMS, seq_len=1024)
        assert estimate.parameters == 4 * sum(p.numel() for p in m.parameters())
        assert estimate.saved_per_token > 0 and estimate.temporary > 0


TRITON_SCRIPT = textwrap.dedent(
    """
    import torch
    from megaseq.contracts import ForwardContext
    from megaseq.records import ModelDims
    from megaseq_testkit import build_component
    from megaseq_testkit.attention import assert_close

    import megaseq_dsa.ops.indexer

    small = {"n_heads": 2, "head_dim": 8, "q_lora_rank": 8, "kv_lora_rank": 8, "index_heads": 2, "index_dim": 8,
             "topk": 4, "index_pool": 2}
    dims = ModelDims(d_model=16, n_layers=2, vocab_size=8)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.randn(1, 13, 16, generator=torch.Generator().manual_seed(1)).to(device)
    cu = torch.tensor([0, 9, 13], dtype=torch.int32, device=device)
    results = []
    torch_select_block = megaseq_dsa.ops.indexer._select_block

    def no_torch_selection(*args):
        raise AssertionError("backend 'triton' ran the torch selection")

    for backend in ("triton", "torch"):
        torch.manual_seed(0)
        megaseq_dsa.ops.indexer._select_block = no_torch_selection if backend == "triton" else torch_select_block
        m = build_component("attention", "dsa", {**small, "backend": backend}, dims).to(device)
        xr = x.clone().requires_grad_(True)
        ctx = ForwardContext(cu_seqlens=cu)
        out = m(xr, ctx)
        (out.square().sum() + ctx.losses["dsa_indexer"]).backward()
        results.append((out, xr.grad, {n: p.grad for n, p in m.named_parameters()}))
    (out, x_grad, grads), (ref, ref_x_grad, ref_grads) = results
    assert_close(out, ref, 1e-5, "triton output")
    assert_close(x_grad, ref_x_grad, 1e-5, "triton input gradient")
    for n, g in grads.items():
        assert_close(g, ref_grads[n], 1e-5, f"triton gradient of {n}")
    print("ok")
    """
)


@pytest.mark.slow  # the Triton interpreter
def test_triton_backend_equals_torch_backend():
    """The layer with backend='triton' equals backend='torch' in fp32, with key pooling, and never runs the torch
    selection: on CUDA when present, else with the kernels in the Triton CPU interpreter (a subprocess, so
    TRITON_INTERPRET is set before triton is imported)."""
    pytest.importorskip("triton")
    env = {**os.environ} if torch.cuda.is_available() else {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run(
        [sys.executable, "-c", TRITON_SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


def test_backend_choice_is_never_a_silent_fallback(monkeypatch: pytest.MonkeyPatch):
    assert BACKENDS.names == DSAConfig.model_fields["backend"].annotation.__args__
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(core_backends, "is_installed", lambda module: False)
    with pytest.raises(ValueError, match=r"backend 'triton' needs triton, which is not installed \(pip install"):
        build(backend="triton")
    monkeypatch.setattr(core_backends, "is_installed", lambda module: True)
    m = build(backend="triton", index_pool=4)
    with pytest.raises(ValueError, match="backend 'triton' needs cuda tensors, got cpu; backends that run there"):
        m(inputs(8), ForwardContext())
    assert BACKENDS.select("auto", torch.device("cuda")).name == "triton"
    assert BACKENDS.select("auto", torch.device("cpu")).name == "native"


def test_plugin_module_does_not_import_torch():
    code = "import sys, megaseq_dsa.plugin; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "False", done.stderr[-2000:]


def test_backward_never_keeps_the_selected_keys_per_query():
    """Autograd must not save gathered [T, slots, latent] rows (the O(L*k*d) trap): what the layer keeps for
    backward per token stays below one query's gathered latent keys (slots x kv_lora_rank x 4 bytes)."""
    from megaseq.contracts import ForwardContext
    from megaseq.records import ModelDims
    from megaseq_testkit import build_component

    config = dict(n_heads=2, head_dim=16, q_lora_rank=32, kv_lora_rank=32, index_heads=2, index_dim=16, topk=64,
                  query_chunk=16)
    torch.manual_seed(0)
    layer = build_component("attention", "dsa", config, ModelDims(64, 2, 5))
    storages: dict[int, int] = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    tokens = 1024
    x = torch.randn(1, tokens, 64, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        ctx = ForwardContext()
        layer(x, ctx)
    assert ctx.losses, "the indexer loss must be part of the graph for this test to mean anything"
    per_token = sum(storages.values()) / tokens
    assert per_token < 64 * 32 * 4, f"{per_token:.0f} bytes saved per token"


@pytest.mark.parametrize(
    "config",
    [
        {"mode": "sparse", "topk": 64, "index_pool": 4},
        {"mode": "sparse", "topk": 64, "rope": True, "rope_dim": 8},
        {"mode": "dense_warmup", "freeze_main_in_warmup": False, "rope": True, "rope_dim": 8},
        {"mode": "dense_warmup"},
    ],
    ids=["sparse", "sparse-rope", "dense", "dense-frozen"],
)
def test_backward_keeps_what_the_memory_estimate_says(config: dict):
    """Bytes autograd keeps per token (the slope between two lengths, so per-layer constants drop out) equal the
    estimate's ``saved_per_token``: the memory planner sums these estimates."""
    from megaseq.records import ModelDims

    dims = ModelDims(64, 2, 5)
    full = {**SMALL, "query_chunk": 16, **config}
    torch.manual_seed(0)
    layer = build_component("attention", "dsa", full, dims)
    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}

    def saved(tokens: int) -> int:
        storages: dict[int, int] = {}

        def pack(t):
            if t.untyped_storage().data_ptr() not in params:
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            layer(torch.randn(1, tokens, 64, requires_grad=True), ForwardContext())
        return sum(storages.values())

    per_token = (saved(512) - saved(256)) / 256
    assert per_token == memory_estimate(DSAConfig(**full), dims, 512).saved_per_token


@pytest.mark.parametrize("mode", ["sparse", "dense_warmup"])
def test_a_recomputed_forward_keeps_its_selection_as_the_memory_estimate_says(mode: str):
    """A forward that keeps (``ForwardContext.keep``, as a recompute unit's does) records the selection, of the
    estimate's ``kept_per_token`` bytes per token; its re-run takes it back instead of selecting again and gives
    bitwise the same output, loss and gradients. Dense warm-up selects nothing and keeps nothing."""
    from megaseq.contracts import KeptValues
    from megaseq_dsa.testing import recorded_selections

    layer = build(mode=mode, topk=16, index_pool=4)
    x, cu = inputs(150), cumulative([40, 1, 70, 39])

    def step(ctx: ForwardContext) -> tuple[torch.Tensor, ...]:
        layer.zero_grad()
        out = layer(x, ctx)
        (out.square().sum() + sum(ctx.losses.values())).backward()
        return out.detach(), *(p.grad.clone() for p in layer.parameters() if p.grad is not None)

    kept = KeptValues()
    with recorded_selections() as forward:
        first = step(ForwardContext(cu_seqlens=cu).fork(kept))
    with recorded_selections() as rerun:
        again = step(ForwardContext(cu_seqlens=cu).for_recomputation(KeptValues(kept.items)))
    nbytes = sum(value.numel() * value.element_size() for _, value in kept.items)
    assert nbytes == memory_estimate(DSAConfig(**SMALL, mode=mode, topk=16, index_pool=4), DIMS, 150).kept_per_token * 150
    assert len(forward) == (mode == "sparse") and not rerun
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))


def test_bf16_autocast_does_not_reach_inside_the_indexer_loss():
    """The indexer loss and its gradients under a caller's bf16 autocast are bitwise the fp32 ones."""
    from megaseq_dsa.indexer import indexer_kl

    gen = torch.Generator().manual_seed(0)
    q_idx, k_idx, w = (torch.randn(*shape, generator=gen).requires_grad_() for shape in ((1, 40, 2, 8), (1, 40, 8), (1, 40, 2)))
    q, key = torch.randn(1, 40, 3, 8, generator=gen), torch.randn(1, 40, 8, generator=gen)
    pos, starts = torch.arange(40), torch.zeros(40, dtype=torch.long)
    indices = select_topk_reference(q_idx.detach(), k_idx.detach(), w.detach(), 8)

    def run():
        kl = indexer_kl(q_idx, k_idx, w, q, key, 0.3, pos, starts, indices, chunk=7)
        return kl, *torch.autograd.grad(kl, (q_idx, k_idx, w))

    plain = run()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under_autocast = run()
    for a, b in zip(under_autocast, plain, strict=True):
        assert torch.equal(a, b)
