"""Each KDA backend's error against the float64 token-loop oracle, in fp32: output, final state, every gradient.

    TRITON_INTERPRET=1 python packages/attn-kda/benchmarks/oracle_error.py     # CPU: triton in the interpreter
    python packages/attn-kda/benchmarks/oracle_error.py                        # CUDA: triton and fla compiled

Error = max |x - oracle| / max(1, max |oracle|), the largest over o, the final state and the gradients of
q, k, v, g, beta and the initial state, per case; inputs are fp32 (the oracle runs on the same values in
float64). Cases: awkward lengths with packed documents (a 1-token document, lengths not multiples of 64),
random gates in [-5, 0], and gates strong then weak within each chunk (exponent differences near 0 between
cumulative sums near -200). Backends that cannot run here are listed as such. Prints a table.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from megaseq_kda.backends import BACKENDS
from megaseq_kda.ops import naive_recurrent_kda

# name -> (T, H, K, V, cu_seqlens, gate)
CASES = {
    "T=150 3 docs, random gates": (150, 2, 32, 32, [0, 1, 70, 150], "random"),
    "T=200 H=1 K=64 V=32, strong-then-weak": (200, 1, 64, 32, None, "strong_then_weak"),
}
NAMES = ("o", "final_state", "dq", "dk", "dv", "dg", "dbeta", "dh0")


def inputs(length: int, heads: int, k_dim: int, v_dim: int, cu: list[int] | None, gate: str) -> dict:
    gen = torch.Generator().manual_seed(0)
    f64 = dict(dtype=torch.float64, generator=gen)
    uniform = torch.rand(1, length, heads, k_dim, **f64)
    in_chunk = torch.arange(length, dtype=torch.float64)[None, :, None, None] % 64
    gates = {"random": -5 * uniform, "strong_then_weak": torch.where(in_chunk < 40, -5 + 0.1 * uniform, -1e-3 * uniform)}
    n = 1 if cu is None else len(cu) - 1
    return {
        "q": F.normalize(torch.randn(1, length, heads, k_dim, **f64), dim=-1),
        "k": F.normalize(torch.randn(1, length, heads, k_dim, **f64), dim=-1),
        "v": torch.randn(1, length, heads, v_dim, **f64),
        "g": gates[gate],
        "beta": torch.rand(1, length, heads, **f64),
        "h0": torch.randn(n, heads, k_dim, v_dim, **f64),
        "cu": None if cu is None else torch.tensor(cu),
        "d_o": torch.randn(1, length, heads, v_dim, **f64),
        "d_final": torch.randn(n, heads, k_dim, v_dim, **f64),
    }


def run(op, x: dict, device: str, dtype: torch.dtype) -> dict:
    leaves = {n: x[n].to(device, dtype).requires_grad_() for n in ("q", "k", "v", "g", "beta", "h0")}
    o, final = op(*(leaves[n] for n in ("q", "k", "v", "g", "beta")), initial_state=leaves["h0"],
                  output_final_state=True, cu_seqlens=None if x["cu"] is None else x["cu"].to(device))
    ((o * x["d_o"].to(device, o.dtype)).sum() + (final * x["d_final"].to(device, final.dtype)).sum()).backward()
    out = [o, final, *(leaves[n].grad for n in ("q", "k", "v", "g", "beta", "h0"))]
    return {name: t.detach().double().cpu() for name, t in zip(NAMES, out, strict=True)}


def main() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    where = device if device == "cuda" else f"cpu, TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '0')}"
    print(f"fp32 error vs the float64 oracle ({where}); error = max|x - oracle| / max(1, max|oracle|)")
    print(f"{'backend':<8} " + " ".join(f"{case:>40}" for case in CASES))
    oracles = {}
    for case, sizes in CASES.items():
        x = inputs(*sizes)
        oracles[case] = (x, run(naive_recurrent_kda, {**x, **{n: x[n].float().double() for n in ("q", "k", "v", "g",
                                                                                              "beta", "h0")}},
                                "cpu", torch.float64))
    for backend in ("naive", "chunk", "triton", "fla"):
        spec = BACKENDS.backends[backend]
        if spec.missing() or not spec.runs_on(torch.device(device)):
            reason = f"{', '.join(spec.missing())} not installed" if spec.missing() else f"needs {spec.devices[0]}"
            print(f"{backend:<8} " + " ".join(f"{'n/a: ' + reason:>40}" for _ in CASES))
            continue
        op = BACKENDS.load(backend, torch.device(device))
        cells = []
        for x, oracle in oracles.values():
            got = run(op, x, device, torch.float32)
            errors = {n: ((got[n] - oracle[n]).abs().max() / oracle[n].abs().max().clamp_min(1)).item() for n in NAMES}
            worst = max(errors, key=errors.get)
            cells.append(f"{errors[worst]:.1e} ({worst})")
        print(f"{backend:<8} " + " ".join(f"{cell:>40}" for cell in cells))


if __name__ == "__main__":
    main()
