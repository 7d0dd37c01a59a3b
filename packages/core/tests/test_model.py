"""Model assembly and the chunked LM loss."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megaseq.config import validate_recipe
from megaseq.contracts import ForwardContext
from megaseq.model import RMSNorm, build_model, chunked_token_losses
from megaseq_testkit import assert_close, fresh_plugins


def tiny_model(**model):
    plugins = fresh_plugins()
    raw = {"model": {"d_model": 16, "n_layers": 2, **model}, "attention": {"sdpa": {"n_heads": 2}}, "train": {"bf16": True}}
    recipe = validate_recipe(raw, plugins)
    torch.manual_seed(0)
    return build_model(recipe, plugins)


def test_chunked_loss_equals_full_loss_and_gradients():
    torch.manual_seed(0)
    hidden = torch.randn(2, 37, 16, requires_grad=True)
    weight = torch.randn(5, 16, requires_grad=True)
    targets = torch.randint(0, 5, (2, 37))
    full = F.cross_entropy((hidden @ weight.t()).flatten(0, 1), targets.flatten(), reduction="none").view(2, 37)
    gh, gw = torch.autograd.grad(full.sum(), (hidden, weight))
    for chunk in (1, 7, 74, 1000):
        losses = chunked_token_losses(hidden, weight, targets, chunk)
        ch, cw = torch.autograd.grad(losses.sum(), (hidden, weight))
        # fp32 rounding relative to the magnitudes compared (losses up to ~10, |gw| ~ 5 summed over 74 tokens):
        # the order of the chunked sums differs from the full one, and with it the last bits
        assert_close(losses, full, 1e-6, f"token losses, chunk {chunk}")
        assert_close(ch, gh, 1e-6, f"hidden gradient, chunk {chunk}")
        assert_close(cw, gw, 1e-6, f"head gradient, chunk {chunk}")


def test_model_shapes_tied_head_and_decode():
    model = tiny_model()
    assert model.head is None and model.head_weight is model.embed.weight
    tokens = torch.randint(0, 5, (2, 11))
    hidden = model(tokens)
    assert hidden.shape == (2, 11, 16)
    with torch.no_grad():
        caches = model.init_caches(2)
        steps = [model(tokens[:, :4], ForwardContext(), caches)]
        steps += [model(tokens[:, t : t + 1], ForwardContext(), caches) for t in range(4, 11)]
    assert_close(torch.cat(steps, 1), hidden.detach(), 1e-5, "decoding with caches")


def test_untied_head_and_layernorm():
    model = tiny_model(tie_embeddings=False, norm="layernorm")
    assert model.head is not None and isinstance(model.final_norm, torch.nn.LayerNorm)
    assert model.logits(model(torch.randint(0, 5, (1, 3)))).shape == (1, 3, 5)


def saved_bytes(run) -> int:
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return sum(storages.values())


def test_rmsnorm_matches_the_formula_in_float64_and_keeps_input_and_rstd():
    """Hand-written backward against autograd of the formula in float64 (max error <= 1e-6 x max |ref|), on a
    row of large and a row of tiny values; backward keeps x and one rstd per token, not the normalised x."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 7, 12, generator=gen)
    x[0, 0] *= 1e3
    x[1, 3] *= 1e-3
    norm = RMSNorm(12, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(12, generator=gen) + 0.5)
    grad = torch.randn(2, 7, 12, generator=gen)

    def reference(x64: torch.Tensor, w64: torch.Tensor) -> torch.Tensor:
        return x64 * torch.rsqrt(x64.square().mean(-1, keepdim=True) + 1e-6) * w64

    x32 = x.clone().requires_grad_()
    out = norm(x32)
    got = (out, *torch.autograd.grad(out, (x32, norm.weight), grad))
    x64, w64 = x.double().requires_grad_(), norm.weight.detach().double().requires_grad_()
    ref = reference(x64, w64)
    want = (ref, *torch.autograd.grad(ref, (x64, w64), grad.double()))
    for name, a, b in zip(("output", "dx", "dweight"), got, want, strict=True):
        assert a.dtype == torch.float32
        assert (a.double() - b).abs().max() <= 1e-6 * max(1.0, b.abs().max().item()), name
    kept = saved_bytes(lambda: norm(x.clone().requires_grad_()))
    assert kept == 4 * (x.numel() + 2 * 7 + 12), kept  # x, rstd, the weight


def test_swiglu_matches_the_formula_and_keeps_what_its_estimate_says():
    """The hand-written gate backward against autograd of w2(silu(w1 x) * w3 x) in float64; backward keeps the
    input, the w1 and w3 outputs and the gated product (w2's input), which is the memory estimate."""
    from megaseq.builtins.config import SwiGLUConfig
    from megaseq.builtins.swiglu import build, memory_estimate
    from megaseq.records import ModelDims

    config, dims = SwiGLUConfig(hidden=24), ModelDims(d_model=16, n_layers=2, vocab_size=5)
    torch.manual_seed(0)
    ffn = build(config, dims, 0)
    x = torch.randn(2, 9, 16) * 3
    grad = torch.randn(2, 9, 16)
    x32 = x.clone().requires_grad_()
    out = ffn(x32, ForwardContext())
    params = [ffn.w1.weight, ffn.w3.weight, ffn.w2.weight]
    got = (out, *torch.autograd.grad(out, (x32, *params), grad))
    x64, (w1, w3, w2) = x.double().requires_grad_(), (p.detach().double().requires_grad_() for p in params)
    ref = (F.silu(x64 @ w1.t()) * (x64 @ w3.t())) @ w2.t()
    want = (ref, *torch.autograd.grad(ref, (x64, w1, w3, w2), grad.double()))
    for a, b in zip(got, want, strict=True):
        assert (a.double() - b).abs().max() <= 1e-5 * max(1.0, b.abs().max().item())
    kept = saved_bytes(lambda: ffn(x.clone().requires_grad_(), ForwardContext()))
    weights = 4 * sum(p.numel() for p in params)
    assert kept - weights == memory_estimate(config, dims, 18).saved_per_token * 18


def test_swiglu_gate_backward_is_bitwise_autograds():
    """The gate's backward runs autograd's own operations on recomputed silu(a): in fp32 its gradients equal
    plain autograd of silu(a) * b bit for bit (a gate that differentiated its own formula differs in rounding)."""
    from megaseq.builtins.swiglu import _SiLUGate

    gen = torch.Generator().manual_seed(1)
    a, b, grad = (torch.randn(3, 11, 24, generator=gen) * 3 for _ in range(3))
    leaves = [t.clone().requires_grad_() for t in (a, b)]
    got = torch.autograd.grad(_SiLUGate.apply(*leaves), leaves, grad)
    leaves = [t.clone().requires_grad_() for t in (a, b)]
    want = torch.autograd.grad(F.silu(leaves[0]) * leaves[1], leaves, grad)
    for x, y in zip(got, want, strict=True):
        assert torch.equal(x, y)


def block_input_dtypes(model, tokens: torch.Tensor, autocast: bool) -> list[torch.dtype]:
    seen: list[torch.dtype] = []
    handles = [b.register_forward_pre_hook(lambda _m, args: seen.append(args[0].dtype)) for b in model.blocks]
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        model(tokens)
    for handle in handles:
        handle.remove()
    return seen


def test_bf16_residual_stream_carries_bf16_block_inputs_under_autocast_only():
    """model.residual_dtype = "bf16": under bf16 autocast every block's input is bf16, even after a component
    that returns fp32 (the block casts its output into the stream); without autocast the model is fp32. The
    fp32 stream (the default) is the wrong model this check must catch: its block inputs are fp32."""
    tokens = torch.randint(0, 5, (2, 33))
    bf16 = tiny_model(residual_dtype="bf16")
    assert block_input_dtypes(bf16, tokens, autocast=True) == [torch.bfloat16] * 2
    assert block_input_dtypes(bf16, tokens, autocast=False) == [torch.float32] * 2
    assert block_input_dtypes(tiny_model(), tokens, autocast=True) == [torch.float32] * 2

    class ReturnsFloat32(torch.nn.Module):
        def __init__(self, inner: torch.nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
            return self.inner(x, ctx).float()

    bf16.blocks[0].ffn = ReturnsFloat32(bf16.blocks[0].ffn)
    assert block_input_dtypes(bf16, tokens, autocast=True) == [torch.bfloat16] * 2


def test_bf16_residual_stream_loss_and_gradients_stay_near_the_fp32_stream():
    """Same weights, same tokens, both under bf16 autocast: the stream's rounding (bf16 keeps 8 bits) moves
    the loss by well under 1% and the gradient by a few percent of its norm, and keeps everything finite."""
    tokens = torch.randint(0, 5, (2, 65), generator=torch.Generator().manual_seed(0))
    results = []
    for residual in ("fp32", "bf16"):
        model = tiny_model(residual_dtype=residual)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = chunked_token_losses(model(tokens[:, :-1]), model.head_weight, tokens[:, 1:], 64).mean()
        loss.backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters()])
        assert torch.isfinite(loss) and torch.isfinite(grads).all()
        results.append((loss.detach(), grads))
    (loss32, grad32), (loss16, grad16) = results
    assert abs(loss16 - loss32) <= 1e-2 * loss32
    assert (grad16 - grad32).norm() <= 0.1 * grad32.norm()


def _graph_nodes(root: torch.autograd.graph.Node) -> set[str]:
    seen, names, stack = set(), set(), [root]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.add(type(node).__name__)
        stack += [next_node for next_node, _ in node.next_functions]
    return names


def test_chunked_losses_take_split_pieces_whose_backward_joins_them_once():
    """A slice per chunk would make each chunk's backward write its gradient into a zero tensor of the whole
    sequence (quadratic in the length: docs/results.md, "Chunks and tiles as splits"); split's pieces join once.
    The losses and the gradient are those of one unchunked pass."""
    torch.manual_seed(0)
    hidden = torch.randn(1, 37, 8, requires_grad=True)
    weight = torch.randn(5, 8)
    targets = torch.randint(0, 5, (1, 37))
    losses = chunked_token_losses(hidden, weight, targets, chunk=10)
    names = _graph_nodes(losses.grad_fn)
    assert "SliceBackward0" not in names and any(n.startswith("Split") for n in names), names
    expected = torch.nn.functional.cross_entropy(hidden[0] @ weight.t(), targets[0], reduction="none")
    torch.testing.assert_close(losses[0], expected)
    (grad,) = torch.autograd.grad(losses.sum(), hidden)
    (want,) = torch.autograd.grad(expected.sum(), hidden)
    torch.testing.assert_close(grad, want)
