"""Compile a plugin's Triton launches for a Hopper GPU (sm_90) on a machine without one.

A kernel that runs in the Triton interpreter on the CPU can still fail to launch on the GPU: Triton sizes
its shared memory (software pipelining, layout conversions, dot operands) only when it compiles for a
target, and a launch over the chip's 227 KiB per block raises ``OutOfResources``. Triton ships ptxas, so
the compilation itself needs no GPU. Inside ``compiled_for_hopper()`` every launch of a ``@triton.jit``
kernel goes through Triton's own argument binding and specialization (pointer alignment and divisibility
by 16, as on the GPU), is compiled for sm_90 and recorded with its shared memory, and is not run: the
outputs of the code under test hold garbage, its launches are what is checked.

Run it in a process where ``TRITON_INTERPRET`` was unset when the kernels were imported (interpreted
kernels are not compiled): see a plugin's ``tests/test_hopper_fit.py``. The context sets Triton's
interpret knob so that launch guards accept CPU tensors; import the kernels before entering it.

Registers and spills: Triton runs its ptxas verbosely; its log (printed on request, every kernel compiled
afresh rather than taken from Triton's cache) gives the registers per thread and the bytes spilled to local
memory (stores and loads per thread). Assembling the PTX again with other options would not do: ptxas 13's
register allocator, without the option Triton passes, gives some of these kernels 32 registers and
kilobytes of spills. A spilling kernel runs, but every spilled value round-trips through local memory (L1,
then L2 and DRAM) in its inner loop: a plugin's tests hold each kernel to its recorded spills and the others
to none.
"""

from __future__ import annotations

import contextlib
import io
import re
from collections.abc import Iterator
from dataclasses import dataclass

# Bytes of shared memory one block may use on sm_90 (H100, H200): 227 KiB, what Triton checks at launch.
HOPPER_SHARED_LIMIT = 232448
# Triton releases size shared memory differently (KDA's fp32 backward state kernel: 241 KiB under Triton 3.6,
# which failed to launch on an H200, and 225.5 KiB under 3.9), so a launch must fit with 10% to spare to fit
# under whichever Triton the GPU machine has.
HEADROOM = 0.9


@dataclass(frozen=True)
class Launch:
    kernel: str
    constexprs: str
    num_warps: int
    num_stages: int
    shared: int  # bytes per block
    registers: int  # per thread
    spill_stores: int  # bytes per thread
    spill_loads: int

    @property
    def fits(self) -> bool:
        return self.shared <= HEADROOM * HOPPER_SHARED_LIMIT

    @property
    def spills(self) -> bool:
        return self.spill_stores > 0 or self.spill_loads > 0


def ptxas_usage(log: str) -> tuple[int, int, int]:
    """(registers per thread, spill store bytes, spill load bytes) from the ``ptxas -v`` log of one kernel."""
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    registers = re.search(r"Used (\d+) registers", log)
    if spills is None or registers is None:
        raise RuntimeError(f"ptxas printed no register or spill counts: {log[-500:]}")
    return int(registers.group(1)), int(spills.group(1)), int(spills.group(2))


@contextlib.contextmanager
def compiled_for_hopper() -> Iterator[list[Launch]]:
    """Yield a list that fills with one ``Launch`` per distinct kernel specialization launched inside."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    launches: list[Launch] = []
    seen: dict[tuple, Launch] = {}

    def compile_launch(self, *args, grid, warmup, **kwargs):
        binder = create_function_from_signature(self.signature, self.params, backend)
        bound_args, specialization, options = binder(*args, **kwargs)
        key = (self.fn.__qualname__, str(specialization), str(options))
        if key not in seen:
            options, signature, constexprs, attrs = self._pack_args(
                backend, kwargs, bound_args, specialization, options)
            with contextlib.redirect_stdout(io.StringIO()) as log:
                compiled = triton.compile(ASTSource(self, signature, constexprs, attrs), target=target,
                                          options=options.__dict__)
            named = {self.arg_names[path[0]]: value for path, value in constexprs.items()}
            seen[key] = Launch(self.fn.__qualname__, ", ".join(f"{k}={v}" for k, v in named.items()),
                               options.num_warps, options.num_stages, compiled.metadata.shared,
                               *ptxas_usage(log.getvalue()))
            launches.append(seen[key])
        return None

    saved = (JITFunction.run, knobs.runtime.interpret, knobs.nvidia.dump_ptxas_log, knobs.compilation.always_compile)
    JITFunction.run, knobs.runtime.interpret = compile_launch, True
    knobs.nvidia.dump_ptxas_log = knobs.compilation.always_compile = True  # ptxas's log of every kernel
    try:
        yield launches
    finally:
        JITFunction.run, knobs.runtime.interpret, knobs.nvidia.dump_ptxas_log, knobs.compilation.always_compile = saved

