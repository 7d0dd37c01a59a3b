"""The memory planner: `megaseq plan` output and errors, the model it applies, and how it chooses.

Core alone has no memory policy, so the choosing is tested with a small policy plugin registered here
(``ShrinkPolicy``: its presets halve or quarter what the planner is told the layers keep, at a cost), and a
third-party component's own formula is shown to reach the plan. The accuracy against measured memory is in
``tests/test_plan_accuracy.py`` (repository root) and ``benchmarks/plan_accuracy.py``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from megaseq.cli import main
from megaseq.config import load_recipe, validate_recipe
from megaseq.distributed.layout import Layout
from megaseq.hookspecs import hookimpl
from megaseq.memory.machine import GiB, Machine
from megaseq.memory.plan import plan
from megaseq.memory.plan_report import describe_memory_policy, render_table
from megaseq.model import build_model
from megaseq.records import AttentionSpec, ComponentConfig, MemoryEffect, MemoryEstimate, MemoryPolicySpec, ModelDims
from megaseq_testkit import fresh_plugins

REPO = Path(__file__).resolve().parents[3]
TINY = str(REPO / "recipes" / "tiny.toml")


def test_plan_json_has_the_documented_keys(capsys):
    assert main(["plan", TINY, "--seq-len", "4096", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("seq_len", "policies", "device_peak_bytes", "host_peak_bytes", "fits", "candidates"):
        assert key in out
    assert out["seq_len"] == 4096 and out["policies"] == [] and out["fits"] is True
    assert out["device_peak_bytes"] > 0.4 * GiB  # at least the process itself


def test_plan_table_lists_what_the_issue_asks(capsys):
    assert main(["plan", TINY, "--memory-policy", "none", "--device-mem", "8"]) == 0
    text = capsys.readouterr().out
    for word in ("weights", "gradients", "optimizer state", "sdpa+swiglu", "re-run", "peak", "fits", "8.00G"):
        assert word in text, word


def test_nothing_fits_is_said_plainly(capsys):
    assert main(["plan", TINY, "--seq-len", "100000000", "--device-mem", "1"]) == 0
    assert "nothing fits" in capsys.readouterr().out
    assert main(["plan", TINY, "--seq-len", "100000000", "--device-mem", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["fits"] is False


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--seq-len", "0"], "--seq-len 0: Input should be greater than or equal to 2"),
        (["--seq-len", "1000000000000000"], "--seq-len 1000000000000000: Input should be less than or equal to 1073741824"),
        (["--seq-len", "1.5"], "--seq-len 1.5: Input should be a valid integer"),
        (["--device-mem", "0"], "--device-mem 0"),
        (["--device-mem", "-2"], "must be a positive number of GiB"),
        (["--device-mem", "0.1"], "impossible"),
        (["--host-mem", "nan"], "--host-mem nan"),
        (["--parallel", "cp=3", "--seq-len", "100"], "--seq-len 100 is not a multiple of 2 x cp = 6"),
        (["--parallel", "pp=2"], "NAME one of dp, cp, ep, tp, etp"),
        (["--parallel", "dp=zero"], "dp must be a positive integer"),
        (["--memory-policy", "a b"], "expected auto, none or comma-separated policy names"),
        (["--memory-policy", "nonexistent"], "no memory_policy named 'nonexistent'"),
    ],
)
def test_bad_input_is_one_line_exit_2(args, message, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("MEGASEQ_SCRATCH", str(tmp_path))
    assert main(["plan", TINY, *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("megaseq: error:") and message in err[0], err
    assert not list(tmp_path.iterdir())


def test_seq_len_is_read_as_the_recipe_reads_data_seq_len(capsys):
    """``--seq-len 1e3`` as ``--set data.seq_len=1e3``: a TOML number that is an integer is one."""
    assert main(["plan", TINY, "--seq-len", "1e3", "--json"]) == 0
    by_flag = json.loads(capsys.readouterr().out)
    assert main(["plan", TINY, "--set", "data.seq_len=1e3", "--json"]) == 0
    assert by_flag == json.loads(capsys.readouterr().out) and by_flag["seq_len"] == 1000


def test_columns_stay_apart_at_the_largest_seq_len(capsys):
    assert main(["plan", TINY, "--seq-len", str(2**30)]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith(("none ", "offload "))]
    assert rows and all(re.search(r"\dG\d", row) is None for row in rows), rows


# -- choosing, with a policy registered here ---------------------------------------------------------------


class ShrinkConfig(ComponentConfig):
    part: str = "block"
    tile_tokens: int | None = None
    cost: float = 0.1
    maps: int | None = None


def shrink_effect(config: ShrinkConfig) -> MemoryEffect:
    return MemoryEffect(recompute=config.part, tile_tokens=config.tile_tokens, time_cost=config.cost,
                        maps_allocations_from=config.maps)


class ShrinkPlugin:
    @hookimpl
    def megaseq_memory_policy(self):
        return [MemoryPolicySpec(
            name="shrink", target=f"{__name__}:ShrinkConfig", config=ShrinkConfig, memory=f"{__name__}:shrink_effect",
            presets=({"part": "ffn", "cost": 0.1}, {"part": "block", "cost": 0.3}, {"part": "block", "tile_tokens": 64, "cost": 0.4}),
            capabilities=frozenset({"context_parallel"}),
        )]


def test_proposes_the_cheapest_set_that_fits():
    plugins = fresh_plugins()
    plugins.register(ShrinkPlugin(), name="shrink-plugin")
    recipe = load_recipe(TINY, plugins)
    big = plan(recipe, plugins, seq_len=65536, machine=Machine("cpu", 64 * GiB, None))
    assert big.chosen is not None and big.chosen.label == "none"
    peaks = {e.label: e.device_peak for e in big.candidates}
    assert peaks["none"] > peaks["shrink(part=ffn)"] > peaks["shrink(cost=0.3)"] > peaks["shrink(tile_tokens=64, cost=0.4)"]
    between = (peaks["shrink(cost=0.3)"] + peaks["shrink(part=ffn)"]) // 2
    tight = plan(recipe, plugins, seq_len=65536, machine=Machine("cpu", between, None))
    assert tight.chosen is not None and tight.chosen.label == "shrink(cost=0.3)"
    assert "proposed: shrink(cost=0.3)" in render_table(tight)


def test_a_third_party_components_formula_is_planned():
    class Config(ComponentConfig):
        per_token: float = 1000.0

    class Plugin:
        @hookimpl
        def megaseq_attention(self):
            return [AttentionSpec(name="heavy", target=f"{__name__}:_never_built", config=Config, memory=f"{__name__}:_heavy_memory")]

    plugins = fresh_plugins()
    plugins.register(Plugin(), name="heavy-plugin")
    raw = {"model": {"d_model": 32, "n_layers": 2, "layer_pattern": ["heavy"]}, "attention": {"heavy": {"per_token": 1000.0}},
           "train": {"batch_size": 1}}
    light = plan(validate_recipe(raw, plugins), plugins, seq_len=1 << 20, machine=Machine("cpu", 64 * GiB, None), policies="none")
    raw["attention"]["heavy"]["per_token"] = 5000.0
    heavy = plan(validate_recipe(raw, plugins), plugins, seq_len=1 << 20, machine=Machine("cpu", 64 * GiB, None), policies="none")
    assert heavy.candidates[0].device_peak - light.candidates[0].device_peak == 2 * 4000 * (1 << 20)


def _never_built(config, dims, layer_idx):
    raise AssertionError("the planner must not build components")


def _heavy_memory(config, dims, seq_len) -> MemoryEstimate:
    return MemoryEstimate(parameters=0, saved_per_token=config.per_token)


def test_parallel_layout_divides_tokens():
    plugins = fresh_plugins()
    recipe = load_recipe(TINY, plugins, ["train.batch_size=8"])
    one = plan(recipe, plugins, seq_len=4096, machine=Machine("cpu", 64 * GiB, None), policies="none")
    split = plan(recipe, plugins, seq_len=4096, layout=Layout.parse("dp=2,cp=2"), machine=Machine("cpu", 64 * GiB, None), policies="none")
    assert one.tokens == 8 * 4096 and split.tokens == 4 * 2048
    assert split.candidates[0].device_peak < one.candidates[0].device_peak


def test_tensor_parallel_splits_the_stream_and_gathers_each_regions_input():
    """Under tp (with sequence parallelism) each rank holds 1/tp of the residual stream, and each split region
    (tiny's sdpa and SwiGLU, each planned by its estimate at tp_size) keeps its input gathered whole. A planner
    that divided everything a layer keeps by tp, or the stream by nothing, fails the first or the last line."""
    plugins = fresh_plugins()
    recipe = load_recipe(TINY, plugins, ["train.batch_size=1"])
    d, n, layers = 32, 4096, 2  # tiny.toml's d_model and layers; one window
    machine = Machine("cpu", 64 * GiB, None)
    one, two = (plan(recipe, plugins, seq_len=n, layout=Layout(tp=tp), machine=machine, policies="none").candidates[0]
                for tp in (1, 2))
    kept_one, kept_two = (sum(v for k, v in e.saved_by_kind.items() if k != "embedding+head") for e in (one, two))
    rank = ModelDims(d_model=d, n_layers=layers, vocab_size=recipe.model.vocab_size, tp_rank=1, tp_size=2)
    saved = {kind: plugins.get(kind, name).spec.load_memory()(recipe.component(kind, name), rank, n).saved_per_token
             for kind, name in (("attention", "sdpa"), ("ffn", "swiglu"))}
    # the parts' estimates at tp_size 2 over the gathered sequence, the block's norms on the rank's half
    assert kept_two == layers * (saved["attention"] + saved["ffn"] + (4 * d + 4)) * n
    assert kept_two - kept_one / 2 >= layers * 2 * (4 * d * n) / 2  # two gathered inputs a layer, whole
    assert two.gradient_stream == one.gradient_stream / 2
    # the final norm's input and rstd are split; the hidden states the loss gathers are whole
    assert one.saved_by_kind["embedding+head"] - two.saved_by_kind["embedding+head"] == (4 * d + 4) * n / 2
    # the weights are what a rank builds: its heads, hidden width and vocabulary block, the norms whole
    built = build_model(recipe, plugins, rank)
    assert two.weights == sum(p.numel() * p.element_size() for p in built.parameters())


def test_bf16_residual_stream_halves_the_streams_bytes():
    """model.residual_dtype = "bf16" halves what the plan counts in the residual stream's dtype: the norms'
    inputs of every layer, the final norm's input and the gradient stream (2 bytes less per value)."""
    plugins = fresh_plugins()
    base = ["train.bf16=true", "train.batch_size=1"]
    d, n = 32, 4096  # tiny.toml's d_model; one window
    machine = Machine("cpu", 64 * GiB, None)
    fp32, bf16 = (
        plan(load_recipe(TINY, plugins, [*base, f"model.residual_dtype='{r}'"]), plugins, seq_len=n, machine=machine,
             policies="none").candidates[0]
        for r in ("fp32", "bf16")
    )
    assert fp32.gradient_stream - bf16.gradient_stream == 3 * 2 * d * n
    assert fp32.saved_by_kind["embedding+head"] - bf16.saved_by_kind["embedding+head"] == 2 * d * n
    layers = sum(fp32.saved_by_kind.values()) - sum(bf16.saved_by_kind.values()) - 2 * d * n
    assert layers == 2 * 2 * 2 * d * n  # two layers, two norms each


def test_the_heap_is_counted_where_the_c_library_keeps_it(monkeypatch):
    """A CPU run that does not trim its heap (below ``TRIM_FROM_TOKENS`` with run.trim_heap = "auto", or
    false) is planned HEAP_RETAINED x its live activations higher, at most HEAP_RETAINED_MAX; a trimmed run,
    one whose policy maps large allocations, and a CUDA device are not. A planner that ignored the run's heap
    rule fails here."""
    from megaseq.memory import heap
    from megaseq.memory.plan import HEAP_RETAINED, HEAP_RETAINED_MAX

    monkeypatch.setattr(heap, "available", lambda: True)
    plugins = fresh_plugins()
    plugins.register(ShrinkPlugin(), name="shrink-plugin")
    cpu = Machine("cpu", 64 * GiB, None)

    def one(*overrides, seq_len=4096, machine=cpu, policies="none"):
        recipe = load_recipe(TINY, plugins, ["train.batch_size=1", *overrides])
        return plan(recipe, plugins, seq_len=seq_len, machine=machine, policies=policies).candidates[0]

    kept = one()
    live = kept.layers_peak + kept.saved_by_kind["embedding+head"] + kept.gradient_stream + kept.temporary
    assert kept.heap == int(HEAP_RETAINED * live) > 0
    assert one("run.trim_heap=false", seq_len=1 << 20).heap == HEAP_RETAINED_MAX
    assert kept.device_peak == one("run.trim_heap=true").device_peak + kept.heap
    assert one("run.trim_heap=true").heap == 0
    assert one(seq_len=heap.TRIM_FROM_TOKENS).heap == 0
    assert one("run.trim_heap=false", seq_len=heap.TRIM_FROM_TOKENS).heap > 0
    assert one("train.memory_policy=['shrink']", policies=["shrink"]).heap > 0
    assert one("train.memory_policy=['shrink']", "memory_policy.shrink.maps=1048576", policies=["shrink"]).heap == 0
    assert one(machine=Machine("cuda", 64 * GiB, None)).heap == 0
    monkeypatch.setattr(heap, "available", lambda: False)  # no glibc: nothing trims
    assert one(seq_len=heap.TRIM_FROM_TOKENS).heap > 0


def test_run_header_names_the_memory_policy():
    plugins = fresh_plugins()
    assert describe_memory_policy(load_recipe(TINY, plugins)) == "no memory policy"


def test_tiles_are_never_planned_under_context_parallelism():
    """Tiling refuses context parallelism (``SequenceTiling``): ``auto`` must not propose a tiled set that
    every worker would then fail on, and a recipe that names one is refused in one line before any launch."""
    from megaseq.capabilities import check_components
    from megaseq.errors import UserError

    plugins = fresh_plugins()
    plugins.register(ShrinkPlugin(), name="shrink-plugin")
    recipe = load_recipe(TINY, plugins, ["train.batch_size=2"])
    cp2 = Layout.parse("cp=2")
    tight = Machine("cpu", 1, None)  # nothing fits: every candidate is listed
    assert any("tile_tokens" in e.label for e in plan(recipe, plugins, seq_len=65536, machine=tight).candidates)
    labels = [e.label for e in plan(recipe, plugins, seq_len=65536, layout=cp2, machine=tight).candidates]
    assert labels and not any("tile_tokens" in label for label in labels)

    tiled = load_recipe(TINY, plugins, ["train.batch_size=2", 'train.memory_policy=["shrink"]', "memory_policy.shrink.tile_tokens=64"])
    check_components(tiled, plugins, Layout())  # one device: tiles run
    for refuse in (lambda: check_components(tiled, plugins, cp2),
                   lambda: plan(tiled, plugins, seq_len=65536, layout=cp2, machine=tight, policies=["shrink"])):
        with pytest.raises(UserError, match=r"memory_policy\.shrink\.tile_tokens cannot run under context parallelism \(cp=2"):
            refuse()
    whole = load_recipe(TINY, plugins, ["train.batch_size=2", 'train.memory_policy=["shrink"]'])
    check_components(whole, plugins, cp2)  # recompute without tiles runs under CP


def test_optimizer_state_in_host_memory_and_sharded():
    """Per parameter: AdamW's 8 bytes of moments on the device; with optimizer_state = "host" on CUDA 16 bytes of
    host memory instead (moments, master, gradient buffer), on CPU still the process's 8; ZeRO-1 divides by dp x cp."""
    plugins = fresh_plugins()
    cuda, cpu = Machine("cuda", 64 * GiB, None), Machine("cpu", 64 * GiB, None)
    dp2cp2 = Layout.parse("dp=2,cp=2")

    def one(machine, layout=None, *sets):
        recipe = load_recipe(TINY, plugins, ["train.batch_size=4", *sets])
        return plan(recipe, plugins, seq_len=4096, layout=layout, machine=machine, policies="none").candidates[0]

    device = one(cuda)
    params = device.weights // 4
    assert device.optimizer == 8 * params and device.host_optimizer == 0
    host = one(cuda, None, "train.optimizer_state='host'")
    assert host.optimizer == 0 and host.host_optimizer == 16 * params
    assert device.device_peak - host.device_peak == 8 * params
    assert one(cpu, None, "train.optimizer_state='host'").optimizer == 8 * params  # the same memory on a CPU run
    assert one(cuda, dp2cp2, "train.optimizer_shard=true").optimizer == 8 * params // 4
    assert one(cuda, dp2cp2, "train.optimizer_shard=true", "train.optimizer_state='host'").host_optimizer == 16 * params // 4
    assert "in host memory" in render_table(plan(load_recipe(TINY, plugins, ["train.optimizer_state='host'"]), plugins,
                                                 machine=cuda, policies="none"))


def test_reduction_buckets_count_under_gradient_accumulation_on_several_ranks():
    """The gradient reduction's buckets hold every reduced gradient; they take the gradients' place unless
    micro-batches accumulate beside them (several ranks, train.grad_accum > 1): then one more copy of the
    parameters' bytes, in the peak and in the table. ``tests/test_gradient_reduction.py`` measures a run's."""
    plugins = fresh_plugins()
    machine = Machine("cuda", 64 * GiB, None)

    def one(layout, accum):
        recipe = load_recipe(TINY, plugins, ["train.batch_size=4", f"train.grad_accum={accum}"])
        return plan(recipe, plugins, seq_len=4096, layout=layout, machine=machine, policies="none").candidates[0]

    dp2 = Layout.parse("dp=2")
    assert one(None, 2).reduction == 0 and one(dp2, 1).reduction == 0
    accumulating = one(dp2, 2)
    assert accumulating.reduction == accumulating.weights
    assert accumulating.device_peak - one(dp2, 1).device_peak == accumulating.weights
    recipe = load_recipe(TINY, plugins, ["train.batch_size=4", "train.grad_accum=2"])
    assert "reduction buckets" in render_table(plan(recipe, plugins, layout=dp2, machine=machine, policies="none"))


def test_host_optimizer_state_counts_against_host_memory(capsys):
    """--host-mem bounds everything the step holds in host memory: the host optimizer state too."""
    plugins = fresh_plugins()
    recipe = load_recipe(TINY, plugins, ["train.optimizer_state='host'", "run.device='cuda'"])
    unbounded = plan(recipe, plugins, machine=Machine("cuda", 64 * GiB, None), policies="none").candidates[0]
    need = unbounded.host + unbounded.host_optimizer
    assert need == unbounded.host_optimizer > 0
    assert plan(recipe, plugins, machine=Machine("cuda", 64 * GiB, need), policies="none").candidates[0].fits
    assert not plan(recipe, plugins, machine=Machine("cuda", 64 * GiB, need - 1), policies="none").candidates[0].fits

    args = ["plan", TINY, "--set", "train.optimizer_state='host'", "--set", "run.device='cuda'", "--device-mem", "1e12",
            "--host-mem", "1e-9"]
    assert main(args) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    assert last == "nothing fits host memory: the least any set holds there is 0.00G of 0.00G (--host-mem)", last
    assert main([*args, "--memory-policy", "none"]) == 0
    assert "does NOT fit" in capsys.readouterr().out
    assert main([*args, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["fits"] is False


class CostConfig(ComponentConfig):
    part: str = "block"


def cost_effect(config: CostConfig) -> MemoryEffect:  # block: cheap on CPU, dear on CUDA; ffn the other way
    costs = {"block": {"cpu": 0.2, "cuda": 0.5}, "ffn": {"cpu": 0.6, "cuda": 0.1}}[config.part]
    return MemoryEffect(recompute=config.part, time_cost=0.3, time_costs=costs)


class CostPlugin:
    @hookimpl
    def megaseq_memory_policy(self):
        return [MemoryPolicySpec(name="cost", target=f"{__name__}:CostConfig", config=CostConfig,
                                 memory=f"{__name__}:cost_effect", presets=({"part": "ffn"}, {"part": "block"}))]


def test_time_costs_per_device_kind_and_a_calibration_decide_the_ranking():
    """Two sets that both fit: the cheaper on the plan's device kind is proposed; a calibration overrides."""
    plugins = fresh_plugins()
    plugins.register(CostPlugin(), name="cost-plugin")
    recipe = load_recipe(TINY, plugins)
    def tight(kind: str) -> Machine:  # no policy does not fit; both sets do
        none = plan(recipe, plugins, seq_len=65536, machine=Machine(kind, 64 * GiB, None), policies="none")
        return Machine(kind, none.candidates[0].device_peak - 1, None)

    for kind, cheaper in (("cpu", "cost"), ("cuda", "cost(part=ffn)")):
        machine = tight(kind)
        result = plan(recipe, plugins, seq_len=65536, machine=machine)
        assert {e.label for e in result.candidates if e.fits} == {"cost", "cost(part=ffn)"}, kind
        assert result.chosen is not None and result.chosen.label == cheaper, kind
    calibrated = plan(recipe, plugins, seq_len=65536, machine=tight("cpu"), time_costs={"cost": 0.9, "cost(part=ffn)": 0.05})
    assert calibrated.chosen is not None and calibrated.chosen.label == "cost(part=ffn)"
    assert {e.label: e.time_cost for e in calibrated.candidates}["cost"] == 0.9


def test_a_cpu_worker_of_several_counts_its_libraries_and_a_ray_worker_rays(monkeypatch):
    """A CPU worker of a multi-process layout holds torch.distributed's groups and megatron-core; one that Ray
    started holds Ray's core worker and Ray Train besides (``megaseq.memory.machine``: measured per worker).
    On a GPU they live in host memory, not the device's."""
    import sys
    import types

    from megaseq.memory.machine import DISTRIBUTED_WORKER_BYTES, RAY_WORKER_BYTES

    plugins = fresh_plugins()
    recipe = load_recipe(TINY, plugins, ["train.batch_size=4"])

    def runtime(layout, kind="cpu"):
        return plan(recipe, plugins, seq_len=256, layout=layout, machine=Machine(kind, 64 * GiB, None),
                    policies="none").candidates[0].runtime

    dp2 = Layout.parse("dp=2")
    monkeypatch.delitem(sys.modules, "ray", raising=False)
    assert runtime(dp2) - runtime(None) == DISTRIBUTED_WORKER_BYTES
    monkeypatch.setitem(sys.modules, "ray", types.SimpleNamespace(is_initialized=lambda: True))
    assert runtime(dp2) - runtime(None) == DISTRIBUTED_WORKER_BYTES + RAY_WORKER_BYTES
    assert runtime(dp2, "cuda") == runtime(None, "cuda")
