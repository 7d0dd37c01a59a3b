"""The context-extension plan: presets, --set routing, one-line errors, the stages it implies, the sdpa twin,
and the report's columns and verdict. (The whole pipeline runs in the repository's tests/test_context_extension.py.)"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from megaseq.config import load_recipe
from megaseq.errors import ConfigError
from megaseq.plugins import get_plugins
from megaseq_genome.experiment.plan import PRESETS, load_plan, parameter_count, stages
from megaseq_genome.experiment.report import columns, per_window_bits, verdict

REPO = Path(__file__).resolve().parents[3]
SMALL = ["plan.short_len=128", "plan.long_len=512", "plan.pretrain_tokens=2048", "plan.extension_tokens=1024", "plan.first_bucket=16"]


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
    plan = load_plan("cpu", [*SMALL, "plan.pretrain_batch=2", "train.lr=2e-3", "short.train.log_every=3"])
    by_name = {s.name: s for s in stages(plan, recipe.to_dict(), plugins, "r.toml", tmp_path)}
    assert list(by_name) == ["pretrain", "long", "short", "sdpa"]
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


def test_sdpa_twin_matches_the_parameter_count(recipe, plugins, tmp_path):
    plan = load_plan("cpu", [*SMALL, "plan.sdpa_heads=2"])
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
