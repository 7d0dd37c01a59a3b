"""Every Triton launch of the DSA kernels, compiled for a Hopper GPU (sm_90) on the CPU, fits its 227 KiB of
shared memory per block (megaseq_testkit.hopper) and spills no more registers than recorded. The
interpreter tests cannot see this: at the reported shapes the sparse attention backward asked for 401 KiB
with whole value tiles and Triton's default pipelining, and failed to launch on an H200.

Shapes: the reported model's indexer (32 index heads x 128, top-k 2048, pool 1 and 4, bf16) and sparse
attention (16 query heads, D = 576 over a 512-wide latent value, bf16 and fp32). The kernels are compiled
in a subprocess (this file as a script) in which triton is imported without TRITON_INTERPRET.
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

# Spill stores (bytes per thread) ptxas 13 reports at these shapes, the largest over the launches of a kernel:
# the indexer's running top-k list at topk=2048 (the fp32 sparse forward, which only the device check's
# correctness rows run, 2.4 KB; bf16 spills nothing). A launch may not spill more than 10% over its kernel's.
KNOWN_SPILL_STORES = {"_indexer_topk_kernel": 4192, "_sparse_attention_fwd_kernel": 2396, "_sparse_attention_bwd_kernel": 24}

KERNELS = {"_indexer_topk_kernel", "_sparse_attention_fwd_kernel", "_sparse_attention_bwd_kernel"}


def compile_launches() -> list[dict]:
    import torch

    from megaseq_dsa.ops.triton import select_topk_triton, sparse_attention_triton
    from megaseq_testkit.hopper import compiled_for_hopper

    length, index_heads, index_dim, topk, heads, dim, dim_v = 256, 32, 128, 2048, 16, 576, 512
    with compiled_for_hopper() as launches:
        for pool in (1, 4):
            q_idx = torch.randn(1, length, index_heads, index_dim, dtype=torch.bfloat16)
            k_idx = torch.randn(1, length, index_dim, dtype=torch.bfloat16)
            select_topk_triton(q_idx, k_idx, torch.randn(1, length, index_heads), topk, pool=pool)
        for dtype in (torch.bfloat16, torch.float32):
            q = torch.randn(1, length, heads, dim, dtype=dtype, requires_grad=True)
            latent = torch.randn(1, length, dim, dtype=dtype, requires_grad=True)
            indices = torch.randint(0, length, (1, length, topk), dtype=torch.int32)
            sparse_attention_triton(q, latent, latent[..., :dim_v], indices, dim**-0.5).sum().backward()
    return [{**vars(x), "fits": x.fits} for x in launches]


def test_every_launch_fits_hopper_shared_memory_and_spills_no_more_than_recorded():
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    launches = json.loads(done.stdout.splitlines()[-1])
    assert {x["kernel"] for x in launches} == KERNELS
    assert len(launches) == 6  # top-k at two pools, forward and backward in two dtypes
    over = [f"{x['kernel']} ({x['constexprs']}): {x['shared'] / 1024:.1f} KiB" for x in launches if not x["fits"]]
    assert not over, f"over 90% of sm_90's 227 KiB of shared memory: {over}"
    spilled = [f"{x['kernel']} ({x['constexprs']}, {x['num_warps']} warps): {x['spill_stores']} bytes" for x in launches
               if x["spill_stores"] > 1.1 * KNOWN_SPILL_STORES.get(x["kernel"], 0)]
    assert not spilled, f"register spill stores per thread over the recorded ones: {spilled}"


if __name__ == "__main__":
    print(json.dumps(compile_launches()))
