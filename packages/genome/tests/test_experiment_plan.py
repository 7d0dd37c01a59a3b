"""The context-extension plan: presets, --set routing, one-line errors, the stages it implies (the curriculum's
schedule and planted repeats, the control at equal tokens), the sdpa twin, and the report's columns, targets and
verdict. (The whole pipeline runs in the repository's tests/test_context_extension.py.)"""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
from pydantic import ValidationError

from megaseq.config import load_recipe
from megaseq.errors import ConfigError
from megaseq.plugins import get_plugins
from megaseq_genome.experiment.plan import PRESETS, ContextExtensionPlan, load_plan, parameter_count, stages
from megaseq_genome.experiment.report import check, check_targets, columns, per_window_bits, target_lines, verdict
from megaseq_genome.retrieval import BUCKETS, RetrievalLoss, relative_change

REPO = Path(__file__).resolve().parents[3]
SMALL = ["plan.short_len=128", "plan.long_len=512", "plan.pretrain_tokens=2048", "plan.extension_tokens=1024", "plan.first_bucket=16",
         "plan.pretrain_batch=4", "plan.curriculum=[]", "plan.planted_share=0"]
# the small plan with a curriculum: 8 steps of 2 windows of 128 tokens, cut into 64-token windows until step 4,
# planted repeats in every window until step 3, annealed to none by step 6
CURRICULUM = [*SMALL, "plan.pretrain_batch=2", "plan.curriculum=[[64, 4]]", "plan.planted_share=1.0", "plan.planted_segment=48",
              "plan.planted_hold_step=3", "plan.planted_until_step=6"]


@pytest.fixture(scope="module")
def plugins():
    return get_plugins()


@pytest.fixture(scope="module")
def recipe(plugins):
    # a core-only recipe whose layers differ from the sdpa twin's (narrow heads, wide SwiGLU)
    return load_recipe(REPO / "recipes" / "tiny.toml", plugins, ["ffn.swiglu.hidden=200", "attention.sdpa.n_heads=1", "attention.sdpa.head_dim=64"])


@pytest.mark.parametrize("scale", list(PRESETS))
def test_presets_validate(scale):
    plan = load_plan(scale, [])
    assert plan.long_len > plan.short_len and plan.extension_tokens >= plan.long_len


def test_set_routes_plan_keys_and_recipe_overrides():
    plan = load_plan("cpu", [*SMALL, "train.lr=1e-3", "attention.sdpa.n_heads=2", "long.train.memory_policy=['x']",
                             "sdpa.train.bf16=true"])
    assert plan.short_len == 128 and plan.pretrain_tokens == 2048
    assert plan.recipe_overrides == ["train.lr=1e-3", "attention.sdpa.n_heads=2"]
    assert plan.stage_overrides == {"long": ["train.memory_policy=['x']"], "sdpa": ["train.bf16=true"]}


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (["plan.pretrain_tokens=0"], "plan.pretrain_tokens: Input should be greater than or equal to 1"),
        (["plan.extension_tokens=0"], "plan.extension_tokens: Input should be greater than or equal to 1"),
        (["plan.short_len=3000"], "short_len must be a power of two"),
        (["plan.long_len=6000"], "must be a multiple of short_len"),
        (["plan.colour=red"], r"--set 'plan.colour=red': colour: unknown plan key; allowed: short_len, long_len, "),
        (["plan.recipe_overrides=[]"], "recipe_overrides: unknown plan key"),
        (["plan.short_len.x=1"], "short_len.x: unknown plan key"),
        (["pretrain_tokens=1000"], r"--set 'pretrain_tokens=1000': expected plan.KEY=VALUE \(a plan key\), STAGE.SECTION.KEY"),
    ],
)
def test_bad_plans_are_one_line_errors(sets, message):
    with pytest.raises(ConfigError, match=message) as err:
        load_plan("cpu", sets)
    assert "\n" not in str(err.value)


def test_unknown_scale():
    with pytest.raises(ConfigError, match="--scale 'tpu': choose one of cpu, cpu-quick, gpu"):
        load_plan("tpu", [])


def test_budget_below_one_step_is_an_error(recipe, plugins, tmp_path):
    plan = load_plan("cpu", [*SMALL, "plan.extension_tokens=511"])
    with pytest.raises(ConfigError, match="extension_tokens: a budget of 511 tokens is less than one step of 512 tokens"):
        stages(plan, recipe.to_dict(), plugins, "r.toml", tmp_path)


def test_stages_share_budget_steps_and_schedule(recipe, plugins, tmp_path):
    plan = load_plan("cpu", [*SMALL, "plan.pretrain_batch=2", "plan.sdpa=true", "train.lr=2e-3", "short.train.log_every=3"])
    by_name = {s.name: s for s in stages(plan, recipe.to_dict(), plugins, "r.toml", tmp_path)}
    assert list(by_name) == ["pretrain", "long", "short", "sdpa"]  # no curriculum: no control
    pre, long, short, sdpa = (by_name[n] for n in ("pretrain", "long", "short", "sdpa"))
    assert (pre.recipe.data.seq_len, pre.recipe.train.batch_size, pre.steps, pre.tokens) == (128, 2, 8, 2048)
    assert pre.recipe.train.lr == 2e-3 and pre.init_from is None
    assert (long.recipe.data.seq_len, long.recipe.train.batch_size * long.recipe.train.grad_accum) == (512, 1)
    assert (short.recipe.data.seq_len, short.recipe.train.batch_size * short.recipe.train.grad_accum) == (128, 4)
    assert long.steps == short.steps == 2 and long.tokens == short.tokens == 1024
    for cont in (long, short):
        t = cont.recipe.train
        assert (t.lr, t.warmup_steps, cont.init_from) == (plan.extension_lr, plan.extension_warmup, "pretrain")
    assert short.recipe.train.log_every == 3 and long.recipe.train.log_every != 3
    assert long.recipe.out_dir == tmp_path / "long"
    assert sdpa.tokens == 2048 + 1024 and sdpa.eval_context == 128 and sdpa.recipe.data.seq_len == 128


def test_curriculum_pretrain_and_its_control_at_equal_tokens(recipe, plugins, tmp_path):
    plan = load_plan("cpu", [*CURRICULUM, "plan.sdpa=true", "control.train.log_every=3"])
    by_name = {s.name: s for s in stages(plan, recipe.to_dict(), plugins, "r.toml", tmp_path)}
    assert list(by_name) == ["pretrain", "control", "long", "short", "sdpa"]
    pre, control = by_name["pretrain"], by_name["control"]
    data = pre.recipe.data
    assert [(st.seq_len, st.until_step, st.until_tokens) for st in data.schedule] == [(64, 4, None)]
    assert data.lengths() == [64, 128] and data.length_at(3, 0) == 64 and data.length_at(4, 0) == 128
    assert data.transforms == ["planted-repeats"]
    planted = pre.recipe.component("data_transform", "planted-repeats")
    assert (planted.share, planted.segment, planted.anneal_from_step, planted.anneal_until_step) == (1.0, 48, 3, 6)
    # the control: the same recipe, steps, windows and tokens, in the recipe's own data order
    assert control.recipe.data.schedule == [] and control.recipe.data.transforms == []
    assert control.init_from is None and control.eval_context is None
    assert (control.steps, control.tokens) == (pre.steps, pre.tokens) == (8, 2048)
    assert control.recipe.train.batch_size * control.recipe.train.grad_accum == 2
    assert control.recipe.train.log_every == 3 and pre.recipe.train.log_every != 3
    assert control.recipe.out_dir == tmp_path / "control"
    assert recipe_differences(control, pre) == {"data.schedule", "data.transforms", "data_transform", "run.name", "run.out_dir",
                                                "train.log_every"}
    # the continuations start from the curriculum pretrain, on the genome's own data; the sdpa twin has its data
    for name in ("long", "short"):
        assert by_name[name].init_from == "pretrain" and by_name[name].recipe.data.transforms == []
    assert by_name["sdpa"].recipe.data.transforms == ["planted-repeats"] and by_name["sdpa"].recipe.data.schedule


def recipe_differences(a, b) -> set[str]:
    """The top-level recipe keys (SECTION.KEY) in which two stages differ."""
    da, db = a.recipe.to_dict(), b.recipe.to_dict()
    keys = set()
    for section in set(da) | set(db):
        sa, sb = da.get(section, {}), db.get(section, {})
        if not isinstance(sa, dict) or not isinstance(sb, dict) or section == "data_transform":
            if sa != sb:
                keys.add(section)
            continue
        keys |= {f"{section}.{k}" for k in set(sa) | set(sb) if sa.get(k) != sb.get(k)}
    return keys


@pytest.mark.parametrize("scale", list(PRESETS))
def test_presets_pretrain_with_a_curriculum_that_ends_on_natural_data(scale, plugins, recipe, tmp_path):
    # a core-only recipe: this package's tests run with core and the test kit alone (the stages' shape is the
    # preset's, whatever the model)
    plan = load_plan(scale, [])
    by_name = {s.name: s for s in stages(plan, recipe.to_dict(), plugins, "tiny.toml", tmp_path)}
    pre, control = by_name["pretrain"], by_name["control"]
    lengths = pre.recipe.data.lengths()
    assert lengths[0] == 128 and lengths[-1] == plan.short_len and lengths == sorted(lengths)
    assert all(b == 2 * a for a, b in itertools.pairwise(lengths))  # doubling, one stage per length
    assert pre.recipe.data.schedule[-1].until_step < pre.steps
    planted = pre.recipe.component("data_transform", "planted-repeats")
    assert planted.share > 0 and planted.anneal_until_step < pre.steps  # the last steps are the genome's own repeats
    assert planted.anneal_from_step >= pre.recipe.data.schedule[0].until_step  # full share through the 128-base stage
    assert (control.steps, control.tokens) == (pre.steps, pre.tokens) and not control.recipe.data.transforms
    assert by_name["long"].tokens == by_name["short"].tokens and by_name["long"].recipe.data.seq_len == plan.long_len


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (["plan.curriculum=[[128, 4]]"], r"curriculum\[0\]: window length 128 must divide short_len \(128\) and be shorter"),
        (["plan.curriculum=[[48, 4]]"], "window length 48 must divide short_len"),
        (["plan.curriculum=[[64, 4], [32, 5]]"], r"curriculum\[1\]: \[32, 5\] must be longer and end later"),
        (["plan.curriculum=[[32, 4], [64, 4]]"], r"curriculum\[1\]: \[64, 4\] must be longer and end later"),
        (["plan.planted_hold_step=6"], r"planted_hold_step \(6\) must be before planted_until_step \(6\)"),
    ],
)
def test_bad_curricula_are_one_line_errors(sets, message):
    with pytest.raises(ConfigError, match=message) as err:
        load_plan("cpu", [*CURRICULUM, *sets])
    assert "\n" not in str(err.value)


def test_planted_repeats_without_an_anneal_are_refused():
    with pytest.raises(ValidationError, match="planted_share needs planted_until_step: the planted repeats are annealed"):
        ContextExtensionPlan(**{**PRESETS["cpu"], "planted_share": 0.5, "planted_until_step": None})


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (["plan.curriculum=[[64, 8]]"], "plan.curriculum: its last stage ends at step 8, leaving none of the pretrain's 8 steps"),
        (["plan.planted_until_step=9"], "plan.planted_until_step: 9 is after the pretrain's last step (8)"),
        (["plan.pretrain_tokens=1024"], "plan.curriculum: its last stage ends at step 4, leaving none of the pretrain's 4 steps"),
    ],
)
def test_a_curriculum_past_the_pretrain_is_an_error(recipe, plugins, tmp_path, sets, message):
    plan = load_plan("cpu", [*CURRICULUM, *sets])
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        stages(plan, recipe.to_dict(), plugins, "r.toml", tmp_path)


def test_a_recipe_with_its_own_curriculum_is_refused(recipe, plugins, tmp_path):
    raw = recipe.to_dict()
    raw["data"] = {**raw["data"], "schedule": [{"seq_len": 128, "until_step": 2}]}
    with pytest.raises(ConfigError, match="r.toml: data.schedule / data.transforms 'planted-repeats': the context-extension "
                       "experiment sets the pretrain's curriculum itself"):
        stages(load_plan("cpu", CURRICULUM), raw, plugins, "r.toml", tmp_path)


def test_sdpa_twin_matches_the_parameter_count(recipe, plugins, tmp_path):
    plan = load_plan("cpu", [*SMALL, "plan.sdpa_heads=2", "plan.sdpa=true"])
    by_name = {s.name: s for s in stages(plan, recipe.to_dict(), plugins, "r.toml", tmp_path)}
    target, twin = parameter_count(by_name["pretrain"].recipe, plugins), parameter_count(by_name["sdpa"].recipe, plugins)
    swiglu_row = 3 * recipe.model.d_model * recipe.model.n_layers  # parameters per unit of SwiGLU width
    assert abs(twin - target) <= swiglu_row / 2, (twin, target)
    assert by_name["sdpa"].recipe.component("attention", "sdpa").n_heads == 2
    assert by_name["sdpa"].recipe.component("ffn", "swiglu").hidden != 200


def test_report_columns_pool_positions_inside_and_past_short_len():
    edges = [0, 2, 4, 8]
    sums = np.array([[2.0, 4.0, 16.0]])  # nats per bucket of one window
    bits = per_window_bits(sums, edges, short_len=4) * np.log(2)
    np.testing.assert_allclose(bits[0], [1.0, 2.0, 4.0, 22 / 8, 6 / 4, 16 / 4])
    assert columns(edges, 4) == ["0-2", "2-4", "4-8", "all", "<4", ">=4"]
    with pytest.raises(ValueError, match="not a bucket edge"):
        per_window_bits(sums, edges, short_len=3)


@pytest.mark.parametrize(
    ("within", "beyond", "start"),
    [
        ((-0.001, -0.004, 0.002), (-0.03, -0.04, -0.02), "Yes"),
        ((-0.03, -0.04, -0.02), (-0.03, -0.04, -0.02), "Partly"),
        ((-0.001, -0.004, 0.002), (-0.01, -0.03, 0.01), "No"),
    ],
)
def test_verdict(within, beyond, start):
    rel = {key: [within[i], beyond[i]] for i, key in enumerate(("mean", "low", "high"))}
    assert verdict(rel, ["<4k", ">=4k"], 0, 1, 4096).startswith(start)



@pytest.mark.parametrize(
    ("goal", "threshold", "met_at", "missed_at"),
    [
        ("at_least", 0.5, (0.55, 0.41, 0.66), (0.33, 0.21, 0.43)),
        ("at_most", 0.005, (0.002, -0.001, 0.006), (0.02, 0.01, 0.03)),
        ("below", 0.0, (-0.01, -0.02, 0.001), (0.004, -0.001, 0.01)),
        ("contains", 0.0, (0.05, -0.1, 0.2), (0.3, 0.1, 0.5)),
        ("interval_below", 0.0, (-0.02, -0.03, -0.01), (-0.02, -0.03, 0.001)),
    ],
)
def test_a_check_is_met_or_missed_by_its_goal(goal, threshold, met_at, missed_at):
    met = check("a", "claim", met_at, goal, threshold, "share")
    missed = check("a", "claim", missed_at, goal, threshold, "share")
    assert met["met"] is True and missed["met"] is False
    if goal in ("contains", "interval_below"):  # decided by the interval
        assert met["resolved"] is True and missed["resolved"] is False
    else:  # decided by the estimate; these intervals straddle the threshold, so they do not resolve it
        assert met["resolved"] is False and missed["resolved"] is False
        assert check("a", "claim", (0.6, 0.55, 0.7), "at_least", 0.5, "share")["resolved"] is True
    assert check("a", "claim", (None, None, None), goal, threshold, "share")["met"] is None  # no targets: not measured


def interval(mean: float, low: float, high: float) -> dict[str, list]:
    return {"mean": [mean], "low": [low], "high": [high]}


def synthetic_targets(captured: dict[str, dict[str, tuple]], control_cost: tuple, long_vs_markov: tuple,
                      long_vs_short_past: tuple) -> dict:
    """check_targets on hand-made numbers: ``captured[model][bucket]`` (mean, low, high) at k = 20, the pretrain
    over the control on targets without an earlier 20-mer, the long continuation over markov-11 (all targets),
    and the long over the short continuation past short_len."""
    ks, buckets = [12, 16, 20, 32], list(BUCKETS)

    def grid(values: dict[str, tuple], i: int) -> list:
        return [[values.get(b, (None,) * 3)[i] if k == 20 else None for b in buckets] for k in ks]

    table = {"ks": ks, "buckets": buckets, "reference": "markov-11",
             "models": {m: {"captured": {key: grid(v, i) for i, key in enumerate(("mean", "low", "high"))}}
                        for m, v in captured.items()}}
    vs_control = {key: grid({"none": control_cost}, i) for i, key in enumerate(("mean", "low", "high"))}
    cols = ["0-4k", "4k-64k", "all", "<4k", ">=4k"]
    long_vs_reference = {key: [None, None, long_vs_markov[i], None, None] for i, key in enumerate(("mean", "low", "high"))}
    models = {"long": {"relative_to_short": {key: [None] * 4 + [long_vs_short_past[i]] for i, key in enumerate(("mean", "low", "high"))}},
              "short": {}, "pretrain": {}, "control": {}}
    return check_targets(table, long_vs_reference, vs_control, models, cols, beyond=4)


MET = {
    "captured": {"pretrain": {"<512": (0.55, 0.45, 0.65), "512-4k": (0.35, 0.2, 0.5)},
                 "long": {"4k-16k": (0.4, 0.3, 0.5), "16k-64k": (0.31, 0.1, 0.5)},
                 "short": {"4k-16k": (0.05, -0.1, 0.2), "16k-64k": (-0.02, -0.2, 0.1)}},
    "control_cost": (0.003, -0.001, 0.007), "long_vs_markov": (-0.01, -0.02, 0.0), "long_vs_short_past": (-0.01, -0.02, -0.005),
}


@pytest.mark.parametrize(
    ("target", "change"),
    [
        ("a", {"captured": {**MET["captured"], "pretrain": {"<512": (0.33, 0.21, 0.43), "512-4k": (0.35, 0.2, 0.5)}}}),
        ("b", {"captured": {**MET["captured"], "short": {"4k-16k": (0.3, 0.1, 0.5), "16k-64k": (0.0, -0.1, 0.1)}}}),
        ("b", {"captured": {**MET["captured"], "long": {"4k-16k": (0.4, 0.3, 0.5), "16k-64k": (0.2, 0.1, 0.3)}}}),
        ("c", {"control_cost": (0.065, 0.05, 0.08)}),
        ("c", {"long_vs_markov": (0.01, 0.0, 0.02)}),
        ("d", {"long_vs_short_past": (-0.01, -0.02, 0.001)}),
    ],
)
def test_the_targets_met_and_missed_on_synthetic_numbers(target, change):
    met = synthetic_targets(**MET)
    assert met["met"] == {"a": True, "b": True, "c": True, "d": True}
    assert len(met["checks"]) == 9 and all(c["met"] for c in met["checks"])
    missed = synthetic_targets(**(MET | change))
    assert missed["met"] == {t: t != target for t in "abcd"}
    lines = target_lines(missed)
    assert f"- ({target}) **missed**: " in "\n".join(lines)
    line = next(x for x in lines if x.startswith("- (a)"))
    assert "pretrain captures, 20-mer last seen <512 back: " in line and "(goal >= 50%: " in line
    met_lines = "\n".join(target_lines(met))
    assert "55% [45%, 65%] (goal >= 50%: met, the interval includes it)" in met_lines
    assert "40% [30%, 50%] (goal >= 30%: met, the interval clears it)" in met_lines
    if target == "c" and change.get("control_cost"):
        assert "+6.50% [+5.00%, +8.00%] (goal <= +0.50%: missed, the whole interval misses it)" in line + "\n".join(lines)
    assert "- (d) **" in "\n".join(lines) and "goal: interval below +0.00%" in "\n".join(lines)


def test_a_target_without_targets_in_its_buckets_is_not_measured():
    empty = {**MET["captured"], "long": {}, "short": {}}  # held-out windows too short for a 4k-64k distance
    targets = synthetic_targets(**(MET | {"captured": empty}))
    assert targets["met"]["b"] is None and targets["met"]["a"] is True
    assert "- (b) **not measured**: " in "\n".join(target_lines(targets))


def test_relative_change_of_retrieval_bits_is_paired():
    rng = np.random.default_rng(0)
    control = RetrievalLoss(6, (12, 20))
    control.sums, control.counts = rng.uniform(1, 2, (6, 2, 5)) * 100, np.full((6, 2, 5), 100.0)
    pretrain = RetrievalLoss(6, (12, 20))
    pretrain.sums, pretrain.counts = control.sums * 1.01, control.counts  # 1% worse in every window and bucket
    weights = np.random.default_rng(1).multinomial(6, [1 / 6] * 6, size=200).astype(float)
    rel = relative_change({"pretrain": pretrain, "control": control}, "pretrain", "control", weights)
    np.testing.assert_allclose(np.asarray(rel["mean"], dtype=float), 0.01)
    np.testing.assert_allclose(np.asarray(rel["low"], dtype=float), 0.01)  # paired: the windows' variation cancels
    np.testing.assert_allclose(np.asarray(rel["high"], dtype=float), 0.01)
    other = RetrievalLoss(6, (12, 20))
    other.sums, other.counts = control.sums, control.counts + 1
    with pytest.raises(ValueError, match="other was not scored on the same targets as control"):
        relative_change({"other": other, "control": control}, "other", "control", weights)

HANGING_STAGES = """
import os, sys, time
from pathlib import Path
from megaseq_genome.experiment.context_extension import Job, run_jobs

def hang(pid_dir, result):
    Path(pid_dir, str(os.getpid())).touch()
    time.sleep(900)  # until terminated: the test ends far sooner

if __name__ == "__main__":
    out = Path(sys.argv[1])
    run_jobs([Job(f"stage{i}", hang, (str(out),), out / f"stage{i}.json") for i in range(2)], parallel=2, out=out)
"""


@pytest.mark.slow
def test_a_terminated_experiment_takes_its_stages_with_it(tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time

    script = tmp_path / "stages.py"
    script.write_text(HANGING_STAGES)
    parent = subprocess.Popen([sys.executable, str(script), str(tmp_path)])
    deadline = time.monotonic() + 600  # each stage imports torch: minutes on a loaded machine
    while len(pids := [int(p.name) for p in tmp_path.iterdir() if p.name.isdigit()]) < 2:
        assert time.monotonic() < deadline and parent.poll() is None, "the stages did not start"
        time.sleep(0.1)
    parent.send_signal(signal.SIGTERM)
    parent.wait(timeout=120)
    for pid in pids:  # reaped by the parent's join: no such process, not even a zombie
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
