"""The RL loop on a tiny checkpoint: a run, its outputs, and every bad input of the issue as one line, exit 2,
with no checkpoint written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megaseq.cli import main
from megaseq.errors import UserError
from megaseq.inference.cached import CachedEngine
from megaseq.plugins import get_plugins
from megaseq.train.checkpoint import read_meta
from megaseq_rl.loop import RLRun
from megaseq_rl.recipe import validate_rl_recipe
from megaseq_rl.task import ContinuationTask


def rl_recipe(tmp_path: Path, checkpoint: Path, **sections) -> dict:
    raw = {
        "run": {"name": "t", "out_dir": str(tmp_path / "rl"), "device": "cpu"},
        "policy": {"checkpoint": str(checkpoint)},
        "task": {"prompt_len": 24},
        "sampling": {"prompts_per_step": 3, "group_size": 3, "max_new_tokens": 6},
        "algorithm": {"name": "grpo"},
        "train": {"steps": 2, "lr": 1e-3},
        "update": {"micro_batch": 4},
        "eval": {"every": 1, "windows": 2, "reward_prompts": 3},
    }
    for name, table in sections.items():
        raw[name] = {**raw.get(name, {}), **table}
    return raw


def write(tmp_path: Path, raw: dict) -> Path:
    lines = []
    for section, table in raw.items():
        lines.append(f"[{section}]")
        lines += [f"{k} = {json.dumps(v)}" for k, v in table.items() if not isinstance(v, dict)]
        for name, sub in table.items():
            if isinstance(sub, dict):
                lines.append(f"[{section}.{name}]")
                lines += [f"{k} = {json.dumps(v)}" for k, v in sub.items()]
    path = tmp_path / "rl.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_run_writes_history_plot_and_a_checkpoint_core_reads(tmp_path, policy_checkpoint):
    plugins = get_plugins()
    recipe = validate_rl_recipe(rl_recipe(tmp_path, policy_checkpoint, algorithm={"name": "dapo"}), plugins)
    run = RLRun(recipe, plugins, progress=False)
    before = {k: v.clone() for k, v in run.model.state_dict().items()}
    result = run.run()
    steps = [h for h in result.history if h["step"] > 0]
    assert len(steps) == 2 and all("reward/mean" in h and "eval/heldout_reward" in h for h in steps)
    updated = [h for h in steps if "policy/loss" in h]
    assert updated and all(h["rollout/logprob_gap"] < 1e-4 for h in updated)  # fp32 engine and trainer agree
    assert any(not torch.equal(before[k], v) for k, v in run.model.state_dict().items()), "the policy did not change"
    # weight sync: the engine scores with the trained weights
    tokens = torch.randint(0, 4, (2, 20))
    assert torch.allclose(run.engine.score(tokens), CachedEngine.score(run.engine, tokens))
    ref = run.engine.score(tokens)
    from megaseq.contracts import ForwardContext
    from megaseq.inference import sequence_logprobs

    run.model.eval()
    with torch.no_grad():
        assert torch.allclose(sequence_logprobs(run.model, tokens, ForwardContext()), ref, atol=1e-5)
    out = result.out_dir
    assert (out / "rl_curve.png").stat().st_size > 1000
    meta = read_meta(out / "checkpoints" / "step_0000002")
    assert meta["recipe"]["model"]["layer_pattern"] == ["sdpa"] and meta["rl_recipe"]["algorithm"]["name"] == "dapo"
    assert main(["logprob-gap", str(out), "--lengths", "40", "--new-tokens", "4", "--device", "cpu"]) == 0
    with pytest.raises(UserError, match="already holds a run"):  # core's run-directory rule
        RLRun(recipe, plugins, progress=False).run()


def test_micro_batch_split_does_not_change_the_step(tmp_path, policy_checkpoint):
    plugins = get_plugins()
    weights = []
    for micro in (9, 2):
        raw = rl_recipe(tmp_path / str(micro), policy_checkpoint, train={"steps": 1}, update={"micro_batch": micro})
        run = RLRun(validate_rl_recipe(raw, plugins), plugins, progress=False)
        run.train_step()
        weights.append(run.model.state_dict())
    for name, value in weights[0].items():
        assert torch.allclose(value, weights[1][name], atol=1e-6), name


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("megaseq: error")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def assert_no_checkpoint(tmp_path: Path) -> None:
    assert not list((tmp_path / "rl").glob("checkpoints/step_*")), "a checkpoint was written by a failed run"


def test_nan_rewards(tmp_path, policy_checkpoint, capsys, monkeypatch):
    monkeypatch.setattr(ContinuationTask, "reward", lambda self, a, t, m: torch.full((t.shape[0],), float("nan")))
    assert main(["rl", str(write(tmp_path, rl_recipe(tmp_path, policy_checkpoint))), "--no-progress"]) == 2
    assert "non-finite rewards" in one_error_line(capsys)
    assert_no_checkpoint(tmp_path)


def test_group_of_one_with_rloo(tmp_path, policy_checkpoint, capsys):
    raw = rl_recipe(tmp_path, policy_checkpoint, algorithm={"name": "rloo"}, sampling={"group_size": 1})
    assert main(["rl", str(write(tmp_path, raw))]) == 2
    assert "group_size = 1" in one_error_line(capsys)
    assert_no_checkpoint(tmp_path)


def test_prompt_longer_than_the_engine_allows(tmp_path, policy_checkpoint, capsys):
    raw = rl_recipe(tmp_path, policy_checkpoint, engine={"name": "cached", "cached": {"max_model_len": 20}})
    assert main(["rl", str(write(tmp_path, raw))]) == 2
    assert "max_model_len 20" in one_error_line(capsys)
    assert_no_checkpoint(tmp_path)


def test_engine_tokens_outside_the_vocabulary(tmp_path, policy_checkpoint, capsys, monkeypatch):
    generate = CachedEngine.generate

    def wrong(self, prompts, params):
        out = generate(self, prompts, params)
        out.tokens[0, 0] = 7
        return out

    monkeypatch.setattr(CachedEngine, "generate", wrong)
    assert main(["rl", str(write(tmp_path, rl_recipe(tmp_path, policy_checkpoint))), "--no-progress"]) == 2
    assert "outside the model's vocabulary [0, 5)" in one_error_line(capsys)
    assert_no_checkpoint(tmp_path)


def test_checkpoint_whose_components_are_not_installed(tmp_path, policy_checkpoint, capsys):
    import shutil

    from megaseq.train.checkpoint import commit, staging_dir

    meta = json.loads((policy_checkpoint / "meta.json").read_text())
    meta["recipe"]["model"]["layer_pattern"] = ["not-installed-attention"]
    meta["recipe"]["attention"] = {"not-installed-attention": meta["recipe"]["attention"]["sdpa"]}
    staged = staging_dir(tmp_path / "broken" / "checkpoints", meta["step"])
    for name in ("model.safetensors", "state.pt"):
        shutil.copy(policy_checkpoint / name, staged / name)
    broken = commit(tmp_path / "broken" / "checkpoints", meta["step"], meta)  # a valid manifest, foreign recipe
    assert main(["rl", str(write(tmp_path, rl_recipe(tmp_path, broken)))]) == 2
    assert "not-installed-attention" in one_error_line(capsys)
    assert main(["logprob-gap", str(broken), "--lengths", "32"]) == 2
    assert "not-installed-attention" in one_error_line(capsys)
    assert_no_checkpoint(tmp_path)


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"bogus": {"x": 1}}, "[bogus]: unknown section"),
        ({"sampling": {"group_sise": 2}}, "sampling.group_sise: unknown key"),
        ({"algorithm": {"name": "ppo2"}}, "no rl_algorithm named 'ppo2'; available: dapo, grpo, rloo"),
        ({"algorithm": {"name": "grpo", "dapo": {"eps_high": 0.3}}}, "[algorithm.dapo] is configured but algorithm.name is 'grpo'"),
        ({"algorithm": {"name": "dapo", "dapo": {"eps_hi": 0.3}}}, "[algorithm.dapo]: eps_hi: unknown key; allowed: eps_low"),
        ({"engine": {"name": "cached", "cached": {"dtype": "fp8"}}}, "[engine.cached]: dtype"),
    ],
)
def test_recipe_mistakes_are_one_line(tmp_path, policy_checkpoint, capsys, change, expected):
    raw = rl_recipe(tmp_path, policy_checkpoint)
    for section, table in change.items():
        raw[section] = table
    assert main(["rl", str(write(tmp_path, raw))]) == 2
    assert expected in one_error_line(capsys)


def test_gap_command_arguments(policy_checkpoint, capsys):
    assert main(["logprob-gap", str(policy_checkpoint), "--lengths", "0,5"]) == 2
    assert "--lengths" in one_error_line(capsys)
    assert main(["logprob-gap", str(policy_checkpoint), "--lengths", "32", "--engine", "nope"]) == 2
    assert "no inference_engine named 'nope'" in one_error_line(capsys)
    assert main(["logprob-gap", str(policy_checkpoint), "--bogus"]) == 2
    assert "unrecognized arguments" in one_error_line(capsys)


def test_gap_fp32_and_bf16(policy_checkpoint, capsys):
    assert main(["logprob-gap", str(policy_checkpoint), "--lengths", "48,200", "--new-tokens", "8", "--device", "cpu",
                 "--prompts", "3", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["length"] for r in rows] == [48, 200] and rows[0]["prompts"] == 3
    assert all(r["mean_abs"] <= 1e-4 and r["max_abs"] >= r["mean_abs"] for r in rows), rows
    assert main(["logprob-gap", str(policy_checkpoint), "--lengths", "48", "--new-tokens", "8", "--device", "cpu",
                 "--dtype", "bf16", "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert 0 < row["mean_abs"] < 0.05, row


@pytest.mark.skipif(__import__("importlib").util.find_spec("ray") is not None, reason="Ray is installed here")
def test_rollout_workers_without_ray(tmp_path, policy_checkpoint, capsys):
    raw = rl_recipe(tmp_path, policy_checkpoint, sampling={"rollout_workers": 2})
    assert main(["rl", str(write(tmp_path, raw))]) == 2
    assert "pip install 'megaseq-rl[ray]'" in one_error_line(capsys)
    assert_no_checkpoint(tmp_path)


@pytest.mark.skipif(__import__("importlib").util.find_spec("ray") is None, reason="needs Ray (pip install 'megaseq-rl[ray]')")
def test_rollout_workers_as_ray_actors_match_one_engine(tmp_path, policy_checkpoint):
    from megaseq.inference import SamplingParams
    from megaseq_rl.rollout import RayEngines

    plugins = get_plugins()
    run = RLRun(validate_rl_recipe(rl_recipe(tmp_path, policy_checkpoint), plugins), plugins, progress=False)
    actors = RayEngines("cached", run.recipe.engine_config, run.policy_recipe, workers=2)
    actors.update_weights(run.model.state_dict())
    prompts = torch.randint(0, 4, (4, 12))
    greedy = SamplingParams(5, temperature=0.0)
    assert torch.equal(actors.generate(prompts, greedy).tokens, run.engine.generate(prompts, greedy).tokens)
    assert torch.allclose(actors.score(prompts), run.engine.score(prompts), atol=1e-6)


def test_shipped_rl_recipes_validate():
    from megaseq_rl.recipe import load_rl_recipe

    recipes = Path(__file__).parents[1] / "recipes"
    recipe = load_rl_recipe(recipes / "genome-rl-cpu.toml", get_plugins())
    assert recipe.algorithm.name == "grpo" and recipe.task.name == "continuation"
    recipe = load_rl_recipe(recipes / "genome-gc-rl-cpu.toml", get_plugins())
    assert recipe.algorithm.name == "dapo" and recipe.task.name == "gc-content"


def test_gc_content_reward_by_hand():
    from megaseq_rl.task import GCContentTask

    task = GCContentTask.__new__(GCContentTask)  # the reward needs no genome
    task.gc_target, task.motif = 0.6, torch.tensor([3, 0, 3, 0])  # TATA
    # A C G T N = 0 1 2 3 4
    tokens = torch.tensor([[1, 2, 1, 2, 0], [1, 2, 0, 3, 0], [3, 0, 3, 0, 2], [2, 2, 2, 2, 2]])
    mask = torch.tensor([[True] * 5, [True] * 5, [True] * 5, [True, True, False, False, False]])
    # GC 4/5 -> 1 - 0.2/0.6; GC 2/5 -> 1 - 0.2/0.6; contains TATA -> 0; GC 2/2 -> 1 - 0.4/0.6
    expected = torch.tensor([1 - 0.2 / 0.6, 1 - 0.2 / 0.6, 0.0, 1 - 0.4 / 0.6])
    assert torch.allclose(task.reward(None, tokens, mask), expected)
