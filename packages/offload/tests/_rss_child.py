"""Child process of test_offload.py: saves ~256 MiB of activations in a forward, with or without offloading,
and reports resident memory (VmRSS after the forward, VmHWM at the end) and the gradient."""

import json
import re
import sys

import torch

from megaseq_offload.config import OffloadConfig
from megaseq_offload.policies import OffloadPolicy


def status(key: str) -> int:
    text = open("/proc/self/status").read()
    return int(re.search(rf"{key}:\s+(\d+) kB", text).group(1)) * 1024


def main() -> None:
    offload, scratch = sys.argv[1] == "offload", sys.argv[2]
    torch.manual_seed(0)
    model = torch.nn.Linear(1, 1)
    w = model.weight
    x = torch.randn(8 * 2**20)  # 32 MiB
    policy = OffloadPolicy(OffloadConfig(scratch_dir=scratch))
    policy.apply(model)
    step = policy.step() if offload else None
    if step is not None:
        step.__enter__()
    y = x
    for _ in range(4):  # each round saves two 32 MiB tensors (mul: y; sin: y * w)
        y = (y * w[0, 0]).sin()
    after_forward = status("VmRSS")
    y.sum().backward()
    if step is not None:
        step.__exit__(None, None, None)
    print(json.dumps({"rss_after_forward": after_forward, "hwm": status("VmHWM"), "grad": w.grad.item(),
                      "moved": policy.last_moved}))


main()
