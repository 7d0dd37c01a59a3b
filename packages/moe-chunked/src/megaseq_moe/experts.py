"""SwiGLU experts applied to rows already grouped by expert.

Routed experts keep their weights stacked (``[E, d_in, d_out]``) so that one grouped GEMM
(``torch.nn.functional.grouped_mm``) multiplies every expert's rows by that expert's matrix. grouped_mm
needs 16-byte aligned row strides and runs in fp32/bf16 on CPU but only in bf16 on CUDA (compute capability
8.0 or newer); elsewhere the same product is a loop over experts, which reads the group sizes to the host
(once per call, a synchronisation on CUDA).
Both paths are tested against each other and a float64 oracle.

The routed and shared experts compute in :func:`expert_dtype`: bf16 under a CUDA bf16 autocast (so that the
grouped GEMM runs there, on the GPU's bf16 units), the input's dtype otherwise. On CPU autocast does not reach them, so CPU
results do not depend on it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def swiglu(gate_up: Tensor, limit: float | None) -> Tensor:
    """``silu(gate) * up`` of ``gate_up = [gate | up]``; with ``limit`` the gate is clamped from above and up
    to ``[-limit, limit]`` (keeps rare huge activations from overflowing in low precision)."""
    gate, up = gate_up.chunk(2, dim=-1)
    if limit is not None:
        gate = gate.clamp(max=limit)
        up = up.clamp(-limit, limit)
    return F.silu(gate) * up


def grouped_mm_supported(device: torch.device | str, dtype: torch.dtype, *widths: int) -> bool:
    """Whether ``grouped_mm`` multiplies rows of ``dtype`` on ``device`` by stacked ``[E, d_in, d_out]`` weights
    whose ``d_in`` and ``d_out`` are among ``widths``: fp32 or bf16 on CPU, bf16 on CUDA devices of compute
    capability 8.0 or newer; every width a multiple of 16 bytes."""
    device = torch.device(device)
    if not hasattr(F, "grouped_mm"):
        return False
    if device.type == "cpu":
        dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16)
    elif device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 0):
        dtypes = (torch.bfloat16,)
    else:
        return False
    return dtype in dtypes and all(width * dtype.itemsize % 16 == 0 for width in widths)


def expert_dtype(device_type: str, dtype: torch.dtype, autocast: torch.dtype | None) -> torch.dtype:
    """The dtype the routed experts compute in, for inputs of ``dtype`` on a ``device_type`` device, under an
    autocast to ``autocast`` (None: autocast off): bf16 under a CUDA bf16 autocast, else ``dtype``."""
    return torch.bfloat16 if device_type == "cuda" and autocast == torch.bfloat16 else dtype


def grouped_linear(
    x: Tensor, weight: Tensor, counts: Tensor, use_grouped_mm: bool, sizes: list[int] | None = None
) -> Tensor:
    """``x [m, d_in]`` holds ``counts[e]`` consecutive rows for each expert ``e``; row block e is multiplied
    by ``weight[e] [d_in, d_out]``. Returns ``[m, d_out]``. The loop over experts (``use_grouped_mm`` false)
    needs the counts on the host: ``sizes`` when the caller has read them already, else read here."""
    if use_grouped_mm:
        if x.stride() != (x.shape[1], 1):
            # a column slice with 0 or 1 rows counts as contiguous yet keeps its parent's row stride, which
            # grouped_mm rejects unless it is a 16-byte multiple: copy to the dense layout
            x = x.clone(memory_format=torch.contiguous_format)
        offsets = counts.cumsum(0).to(torch.int32)
        return F.grouped_mm(x, weight, offs=offsets)
    blocks = x.split(counts.tolist() if sizes is None else sizes)
    return torch.cat([block @ weight[e] for e, block in enumerate(blocks)])


class GroupedExperts(nn.Module):
    """This rank's routed experts: ``w_gate_up [E_local, d, 2, h]`` (the gate projection, then the up one) and
    ``w_down [E_local, h, d]``. The hidden width has a dimension of its own in each tensor, so that under expert
    tensor parallelism a rank's block of it (``h = expert_hidden / etp``) is one contiguous block of each.

    Experts ``first .. first + n_local - 1`` of ``n_experts``, block ``etp_rank`` of ``etp_size`` of each one's
    hidden width: every expert is drawn whole from the global generator in turn, as one process draws them, and
    only the local ones' blocks are kept, so any layout starts from the one-process experts while holding one
    whole expert at a time besides its own (``expert_parallel`` in ``megaseq.records.CAPABILITIES``)."""

    def __init__(
        self, n_local: int, d_model: int, hidden: int, limit: float | None, init_std: float,
        first: int = 0, n_experts: int | None = None, etp_rank: int = 0, etp_size: int = 1,
    ) -> None:
        super().__init__()
        self.limit = limit
        self.w_gate_up = nn.Parameter(torch.empty(n_local, d_model, 2, hidden))
        self.w_down = nn.Parameter(torch.empty(n_local, hidden, d_model))
        if self.w_down.is_meta:
            # built without memory (a launch's pre-flight): meta draws have no values and leave the generator
            # where it is, and drawing every expert of every layer one at a time costs over a minute at GLM's shapes
            return
        whole = hidden * etp_size
        with torch.no_grad():
            for weight, shape, dim in ((self.w_gate_up, (d_model, 2, whole), 2), (self.w_down, (whole, d_model), 0)):
                for expert in range(n_local if n_experts is None else n_experts):
                    drawn = torch.randn(shape) * init_std
                    if first <= expert < first + n_local:
                        weight[expert - first] = drawn.narrow(dim, etp_rank * hidden, hidden)

    def forward(self, rows: Tensor, counts: Tensor, dtype: torch.dtype | None = None) -> Tensor:
        """Rows grouped by local expert (``counts[e]`` rows for expert e) -> expert outputs, same order and dtype
        as the rows. ``dtype``: what the products run in (:func:`expert_dtype`; default the rows' dtype)."""
        dtype = dtype or rows.dtype
        gate_up = self.w_gate_up.flatten(2).to(dtype)  # [E, d, gate | up]: one product for both
        down = self.w_down.to(dtype)
        use_grouped_mm = grouped_mm_supported(rows.device, dtype, *gate_up.shape[1:], *down.shape[1:])
        sizes = None if use_grouped_mm else counts.tolist()  # read once for both products
        hidden = swiglu(grouped_linear(rows.to(dtype), gate_up, counts, use_grouped_mm, sizes), self.limit)
        # back in the rows' dtype: combined with the routing weights and summed over ranks in at least fp32
        return grouped_linear(hidden, down, counts, use_grouped_mm, sizes).to(rows.dtype)

    def one(self, local: int, x: Tensor) -> Tensor:
        """Expert ``local`` applied to each row of ``x``: the definition the grouped path must match."""
        return swiglu(x @ self.w_gate_up[local].flatten(1), self.limit) @ self.w_down[local]


class SharedExpert(nn.Module):
    """The always-on experts fused into one SwiGLU of width ``n_shared * shared_hidden``."""

    def __init__(self, d_model: int, hidden: int, limit: float | None, init_std: float) -> None:
        super().__init__()
        self.limit = limit
        self.w_gate_up = nn.Parameter(torch.randn(d_model, 2 * hidden) * init_std)
        self.w_down = nn.Parameter(torch.randn(hidden, d_model) * init_std)

    def forward(self, x: Tensor, dtype: torch.dtype | None = None) -> Tensor:
        """``dtype``: what the products run in (:func:`expert_dtype`; default ``x``'s); returns ``x``'s dtype."""
        dtype = dtype or x.dtype
        return (swiglu(x.to(dtype) @ self.w_gate_up.to(dtype), self.limit) @ self.w_down.to(dtype)).to(x.dtype)
