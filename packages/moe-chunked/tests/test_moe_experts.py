"""Grouped expert products (grouped_mm and the per-expert loop) against a float64 oracle; clamped SwiGLU; a rank's
experts are the one-process layer's blocks (core's ``check_local_experts``), which a layer drawing only its own
experts fails; a layer built on the meta device draws nothing."""

from unittest import mock

import pytest
import torch
import torch.nn.functional as F

from megaseq_moe.config import ChunkedMoEConfig
from megaseq_moe.experts import GroupedExperts, expert_dtype, grouped_linear, grouped_mm_supported, swiglu
from megaseq_moe.layer import ChunkedMoE
from megaseq_testkit.moe import check_local_experts

RTOL = 1e-5  # max abs error <= RTOL * max(1, max |reference|)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    if expected.numel():
        err = (actual.double() - expected.double()).abs().max().item()
        assert err <= RTOL * max(1.0, expected.abs().max().item()), f"{what}: error {err:.3e}"


def grouped_linear_oracle(x: torch.Tensor, weight: torch.Tensor, counts: list[int]) -> torch.Tensor:
    expert_of_row = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    return torch.stack([x[i].double() @ weight[e].double() for i, e in enumerate(expert_of_row.tolist())])


@pytest.mark.parametrize("use_grouped_mm", [True, False], ids=["grouped_mm", "loop"])
@pytest.mark.parametrize(
    "counts", [[3, 0, 7, 1], [0, 0, 0, 5], [11, 0, 0, 0]], ids=["mixed", "last-only", "first-only"]
)
def test_grouped_linear_matches_oracle(use_grouped_mm: bool, counts: list[int]) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(sum(counts), 12, generator=gen, requires_grad=True)
    weight = torch.randn(4, 12, 8, generator=gen, requires_grad=True)
    grad_out = torch.randn(sum(counts), 8, generator=gen)
    out = grouped_linear(x, weight, torch.tensor(counts), use_grouped_mm)
    assert_close(out, grouped_linear_oracle(x.detach(), weight.detach(), counts), "output")
    (out * grad_out).sum().backward()
    x64, w64 = x.detach().double().requires_grad_(True), weight.detach().double().requires_grad_(True)
    (grouped_linear_oracle(x64, w64, counts) * grad_out.double()).sum().backward()
    assert_close(x.grad, x64.grad, "input gradient")
    assert_close(weight.grad, w64.grad, "weight gradient")


@pytest.mark.parametrize("n_rows", [0, 1, 3])
def test_grouped_linear_accepts_column_slices(n_rows: int) -> None:
    """Payloads are column slices: with 0 or 1 rows they look contiguous but keep a 260-byte stride."""
    payload = torch.randn(n_rows, 65)
    weight = torch.randn(2, 32, 8)
    counts = torch.tensor([n_rows, 0])
    out = grouped_linear(
        payload[:, :32], weight, counts, use_grouped_mm=grouped_mm_supported("cpu", payload.dtype, 32, 8)
    )
    assert_close(out, payload[:, :32].double() @ weight[0].double(), "slice product")


def test_grouped_mm_support_rules() -> None:
    have = hasattr(F, "grouped_mm")
    assert grouped_mm_supported("cpu", torch.float32, 8, 4) == have
    assert grouped_mm_supported("cpu", torch.bfloat16, 8, 16) == have
    assert not grouped_mm_supported("cpu", torch.float32, 7, 4)  # 28-byte rows
    assert not grouped_mm_supported("cpu", torch.bfloat16, 8, 4)  # 8-byte rows
    assert not grouped_mm_supported("cpu", torch.float64, 8, 4)


@pytest.mark.parametrize(("capability", "dtype", "grouped"), [
    ((9, 0), torch.bfloat16, True),
    ((8, 0), torch.bfloat16, True),
    ((9, 0), torch.float32, False),  # CUDA's grouped GEMM is bf16 only: fp32 takes the loop
    ((7, 5), torch.bfloat16, False),
])
def test_grouped_mm_choice_on_cuda(monkeypatch, capability, dtype, grouped) -> None:
    """The choice for a CUDA device, decided without one (its compute capability is read, nothing else)."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert grouped_mm_supported(torch.device("cuda", 3), dtype, 64, 128) == (grouped and hasattr(F, "grouped_mm"))


@pytest.mark.parametrize(("device", "dtype", "autocast", "expected"), [
    ("cuda", torch.float32, torch.bfloat16, torch.bfloat16),  # the GPU's bf16 grouped GEMM
    ("cuda", torch.float32, None, torch.float32),
    ("cuda", torch.float32, torch.float16, torch.float32),  # grouped_mm has no fp16
    ("cuda", torch.bfloat16, None, torch.bfloat16),
    ("cpu", torch.float32, torch.bfloat16, torch.float32),  # CPU numerics do not depend on autocast
])
def test_expert_dtype(device, dtype, autocast, expected) -> None:
    assert expert_dtype(device, dtype, autocast) == expected


def test_experts_in_bf16_return_the_rows_dtype() -> None:
    torch.manual_seed(0)
    experts = GroupedExperts(n_local=3, d_model=16, hidden=8, limit=None, init_std=0.5)
    counts = [2, 0, 5]
    rows = torch.randn(sum(counts), 16)
    out = experts(rows, torch.tensor(counts), torch.bfloat16)
    assert out.dtype == torch.float32
    expected = torch.cat([experts.one(e, block) for e, block in enumerate(rows.split(counts))])
    assert (out - expected).abs().max() <= 3e-2 * expected.abs().max()


def test_experts_grouped_rows_equal_one_expert_at_a_time() -> None:
    torch.manual_seed(0)
    experts = GroupedExperts(n_local=3, d_model=8, hidden=4, limit=None, init_std=0.5)
    counts = [2, 0, 5]
    rows = torch.randn(sum(counts), 8)
    out = experts(rows, torch.tensor(counts))
    blocks = rows.split(counts)
    expected = torch.cat([experts.one(e, block) for e, block in enumerate(blocks)])
    assert_close(out, expected, "grouped experts")


def test_swiglu_clamps_gate_above_and_up_both_sides() -> None:
    gate = torch.tensor([-20.0, 0.5, 20.0, 3.0])
    up = torch.tensor([-20.0, 0.5, 20.0, -3.0])
    gate_up = torch.cat([gate, up]).requires_grad_(True)
    out = swiglu(gate_up, limit=2.0)
    expected = F.silu(torch.tensor([-20.0, 0.5, 2.0, 2.0])) * torch.tensor([-2.0, 0.5, 2.0, -2.0])
    assert_close(out, expected, "clamped swiglu")
    out.sum().backward()
    # clamped entries pass no gradient: gate at 20 and 3 (> 2), up at -20, 20 and -3
    assert gate_up.grad[2] == 0 and gate_up.grad[3] == 0
    assert (gate_up.grad[[4, 6, 7]] == 0).all() and gate_up.grad[5] != 0
    assert torch.equal(swiglu(gate_up.detach(), None), F.silu(gate) * up)


class LocallyDrawnExperts(GroupedExperts):
    """Draws only its own experts, in one stack: the right shapes, but not the one-process layer's values."""

    def __init__(self, n_local, d_model, hidden, limit, init_std, *whole_layer) -> None:
        super().__init__(n_local, d_model, hidden, limit, init_std)


def build_locally_drawn(config, dims, layer_idx):
    with mock.patch("megaseq_moe.layer.GroupedExperts", LocallyDrawnExperts):
        return ChunkedMoE(ChunkedMoEConfig.model_validate(config), dims, layer_idx)


def test_local_experts_are_the_one_process_blocks_and_a_layer_drawing_only_its_own_is_caught() -> None:
    config = {"n_experts": 4, "top_k": 2, "expert_hidden": 16, "init_std": 0.3}
    both = frozenset({"expert_parallel", "tensor_parallel"})
    assert check_local_experts("chunked", config, both) == 2
    for capability in sorted(both):
        with pytest.raises(AssertionError, match="global generator elsewhere|one-process layer's block"):
            check_local_experts("chunked", config, frozenset({capability}), factory=f"{__name__}:build_locally_drawn")


def test_experts_built_on_meta_have_the_rank_shapes_and_draw_nothing() -> None:
    """A launch's pre-flight builds every layer on the meta device for its shapes: the same parameters as a real
    build, no draws (which would also leave the generator unchanged: a meta draw has no values)."""
    args = dict(n_local=2, d_model=8, hidden=3, limit=None, init_std=0.02, first=2, n_experts=6, etp_rank=1, etp_size=2)
    real = GroupedExperts(**args)
    with mock.patch("torch.randn", side_effect=AssertionError("drew on meta")), torch.device("meta"):
        meta = GroupedExperts(**args)
    assert {n: (p.shape, p.dtype) for n, p in meta.named_parameters()} == {
        n: (p.shape, p.dtype) for n, p in real.named_parameters()
    }
    assert all(p.is_meta for p in meta.parameters())
