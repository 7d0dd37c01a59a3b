"""Rules of the trainer that every process layout relies on, checked in one process (no extra needed):
one-line layout errors before anything starts, metrics as true means, processed-token counts, and the
non-finite check before the update (stop or skip, never a non-finite checkpoint)."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch
from torch import nn

from megaseq.cli import main
from megaseq.config import validate_recipe
from megaseq.contracts import ForwardContext
from megaseq.distributed.groups import import_parallel_state
from megaseq.distributed.layout import Layout
from megaseq.errors import TrainingDiverged, UserError
from megaseq.hookspecs import hookimpl
from megaseq.records import AttentionSpec, ComponentConfig
from megaseq.train.trainer import Trainer
from megaseq_testkit import fresh_plugins, registered


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGASEQ_CACHE", str(tmp_path / "cache"))


TINY = """
[run]
name = "t"
out_dir = "{out}"
device = "cpu"
[data]
train = "excerpt-chr20"
heldout = "excerpt-chrX"
seq_len = 64
[model]
d_model = 16
n_layers = 2
[attention.sdpa]
n_heads = 2
[train]
steps = 2
batch_size = 4
"""


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--parallel", "dp=3"], "train.batch_size 4 is not a multiple of dp 3"),
        (["--parallel", "cp=3"], "data.seq_len 64 is not a multiple of 2 x cp = 6"),
        (["--parallel", "dp=2,ep=3"], "ep x etp = 3 x 1 does not divide the 2 workers"),
        (["--parallel", "dp=2,ep=2"], "ep 2 > 1 but model.moe is not set"),
        (["--parallel", "dp=2", "--workers", "4"], "dp x cp x tp = 2 x 1 x 1 = 2 ranks, but --workers is 4"),
        (["--parallel", "xp=2"], "NAME one of dp, cp, ep, tp, etp"),
        (["--parallel", "dp=2,etp=2"], "etp 2 > 1 but model.moe is not set"),
        (["--parallel", "tp=4"], "attention.sdpa: n_heads 2 is not a multiple of tp 4"),
        (["--parallel", "tp=3"], "data.seq_len 64 / cp 1 is not a multiple of tp 3"),
        (["--parallel", "dp=0"], "dp must be a positive integer"),
        (["--workers", "2", "--address", "127.0.0.1:1"], "--address 127.0.0.1:1: cannot reach a Ray cluster there"),
        (["--workers", "2", "--address", "nowhere"], "expected HOST:PORT"),
    ],
)
def test_impossible_layouts_are_one_line_exit_2_before_any_worker(tmp_path, capsys, args, message):
    recipe = tmp_path / "r.toml"
    recipe.write_text(TINY.format(out=tmp_path / "run"))
    assert main(["train", str(recipe), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("megaseq: error: ") and message in err and err.count("\n") == 1, err
    assert not (tmp_path / "run").exists()  # nothing started


def test_without_the_extra_a_layout_says_how_to_install_it(tmp_path, capsys, monkeypatch):
    recipe = tmp_path / "r.toml"
    recipe.write_text(TINY.format(out=tmp_path / "run"))
    for name in ("ray", "ray.train", "ray.train.torch"):  # as if not installed: importing them raises ImportError
        monkeypatch.setitem(sys.modules, name, None)
    assert main(["train", str(recipe), "--workers", "2"]) == 2
    assert "--workers needs Ray Train: pip install 'megaseq-core[distributed]'" in capsys.readouterr().err
    for name in ("megatron", "megatron.core"):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(UserError, match=r"needs megatron-core: pip install 'megaseq-core\[distributed\]'"):
        import_parallel_state()


def test_core_imports_neither_megatron_nor_ray():
    code = (
        "import sys, megaseq.cli, megaseq.train.trainer, megaseq.distributed.launch, megaseq_testkit.layouts; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('ray', 'megatron')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True).stdout
    assert out.strip() == "[]"


def test_parse_parallel():
    assert Layout.parse("dp=2, cp=2,ep=2") == Layout(dp=2, cp=2, ep=2)
    assert Layout.parse("", base=Layout(cp=2)) == Layout(cp=2)
    assert Layout.parse("ep=2", base=Layout(dp=2)) == Layout(dp=2, ep=2)
    assert Layout.parse("tp=8,etp=2") == Layout(tp=8, etp=2)
    assert Layout(dp=2, cp=2, ep=2).world_size == 4
    assert Layout(dp=2, cp=2, tp=2).world_size == 8
    for bad in ("dp2", "xp=2", "dp=0", "dp=-1"):
        with pytest.raises(UserError):
            Layout.parse(bad)


# -- a probe component: logs per-layer values, adds an auxiliary loss, can poison the loss or a gradient ----
class ProbeConfig(ComponentConfig):
    pass


class Probe(nn.Module):
    """Identity attention with a weight; ``poison`` (class-wide) makes the next forward's aux loss or
    gradient NaN."""

    poison: str | None = None

    def __init__(self, config: ProbeConfig, dims, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.scale = nn.Parameter(torch.ones(dims.d_model))

    def forward(self, x, ctx: ForwardContext, cache=None):
        ctx.log("probe/layer", float(self.layer_idx))
        aux = (self.scale - 1).pow(2).sum() + 0.01
        if Probe.poison == "aux":
            aux = aux * float("nan")
        ctx.add_loss("probe", aux)
        out = x * self.scale
        if Probe.poison == "grad":
            out = _NanGrad.apply(out)
        return out

    def init_cache(self, batch_size, *, device, dtype):
        return None


class _NanGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * float("nan")


class ProbePlugin:
    @hookimpl
    def megaseq_attention(self):
        return [AttentionSpec(name="probe", target=f"{__name__}:Probe", config=ProbeConfig)]


@pytest.fixture
def probe_plugins():
    plugins = fresh_plugins()
    with registered(ProbePlugin(), plugins, name="probe"):
        yield plugins
    Probe.poison = None


def probe_recipe(tmp_path, plugins, **train):
    raw = {
        "run": {"name": "p", "out_dir": str(tmp_path / "run"), "device": "cpu"},
        "data": {"train": "excerpt-chr20", "heldout": "excerpt-chrX", "seq_len": 32},
        "model": {"d_model": 8, "n_layers": 2, "layer_pattern": ["probe"]},
        "train": {"steps": 3, "batch_size": 2, "warmup_steps": 0, "log_every": 1, **train},
        "eval": {"windows": 2, "batch_size": 2},
    }
    return validate_recipe(raw, plugins)


def test_log_reports_the_mean_of_repeated_names():
    ctx = ForwardContext()
    for value in (1.0, 2.0, 6.0):
        ctx.log("m", value)
    assert ctx.metrics["m"] == pytest.approx(3.0) and ctx.metric_counts["m"] == 3


def test_step_metrics_are_means_and_tokens_are_those_processed(tmp_path, probe_plugins):
    trainer = Trainer(probe_recipe(tmp_path, probe_plugins, grad_accum=2), probe_plugins, progress=False, tensorboard=False)
    metrics = trainer.train_step()
    assert metrics["probe/layer"] == pytest.approx(0.5)  # layers 0 and 1, two micro-batches: a mean, not the last
    assert trainer.tokens == 2 * 2 * 32  # micro-batches x windows x tokens
    assert metrics["aux/probe"] == pytest.approx(2 * 0.01)  # two layers' losses add; micro-batches average


@pytest.mark.parametrize("poison", ["aux", "grad"])
def test_nonfinite_step_stops_before_the_update_and_writes_no_checkpoint(tmp_path, probe_plugins, poison):
    recipe = probe_recipe(tmp_path, probe_plugins, checkpoint_every=1)
    trainer = Trainer(recipe, probe_plugins, progress=False, tensorboard=False)
    trainer.train_step()
    trainer.save()
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    Probe.poison = poison
    with pytest.raises(TrainingDiverged, match="stopped before the update"):
        trainer.train_step()
    for name, p in trainer.model.named_parameters():
        assert torch.equal(p, before[name]), name
    assert [p.name for p in (tmp_path / "run" / "checkpoints").glob("step_*")] == ["step_0000001"]


def test_nonfinite_step_is_skipped_when_configured(tmp_path, probe_plugins):
    trainer = Trainer(probe_recipe(tmp_path, probe_plugins, on_nonfinite="skip"), probe_plugins, progress=False, tensorboard=False)
    trainer.train_step()
    weights = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    moments = {k: v.clone() for k, v in trainer.optimizer.state[trainer.model.blocks[0].attention.scale].items()}
    Probe.poison = "grad"
    metrics = trainer.train_step()
    assert metrics["skipped_steps"] == 1 and math.isnan(metrics["grad_norm"]) and trainer.step == 2
    for name, p in trainer.model.named_parameters():
        assert torch.equal(p, weights[name]), name
    state = trainer.optimizer.state[trainer.model.blocks[0].attention.scale]
    assert all(torch.equal(state[k], v) for k, v in moments.items())
    Probe.poison = None
    assert trainer.train_step()["skipped_steps"] == 1
    trainer.save()
    assert json.loads((tmp_path / "run" / "checkpoints" / "step_0000003" / "meta.json").read_text())["step"] == 3


def test_nonfinite_weights_are_never_checkpointed(tmp_path, probe_plugins):
    trainer = Trainer(probe_recipe(tmp_path, probe_plugins), probe_plugins, progress=False, tensorboard=False)
    with torch.no_grad():
        trainer.model.blocks[0].attention.scale[0] = float("inf")
    with pytest.raises(TrainingDiverged, match="no checkpoint written"):
        trainer.save()
    assert not (tmp_path / "run" / "checkpoints" / "latest").exists()
