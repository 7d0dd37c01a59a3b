"""The optimizer's placements are exact: HostAdamW and ZeRO-1 reach the weights of torch.optim.AdamW.

Each check compares against an oracle that is plainly right (``torch.optim.AdamW`` itself, or AdamW on fp32
copies cast back by hand) and is shown to catch a wrong optimizer (L2 decay instead of decoupled decay;
masters not refreshed after loading). Sharding under dp=2 is in ``tests/test_optimizer_dist.py``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from megaseq.config import TrainConfig, validate_recipe
from megaseq.distributed.layout import Layout, check_layout
from megaseq.errors import UserError
from megaseq.train.optimizer import HostAdamW, HostShare, host_share, make_optimizer, param_groups
from megaseq.train.trainer import Trainer
from megaseq_testkit import fresh_plugins

RTOL = 1e-6
STEPS = 5


def _model(dtype=torch.float32) -> nn.Module:
    torch.manual_seed(0)
    # awkward sizes; a norm-like vector (not decayed) and a frozen matrix (no state)
    model = nn.Sequential(nn.Linear(7, 13), nn.LayerNorm(13), nn.Linear(13, 5, bias=False)).to(dtype)
    model[2].weight.requires_grad_(False)
    return model


def _grads(model: nn.Module, step: int) -> None:
    g = torch.Generator().manual_seed(100 + step)
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.randn(p.shape, generator=g).to(p.dtype)


def _run(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int = STEPS, first: int = 0) -> None:
    for step in range(first, first + steps):
        for group in optimizer.param_groups:
            group["lr"] = 1e-2 * (step + 1)  # a schedule: every step another lr
        _grads(model, step)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    scale = expected.float().abs().max().clamp_min(1e-30)
    err = (actual.float() - expected.float()).abs().max() / scale
    assert err <= RTOL, f"{what}: relative error {err:.2e} > {RTOL}"


def _assert_same_weights(a: nn.Module, b: nn.Module) -> None:
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        _close(pa.detach(), pb.detach(), name)


TRAIN = TrainConfig(weight_decay=0.1, betas=(0.9, 0.95))


def test_host_adamw_equals_torch_adamw():
    reference, host = _model(), _model()
    _run(reference, make_optimizer(reference, TRAIN))
    optimizer = make_optimizer(host, TRAIN.model_copy(update={"optimizer_state": "host"}))
    assert isinstance(optimizer, HostAdamW)
    _run(host, optimizer)
    _assert_same_weights(host, reference)
    assert all(s["exp_avg"].device.type == "cpu" for s in optimizer.state.values())


def test_host_update_is_multi_tensor(monkeypatch):
    """The host update runs torch's foreach AdamW (one kernel per operation over a bucket's tensors), never the
    tensor-by-tensor loop, and still equals torch.optim.AdamW."""
    import torch.optim.adam as adam

    reference, host = _model(), _model()
    _run(reference, make_optimizer(reference, TRAIN))

    def refused(*args, **kwargs):
        raise AssertionError("the host update ran AdamW tensor by tensor")

    monkeypatch.setattr(adam, "_single_tensor_adam", refused)
    _run(host, make_optimizer(host, TRAIN.model_copy(update={"optimizer_state": "host"})))
    _assert_same_weights(host, reference)


def test_host_update_runs_with_its_share_of_threads_and_restores_the_process_count(monkeypatch):
    import megaseq.train.optimizer as optimizer

    seen = []
    update = optimizer.adamw_update

    def spy(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return update(*args, **kwargs)

    monkeypatch.setattr(optimizer, "adamw_update", spy)
    before = torch.get_num_threads()
    model = _model(torch.bfloat16)
    host = HostAdamW(param_groups(model, TRAIN), share=HostShare(threads=before + 2))
    _grads(model, 0)
    host.step()
    assert seen and set(seen) == {before + 2} and torch.get_num_threads() == before
    seen.clear()
    HostAdamW(param_groups(_model(), TRAIN)).step()  # no share of threads given: the process's own
    assert set(seen) <= {before}
    # on a CPU run the trainer's core share decides the threads; one process is alone on its machine
    assert host_share(_model(), None) == HostShare(ranks=1, threads=None)


def test_the_comparison_catches_l2_decay_in_place_of_decoupled_decay():
    reference, wrong = _model(), _model()
    _run(reference, make_optimizer(reference, TRAIN))
    _run(wrong, torch.optim.Adam(param_groups(wrong, TRAIN), betas=TRAIN.betas))
    with pytest.raises(AssertionError, match="relative error"):
        _assert_same_weights(wrong, reference)


def test_bf16_parameters_update_fp32_host_masters():
    """Oracle: AdamW on fp32 copies fed the bf16 gradients, cast back to bf16 after every step."""
    model = _model(torch.bfloat16)
    masters = _model(torch.bfloat16).float()
    oracle = torch.optim.AdamW(param_groups(masters, TRAIN), betas=TRAIN.betas)
    optimizer = HostAdamW(param_groups(model, TRAIN), betas=TRAIN.betas)
    for step in range(STEPS):
        for opt in (oracle, optimizer):
            for group in opt.param_groups:
                group["lr"] = 1e-2 * (step + 1)
        _grads(model, step)
        for m, p in zip(masters.parameters(), model.parameters(), strict=True):
            m.grad = None if p.grad is None else p.grad.float()
        oracle.step()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    for (name, m), p in zip(masters.named_parameters(), model.parameters(), strict=True):
        if p.requires_grad:
            _close(optimizer.master(p), m.detach(), f"master {name}")
            assert torch.equal(p.detach(), m.detach().to(torch.bfloat16)), name


def test_state_moves_between_device_and_host_optimizers():
    straight = _model()
    reference = make_optimizer(straight, TRAIN)
    _run(straight, reference, steps=2 * STEPS + 1)

    first = _model()
    device = make_optimizer(first, TRAIN)
    _run(first, device)
    second = _model()
    second.load_state_dict(first.state_dict())
    host = HostAdamW(param_groups(second, TRAIN), betas=TRAIN.betas)
    host.load_state_dict(device.state_dict())
    _run(second, host, first=STEPS)
    third = _model()  # and back: HostAdamW's state dict is AdamW's
    third.load_state_dict(second.state_dict())
    back = make_optimizer(third, TRAIN)
    back.load_state_dict(host.state_dict())
    _run(third, back, steps=1, first=2 * STEPS)
    _assert_same_weights(third, straight)


class _StaleMasters(HostAdamW):
    """Wrong: keeps the masters copied at construction when a state is loaded."""

    def sync_masters(self) -> None:
        pass


@pytest.mark.parametrize("cls, right", [(HostAdamW, True), (_StaleMasters, False)])
def test_loading_a_state_takes_the_masters_from_the_loaded_weights(cls, right):
    model = _model(torch.bfloat16)
    saved = HostAdamW(param_groups(model, TRAIN), betas=TRAIN.betas)
    _run(model, saved, steps=1)
    fresh = _model(torch.bfloat16)
    host = cls(param_groups(fresh, TRAIN), betas=TRAIN.betas)  # masters of the initial weights
    fresh.load_state_dict(model.state_dict())
    host.load_state_dict(saved.state_dict())
    trained = [p for p in fresh.parameters() if p.requires_grad]
    same = all(torch.equal(host.master(p), p.detach().float()) for p in trained)
    assert same == right


# -- in the trainer ----------------------------------------------------------------------------------------
def _tiny(tmp_path, plugins, **train):
    raw = {
        "run": {"name": "t", "out_dir": str(tmp_path / "run"), "device": "cpu"},
        "data": {"train": "excerpt-chr20", "heldout": "excerpt-chrX", "seq_len": 64},
        "model": {"d_model": 16, "n_layers": 2},
        "attention": {"sdpa": {"n_heads": 2}},
        "train": {"steps": 6, "batch_size": 2, "warmup_steps": 2, "log_every": 1, "loss_chunk": 50, **train},
        "eval": {"windows": 2, "batch_size": 2},
    }
    return validate_recipe(raw, plugins)


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGASEQ_CACHE", str(tmp_path / "cache"))


def _trainer(tmp_path, plugins, **train) -> Trainer:
    return Trainer(_tiny(tmp_path, plugins, **train), plugins, progress=False, tensorboard=False)


@pytest.mark.parametrize("saved, resumed", [
    ({"optimizer_state": "host"}, {}),
    ({"optimizer_shard": True}, {"optimizer_state": "host"}),
    ({}, {"optimizer_shard": True}),
])
def test_trainer_runs_and_resumes_across_placements(tmp_path, saved, resumed):
    plugins = fresh_plugins()
    straight = _trainer(tmp_path / "a", plugins)
    losses = [straight.train_step()["loss"] for _ in range(4)]

    first = _trainer(tmp_path / "b", plugins, **saved)
    got = [first.train_step()["loss"] for _ in range(2)]
    path = first.save()
    assert (path / "optimizer" / "rank0.pt").is_file() == bool(saved.get("optimizer_shard"))
    second = _trainer(tmp_path / "b", plugins, **resumed)
    assert second.resume() and second.step == 2
    assert not any("carried over" in note for note in second.notes)
    got += [second.train_step()["loss"] for _ in range(2)]
    assert got == losses
    _assert_same_weights(second.model, straight.model)


def test_sharding_refuses_expert_parallelism_in_one_line(tmp_path):
    plugins = fresh_plugins()
    recipe = _tiny(tmp_path, plugins, optimizer_shard=True, batch_size=2)
    recipe = recipe.model_copy(update={"model": recipe.model.model_copy(update={"moe": "x"})})
    with pytest.raises(UserError) as err:
        check_layout(recipe, Layout(dp=2, ep=2))
    assert "train.optimizer_shard cannot shard expert-parallel parameters" in str(err.value)
    assert "\n" not in str(err.value)


def test_a_host_that_cannot_hold_the_state_is_one_line_before_any_step(monkeypatch):
    import megaseq.train.optimizer as optimizer

    model = _model(torch.bfloat16)  # its masters and buffers need host memory: 16 bytes per trained parameter
    need = 16 * sum(p.numel() for p in model.parameters() if p.requires_grad)
    monkeypatch.setattr(optimizer, "available_host_memory", lambda: need - 1)
    with pytest.raises(UserError) as err:
        HostAdamW(param_groups(model, TRAIN))
    assert "needs 0.00 GiB of host memory" in str(err.value) and "\n" not in str(err.value)
    monkeypatch.setattr(optimizer, "available_host_memory", lambda: need)
    HostAdamW(param_groups(model, TRAIN))


def test_the_host_check_counts_every_training_process_of_the_machine(monkeypatch):
    """Eight ranks on one machine each pass a check of their own state alone; together they need eight times it."""
    import megaseq.train.optimizer as optimizer

    model = _model(torch.bfloat16)
    need = 16 * sum(p.numel() for p in model.parameters() if p.requires_grad)
    monkeypatch.setattr(optimizer, "available_host_memory", lambda: 8 * need - 1)
    HostAdamW(param_groups(model, TRAIN))  # alone it fits
    with pytest.raises(UserError) as err:
        HostAdamW(param_groups(model, TRAIN), share=HostShare(ranks=8))
    message = str(err.value)
    assert "the optimizer state of the 8 training processes on this machine" in message and "\n" not in message
    monkeypatch.setattr(optimizer, "available_host_memory", lambda: 8 * need)
    HostAdamW(param_groups(model, TRAIN), share=HostShare(ranks=8))


def _host_state_on_two_ranks(rank: int, world: int, available: int) -> str:
    import torch.distributed as dist

    import megaseq.train.optimizer as optimizer
    from megaseq.distributed.groups import Parallel

    parallel = Parallel(layout=Layout(dp=world), rank=rank, dp_rank=rank, world_group=dist.group.WORLD)
    optimizer.available_host_memory = lambda: available
    try:
        make_optimizer(_model(torch.bfloat16), TRAIN.model_copy(update={"optimizer_state": "host"}), parallel)
    except UserError as err:
        return str(err)
    return f"built; {host_share(_model(), parallel)}"


@pytest.mark.slow
def test_ranks_on_one_machine_are_checked_together():
    """The ranks find how many of them share the machine (both gloo ranks here) and each checks their total."""
    from megaseq_testkit.distributed import run_gloo

    model = _model(torch.bfloat16)
    need = 16 * sum(p.numel() for p in model.parameters() if p.requires_grad)
    for answer in run_gloo(2, _host_state_on_two_ranks, 2 * need - 1):
        assert "the optimizer state of the 2 training processes on this machine" in answer, answer
    for answer in run_gloo(2, _host_state_on_two_ranks, 2 * need):
        assert answer == "built; HostShare(ranks=2, threads=None)", answer
