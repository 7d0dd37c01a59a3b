"""Where the Triton DSA kernels can run: on CUDA tensors, or on CPU tensors under TRITON_INTERPRET=1."""

import torch
from triton import knobs


def check_runnable(tensor: torch.Tensor) -> None:
    if not tensor.is_cuda and not knobs.runtime.interpret:
        raise ValueError(
            f"Triton DSA kernels need CUDA tensors (or TRITON_INTERPRET=1), got device {tensor.device}"
        )
