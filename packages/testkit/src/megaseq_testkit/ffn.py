"""Conformance suite for feed-forward components (see ``megaseq.contracts.FeedForward``).

Subclass :class:`FeedForwardConformance` in a pytest module and set ``name`` and ``config``; every test below
then runs against the component built through the installed plugins (the ``ffn`` kind; the MoE suite reuses
these tests for the ``moe`` kind). What is checked, and what each check would catch:

- ``test_shape_and_dtype``: ``[B, T, d_model]`` in and out, the input's dtype (float32 and float64), finite.
- ``test_per_token``: a token's output depends on that token only: changing one token changes its output
  and no other (mixing over the sequence or the batch, batch statistics); permuting the tokens permutes the
  outputs; a packed context (``cu_seqlens``) changes nothing.
- ``test_gradients``: float64 finite differences for the input and every trainable parameter (wrong or
  missing gradients), reference-free.
- ``test_deterministic``: the same forward and backward twice, torch's global random generator moved in
  between, are identical, and the generator is left alone.
- ``test_zero_input``: all-zero tokens (padding) give finite outputs and gradients.
- ``test_one_host_sync_per_batch``: two layers sharing one packed forward read ``cu_seqlens`` to the host at
  most once between them (a component that needs the layout reads it through ``ctx.documents``).
- ``test_two_forwards_one_backward``: two forwards, then one backward of both, give each forward's own
  gradients (a hand-written backward that reads state the module kept on itself in forward).
- ``test_tensor_parallel``: with ``tensor_parallel`` declared (the record's, or the ``capabilities`` knob with
  ``factory``), ``megaseq_testkit.tensor_parallel.check_tensor_parallel`` at tp=2.
- ``test_memory_estimate``: the record's ``MemoryEstimate.saved_per_token`` times the tokens is within
  ``memory_tolerance`` (25%) of the bytes autograd saves (distinct storages, the input included, the
  parameters not), at each of ``memory_lengths`` (a 3x underestimate, a cost that grows faster than the tokens).
- ``test_temporary_estimate``: the record's ``MemoryEstimate.temporary`` (times the rows: it is one sequence's)
  against the larger transient working set of one forward and one backward
  (``megaseq_testkit.checks.transient_bytes``) at each of ``memory_lengths``: at least ``1 - memory_tolerance``
  and at most ``temporary_ratio`` (4) times it (a scratch buffer the estimate leaves out).

Error bound: ``max |actual - expected| <= tolerance * max(1, max |expected|)`` (``tolerance``, 1e-5 for
float32 comparisons; the float64 gradient check uses ``grad_tolerance``, 1e-6).
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor, nn

from megaseq.contracts import ForwardContext
from megaseq_testkit import (
    ComponentSuite,
    assert_close,
    build_component,
    check_deterministic,
    check_gradients,
    watch_host_syncs,
)
from megaseq_testkit.checks import (
    check_shape_and_dtype,
    check_two_forwards,
    forward_backward,
)
from megaseq_testkit.tensor_parallel import check_tensor_parallel


class FeedForwardConformance(ComponentSuite):
    """Base class of a feed-forward component's conformance tests (the knobs are documented in
    docs/writing-a-plugin.md)."""

    kind: ClassVar[str] = "ffn"
    temporary_ratio: ClassVar[float] = 4.0
    grad_tolerance: ClassVar[float] = 1e-6
    batch: ClassVar[int] = 2
    seq_len: ClassVar[int] = 13
    grad_seq_len: ClassVar[int] = 5

    def build(self, seed: int = 0) -> nn.Module:
        """The module under test, in training mode."""
        torch.manual_seed(seed)
        return build_component(self.kind, self.name, self.config, self.dims(), factory=self.factory).float().train()

    def inputs(self, seed: int = 1, length: int | None = None) -> Tensor:
        gen = torch.Generator().manual_seed(seed)
        return torch.randn(self.batch, length or self.seq_len, self.d_model, generator=gen)

    def test_shape_and_dtype(self) -> None:
        check_shape_and_dtype(self.build(), self.inputs(), ForwardContext)

    def test_per_token(self) -> None:
        module = self.build()
        x = self.inputs()
        with torch.no_grad():
            out = module(x, ForwardContext())
            # one token changed: its output changes, no other does
            b, t = self.batch - 1, self.seq_len // 2
            changed = x.clone()
            changed[b, t] = self.inputs(seed=7)[b, t]
            out_changed = module(changed, ForwardContext())
            others = torch.ones(self.batch, self.seq_len, dtype=torch.bool)
            others[b, t] = False
            assert_close(out_changed[others], out[others], self.tolerance, "outputs of the tokens left unchanged")
            assert not torch.allclose(out_changed[b, t], out[b, t]), "changing a token did not change its output"
            # tokens permuted (across rows too), and all of them packed in one row
            flat = x.reshape(1, -1, self.d_model)
            order = torch.randperm(flat.shape[1], generator=torch.Generator().manual_seed(3))
            permuted = module(flat[:, order], ForwardContext())
            assert_close(permuted, out.reshape(1, -1, self.d_model)[:, order], self.tolerance, "permuted tokens")
            cu = torch.tensor([0, 3, 3, flat.shape[1]], dtype=torch.int32)
            packed = module(flat, ForwardContext(cu_seqlens=cu))
            assert_close(packed, out.reshape(1, -1, self.d_model), self.tolerance, "tokens in a packed row")

    def test_gradients(self) -> None:
        grad_out = self.inputs(seed=4, length=self.grad_seq_len).double()

        def loss(module: nn.Module, x: Tensor) -> Tensor:
            return (module(x, ForwardContext()) * grad_out).sum()

        x = self.inputs(length=self.grad_seq_len)
        check_gradients(self.build(), loss, x, f"{self.name} (float64)", self.grad_tolerance)

    def test_deterministic(self) -> None:
        module = self.build(seed=5)
        x, grad_out = self.inputs(), self.inputs(seed=3)

        check_deterministic(lambda: forward_backward(module, x, grad_out, ForwardContext()), self.name)

    def test_zero_input(self) -> None:
        module = self.build()
        x = torch.zeros(self.batch, self.seq_len, self.d_model, requires_grad=True)
        ctx = ForwardContext()
        out = module(x, ctx)
        assert torch.isfinite(out).all(), "zeros: non-finite output"
        aux = sum(ctx.losses.values(), torch.zeros(()))
        ((out * self.inputs(seed=3)).sum() + aux).backward()
        assert torch.isfinite(x.grad).all(), "zeros: non-finite input gradient"
        for n, p in module.named_parameters():
            assert p.grad is None or torch.isfinite(p.grad).all(), f"zeros: non-finite gradient of {n}"

    def test_one_host_sync_per_batch(self) -> None:
        layers = [self.build(seed=0), self.build(seed=1)]
        n = self.batch * self.seq_len
        cu, host_reads = watch_host_syncs(torch.tensor([0, 4, 4, n // 2, n], dtype=torch.int32))
        ctx = ForwardContext(cu_seqlens=cu)
        h = self.inputs().reshape(1, n, self.d_model).requires_grad_(True)
        for layer in layers:
            h = layer(h, ctx)
        aux = sum(ctx.losses.values(), torch.zeros(()))
        (h.square().sum() + aux).backward()
        assert host_reads() <= 1, (
            f"{self.name}: two layers of one packed forward read cu_seqlens to the host {host_reads()} times; "
            "read the layout through ctx.documents (built once per forward)"
        )

    def test_two_forwards_one_backward(self) -> None:
        module = self.build()
        inputs, grad_outs = (self.inputs(seed=11), self.inputs(seed=12)), (self.inputs(seed=13), self.inputs(seed=14))
        check_two_forwards(module, inputs, grad_outs, ForwardContext, self.tolerance, self.name)

    def test_tensor_parallel(self) -> None:
        """With ``tensor_parallel`` declared: ``megaseq_testkit.tensor_parallel.check_tensor_parallel`` at tp=2
        (a component without it is refused by the launch, ``megaseq.capabilities``, and never sees ``ctx.tp``)."""
        if "tensor_parallel" in self.declared():
            check_tensor_parallel(self.kind, self.name, self.config, self.d_model, tolerance=self.tolerance,
                                  factory=self.factory)

    def test_memory_estimate(self) -> None:
        self.check_saved_per_token(self.batch, lambda length: self.inputs(length=length))

    def test_temporary_estimate(self) -> None:
        self.check_temporary(self.batch, lambda length, seed: self.inputs(seed=seed, length=length))
