"""chunk_kda against the token-loop oracle (run in float64), on awkward sizes and gates.

Tolerance for fp32 results: max |a - ref| <= 1e-5 * max(1, max |ref|), ref computed in float64.
"""

import itertools
import math

import pytest
import torch
import torch.nn.functional as F

import megaseq_kda.ops.chunk as chunk_module
from megaseq_kda.ops import chunk_kda, naive_recurrent_kda
from megaseq_kda.ops.chunk import _GatedGrams

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


def _gated_grams_by_definition(k: torch.Tensor, q: torch.Tensor, G: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A_kk, A_qk formed directly: sum_d x_s k_j exp(G_s - G_j) for j < s (A_kk) and j <= s (A_qk)."""
    decay = (G[..., :, None, :] - G[..., None, :, :]).clamp_max(0).exp()  # [.., s, j, K]
    lower = torch.ones(G.shape[-2], G.shape[-2], dtype=torch.bool).tril()
    kk = torch.einsum("...sd,...jd,...sjd->...sj", k, k, decay) * lower.tril(-1)
    return kk, torch.einsum("...sd,...jd,...sjd->...sj", q, k, decay) * lower


def test_gated_grams_backward_equals_autograd_through_the_definition() -> None:
    """The hand-written backward (blocks below the diagonal and on it, both Grams) against autograd through the
    direct formula, float64, two chunks, gates of up to -3 per token."""
    gen = torch.Generator().manual_seed(0)
    k, q = (torch.randn(2, 64, 5, generator=gen, dtype=torch.float64) for _ in range(2))
    G = (-3 * torch.rand(2, 64, 5, generator=gen, dtype=torch.float64)).cumsum(-2)
    weights = [torch.randn(2, 64, 64, generator=gen, dtype=torch.float64) for _ in range(2)]
    grads = []
    for grams in (_GatedGrams.apply, _gated_grams_by_definition):
        leaves = [x.clone().requires_grad_() for x in (k, q, G)]
        sum((w * a).sum() for w, a in zip(weights, grams(*leaves), strict=True)).backward()
        grads.append([x.grad for x in leaves])
    for name, got, want in zip("kqG", *grads, strict=True):
        assert_close(got, want, f"d{name}", 1e-12)


def test_gated_grams_equal_their_definition_at_extreme_gates() -> None:
    """A_qk[s, j] = sum_d q_s k_j exp(G_s - G_j) for j <= s, A_kk the same with k_s for j < s, formed directly in
    float64, with gates from -1e-3 to -60 per token (exponents far below fp32's range) in fp32."""
    gen = torch.Generator().manual_seed(1)
    q, k = (torch.randn(3, 64, 8, generator=gen) for _ in range(2))
    g = -torch.logspace(-3, math.log10(60), 64 * 8, dtype=torch.float64)[torch.randperm(64 * 8, generator=gen)]
    G = g.view(1, 64, 8).expand(3, 64, 8).cumsum(-2)
    A_kk, A_qk = _GatedGrams.apply(k, q, G)
    want_kk, want_qk = _gated_grams_by_definition(k.double(), q.double(), G)
    assert_close(A_kk, want_kk, "A_kk")
    assert_close(A_qk, want_qk, "A_qk")


@pytest.mark.parametrize(
    ("group_head_tokens", "diagonal_head_tokens"), [(1, 2048), (3 * 64, 2048), (10**6, 64), (10**6, 2 * 64)]
)
def test_chunk_groups_do_not_change_results(
    group_head_tokens: int, diagonal_head_tokens: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Forward and backward walk groups of chunks (one chunk, or three per group here), and the Grams' diagonal
    blocks slices of a group (one chunk, or two per slice, of a group of every chunk): the state and its
    gradient cross group boundaries, also inside and between packed documents, exactly as in one group."""
    lengths = [150, 1, 0, 64, 200, 5]  # documents spanning groups, starting and ending inside them
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    inputs = make_inputs(B=1, T=sum(lengths), H=1, K=8, V=6, gate="mixed", n_states=len(lengths))
    oracle = run_with_grads(naive_recurrent_kda, inputs, torch.float64, cu_seqlens=offsets)
    monkeypatch.setattr(chunk_module, "GROUP_HEAD_TOKENS", group_head_tokens)
    monkeypatch.setattr(chunk_module, "DIAGONAL_HEAD_TOKENS", diagonal_head_tokens)
    assert_all_close(run_with_grads(chunk_kda, inputs, torch.float64, cu_seqlens=offsets), oracle, tol=1e-11)
    batched = make_inputs(B=2, T=300, H=2, K=8, V=6, gate="random")
    oracle = run_with_grads(naive_recurrent_kda, batched, torch.float64)
    assert_all_close(run_with_grads(chunk_kda, batched, torch.float64), oracle, tol=1e-11)


def test_state_map_rides_on_extra_value_columns() -> None:
    """What context parallelism relies on (``megaseq_kda/parallel.py``): one call on values ``[v | 0]`` from
    the initial state ``[0 | I]`` gives the outputs from zero (first V columns), ``q_t^T P_t`` (last K) and
    the final state ``[S_loc | M]``; then any initial state S0 gives ``o = o0 + (q^T P) S0`` and
    ``final = M S0 + S_loc``, against the float64 oracle run from S0. Also per document: only the first
    piece is seeded, so the others' extra columns stay zero."""
    inputs = make_inputs(B=2, T=300, H=2, K=16, V=24)
    q, k, v, g, beta, S0 = (inputs[name] for name in INPUT_NAMES)
    eye = torch.eye(16).expand(2, 2, 16, 16)
    seed = torch.cat([torch.zeros(2, 2, 16, 24), eye], -1)
    o_aug, final_aug = chunk_kda(q, k, torch.cat([v, torch.zeros(2, 300, 2, 16)], -1), g, beta,
                                 initial_state=seed, output_final_state=True)
    o_ref, final_ref = naive_recurrent_kda(
        *(x.double() for x in (q, k, v, g, beta)), initial_state=S0.double(), output_final_state=True
    )
    o = o_aug[..., :24] + torch.einsum("bthk,bhkv->bthv", o_aug[..., 24:], S0)
    assert_close(o, o_ref, "outputs from S0")
    assert_close(final_aug[..., 24:] @ S0 + final_aug[..., :24], final_ref, "final state from S0")

    offsets = torch.tensor([0, 40, 40, 140])
    docs = make_inputs(B=1, T=140, H=2, K=8, V=8)
    q, k, v, g, beta = (docs[name] for name in INPUT_NAMES[:5])
    seed = torch.cat([torch.cat([torch.zeros(1, 2, 8, 8), torch.eye(8).expand(1, 2, 8, 8)], -1), torch.zeros(2, 2, 8, 16)])
    o_aug, final_aug = chunk_kda(q, k, torch.cat([v, torch.zeros(1, 140, 2, 8)], -1), g, beta,
                                 initial_state=seed, output_final_state=True, cu_seqlens=offsets)
    assert torch.equal(o_aug[:, 40:, :, 8:], torch.zeros_like(o_aug[:, 40:, :, 8:]))
    assert torch.equal(final_aug[1:, ..., 8:], torch.zeros_like(final_aug[1:, ..., 8:]))
    S_first = torch.randn(1, 2, 8, 8, generator=torch.Generator().manual_seed(4))
    o_ref, final_ref = naive_recurrent_kda(*(x[:, :40].double() for x in (q, k, v, g, beta)),
                                           initial_state=S_first.double(), output_final_state=True)
    assert_close(o_aug[:, :40, :, :8] + torch.einsum("bthk,bhkv->bthv", o_aug[:, :40, :, 8:], S_first), o_ref, "first piece")
    assert_close(final_aug[:1, ..., 8:] @ S_first + final_aug[:1, ..., :8], final_ref, "first piece's final state")


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
