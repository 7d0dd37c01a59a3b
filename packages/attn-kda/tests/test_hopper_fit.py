"""Every Triton launch of chunk_kda_triton, forward and backward, compiled for a Hopper GPU (sm_90) on the CPU,
fits its 227 KiB of shared memory per block (megaseq_testkit.hopper) and spills no more registers than
recorded. The interpreter tests cannot see this:
at K = V = 128 in fp32 the backward state kernel asked for 241 KiB with Triton's default pipelining and
failed to launch on an H200.

Shapes: K = V = 128 (the reported model's KDA head), two packed documents; bf16 q/k/v with fp32 gates and
beta (what the layer passes on CUDA) and all fp32 (the device check's fp32 correctness rows). The compiled
kernels run in a subprocess (this file as a script) in which triton is imported without TRITON_INTERPRET.
"""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

# find_spec, not an import: triton must not be imported in the pytest process (test_triton.py sets
# TRITON_INTERPRET before it first imports triton)
if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

# compiling every kernel for sm_90 takes minutes on CPU
pytestmark = pytest.mark.slow

# Spill stores (bytes per thread) ptxas 13 reports at these shapes, the largest over the launches of a kernel
# (BV = 32 with 8 warps: ``Layout.wide_warps``). ptxas gives the forward state kernel 32 registers and a stack frame
# whatever the warps: a finding for the next GPU run to time. A launch may not spill more than 10% over its
# kernel's; a kernel not listed may not spill.
KNOWN_SPILL_STORES = {"wy_fwd_kernel": 408, "state_fwd_kernel": 7248, "state_bwd_kernel": 2220, "chunk_grads_kernel": 312,
                      "wy_bwd_kernel": 88}

KERNELS = {"chunk_cumsum_kernel", "kk_scores_kernel", "wy_fwd_kernel", "state_fwd_kernel", "output_fwd_kernel",
           "state_bwd_kernel", "chunk_grads_kernel", "wy_bwd_kernel", "pair_grads_kernel"}


def compile_launches() -> list[dict]:
    import torch

    from megaseq_kda.ops.triton import chunk_kda_triton
    from megaseq_testkit.hopper import compiled_for_hopper

    length, heads, dim = 150, 2, 128
    with compiled_for_hopper() as launches:
        for dtype in (torch.bfloat16, torch.float32):
            q, k, v = (torch.randn(1, length, heads, dim, dtype=dtype, requires_grad=True) for _ in range(3))
            g = torch.rand(1, length, heads, dim, requires_grad=True)
            beta = torch.rand(1, length, heads, requires_grad=True)
            o, _ = chunk_kda_triton(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 37, length]))
            o.sum().backward()
    return [{**vars(x), "fits": x.fits} for x in launches]


def test_every_launch_fits_hopper_shared_memory_and_spills_no_more_than_recorded():
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    launches = json.loads(done.stdout.splitlines()[-1])
    assert {x["kernel"] for x in launches} == KERNELS
    over = [f"{x['kernel']} ({x['constexprs']}): {x['shared'] / 1024:.1f} KiB" for x in launches if not x["fits"]]
    assert not over, f"over 90% of sm_90's 227 KiB of shared memory: {over}"
    spilled = [f"{x['kernel']} ({x['constexprs']}, {x['num_warps']} warps): {x['spill_stores']} bytes" for x in launches
               if x["spill_stores"] > 1.1 * KNOWN_SPILL_STORES.get(x["kernel"], 0)]
    assert not spilled, f"register spill stores per thread over the recorded ones: {spilled}"


if __name__ == "__main__":
    print(json.dumps(compile_launches()))
