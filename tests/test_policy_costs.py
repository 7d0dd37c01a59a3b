"""The planner ranks this package's policies by their cost on the plan's device kind, in the order measured.

On the 2-core CPU (docs/results.md, "Policy costs" and "Long steps"), one step of recipes/genome-cpu.toml:
at 64k, recompute(part=block) took 110.8 CPU s and offload 141.5 s; at 256k, offload took 637 CPU s and
offload + recompute(tile_tokens=16384) 842 s. The plan's costs must put each pair in that order, and at 64k a
machine on which both fit gets recomputation proposed; on CUDA offloading is the cheap one.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from megaseq.cli import main
from megaseq.config import load_recipe
from megaseq.distributed.layout import Layout
from megaseq.memory.machine import GiB, Machine
from megaseq.memory.plan import plan
from megaseq.plugins import get_plugins

RECIPE = str(Path(__file__).resolve().parents[1] / "recipes" / "genome-cpu.toml")
MEASURED = {  # seq_len: (label, CPU s) per set, measured
    65536: [("recompute", 110.8), ("offload", 141.5)],
    262144: [("offload", 637.0), ("offload + recompute(tile_tokens=16384)", 842.0)],
}


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGASEQ_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("MEGASEQ_SCRATCH", str(tmp_path))


@pytest.mark.parametrize("seq_len", sorted(MEASURED))
def test_cpu_ranking_matches_the_measured_order(seq_len):
    plugins = get_plugins()
    recipe = load_recipe(RECIPE, plugins, ["train.batch_size=1"])
    result = plan(recipe, plugins, seq_len=seq_len, machine=Machine("cpu", 1024 * GiB, None))
    cost = {e.label: e.time_cost for e in result.candidates}
    measured = [label for label, _ in sorted(MEASURED[seq_len], key=lambda m: m[1])]
    assert sorted(measured, key=cost.__getitem__) == measured, cost
    if seq_len == 65536:  # a machine that both sets fit and no set cheaper than recompute does: it is proposed
        tight = plan(recipe, plugins, seq_len=seq_len, machine=Machine("cpu", max(peak(result, m) for m in measured), None))
        assert tight.chosen is not None and tight.chosen.label == "recompute"


def peak(result, label: str) -> int:
    return next(e.device_peak for e in result.candidates if e.label == label)


def test_cuda_ranks_offloading_before_recomputation():
    plugins = get_plugins()
    recipe = load_recipe(RECIPE, plugins, ["train.batch_size=1"])
    result = plan(recipe, plugins, seq_len=65536, machine=Machine("cuda", 1024 * GiB, None))
    cost = {e.label: e.time_cost for e in result.candidates}
    assert cost["offload"] == pytest.approx(0.21) and cost["offload"] < cost["recompute"]


def test_the_reported_layout_facts():
    """The GLM-5.3-Flash plan (packages/offload/README.md, "The reported figures"): sequence parallelism leaves
    each GPU 1/8 of the bf16 block inputs, so at 1M recomputation alone fits 178 GiB and is proposed (offloading
    would pin 22.5 GiB), at 256k offloading moves 5.6 GiB (the reported run's peak fell by 44) and the planner
    prefers recomputing the attention alone; the optimizer state is 16 bytes per parameter of host memory."""
    plugins = get_plugins()
    recipe = load_recipe(str(Path(RECIPE).with_name("glm5-flash-1m.toml")), plugins)
    layout = Layout.parse("dp=4,cp=2,ep=32,tp=8,etp=2")
    machine = Machine("cuda", 178 * GiB, 180 * GiB)
    tokens = 2**20 // 2 // 8  # per GPU between components: cp=2, then sequence parallelism over tp=8
    at_1m = plan(recipe, plugins, layout=layout, machine=machine)
    recompute = "recompute(reuse_kept=False)"  # the recipe's re-runs select again (its comment says why)
    assert at_1m.chosen is not None and at_1m.chosen.label == recompute and at_1m.chosen.host == 0
    offloading = next(e for e in at_1m.candidates if e.label == f"offload + {recompute}")
    assert offloading.host == 45 * tokens * 4096 * 2 == 22.5 * GiB
    assert at_1m.chosen.optimizer == 0 and at_1m.chosen.host_optimizer == 16 * at_1m.chosen.weights // 4
    at_256k = plan(recipe, plugins, seq_len=2**18, layout=layout, machine=machine)
    labels = {e.label: e for e in at_256k.candidates}
    assert at_256k.chosen is not None and at_256k.chosen.label == "recompute(part=attention, reuse_kept=False)"
    # 5.6 GiB leave; backward brings a layer's input back, and the pool loads the one below ahead (1/8 GiB each)
    assert 5 * GiB < labels[recompute].device_peak - labels[f"offload + {recompute}"].device_peak < 5.625 * GiB
    assert labels[f"offload + {recompute}"].host == 5.625 * GiB


def test_sharding_expert_parallel_parameters_is_refused_in_one_line(capsys):
    args = ["plan", str(Path(__file__).resolve().parents[1] / "recipes" / "glm5-flash-1m.toml"), "--parallel", "dp=4,cp=2,ep=32", "--device-mem", "178",
            "--set", "train.optimizer_shard=true"]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "train.optimizer_shard cannot shard expert-parallel parameters (ep=32" in err[0]
