"""The RL loop on a tiny checkpoint: a run, its outputs, and every bad input as one line, exit 2, with no
checkpoint written. Then what the loop gains from core's optimizer step and run machinery: weight decay on
matrices only, the non-finite rule before the update, the algorithm's ratio clip acting only from the second
update on a batch, resume (a stopped run continued with ``megaseq rl --resume`` ends with the uninterrupted
run's weights) and data parallelism (dp=2 on gloo ranks equals one process)."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megaseq.cli import main
from megaseq.errors import UserError
from megaseq.inference.cached import CachedEngine
from megaseq.plugins import get_plugins
from megaseq.train.checkpoint import read_meta
from megaseq.train.rundir import RunLock
from megaseq_rl.algorithms import PolicyGradient
from megaseq_rl.loop import RLRun
from megaseq_rl.recipe import validate_rl_recipe
from megaseq_rl.task import ContinuationTask
from megaseq_testkit import assert_close
from megaseq_testkit.distributed import run_gloo


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
    tmp_path.mkdir(parents=True, exist_ok=True)
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
    with RunLock(out, "training"), pytest.raises(UserError, match=r"in use by PID \d+ on .* \(training\)"):
        RLRun(recipe, plugins, progress=False).run("overwrite")  # core's run-directory lock
    assert (out / "checkpoints" / "step_0000002").is_dir(), "a refused --overwrite deleted the run"


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


@pytest.mark.slow  # Ray actors
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


# -- the shared optimizer step and run machinery ----------------------------------------------------------
RTOL = 1e-5


def build(tmp_path: Path, checkpoint: Path, **sections) -> RLRun:
    plugins = get_plugins()
    return RLRun(validate_rl_recipe(rl_recipe(tmp_path, checkpoint, **sections), plugins), plugins, progress=False)


def weights(run: RLRun) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in run.model.state_dict().items()}


def test_weight_decay_on_matrices_only(tmp_path, policy_checkpoint):
    run = build(tmp_path, policy_checkpoint, train={"weight_decay": 0.5})
    decay, no_decay = run.optimizer.param_groups
    assert decay["weight_decay"] == 0.5 and no_decay["weight_decay"] == 0.0
    assert decay["params"] and all(p.dim() >= 2 for p in decay["params"])
    assert no_decay["params"] and all(p.dim() < 2 for p in no_decay["params"])
    # a norm's gain sees no decay: with a zero gradient it stays where it was after the step
    norm = next(p for p in no_decay["params"] if p.dim() == 1)
    before = norm.detach().clone()
    norm.grad = torch.zeros_like(norm)
    run.optimizer.step()
    assert torch.equal(norm, before)


def nan_loss(monkeypatch):
    loss = PolicyGradient.loss

    def poisoned(self, *args, **kwargs):
        value, metrics = loss(self, *args, **kwargs)
        return value * float("nan"), metrics

    monkeypatch.setattr(PolicyGradient, "loss", poisoned)


def test_nonfinite_loss_stops_before_the_update(tmp_path, policy_checkpoint, capsys, monkeypatch):
    nan_loss(monkeypatch)
    assert main(["rl", str(write(tmp_path, rl_recipe(tmp_path, policy_checkpoint))), "--no-progress"]) == 2
    line = one_error_line(capsys)
    assert "step 1: loss nan" in line and "training diverged, stopped before the update" in line
    assert_no_checkpoint(tmp_path)


def test_nonfinite_loss_skipped_leaves_the_weights(tmp_path, policy_checkpoint, monkeypatch):
    nan_loss(monkeypatch)
    run = build(tmp_path, policy_checkpoint, train={"on_nonfinite": "skip", "steps": 1})
    before = weights(run)
    metrics = run.train_step()
    assert metrics["policy/skipped_updates"] == 1.0
    for name, value in weights(run).items():
        assert torch.equal(value, before[name]), name
    assert not run.optimizer.state, "a skipped update must leave the optimizer state untouched"


def test_ratio_clip_binds_only_from_the_second_update(tmp_path, policy_checkpoint):
    """At the first update the policy is the one the old log-probabilities came from (ratio 1), so the clip
    range cannot change it; from the second on it does."""
    result = {}
    for updates in (1, 2):
        for eps in (0.2, 1e-4):
            run = build(tmp_path / f"{updates}-{eps}", policy_checkpoint, train={"steps": 1, "lr": 1e-2},
                        update={"updates_per_step": updates},
                        algorithm={"name": "grpo", "grpo": {"eps_low": eps, "eps_high": eps}})
            metrics = run.train_step()
            result[updates, eps] = weights(run), metrics
    for name, value in result[1, 0.2][0].items():
        assert torch.equal(value, result[1, 1e-4][0][name]), name
    assert result[1, 1e-4][1]["policy/clip_frac_low"] + result[1, 1e-4][1]["policy/clip_frac_high"] == 0
    assert result[2, 1e-4][1]["policy/clip_frac_low"] + result[2, 1e-4][1]["policy/clip_frac_high"] > 0
    assert any(not torch.equal(v, result[2, 1e-4][0][n]) for n, v in result[2, 0.2][0].items())


def final_weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(str(out / "checkpoints" / (out / "checkpoints" / "latest").read_text().strip() / "model.safetensors"))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, policy_checkpoint):
    """A 3-step RL run (two updates per step, so the optimizer moments matter), never stopped."""
    tmp_path = tmp_path_factory.mktemp("whole")
    assert main(["rl", str(write(tmp_path, rl_recipe(tmp_path, policy_checkpoint, **RESUMED))), "--no-progress"]) == 0
    return tmp_path / "rl"


RESUMED = {"train": {"steps": 3, "lr": 1e-2}, "update": {"micro_batch": 4, "updates_per_step": 2},
           "eval": {"every": 2, "windows": 2, "reward_prompts": 3}}


@pytest.mark.parametrize("how", ["stopped", "killed"])
def test_interrupted_run_resumed_ends_with_the_uninterrupted_weights(tmp_path, policy_checkpoint, uninterrupted, capsys,
                                                                     monkeypatch, how):
    """stopped: SIGINT after step 1 (a checkpoint at the step boundary, exit 130). killed: the process dies in
    step 3 after the checkpoint of step 2 (``train.checkpoint_every = 1``), leaving a half-written save and a
    metrics row cut short. Either way ``megaseq rl --resume`` ends where the uninterrupted run does."""
    raw = rl_recipe(tmp_path, policy_checkpoint, **RESUMED)
    if how == "killed":
        raw["train"]["checkpoint_every"] = 1
    path, out = write(tmp_path, raw), tmp_path / "rl"
    train_step = RLRun.train_step

    def interrupt(self):
        if how == "killed" and self.step == 2:
            (out / "checkpoints" / ".tmp-step_0000003").mkdir()
            with (out / "metrics.jsonl").open("a") as f:
                f.write('{"step": 3, "rew')
            raise SystemExit("killed")
        metrics = train_step(self)
        if how == "stopped" and self.step == 1:
            os.kill(os.getpid(), signal.SIGINT)  # as Ctrl-C
        return metrics

    monkeypatch.setattr(RLRun, "train_step", interrupt)
    capsys.readouterr()
    if how == "stopped":
        assert main(["rl", str(path), "--no-progress"]) == 128 + signal.SIGINT
        assert "stopped after step 1" in capsys.readouterr().err
    else:
        with pytest.raises(SystemExit, match="killed"):
            main(["rl", str(path), "--no-progress"])
    monkeypatch.setattr(RLRun, "train_step", train_step)
    assert main(["rl", str(path), "--no-progress"]) == 2  # a new run refuses the directory
    assert "--resume" in one_error_line(capsys)
    assert main(["rl", str(path), "--resume", "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert f"resumed from {out / 'checkpoints' / ('step_0000001' if how == 'stopped' else 'step_0000002')}" in err
    assert how == "stopped" or "removed .tmp-step_0000003, left by an interrupted save" in err

    expected, got = final_weights(uninterrupted), final_weights(out)
    assert expected.keys() == got.keys()
    for name, value in expected.items():
        assert torch.equal(got[name], value), name
    history = {run: json.loads((run / "rl_history.json").read_text()) for run in (uninterrupted, out)}
    assert [h["step"] for h in history[out]] == [h["step"] for h in history[uninterrupted]] == [0, 1, 2, 3]
    assert history[out][-1]["reward/mean"] == history[uninterrupted][-1]["reward/mean"]
    rows = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows == [0, 1, 2, 3], "each step is logged once"


def _dp_worker(rank: int, world: int, raw: dict, steps: int, nan_rewards: bool = False) -> dict:
    from megaseq.distributed.groups import destroy_process_groups, init_process_groups
    from megaseq.distributed.layout import Layout

    if nan_rewards:
        ContinuationTask.reward = lambda self, a, t, m: torch.full((t.shape[0],), float("nan"))
    parallel = init_process_groups(Layout(dp=world))
    try:
        plugins = get_plugins()
        run = RLRun(validate_rl_recipe(raw, plugins), plugins, parallel=parallel, progress=False)
        try:
            history = [run.train_step() for _ in range(steps)]
        except UserError as exc:
            return {"error": str(exc)}
        return {"metrics": history, "weights": weights(run)}
    finally:
        destroy_process_groups()


@pytest.mark.slow  # gloo processes
def test_data_parallel_equals_one_process(tmp_path, policy_checkpoint):
    """9 completions per step over 2 ranks (4 and 5 rows, micro-batches of 2): the same rewards, loss,
    gradient norm and weights as one process, and every rank holds the same weights."""
    pytest.importorskip("megatron.core", reason="needs the distributed extra: pip install 'megaseq-core[distributed]'")
    sections = {"train": {"steps": 2, "lr": 1e-2}, "update": {"micro_batch": 2, "updates_per_step": 2}}
    single = build(tmp_path / "one", policy_checkpoint, **sections)
    expected = {"metrics": [single.train_step() for _ in range(2)], "weights": weights(single)}
    raw = rl_recipe(tmp_path / "two", policy_checkpoint, parallel={"dp": 2}, **sections)
    ranks = run_gloo(2, _dp_worker, raw, 2)
    for rank, got in enumerate(ranks):
        for step, (a, b) in enumerate(zip(got["metrics"], expected["metrics"], strict=True), start=1):
            assert set(a) == set(b), sorted(set(a) ^ set(b))
            for key in sorted(set(b) - {"time_s"}):
                assert_close(torch.tensor(a[key], dtype=torch.float64), torch.tensor(b[key], dtype=torch.float64),
                             RTOL, f"rank {rank} step {step} {key}")
        for name, value in expected["weights"].items():
            assert_close(got["weights"][name], value, RTOL, f"rank {rank} {name}")


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"train": {"batch_size": 8}}, "train.batch_size: not used by megaseq rl"),
        ({"train": {"micro_batch": 8}}, "train.micro_batch: unknown key; allowed: steps"),
        ({"parallel": {"cp": 2}}, "megaseq rl runs data parallelism only"),
        ({"train": {"memory_policy": "auto"}}, "train.memory_policy = 'auto'"),
        ({"memory_policy": {"recompute": {}}}, "[memory_policy.recompute] is configured but not used by train.memory_policy"),
        ({"parallel": {"dp": 2}}, "torchrun --nproc-per-node 2 --no-python megaseq rl"),
        ({"train": {"optimizer_shard": True}}, "train.optimizer_shard: the RL loop keeps one whole optimizer state"),
    ],
)
def test_shared_section_mistakes_are_one_line(tmp_path, policy_checkpoint, capsys, change, expected):
    raw = rl_recipe(tmp_path, policy_checkpoint)
    for section, table in change.items():
        raw[section] = {**raw.get(section, {}), **table}
    assert main(["rl", str(write(tmp_path, raw)), "--no-progress"]) == 2
    assert expected in one_error_line(capsys)
    assert_no_checkpoint(tmp_path)


@pytest.mark.slow  # gloo processes
def test_data_parallel_mistake_on_rank_0_stops_every_rank(tmp_path, policy_checkpoint):
    """Rank 0 alone draws the rollouts: a mistake it finds there (non-finite rewards) reaches every rank as the
    same one-line error, instead of leaving the others waiting in a collective."""
    raw = rl_recipe(tmp_path, policy_checkpoint, parallel={"dp": 2})
    ranks = run_gloo(2, _dp_worker, raw, 1, True, collective_timeout=30)
    message = "task 'continuation' returned 9 non-finite rewards (NaN or inf); stopping before the update"
    assert [r.get("error") for r in ranks] == [message, message], ranks
