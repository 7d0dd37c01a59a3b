"""Checks shared by the conformance suites, usable on their own in a plugin's tests.

- :func:`assert_close`: outputs or gradients against a reference, with the suites' error bound.
- :func:`check_gradients`: analytic gradients against float64 central finite differences, for the input and
  every trainable parameter; a parameter that changes the loss but receives no gradient is reported.
- :func:`check_deterministic`: a forward and backward repeated with torch's global random generator moved
  between the two runs gives identical results, and leaves the generator's state alone.
- :func:`watch_host_syncs`: counts how often a tensor (e.g. ``cu_seqlens``) is read back to the host.
- :func:`count_host_syncs`: every read of any tensor back to the host (and every ``torch.cuda.synchronize``)
  while a block runs, by the line that asked for it: the host syncs of a whole training step.
- :func:`check_two_forwards`: two forwards of one module before one backward give each forward's own
  gradients (state kept on the module between a forward and its backward is overwritten by the second).
- :func:`saved_bytes` and :func:`check_saved_estimate`: what autograd keeps for backward, in bytes, and a
  component's ``MemoryEstimate.saved_per_token`` held to it.
- :func:`transient_bytes` and :func:`check_temporary_estimate`: the most bytes live at once of the storages a
  call allocates and frees before it returns (its transient working set), and a component's
  ``MemoryEstimate.temporary`` held to it.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import inspect
import os
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def assert_close(actual: Tensor, expected: Tensor, tolerance: float, what: str) -> None:
    """``max |actual - expected| <= tolerance * max(1, max |expected|)``, with a message naming ``what``.

    The bound is absolute for results of magnitude up to 1 and relative to the largest magnitude above that
    (so neither tiny nor large results make it meaningless). Non-finite values fail."""
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert torch.isfinite(actual).all(), f"{what}: non-finite values"
    err = (actual.double() - expected.double()).abs().max().item() if actual.numel() else 0.0
    scale = max(1.0, expected.double().abs().max().item() if expected.numel() else 0.0)
    assert err <= tolerance * scale, f"{what}: max abs error {err:.3e} > {tolerance:.1e} x {scale:.3e}"


def check_gradients(
    module: nn.Module,
    loss: Callable[[nn.Module, Tensor], Tensor],
    x: Tensor,
    what: str,
    tolerance: float = 1e-6,
    eps: float = 1e-6,
) -> None:
    """Gradients of ``loss(module, x)`` (a scalar) against float64 central finite differences.

    Runs on float64 copies of ``module`` and ``x``. For the input and each trainable parameter, the analytic
    directional derivative along one random direction must equal ``(L(p + eps u) - L(p - eps u)) / 2 eps`` to
    ``tolerance * max(1, |finite difference|)``. This needs no reference implementation: it catches detached
    projections, hand-written backward passes that are wrong, and parameters that change the loss but get no
    gradient (``p.grad is None``). The truncation error of the difference is O(eps^2) and its rounding error
    O(1e-16 |L| / eps), both far below the tolerance for smooth components computed in float64 (a component
    that silently computes in float32 shows up as ~1e-7 / eps = 0.1 relative error).
    """
    module = copy.deepcopy(module).double()
    module.zero_grad(set_to_none=True)
    x = x.detach().double().requires_grad_(True)
    value = loss(module, x)
    assert torch.isfinite(value), f"{what}: the loss is {value.item()}"
    value.backward()
    generator = torch.Generator().manual_seed(0)
    targets = [("the input", x), *((n, p) for n, p in module.named_parameters() if p.requires_grad)]
    for name, tensor in targets:
        grad = tensor.grad
        assert grad is None or torch.isfinite(grad).all(), f"{what}: non-finite gradient of {name}"
        direction = torch.randn(tensor.shape, generator=generator, dtype=torch.float64)
        original = tensor.detach().clone()
        with torch.no_grad():
            tensor.copy_(original + eps * direction)
            plus = loss(module, x).item()
            tensor.copy_(original - eps * direction)
            minus = loss(module, x).item()
            tensor.copy_(original)
        numeric = (plus - minus) / (2 * eps)
        bound = tolerance * max(1.0, abs(numeric))
        if grad is None:
            assert abs(numeric) <= bound, (
                f"{what}: {name} receives no gradient but changes the output "
                f"(finite-difference derivative {numeric:.3e} along a random direction)"
            )
            continue
        analytic = (grad * direction).sum().item()
        assert abs(analytic - numeric) <= bound, (
            f"{what}: gradient of {name} along a random direction is {analytic:.6e}, "
            f"finite differences give {numeric:.6e}"
        )


def forward_backward(module: nn.Module, x: Tensor, grad_out: Tensor, ctx: Any) -> dict[str, Tensor]:
    """One forward and backward of ``module`` on a fresh copy of ``x``: the output, the input gradient and every
    parameter's gradient, by name (what the determinism check compares between repeats)."""
    module.zero_grad(set_to_none=True)
    xr = x.clone().requires_grad_(True)
    out = module(xr, ctx)
    (out * grad_out).sum().backward()
    grads = {f"gradient of {n}": p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}
    return {"output": out.detach(), "input gradient": xr.grad, **grads}


def check_two_forwards(
    module: nn.Module,
    inputs: tuple[Tensor, Tensor],
    grad_outs: tuple[Tensor, Tensor],
    context: Callable[[], Any],
    tolerance: float,
    what: str,
) -> None:
    """Two forwards of ``module`` (``inputs``, each with a fresh ``context()``) then one backward of both
    objectives ``(out * grad_out).sum() + auxiliary losses`` equal the two forwards each followed by its own
    backward: outputs, input gradients and every parameter gradient (summed). Gradient accumulation, a
    recomputing memory policy and the RL loop's old/new log-probabilities all run a layer twice before
    a backward; a module that keeps its forward's state on itself (a hand-written backward reading
    ``self.saved``, a cache keyed per layer) hands the second forward's state to the first backward."""

    def forward(x: Tensor, grad_out: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        xr = x.detach().clone().requires_grad_(True)
        ctx = context()
        out = module(xr, ctx)
        return xr, out, (out * grad_out).sum() + sum(ctx.losses.values(), torch.zeros((), dtype=out.dtype))

    module.zero_grad(set_to_none=True)
    separate = []
    for x, g in zip(inputs, grad_outs, strict=True):
        xr, out, objective = forward(x, g)
        objective.backward()
        separate.append((out.detach(), xr.grad))
    ref_grads = {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}
    module.zero_grad(set_to_none=True)
    together = [forward(x, g) for x, g in zip(inputs, grad_outs, strict=True)]
    sum(objective for _, _, objective in together).backward()
    for i, ((xr, out, _), (ref_out, ref_x)) in enumerate(zip(together, separate, strict=True)):
        assert_close(out.detach(), ref_out, tolerance, f"{what}: two forwards before one backward, output {i + 1}")
        assert_close(xr.grad, ref_x, tolerance, f"{what}: two forwards before one backward, input gradient {i + 1}")
    for n, p in module.named_parameters():
        if n in ref_grads:
            assert p.grad is not None, f"{what}: two forwards before one backward: no gradient reached {n}"
            assert_close(p.grad, ref_grads[n], tolerance, f"{what}: two forwards before one backward, gradient of {n}")


def check_deterministic(run: Callable[[], dict[str, Tensor]], what: str) -> None:
    """``run()`` twice, with torch's global random generator moved in between: the results (a dict of
    tensors) must be identical, and ``run()`` must leave the generator's state as it found it (components
    draw no random numbers from it: the trainer's reproducibility and its resumes depend on that state)."""
    state = torch.get_rng_state()
    first = run()
    assert torch.equal(torch.get_rng_state(), state), (
        f"{what}: forward/backward drew from or reseeded torch's global random generator"
    )
    torch.manual_seed(torch.initial_seed() + 7919)  # a different stream for the second run
    torch.randn(17)
    second = run()
    for key, value in first.items():
        assert torch.equal(value, second[key]), f"{what}: {key} differs between two identical runs"


# Tensor methods that read a tensor's values back to the host (a device synchronisation on CUDA)
_READS = ("tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")
# methods whose result is still "the same tensor" (a copy, cast, move or slice of it): it stays watched
_COPIES = ("to", "long", "int", "contiguous", "clone", "detach", "__getitem__", "cpu", "cuda")


def watch_host_syncs(tensor: Tensor) -> tuple[Tensor, Callable[[], int]]:
    """A watched copy of ``tensor`` and a function returning how often it has been read to the host.

    Reads: ``.tolist()``, ``.item()``, ``.cpu()``, ``.numpy()`` and Python conversions (``bool``, ``int``,
    ``float``, indexing a list), of the tensor or of a copy, cast, move or slice of it. Results of other
    operations on it (``searchsorted``, arithmetic) are ordinary tensors. On CPU nothing waits, but the same
    code on CUDA would synchronise at each read; hence a per-layer read is a per-layer stall."""
    reads = {getattr(Tensor, name) for name in _READS}
    copies = {getattr(Tensor, name) for name in _COPIES}
    count = [0]

    class Watched(Tensor):
        @classmethod
        def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
            if func in reads:
                count[0] += 1
            with torch._C.DisableTorchFunctionSubclass():
                out = func(*args, **(kwargs or {}))
            if func in copies and isinstance(out, Tensor):
                return out.as_subclass(cls)
            return out

    return tensor.as_subclass(Watched), lambda: count[0]


@contextlib.contextmanager
def count_host_syncs() -> Iterator[list[str]]:
    """Within the block, record every host read of a tensor (``_READS``: ``.item()``, ``.tolist()``, ``.cpu()``,
    ``.numpy()``, ``bool``, ``int``, ``float``, ``__index__``) and every ``torch.cuda.synchronize()`` as
    ``"file:line"`` of the code that asked for it, into the list it yields. On CPU nothing waits, but on CUDA
    each would stall the host until the device catches up.

    Reads made by torch's own code are left out: torch reads host-side tensors of its own (the optimizer's step
    counters, which never live on the device); a torch function that does synchronise is still counted at the
    line of the caller that asked for it when it goes through one of these methods from outside torch."""
    sites: list[str] = []
    torch_dir = os.path.dirname(torch.__file__)
    patched = {name: getattr(Tensor, name) for name in _READS}
    patched_sync = torch.cuda.synchronize

    def caller() -> str | None:
        frame = inspect.currentframe()
        frame = frame.f_back.f_back if frame and frame.f_back else None  # the wrapper's caller
        if frame is None or frame.f_code.co_filename.startswith(torch_dir):
            return None
        return f"{frame.f_code.co_filename}:{frame.f_lineno}"

    def counting(original: Callable[..., Any]) -> Callable[..., Any]:
        def read(*args: Any, **kwargs: Any) -> Any:
            if (site := caller()) is not None:
                sites.append(site)
            return original(*args, **kwargs)

        return read

    for name, original in patched.items():
        setattr(Tensor, name, counting(original))
    torch.cuda.synchronize = counting(patched_sync)
    try:
        yield sites
    finally:
        for name, original in patched.items():
            setattr(Tensor, name, original)
        torch.cuda.synchronize = patched_sync


# torch.distributed's communication functions and the position of what a rank sends among their arguments
_SENDS = {
    "all_reduce": 0, "all_gather": 1, "all_gather_into_tensor": 1, "all_gather_single": 1, "reduce_scatter_tensor": 1,
    "reduce_scatter_single": 1, "all_to_all_single": 1, "broadcast": 0, "reduce": 0,
}


@contextlib.contextmanager
def count_collective_bytes() -> Iterator[dict[str, int]]:
    """Within the block, the bytes this rank hands to each of ``torch.distributed``'s collectives (its input
    tensor: what it sends, not what travels on a given topology), summed per function name into the dict it
    yields. Every megaseq collective goes through ``megaseq.parallel.collectives``, whose single-tensor
    aliases are patched too."""
    import torch.distributed as dist

    from megaseq.parallel import collectives

    sent: dict[str, int] = {}

    def counting(name: str, position: int, original: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            tensor = args[position]  # megaseq.parallel.collectives passes it positionally
            sent[name] = sent.get(name, 0) + tensor.numel() * tensor.element_size()
            return original(*args, **kwargs)

        return run

    patched = [(dist, name, getattr(dist, name)) for name in _SENDS if hasattr(dist, name)]
    aliases = {"_all_gather_single": "all_gather_into_tensor", "_reduce_scatter_single": "reduce_scatter_tensor"}
    patched += [(collectives, alias, getattr(collectives, alias)) for alias in aliases]
    for module, name, original in patched:
        label = aliases.get(name, name)
        setattr(module, name, counting(label, _SENDS[label], original))
    try:
        yield sent
    finally:
        for module, name, original in patched:
            setattr(module, name, original)


def saved_bytes(run: Callable[[], Any], inputs: tuple[Tensor, ...] = (), exclude: tuple[Tensor, ...] = ()) -> tuple[int, Any]:
    """Bytes of the distinct storages autograd saves for backward while ``run()`` builds its graph, plus those
    of ``inputs``, minus those of ``exclude`` (parameters: they are counted as parameters); and ``run()``'s
    result (keep it alive until the count is used: the saved tensors belong to its graph).

    Storages, not tensors: a saved view of a larger tensor keeps all of that tensor, and two saved views of
    one tensor keep it once (torch's ``saved_tensors_hooks`` see every tensor autograd saves)."""
    storages: dict[int, int] = {}

    def pack(t: Tensor) -> Tensor:
        if t.device.type != "meta":
            storage = t.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        result = run()
    for t in inputs:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    for t in exclude:
        storages.pop(t.untyped_storage().data_ptr(), None)
    return sum(storages.values()), result


def check_saved_estimate(
    measure: Callable[[int], int], estimate: Callable[[int], float], lengths: tuple[int, ...], tolerance: float, what: str
) -> None:
    """At each sequence length, ``estimate(length)`` (bytes) within ``tolerance`` of ``measure(length)``,
    relative to the measurement: the memory planner sums these estimates, so one that is 3x off makes
    ``megaseq plan`` wrong without any error. Two lengths or more, so that a cost growing faster than the
    tokens (a ``[T, T]`` score matrix kept for backward) cannot match a per-token estimate at both."""
    for length in lengths:
        measured, estimated = measure(length), estimate(length)
        assert abs(estimated - measured) <= tolerance * measured, (
            f"{what}: at {length} tokens the estimate says autograd keeps {estimated:.0f} bytes, it keeps "
            f"{measured} ({estimated / max(measured, 1):.2f}x; bound {tolerance:.0%}): fix saved_per_token"
        )


class _Allocations(TorchDispatchMode):
    """Every storage an operation allocates while the mode is on: its bytes, and when it was allocated and freed,
    on a clock that ticks at each of these events.

    An operation's output is an allocation when its storage is neither one of the operation's inputs' (a view,
    an in-place or ``out=`` result) nor one already tracked. A weak reference to the storage says when it is
    freed. Buffers a kernel allocates and frees inside itself are not seen: they are the kernel's, bounded by
    its blocking, not by the tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.clock = 0
        self.sizes: list[int] = []
        self.allocated: list[int] = []
        self.freed: list[int | None] = []
        self.live: dict[int, int] = {}  # data_ptr -> index of the allocation
        self.refs: list[weakref.ref] = []  # kept so that their callbacks fire

    def _free(self, index: int, ptr: int) -> None:
        self.clock += 1
        self.freed[index] = self.clock
        if self.live.get(ptr) == index:
            del self.live[ptr]

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        given = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, Tensor)
                 and t.device.type != "meta"}
        for t in tree_leaves(out):
            if not isinstance(t, Tensor) or t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            ptr, nbytes = storage.data_ptr(), storage.nbytes()
            if nbytes == 0 or ptr in given or ptr in self.live:
                continue
            index = len(self.sizes)
            self.clock += 1
            self.sizes.append(nbytes)
            self.allocated.append(self.clock)
            self.freed.append(None)
            self.live[ptr] = index
            self.refs.append(weakref.ref(storage, lambda _, i=index, p=ptr: self._free(i, p)))
        return out

    def alive_bytes(self) -> int:
        """The bytes of the storages allocated while tracking and not freed (yet)."""
        return sum(size for size, freed in zip(self.sizes, self.freed, strict=True) if freed is None)

    def transient_peak(self) -> int:
        """The most bytes live at once of the storages allocated and freed (those still alive are
        what the call returns or leaves for later: outputs, saved tensors, gradients)."""
        events = []
        for size, start, stop in zip(self.sizes, self.allocated, self.freed, strict=True):
            if stop is not None:
                events += [(start, size), (stop, -size)]
        peak = live = 0
        for _, change in sorted(events):
            live += change
            peak = max(peak, live)
        return peak


def transient_bytes(run: Callable[[], Any]) -> tuple[int, Any]:
    """The transient working set of ``run()``: the most bytes live at once, during the call, of the distinct
    storages it allocates and frees before it returns; and ``run()``'s result.

    What the call receives (its inputs, the graph it differentiates), what it returns or leaves alive (outputs,
    the tensors autograd saves, gradients) is not counted: these are the other terms of a component's
    ``MemoryEstimate``. Every storage an operation allocates is seen, at any depth (autograd's backward,
    ``torch.utils.checkpoint``'s re-runs, custom ``autograd.Function``s), except a kernel's own scratch."""
    tracker = _Allocations()
    with tracker:
        result = run()
    gc.collect()  # what a reference cycle kept until now was freed by the end of the call
    peak = tracker.transient_peak()
    tracker.refs.clear()
    return peak, result


def call_transients(module: nn.Module, x: Tensor, grad_out: Tensor, ctx: Any) -> tuple[int, str]:
    """The larger transient working set (:func:`transient_bytes`) of ``module``'s forward on ``x`` (which needs
    a gradient, as an inner layer's input does) and of the backward of ``out`` with ``grad_out`` and of the
    auxiliary losses it added to ``ctx``, and which of the two it was (``"forward"``, ``"backward"``)."""
    module.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    forward, out = transient_bytes(lambda: module(x, ctx))
    aux = list(ctx.losses.values())
    grads = [grad_out, *(torch.ones_like(a) for a in aux)]
    backward, _ = transient_bytes(lambda: torch.autograd.backward([out, *aux], grads))
    return (forward, "forward") if forward > backward else (backward, "backward")


def check_temporary_estimate(
    measure: Callable[[int], tuple[int, str]],
    estimate: Callable[[int], float],
    lengths: tuple[int, ...],
    tolerance: float,
    ratio: float,
    what: str,
) -> None:
    """At each sequence length, ``estimate(length)`` (bytes) at least ``1 - tolerance`` and at most ``ratio``
    times ``measure(length)``: the largest transient working set of the component's forward or backward, and
    which of the two it was. The planner adds the temporary beside everything the layers keep: an estimate
    below it plans an out-of-memory step; one far above it refuses layouts that fit. Two lengths or more, so
    that a working set growing faster than the tokens cannot match a per-token estimate at both."""
    for length in lengths:
        (measured, where), estimated = measure(length), estimate(length)
        low, high = (1 - tolerance) * measured, ratio * measured
        assert low <= estimated <= high, (
            f"{what}: at {length} tokens the estimate is {estimated:.0f} bytes, the largest transient working set "
            f"measured ({where}) is {measured} ({estimated / max(measured, 1):.2f}x; bound {1 - tolerance:.2f}x "
            f"to {ratio:g}x): fix temporary"
        )


__all__ = [
    "assert_close",
    "call_transients",
    "check_deterministic",
    "check_gradients",
    "check_saved_estimate",
    "check_temporary_estimate",
    "check_two_forwards",
    "count_collective_bytes",
    "count_host_syncs",
    "forward_backward",
    "saved_bytes",
    "transient_bytes",
    "watch_host_syncs",
]


def check_shape_and_dtype(module: nn.Module, x: Tensor, context: Callable[[], Any]) -> None:
    """The output of ``module`` keeps the input's shape and dtype and is finite, in float32 and float64
    (``context()``: a fresh forward context per call)."""
    for dtype in (torch.float32, torch.float64):
        module = module.to(dtype)
        out = module(x.to(dtype), context())
        assert out.shape == x.shape, f"output shape {tuple(out.shape)} for input {tuple(x.shape)}"
        assert out.dtype == dtype, f"output dtype {out.dtype} for input dtype {dtype}"
        assert torch.isfinite(out).all(), f"non-finite output ({dtype})"
