"""Each DSA backend against the dense oracles, in fp32: selections compared row by row, sparse attention's
output and gradients against the float64 dense masked softmax.

    TRITON_INTERPRET=1 python packages/attn-dsa/benchmarks/oracle_error.py     # CPU: triton in the interpreter
    python packages/attn-dsa/benchmarks/oracle_error.py                        # CUDA: triton compiled

Error = max |x - oracle| / max(1, max |oracle|) over the output and the gradients of q, k, v. The case: 200
tokens in 3 packed documents (one of 1 token), 3 index heads x 20, top-k 32 with key pooling 1 and 4,
16 query heads over a 96-wide key, 64-wide value, 10% of the selected slots knocked out (-1). Prints a table.
"""

from __future__ import annotations

import torch

from megaseq_dsa.backends import BACKENDS
from megaseq_dsa.ops import select_topk_reference, sparse_attention_reference

LENGTH, CU = 200, torch.tensor([0, 83, 84, 200])


def main() -> None:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gen = torch.Generator().manual_seed(0)
    q_idx, k_idx, weights = (torch.randn(*s, generator=gen) for s in ((1, LENGTH, 3, 20), (1, LENGTH, 20),
                                                                       (1, LENGTH, 3)))
    q, k = torch.randn(1, LENGTH, 16, 96, generator=gen), torch.randn(1, LENGTH, 96, generator=gen)
    v, d_o = torch.randn(1, LENGTH, 64, generator=gen), torch.randn(1, LENGTH, 16, 64, generator=gen)
    print(f"DSA backends vs the dense oracles, fp32, on {device}; error = max|x - oracle| / max(1, max|oracle|)")
    print(f"{'backend':<8} {'top-k pool 1':>22} {'top-k pool 4':>22} {'sparse attention (o, dq, dk, dv)':>36}")
    for backend in ("torch", "triton"):
        spec = BACKENDS.backends[backend]
        if spec.missing() or not spec.runs_on(device):
            print(f"{backend:<8} n/a: {'not installed' if spec.missing() else 'needs CUDA or TRITON_INTERPRET=1'}")
            continue
        ops = BACKENDS.load(backend, device)
        cells = []
        for pool in (1, 4):
            got = ops.select_topk(*(x.to(device) for x in (q_idx, k_idx, weights)), 32, CU.to(device), pool, None,
                                  None).cpu()
            expected = select_topk_reference(q_idx, k_idx, weights, 32, CU, pool)
            cells.append(f"{int((got == expected).all(-1).sum())}/{LENGTH} rows equal")
        indices = select_topk_reference(q_idx, k_idx, weights, 32, CU, 4)
        indices = indices.masked_fill(torch.rand(indices.shape, generator=gen) < 0.1, -1)
        leaves = [x.detach().to(device).requires_grad_() for x in (q, k, v)]
        out = ops.sparse_attention(*leaves, indices.to(device), 96**-0.5, None)
        out.backward(d_o.to(device))
        oracle_leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
        expected = sparse_attention_reference(*oracle_leaves, indices, 96**-0.5)
        expected.backward(d_o.double())
        pairs = [(out, expected), *((a.grad, b.grad) for a, b in zip(leaves, oracle_leaves, strict=True))]
        errors = [((a.detach().double().cpu() - b).abs().max() / b.abs().max().clamp_min(1)).item() for a, b in pairs]
        cells.append(f"max {max(errors):.1e}")
        print(f"{backend:<8} {cells[0]:>22} {cells[1]:>22} {cells[2]:>36}")


if __name__ == "__main__":
    main()
