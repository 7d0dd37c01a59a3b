"""The ``offload`` policy on CPU: what leaves memory, where it goes, and what is left behind (nothing).

Resident memory is measured in child processes (each has its own VmHWM): a forward that saves 256 MiB of
activations keeps them resident without the policy and in the page cache of an unnamed scratch file with
it. A child killed with SIGKILL while tensors are offloaded leaves no file behind. Bad scratch directories
and a policy with nothing to offload are one-line errors. CUDA's pinned pool is tested where CUDA exists.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from megaseq.errors import UserError
from megaseq_offload.config import OffloadConfig
from megaseq_offload.policies import OffloadPolicy
from megaseq_offload.stores import PinnedPool, ScratchFile, check_scratch_dir

HERE = Path(__file__).parent
MiB = 2**20


def _cases() -> list[torch.Tensor]:
    base = torch.randn(33, 17, dtype=torch.float64)
    return [
        torch.randn(5, 7, 3),
        base.t(),  # transposed: comes back with the same strides
        base[:, ::2],  # gapped: comes back contiguous
        torch.randn(9, 4).to(torch.bfloat16),
        torch.tensor(3.5),
        torch.zeros(0, 4),
        torch.arange(10, dtype=torch.int64)[2:7],
    ]


def test_scratch_file_round_trip(tmp_path):
    store = ScratchFile(check_scratch_dir(str(tmp_path)))
    handles = [(t, store.put(t)) for t in _cases()]
    assert not list(tmp_path.iterdir()), "the scratch file must have no name"
    for t, h in handles:
        back = store.get(h)
        assert back.dtype == t.dtype and back.shape == t.shape and torch.equal(back, t)
        assert back.stride() == (t.stride() if t.is_contiguous() or t.stride() == (1, 17) else back.stride())
    assert handles[1][0].stride() == store.get(handles[1][1]).stride() == (1, 17)
    fd = store.fd
    store.close()
    with pytest.raises(OSError):
        os.fstat(fd)


def test_scratch_file_grows_past_its_reservation(tmp_path):
    store = ScratchFile(Path(tmp_path), reserve=4096)
    big = torch.randn(3 * MiB // 4)
    handle = store.put(big)
    assert store.reserved >= 3 * MiB and torch.equal(store.get(handle), big)
    store.close()


def _rss(mode: str, scratch: str) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, str(HERE / "_rss_child.py"), mode, scratch], capture_output=True, text=True,
                         env=env, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # a training subprocess whose resident memory is measured
def test_resident_memory_really_drops(tmp_path):
    kept, offloaded = _rss("keep", str(tmp_path)), _rss("offload", str(tmp_path))
    assert offloaded["grad"] == kept["grad"], "offloading changed the gradient"
    assert offloaded["moved"] >= 256 * MiB
    # the 256 MiB of saved activations are not resident with the policy (slack: allocator and page-size noise)
    assert kept["rss_after_forward"] - offloaded["rss_after_forward"] > 200 * MiB, (kept, offloaded)
    assert kept["hwm"] - offloaded["hwm"] > 150 * MiB, (kept, offloaded)
    assert not list(tmp_path.iterdir())


KILL_CHILD = """
import sys, time, torch
from megaseq_offload.config import OffloadConfig
from megaseq_offload.policies import OffloadPolicy
model = torch.nn.Linear(1, 1)
policy = OffloadPolicy(OffloadConfig(scratch_dir=sys.argv[1]))
policy.apply(model)
with policy.step():
    y = (torch.randn(4 * 2**20) * model.weight[0, 0]).sin()
    print("offloaded", flush=True)
    time.sleep(600)
"""


@pytest.mark.slow  # a megaseq subprocess
def test_sigkill_leaves_no_scratch_file(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", KILL_CHILD, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        assert child.stdout.readline().strip() == "offloaded"
        links = [os.readlink(fd) for fd in Path(f"/proc/{child.pid}/fd").iterdir()]
        assert any(link.startswith(str(tmp_path)) for link in links), f"no scratch file open in {tmp_path}: {links}"
        assert not list(tmp_path.iterdir()), "a scratch file had a name while the step ran"
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
    assert child.returncode == -signal.SIGKILL
    assert not list(tmp_path.iterdir())


def _policy(**config) -> OffloadPolicy:
    policy = OffloadPolicy(OffloadConfig(**config))
    policy.apply(torch.nn.Linear(2, 2))
    return policy


def test_missing_scratch_dir(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        _policy(scratch_dir=str(tmp_path / "nope"))


def test_scratch_dir_that_is_a_file(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(UserError, match="is not a directory"):
        _policy(scratch_dir=str(tmp_path / "f"))


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="no /dev/shm (tmpfs) on this machine")
def test_scratch_dir_on_tmpfs():
    with pytest.raises(UserError, match="tmpfs"):
        _policy(scratch_dir="/dev/shm")


def test_read_only_scratch_dir(tmp_path, monkeypatch):
    # this machine runs tests as root on a writable disk: the read-only mount is simulated where the policy
    # meets it, creating its file
    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(tempfile, "TemporaryFile", read_only)
    with pytest.raises(UserError, match="is not writable: Read-only file system"):
        _policy(scratch_dir=str(tmp_path))


def test_full_scratch_dir(tmp_path):
    stat = os.statvfs(tmp_path)
    too_much = stat.f_bavail * stat.f_frsize + 2**30
    with pytest.raises(UserError, match="is full: a step needs") as err:  # refused when applied, before training
        _policy(scratch_dir=str(tmp_path), pool_bytes=too_much)
    assert "\n" not in str(err.value)
    policy = _policy(scratch_dir=str(tmp_path))
    policy.config = policy.config.model_copy(update={"pool_bytes": too_much})  # a disk that filled up since
    with pytest.raises(UserError, match="is full: this step needs"), policy.step():
        pass
    assert not list(tmp_path.iterdir())


def test_scratch_dir_on_a_network_file_system(tmp_path, monkeypatch):
    # no network mount here: the mount table the policy reads is simulated
    import megaseq_offload.stores as stores

    monkeypatch.setattr(stores, "filesystem_type", lambda path: "nfs4")
    with pytest.raises(UserError, match=r"is on a network file system \(nfs4\); choose a directory on a local disk"):
        _policy(scratch_dir=str(tmp_path))


def test_full_scratch_dir_in_the_middle_of_a_step(tmp_path, monkeypatch):
    policy = _policy(scratch_dir=str(tmp_path), min_bytes=1024)
    real = os.statvfs

    class Full:
        def __init__(self, st):
            self.f_frsize, self.f_bavail = st.f_frsize, 0

    monkeypatch.setattr(os, "statvfs", lambda p: Full(real(p)))
    w = torch.ones((), requires_grad=True)
    with pytest.raises(UserError, match="is full"), policy.step():
        (torch.randn(4096) * w).sin()
    assert not list(tmp_path.iterdir())


def test_nothing_to_offload_is_an_error(tmp_path):
    policy = _policy(scratch_dir=str(tmp_path), min_bytes=2**40)
    w = torch.ones((), requires_grad=True)
    with pytest.raises(UserError, match="nothing to offload"), policy.step():
        (torch.randn(64) * w).sin().sum().backward()


@pytest.mark.slow  # a megaseq subprocess
def test_cli_bad_scratch_dir_is_one_line(tmp_path):
    recipe = Path(__file__).resolve().parents[3] / "recipes" / "tiny.toml"
    out = subprocess.run(
        [sys.executable, "-m", "megaseq.cli", "train", str(recipe), "--memory-policy", "offload",
         "--set", f"memory_policy.offload.scratch_dir='{tmp_path / 'missing'}'", "--set", f"run.out_dir='{tmp_path / 'run'}'"],
        capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1", "MEGASEQ_CACHE": str(tmp_path / "cache")},
    )
    assert out.returncode == 2, out.stderr
    errors = [line for line in out.stderr.splitlines() if line.startswith("megaseq: error:")]
    assert len(errors) == 1 and "scratch_dir" in errors[0] and "does not exist" in errors[0], out.stderr
    assert "Traceback" not in out.stderr


# -- CUDA -----------------------------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_pinned_pool_round_trip_and_prefetch():
    pool = PinnedPool(torch.device("cuda"), reserve=MiB)
    tensors = [t.cuda() for t in _cases()] + [torch.randn(3 * MiB // 4, device="cuda")]  # the last one finds no room
    handles = [pool.put(t) for t in tensors]
    assert len(pool.segments) == 1 and pool.short == 3 * MiB
    for t, h in reversed(list(zip(tensors, handles, strict=True))):  # backward order: prefetches the next
        back = pool.get(h)
        assert back.device == t.device and back.dtype == t.dtype and torch.equal(back, t)
    pool.begin()  # the next step: the pool grew by what did not fit
    assert len(pool.segments) == 2
    pool.close()
    assert not pool.segments


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_offload_keeps_gradients_and_frees_device_memory():
    model = torch.nn.Linear(1, 1).cuda()
    x = torch.randn(8 * MiB, device="cuda")

    def run(offload: bool):
        model.zero_grad()
        policy = OffloadPolicy(OffloadConfig(pool_bytes=128 * MiB))
        policy.apply(model)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        with policy.step() if offload else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            y = x
            for _ in range(4):
                y = (y * model.weight[0, 0]).sin()
            torch.cuda.synchronize()
            held = torch.cuda.memory_allocated() - before
            y.sum().backward()
        return model.weight.grad.clone(), held

    g_keep, held_keep = run(False)
    g_off, held_off = run(True)
    assert torch.equal(g_keep, g_off)
    assert held_keep - held_off > 200 * MiB


# -- the pinned pool's lifecycle on a fake CUDA ----------------------------------------------------------


class FakeCuda:
    """torch.cuda's streams, events and ``cudaHostRegister`` replaced by recorders; copies are the host's. Records
    each registration's size, and each registration and synchronisation with whether a forward or backward
    was running (``inside``, set by the test)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.inside = False
        self.registered: list[tuple[int, bool]] = []
        self.unregistered = 0
        self.synchronized: list[bool] = []
        fake = self

        class Stream:
            def __init__(self, device=None) -> None:
                pass

            def wait_stream(self, other) -> None:
                pass

            def wait_event(self, event) -> None:
                pass

            def synchronize(self) -> None:
                fake.synchronized.append(fake.inside)

        class Event:
            def record(self, stream=None) -> None:
                pass

        class Runtime:
            def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:
                fake.registered.append((size, fake.inside))
                return 0

            def cudaHostUnregister(self, ptr: int) -> int:
                fake.unregistered += 1
                return 0

        current = Stream()
        monkeypatch.setattr(torch.cuda, "Stream", Stream)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current)
        monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
        monkeypatch.setattr(torch.cuda, "Event", Event)
        monkeypatch.setattr(torch.cuda, "cudart", lambda: Runtime())
        monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: None)


class HostBackedCuda:
    """The policy's device: of type cuda (so it takes the pinned pool), equal to the host's, where the tensors are."""

    type = "cuda"

    def __eq__(self, other: object) -> bool:
        return other is self or other == torch.device("cpu")

    def __ne__(self, other: object) -> bool:
        return not self == other

    __hash__ = object.__hash__


def _fake_cuda_steps(cuda: FakeCuda, policy: OffloadPolicy, sizes: list[int]) -> list[torch.Tensor]:
    """One step per size: a chain of four saved tensors of that many floats, forward and backward; returns the
    gradients."""
    w = torch.ones((), requires_grad=True)
    grads = []
    for step, n in enumerate(sizes):
        x = torch.randn(n, generator=torch.Generator().manual_seed(step))
        with policy.step():
            cuda.inside = True
            y = x
            for _ in range(4):
                y = (y * w).sin()
            y.sum().backward()
            cuda.inside = False
        grads.append(w.grad.clone())
        w.grad = None
    return grads


def _reference(sizes: list[int]) -> list[torch.Tensor]:
    w = torch.ones((), requires_grad=True)
    grads = []
    for step, n in enumerate(sizes):
        y = torch.randn(n, generator=torch.Generator().manual_seed(step))
        for _ in range(4):
            y = (y * w).sin()
        y.sum().backward()
        grads.append(w.grad.clone())
        w.grad = None
    return grads


def _fake_cuda_policy(tmp_path: Path, **config) -> OffloadPolicy:
    policy = _policy(scratch_dir=str(tmp_path), min_bytes=1024, **config)
    policy.device = HostBackedCuda()
    return policy


def test_pinned_pool_is_pinned_once_and_kept_across_steps(tmp_path, monkeypatch):
    """With the planner's size: one registration before the first forward, none after, no unpinning between
    steps, and no synchronisation inside a forward or backward (the pool is reused without one)."""
    cuda = FakeCuda(monkeypatch)
    policy = _fake_cuda_policy(tmp_path, pool_bytes=4 * MiB)
    sizes = [64 * 1024] * 3
    grads = _fake_cuda_steps(cuda, policy, sizes)
    assert cuda.registered == [(4 * MiB, False)]
    assert cuda.unregistered == 0
    assert not any(cuda.synchronized), "the pool synchronised with the device inside a forward or backward"
    assert all(torch.equal(g, r) for g, r in zip(grads, _reference(sizes), strict=True))
    policy.pool.close()
    assert cuda.unregistered == 1


def test_pinned_pool_is_sized_by_the_first_step_and_grows_between_steps(tmp_path, monkeypatch):
    """Without a planned size: the first step's tensors wait in pageable memory and the pool is pinned for
    them before the second step; a step that needs more grows it once, before the step after it; nothing is
    registered inside a forward or backward."""
    import megaseq_offload.stores as stores

    monkeypatch.setattr(stores, "GROWTH", MiB)  # the least a pool grows by, small enough for these steps
    cuda = FakeCuda(monkeypatch)
    policy = _fake_cuda_policy(tmp_path)
    small, large = 64 * 1024, 2**20  # floats per saved tensor: 256 KiB, then 4 MiB
    sizes = [small, small, small, large, large, large]
    grads = _fake_cuda_steps(cuda, policy, sizes)
    assert [inside for _, inside in cuda.registered] == [False, False], cuda.registered
    first, grown = (size for size, _ in cuda.registered)
    assert first >= 4 * small * 4 and first + grown >= 4 * large * 4
    assert cuda.unregistered == 0 and not any(cuda.synchronized)
    assert all(torch.equal(g, r) for g, r in zip(grads, _reference(sizes), strict=True))
    policy.pool.close()
    assert cuda.unregistered == 2
