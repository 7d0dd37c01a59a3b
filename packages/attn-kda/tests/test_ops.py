"""chunk_kda and kda_transition against the token-loop oracle (run in float64), on awkward sizes and gates.

Tolerance for fp32 results: max |a - ref| <= 1e-5 * max(1, max |ref|), ref computed in float64.
"""

import itertools

import pytest
import torch
import torch.nn.functional as F

import megaseq_kda.ops.chunk as chunk_module
import megaseq_kda.ops.transition
from megaseq_kda.ops import chunk_kda, kda_affine_map, kda_transition, naive_recurrent_kda
from megaseq_kda.ops.chunk import _SubchunkDiagonalGrams

FP32_TOL = 1e-5
INPUT_NAMES = ("q", "k", "v", "g", "beta", "initial_state")


def make_inputs(
    B: int, T: int, H: int, K: int, V: int, gate: str = "random", n_states: int | None = None, seed: int = 0
) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shape = (B, T, H, K)
    uniform = torch.rand(shape, generator=gen)
    gates = {
        "near_zero": torch.full(shape, -1e-6),
        "minus5": torch.full(shape, -5.0),
        "random": -5.0 * uniform,
        "mixed": torch.where(uniform < 0.5, -1e-6, -5.0 * uniform),  # per-channel mix of extremes
        "long_decay": -0.3 * uniform,  # slow decay: cumulative log-decay reaches ~ -150 over 1000 tokens
        "extreme": torch.where(uniform < 0.5, 0.0, -1e4),
    }
    return {
        "q": F.normalize(torch.randn(shape, generator=gen), dim=-1),
        "k": F.normalize(torch.randn(shape, generator=gen), dim=-1),
        "v": torch.randn(B, T, H, V, generator=gen),
        "g": gates[gate],
        "beta": torch.rand(B, T, H, generator=gen),
        "initial_state": torch.randn(n_states or B, H, K, V, generator=gen),
    }


def random_cotangents(o_shape: torch.Size, state_shape: torch.Size) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(o_shape, generator=gen), torch.randn(state_shape, generator=gen)


def run_with_grads(
    fn, inputs: dict[str, torch.Tensor], dtype: torch.dtype, cotangents: tuple | None = None, **kwargs
) -> dict[str, torch.Tensor]:
    """Run fn, backpropagate cotangents (random by default) through (o, final); return values and grads."""
    leaves = {name: x.detach().to(dtype).requires_grad_() for name, x in inputs.items()}
    o, final = fn(**leaves, output_final_state=True, **kwargs)
    d_o, d_final = cotangents or random_cotangents(o.shape, final.shape)
    ((o * d_o.to(o.dtype)).sum() + (final * d_final.to(final.dtype)).sum()).backward()
    return {"o": o, "final_state": final} | {f"d{name}": x.grad for name, x in leaves.items()}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str, tol: float = FP32_TOL) -> None:
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    assert torch.isfinite(actual).all(), f"{what}: not finite"
    err = (actual.double() - expected.double()).abs().max().item()
    bound = tol * max(1.0, expected.abs().max().item())
    assert err <= bound, f"{what}: max abs error {err:.3g} > {bound:.3g}"


def assert_all_close(actual: dict, expected: dict, tol: float = FP32_TOL) -> None:
    assert actual.keys() == expected.keys()
    for name in expected:
        assert_close(actual[name], expected[name], name, tol)


@pytest.mark.parametrize(
    ("B", "T", "H", "K", "V", "gate"),
    [
        (2, 1, 2, 32, 48, "random"),
        (2, 63, 2, 32, 48, "random"),
        (2, 64, 2, 32, 48, "near_zero"),
        (2, 65, 2, 32, 48, "minus5"),
        (2, 130, 2, 32, 48, "mixed"),
        (2, 200, 2, 32, 48, "extreme"),
        (1, 1000, 2, 16, 24, "long_decay"),  # smaller heads: the float64 oracle's backward is slow
        (1, 1000, 1, 16, 8, "random"),
    ],
)
def test_chunk_matches_oracle_outputs_states_and_grads(
    B: int, T: int, H: int, K: int, V: int, gate: str
) -> None:
    inputs = make_inputs(B, T, H, K, V, gate=gate, seed=T)
    expected = run_with_grads(naive_recurrent_kda, inputs, torch.float64)
    assert_all_close(run_with_grads(chunk_kda, inputs, torch.float32), expected)


def test_chunk_without_initial_state_and_custom_scale() -> None:
    inputs = make_inputs(B=2, T=100, H=3, K=16, V=24)
    del inputs["initial_state"]
    expected = run_with_grads(naive_recurrent_kda, inputs, torch.float64, scale=0.3)
    assert_all_close(run_with_grads(chunk_kda, inputs, torch.float32, scale=0.3), expected)


def test_chunk_in_float64_is_exact() -> None:
    """The chunked algebra is an exact rewrite of the recurrence, not an approximation."""
    inputs = make_inputs(B=1, T=150, H=2, K=8, V=12, gate="mixed")
    expected = run_with_grads(naive_recurrent_kda, inputs, torch.float64)
    assert_all_close(run_with_grads(chunk_kda, inputs, torch.float64), expected, tol=1e-11)


@pytest.mark.parametrize("offsets_dtype", [torch.int32, torch.int64])
def test_cu_seqlens_equals_documents_run_separately(offsets_dtype: torch.dtype) -> None:
    lengths = [70, 1, 0, 64, 129, 5]  # ragged, one empty document, one exactly one chunk long
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=offsets_dtype)
    H, K, V = 2, 16, 8
    inputs = make_inputs(B=1, T=sum(lengths), H=H, K=K, V=V, n_states=len(lengths))
    d_o, d_final = random_cotangents((1, sum(lengths), H, V), (len(lengths), H, K, V))
    packed = run_with_grads(chunk_kda, inputs, torch.float32, (d_o, d_final), cu_seqlens=offsets)

    per_doc = []
    for doc, (start, end) in enumerate(itertools.pairwise(offsets.tolist())):
        doc_inputs = {name: x[:, start:end] for name, x in inputs.items()}
        doc_inputs["initial_state"] = inputs["initial_state"][doc : doc + 1]
        doc_cotangents = (d_o[:, start:end], d_final[doc : doc + 1])
        per_doc.append(run_with_grads(chunk_kda, doc_inputs, torch.float32, doc_cotangents))
    separate = {
        name: torch.cat([d[name] for d in per_doc], 1) for name in ("o", "dq", "dk", "dv", "dg", "dbeta")
    }
    separate |= {name: torch.cat([d[name] for d in per_doc]) for name in ("final_state", "dinitial_state")}
    assert_all_close(packed, separate)

    oracle = run_with_grads(naive_recurrent_kda, inputs, torch.float64, (d_o, d_final), cu_seqlens=offsets)
    assert_all_close(packed, oracle)


def test_output_dtype_follows_input_and_state_stays_fp32() -> None:
    inputs = {name: x.to(torch.bfloat16) for name, x in make_inputs(B=1, T=70, H=2, K=16, V=16).items()}
    del inputs["initial_state"]
    o, final = chunk_kda(**inputs, output_final_state=True)
    assert o.dtype == torch.bfloat16 and final.dtype == torch.float32
    reference, _ = naive_recurrent_kda(**inputs)
    assert_close(o.float(), reference.float(), "bf16 output", tol=2e-2)
    assert chunk_kda(**inputs)[1] is None


def test_saved_for_backward_is_the_inputs_and_one_state_per_chunk() -> None:
    """Autograd keeps the op's inputs and the state entering each chunk: 3K + V + 1 + K V / 64 floats per token
    and head (5 KB per token at H=4, K=V=64), never the intra-chunk tensors (~30 K floats; 33 KB per token at
    H=4, K=V=64 before the recompute) and never a state per token."""
    T, H, K, V = 256, 2, 64, 64
    inputs = make_inputs(B=1, T=T, H=H, K=K, V=V)
    leaves = [inputs[name].requires_grad_() for name in ("q", "k", "v", "g", "beta")]
    saved_bytes: dict[int, int] = {}

    def record(t: torch.Tensor) -> torch.Tensor:
        saved_bytes[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(record, lambda t: t):
        chunk_kda(*leaves)
    floats_per_token_and_head = sum(saved_bytes.values()) / 4 / (T * H)
    assert floats_per_token_and_head <= 3 * K + V + 1 + K * V / 64, floats_per_token_and_head


def test_subchunk_diagonal_grams_backward_gradcheck() -> None:
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, 16, 3, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(2))
    g = (-3 * torch.rand(1, 16, 3, generator=gen, dtype=torch.float64)).requires_grad_()
    assert torch.autograd.gradcheck(_SubchunkDiagonalGrams.apply, (k, g, q))
    assert torch.autograd.gradcheck(_SubchunkDiagonalGrams.apply, (k, g))  # k-k blocks only


@pytest.mark.parametrize("group_head_tokens", [1, 3 * 64])
def test_chunk_groups_do_not_change_results(group_head_tokens: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Forward and backward walk groups of chunks (one chunk, or three per group here): the state and its
    gradient cross group boundaries, also inside and between packed documents, exactly as in one group."""
    lengths = [150, 1, 0, 64, 200, 5]  # documents spanning groups, starting and ending inside them
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    inputs = make_inputs(B=1, T=sum(lengths), H=1, K=8, V=6, gate="mixed", n_states=len(lengths))
    oracle = run_with_grads(naive_recurrent_kda, inputs, torch.float64, cu_seqlens=offsets)
    monkeypatch.setattr(chunk_module, "GROUP_HEAD_TOKENS", group_head_tokens)
    assert_all_close(run_with_grads(chunk_kda, inputs, torch.float64, cu_seqlens=offsets), oracle, tol=1e-11)
    batched = make_inputs(B=2, T=300, H=2, K=8, V=6, gate="random")
    oracle = run_with_grads(naive_recurrent_kda, batched, torch.float64)
    assert_all_close(run_with_grads(chunk_kda, batched, torch.float64), oracle, tol=1e-11)


def oracle_transition(k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """prod_t (I - beta_t k_t k_t^T) Diag(exp(g_t)), later tokens on the left, token by token in float64."""
    B, T, H, K = k.shape
    k, g, beta = (x.double() for x in (k, g, beta))
    M = torch.eye(K, dtype=torch.float64).expand(B, H, K, K)
    eye = torch.eye(K, dtype=torch.float64)
    for t in range(T):
        householder = eye - beta[:, t, :, None, None] * k[:, t, :, :, None] * k[:, t, :, None, :]
        M = householder @ (g[:, t, :, :, None].exp() * M)
    return M


def test_transition_matches_token_product_and_its_grads() -> None:
    inputs = make_inputs(B=2, T=90, H=2, K=8, V=8, gate="mixed")
    leaves = [inputs[name].clone().requires_grad_() for name in ("k", "g", "beta")]
    oracle_leaves = [x.detach().double().requires_grad_() for x in leaves]
    M, M_ref = kda_transition(*leaves), oracle_transition(*oracle_leaves)
    assert M.dtype == torch.float32
    assert_close(M, M_ref, "transition")
    cotangent = torch.randn(M.shape, generator=torch.Generator().manual_seed(2))
    (M * cotangent).sum().backward()
    (M_ref * cotangent.double()).sum().backward()
    for name, x, ref in zip(("dk", "dg", "dbeta"), leaves, oracle_leaves, strict=True):
        assert_close(x.grad, ref.grad, name)


def test_affine_map_equals_oracle_without_q(monkeypatch: pytest.MonkeyPatch) -> None:
    """(M, S) with final(S0) = M S0 + S against the oracle, gradients included, over 5 chunks (an odd count
    pads the tree) with mixed gates; the pass never forms q.k scores."""
    gated_grams = chunk_module._gated_grams

    def grams_without_q(q, *args):
        assert q is None, "the transition pass formed q.k scores"
        return gated_grams(q, *args)

    monkeypatch.setattr(chunk_module, "_gated_grams", grams_without_q)
    monkeypatch.setattr(megaseq_kda.ops.transition, "_gated_grams", grams_without_q)
    inputs = make_inputs(B=2, T=300, H=2, K=8, V=6, gate="mixed")
    leaves = [inputs[name].clone().requires_grad_() for name in ("k", "v", "g", "beta")]
    oracle_leaves = [x.detach().double().requires_grad_() for x in leaves]
    M, S = kda_affine_map(*leaves)
    k, v, g, beta = oracle_leaves
    _, S_ref = naive_recurrent_kda(torch.zeros_like(k), k, v, g, beta, output_final_state=True)
    M_ref = oracle_transition(k, g, beta)
    assert M.dtype == S.dtype == torch.float32
    assert_close(M, M_ref, "M")
    assert_close(S, S_ref, "S")
    gen = torch.Generator().manual_seed(3)
    d_M, d_S = torch.randn(M.shape, generator=gen), torch.randn(S.shape, generator=gen)
    ((M * d_M).sum() + (S * d_S).sum()).backward()
    ((M_ref * d_M.double()).sum() + (S_ref * d_S.double()).sum()).backward()
    for name, x, ref in zip(("dk", "dv", "dg", "dbeta"), leaves, oracle_leaves, strict=True):
        assert_close(x.grad, ref.grad, name)
    assert kda_transition(*(inputs[n] for n in ("k", "g", "beta"))).shape == (2, 2, 8, 8)


def test_transition_per_document() -> None:
    lengths = [40, 0, 100]
    offsets = torch.tensor([0, 40, 40, 140])
    inputs = make_inputs(B=1, T=sum(lengths), H=2, K=8, V=8)
    M = kda_transition(inputs["k"], inputs["g"], inputs["beta"], cu_seqlens=offsets)
    for doc, (start, end) in enumerate(itertools.pairwise(offsets.tolist())):
        expected = oracle_transition(*(inputs[name][:, start:end] for name in ("k", "g", "beta")))
        assert_close(M[doc : doc + 1], expected, f"document {doc}")


def test_state_update_is_affine_in_initial_state() -> None:
    """final(S0) = M S0 + final(0), and a sequence split in two halves ("ranks") reproduces the full run."""
    inputs = make_inputs(B=2, T=300, H=2, K=16, V=24)
    q, k, v, g, beta, S0 = (inputs[name] for name in INPUT_NAMES)
    o_full, final_full = chunk_kda(q, k, v, g, beta, initial_state=S0, output_final_state=True)
    _, final_zero = chunk_kda(q, k, v, g, beta, output_final_state=True)
    M = kda_transition(k, g, beta)
    assert_close(M @ S0 + final_zero, final_full, "affine final state")

    split = 137  # each "rank" computes from a zero state, then the second one folds in the first's (M, S)
    first = [x[:, :split] for x in (q, k, v, g, beta)]
    second = [x[:, split:] for x in (q, k, v, g, beta)]
    _, local_state = chunk_kda(*first, output_final_state=True)
    incoming = kda_transition(first[1], first[3], first[4]) @ S0 + local_state
    o_second, final_second = chunk_kda(*second, initial_state=incoming, output_final_state=True)
    assert_close(o_second, o_full[:, split:], "second rank's outputs")
    assert_close(final_second, final_full, "second rank's final state")

    o_ref, final_ref = naive_recurrent_kda(
        *(x.double() for x in (q, k, v, g, beta)), initial_state=S0.double(), output_final_state=True
    )
    assert_close(o_full, o_ref, "outputs vs oracle")
    assert_close(final_full, final_ref, "final state vs oracle")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda x: x.update(v=x["v"][:, :-1]), "v must be"),
        (lambda x: x.update(beta=x["beta"][..., None]), "beta must be"),
        (lambda x: x.update(g=x["g"][..., :-1]), "k and g must"),
        (lambda x: x.update(initial_state=x["initial_state"][:, :, :-1]), "initial_state must be"),
        (lambda x: x.update(cu_seqlens=torch.tensor([0, 5])), "cu_seqlens needs packed documents in a batch of 1"),
    ],
)
def test_bad_shapes_raise_one_line_errors(change, message: str) -> None:
    inputs = make_inputs(B=2, T=10, H=2, K=4, V=3)
    change(inputs)
    for fn in (chunk_kda, naive_recurrent_kda):
        with pytest.raises(ValueError, match=message):
            fn(**inputs)


@pytest.mark.parametrize("offsets", [[0, 4, 3, 10], [1, 10], [0, 9], [[0, 10]]])
def test_bad_cu_seqlens_raise(offsets: list) -> None:
    inputs = make_inputs(B=1, T=10, H=2, K=4, V=3)
    del inputs["initial_state"]
    with pytest.raises(ValueError, match="cu_seqlens"):
        chunk_kda(**inputs, cu_seqlens=torch.tensor(offsets))


def test_bf16_autocast_does_not_reach_inside_the_op() -> None:
    """Gates, beta and the state stay fp32 under a caller's bf16 autocast: the op's outputs and gradients are
    bitwise those of the fp32 run (without the op's own guard its products would run in bf16, ~1e-3 off)."""
    inputs = make_inputs(B=1, T=150, H=2, K=16, V=16, gate="mixed")
    plain = run_with_grads(chunk_kda, inputs, torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under_autocast = run_with_grads(chunk_kda, inputs, torch.float32)
    for name, value in plain.items():
        assert torch.equal(under_autocast[name], value), name
