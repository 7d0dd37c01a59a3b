"""``megaseq_testkit.hopper`` reads each launch's registers and spills from ptxas: a kernel whose tiles fit
spills nothing, one whose accumulator cannot fit one warp's registers is caught spilling. The kernels are
compiled for sm_90 in a subprocess in which triton is imported without TRITON_INTERPRET."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

pytestmark = pytest.mark.slow  # ptxas, twice

KERNELS = '''
import json

import torch
import triton
import triton.language as tl

from megaseq_testkit.hopper import compiled_for_hopper


@triton.jit
def product(a, b, c, N: tl.constexpr):
    rows = tl.arange(0, N)[:, None] * N + tl.arange(0, N)[None, :]
    tl.store(c + rows, tl.dot(tl.load(a + rows), tl.load(b + rows)))


with compiled_for_hopper() as launches:
    for n, warps in ((32, 4), (128, 1)):  # 128 x 128 fp32 products in one warp: 512 accumulators per thread
        x = torch.zeros(n * n)
        product[(1,)](x, x, x, N=n, num_warps=warps)
print(json.dumps([vars(launch) | {"spills": launch.spills} for launch in launches]))
'''


def test_registers_and_spills_per_launch(tmp_path: Path):
    script = tmp_path / "kernels.py"
    script.write_text(KERNELS)
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    small, large = json.loads(done.stdout.splitlines()[-1])
    assert (small["constexprs"], small["num_warps"], large["constexprs"], large["num_warps"]) == ("N=32", 4, "N=128", 1)
    assert 0 < small["registers"] <= 255 and not small["spills"], small
    assert large["spills"] and large["spill_stores"] > 0 and large["spill_loads"] > 0, large
